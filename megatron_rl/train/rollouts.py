"""A step's rollouts: the data draw, sampling rounds, rewards and dynamic sampling.

Owns :class:`RolloutSource`, which turns the training order into this rank's groups of one
RL step: it draws prompts (each data-parallel rank owns whole groups: prompt j of a round
goes to rank j mod DP), generates G responses per prompt with seeds fixed by (seed, step,
round) (with ``rollout.env``: G multi-turn trajectories, ``megatron_rl.rollout.multiturn``),
checks their weight versions, scores them in the reward pool (errors printed and counted,
never silent), adds the environment's rewards and overlong shaping, and with dynamic
sampling (DAPO) samples further rounds until every rank holds enough groups whose rewards
differ, topping up with uninformative ones. Its public methods are also what the batch generated ahead draws and
generates through (:mod:`megatron_rl.train.async_rollouts`).

After the rollouts it re-deals whole groups over the DP ranks by tokens (with a token budget)
and measures, for multi-turn R3, how far the rollout routes agree with the old policy's.
Does not own the batch in flight (``async_rollouts``), the old-policy pass, advantages or
updates (:mod:`megatron_rl.train.trainer`), nor how a reward is computed
(:mod:`megatron_rl.rewards`).
"""

from __future__ import annotations

import sys
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import torch

from megatron_rl.algos import dynamic_sampling_keep_S, soft_overlong_penalty_S
from megatron_rl.parallel import comm
from megatron_rl.parallel.comm import (
    all_gather_objects,
    all_ranks_agree,
    all_reduce,
    mean_over,
)
from megatron_rl.rewards.core import RewardInput, RewardResult
from megatron_rl.rollout.engine import RolloutSample, SamplingParams
from megatron_rl.rollout.multiturn import is_env_count, trajectory_stats
from megatron_rl.rollout.trajectory import ENV_FAULTS, turn_of_positions
from megatron_rl.train.dp_balance import rebalance_over_dp
from megatron_rl.train.phases import phase_timer

if TYPE_CHECKING:
    from megatron_rl.algos import ObjectiveConfig
    from megatron_rl.config import RunConfig
    from megatron_rl.data.prompts import PromptRecord, PromptSet
    from megatron_rl.data.tokenizer import PromptTokenizer
    from megatron_rl.parallel.groups import ParallelGroups
    from megatron_rl.rewards.pool import RewardScorer
    from megatron_rl.rollout.engine import RolloutEngine
    from megatron_rl.rollout.sglang.engine import PendingGeneration
    from megatron_rl.train.checkpoint import TrainerState

MAX_REWARD_ERRORS_PRINTED = 5
"""Reward errors printed per scoring call and rank (all are counted in ``reward/errors``, the
timeouts among them also in ``reward/timeouts``)."""


@dataclass
class Groups:
    """This rank's rollout groups of one step."""

    problems: list[PromptRecord]
    """The prompt of each group."""
    samples: list[list[RolloutSample]]
    """G responses per group."""
    rewards: list[torch.Tensor]
    """``[G]`` rewards per group (shaping included)."""


@dataclass
class Round:
    """One sampling round on this rank."""

    problems: list[PromptRecord]
    """This rank's prompts (one per group)."""
    samples: list[RolloutSample]
    """G responses per prompt, group by group."""
    ready: dict[int, RewardResult] | None = None
    """Rewards of ``samples`` already scored (by the thread that generated them), by index."""


@dataclass
class _Drawn:
    """What the sampling rounds of one step drew on this rank."""

    kept: Groups = field(default_factory=lambda: Groups([], [], []))
    """Groups to train: informative ones (all of them without dynamic sampling)."""
    dropped: Groups = field(default_factory=lambda: Groups([], [], []))
    """Uninformative groups (equal rewards), the top-up when too few are informative."""
    rewards: list[torch.Tensor] = field(default_factory=list)
    """``[G]`` rewards of every group drawn."""
    correct: list[float] = field(default_factory=list)
    """1.0 per response with a positive reward, else 0.0."""
    lengths: list[int] = field(default_factory=list)
    """Response lengths in tokens."""
    extras: dict[str, list[float]] = field(default_factory=dict)
    """``reward/<name>`` -> the reward functions' extra fields, per response that has one."""
    errors: int = 0
    """Responses whose reward function failed."""
    timeouts: int = 0
    """Of those, responses whose reward ran out of time (twice: a timeout is tried once more)."""
    trajectories: dict[str, list[float]] = field(default_factory=dict)
    """``env/<name>`` -> one value per multi-turn trajectory that has it (``trajectory_stats``)."""


class Background:
    """Multi-turn rollouts of one sampling round generated in the background (asynchronous
    rollouts with ``rollout.env``): the model-parallel leader's thread runs the whole
    multi-turn rollout against the SGLang servers over HTTP only (the engine's
    ``generate_local``; its environments answer in that thread's own daemon threads), so
    nothing collective happens off the main thread; :meth:`finish` joins it on every rank,
    fails every rank if the leader's thread failed, and gives the leader's trajectories to
    its model-parallel peers. The servers hold one weight version throughout (no push
    happens while a batch is in flight), which every turn checks."""

    def __init__(self) -> None:
        self.samples: list[RolloutSample] | None = None
        self.error: BaseException | None = None
        self.thread: threading.Thread | None = None
        self.stats = None
        """The leader's client counters (``ClientStats``)."""

    @classmethod
    def start(cls, source: RolloutSource, records: list[PromptRecord], seed: int,
              on_samples: Callable[[dict[int, RolloutSample]], None]) -> Background:
        from megatron_rl.rollout.multiturn import LonePeers, MultiTurnRollout
        from megatron_rl.rollout.sglang.client import ClientStats

        pending, engine = cls(), source.engine
        if engine.weight_sync is not None and not engine.synced:
            engine.update_weights(engine.weight_version)  # collective, as the engine's start_generate does
        if comm.rank(source.groups.mp) != 0:
            return pending
        pending.stats = ClientStats()
        expected = str(engine.weight_version) if engine.synced else None
        turns = _LeaderTurns(engine, expected, pending.stats)
        env = source.cfg.rollout.env
        rollout = MultiTurnRollout(turns, source.tokenizer, env, source.multiturn.make_env, LonePeers(),
                                   source.cfg.model.max_position_embeddings)
        params, routes = source.sampling(source.cfg.rollout.temperature), source.cfg.rollout.return_routed_experts

        def run() -> None:
            try:
                pending.samples = rollout.run(records, params, seed=seed, return_routes=routes)
                on_samples(dict(enumerate(pending.samples)))
            except BaseException as err:  # noqa: BLE001 - raised on every rank at the join
                pending.error = err

        pending.thread = threading.Thread(target=run, daemon=True, name="megatron-rl-async-trajectories")
        pending.thread.start()
        return pending

    def finish(self, source: RolloutSource) -> list[RolloutSample]:
        """Collective over the world: the leader's trajectories, on every rank of its group."""
        if self.thread is not None:
            self.thread.join()
            source.engine.count_background(self.stats)
        comm.raise_first_failure(self.error, source.groups.world, "a background multi-turn rollout")
        if comm.size(source.groups.mp) > 1:
            return comm.broadcast_object(self.samples, 0, source.groups.mp)
        return self.samples


class _LeaderTurns:
    """The SGLang engine's ``generate_local`` behind the engine interface ``MultiTurnRollout`` calls."""

    def __init__(self, engine, expected: str | None, stats) -> None:
        self.engine, self.expected, self.stats = engine, expected, stats

    def generate(self, prompts, params, *, return_routed_experts, seed, routes_from=None) -> list[RolloutSample]:
        return self.engine.generate_local(prompts, params, return_routed_experts=return_routed_experts, seed=seed,
                                          routes_from=routes_from, expected=self.expected, stats=self.stats)


def check_versions(samples: list[RolloutSample], version: int, max_staleness: int = 0) -> None:
    """Every token of every rollout must come from the weights the old-policy pass will use,
    or from one at most ``max_staleness`` versions older."""
    def in_bound(s: RolloutSample) -> bool:
        versions = [s.weight_version, *s.versions().tolist()]
        return version - max_staleness <= min(versions) and max(versions) <= version

    stale = [i for i, s in enumerate(samples) if not in_bound(s)]
    if stale:
        raise RuntimeError(
            f"rollout samples {stale[:8]}{' ...' if len(stale) > 8 else ''} carry weight versions "
            f"{sorted(set(samples[stale[0]].versions().tolist()))}, but the trainer is at version {version}"
            f"{f' (rollout.max_staleness {max_staleness})' if max_staleness else ''}: the engine "
            "served stale weights (check rollout.sglang.weight_sync)"
        )


class RolloutSource:
    """This rank's rollouts: draw, generate, score and choose groups (every collective method
    is called on every rank together)."""

    def __init__(self, cfg: RunConfig, objective: ObjectiveConfig, groups: ParallelGroups, engine: RolloutEngine,
                 tokenizer: PromptTokenizer, train_set: PromptSet, scorer: RewardScorer) -> None:
        self.cfg, self.objective, self.groups, self.engine = cfg, objective, groups, engine
        self.tokenizer, self.train_set, self.scorer = tokenizer, train_set, scorer
        self.groups_per_rank = cfg.rollout.prompts_per_step // groups.dp_size
        """Groups this rank trains per step (the entry points checked the split)."""
        self.multiturn = None
        """Multi-turn rollouts against ``rollout.env`` (None: one response per prompt)."""
        if cfg.rollout.env.name is not None:
            from megatron_rl.rollout.envs.load import env_factory
            from megatron_rl.rollout.multiturn import GroupPeers, MultiTurnRollout

            self.multiturn = MultiTurnRollout(engine, tokenizer, cfg.rollout.env, env_factory(cfg.rollout.env),
                                              GroupPeers(groups), cfg.model.max_position_embeddings)

    # ------------------------------------------------------------------ data

    def mine(self, items: list) -> list:
        """This DP rank's share (item j goes to rank j mod DP)."""
        return items[self.groups.dp_rank :: self.groups.dp_size]

    def problems_at(self, start: int, end: int) -> list[PromptRecord]:
        """This rank's prompts at positions ``start`` .. ``end - 1`` of the training order."""
        return self.mine([self.train_set.at(p, self.cfg.seed) for p in range(start, end)])

    def draw(self, state: TrainerState) -> list[PromptRecord]:
        """This rank's prompts of the next sampling round (advances the data position)."""
        start = state.data_position
        state.data_position += self.cfg.rollout.prompts_per_step
        return self.problems_at(start, state.data_position)

    def per_sample(self, problems: list[PromptRecord]) -> list[PromptRecord]:
        """Each prompt repeated for its group's G responses."""
        return [p for p in problems for _ in range(self.cfg.rollout.group_size)]

    # ------------------------------------------------------------------ generation

    def sampling(self, temperature: float) -> SamplingParams:
        """The run's sampling parameters at ``temperature``."""
        r = self.cfg.rollout
        return SamplingParams(temperature=temperature, top_p=r.top_p, top_k=r.top_k,
                              max_new_tokens=r.max_new_tokens, stop_token_ids=self.tokenizer.stop_token_ids)

    def _round_seed(self, step: int, round_: int) -> int:
        """Sampling seed of round ``round_`` (from 1) of RL step ``step``."""
        return self.cfg.seed * 7919 + step * 131 + round_

    def generate(self, problems: list[PromptRecord], step: int, round_: int) -> list[RolloutSample]:
        """Collective: G responses per prompt of sampling round ``round_`` of ``step``."""
        r = self.cfg.rollout
        return self.respond(self.per_sample(problems), r.temperature, self._round_seed(step, round_),
                            r.return_routed_experts)

    def respond(self, records: list[PromptRecord], temperature: float, seed: int,
                return_routes: bool) -> list[RolloutSample]:
        """Collective: one response (or multi-turn trajectory, with ``rollout.env``) per record."""
        params = self.sampling(temperature)
        if self.multiturn is not None:
            return self.multiturn.run(records, params, seed=seed, return_routes=return_routes)
        return self.engine.generate([p.prompt_ids for p in records], params, return_routed_experts=return_routes,
                                    seed=seed)

    def start_generate(self, problems: list[PromptRecord], step: int, round_: int,
                       on_samples: Callable[[dict[int, RolloutSample]], None]) -> PendingGeneration | Background:
        """:meth:`generate` begun in the background (the engine's ``start_generate``; with
        ``rollout.env``, the whole multi-turn rollout in the model-parallel leader's thread),
        with the same prompts and seeds; ``on_samples`` gets the samples in the generating thread."""
        r = self.cfg.rollout
        seed = self._round_seed(step, round_)
        if self.multiturn is not None:
            return Background.start(self, self.per_sample(problems), seed, on_samples)
        return self.engine.start_generate([p.prompt_ids for p in self.per_sample(problems)],
                                          self.sampling(r.temperature), return_routed_experts=r.return_routed_experts,
                                          seed=seed, on_samples=on_samples)

    def finish_generate(self, pending: PendingGeneration | Background, version: int) -> list[RolloutSample]:
        """Collective: the samples of a batch :meth:`start_generate` began (``version``: the
        trainer's weight version now, see the engine's ``finish_generate``)."""
        if isinstance(pending, Background):
            return pending.finish(self)
        return self.engine.finish_generate(pending, version)

    # ------------------------------------------------------------------ rewards

    def _reward_input(self, record: PromptRecord, sample: RolloutSample) -> RewardInput:
        # A trajectory's answer is its last model turn.
        ids = sample.output_ids if sample.turns is None else sample.output_ids[sample.turns[-1][0]:]
        return RewardInput(sample_id=record.sample_id, prompt=record.prompt,
                           response=self.tokenizer.decode_response(ids),
                           ground_truth=record.ground_truth, metadata=record.metadata)

    def total_reward(self, result: RewardResult, sample: RolloutSample) -> float:
        """A response's reward: the reward function's score, plus the environment's rewards of a
        trajectory, or ``reward.error_score`` for a trajectory its environment failed."""
        if sample.turn_rewards is None:
            return result.score
        if sample.end_reason in ENV_FAULTS:
            return self.cfg.reward.error_score
        return result.score + sum(sample.turn_rewards)

    def rewards_of(self, records: list[PromptRecord], samples: list[RolloutSample]) -> list[RewardResult]:
        """Rewards of ``samples[i]`` answering ``records[i]``, from the reward pool, as they come
        (any thread; the pool serves one caller at a time)."""
        return self.scorer.score([self._reward_input(r, s) for r, s in zip(records, samples)])

    def score(self, records: list[PromptRecord], samples: list[RolloutSample],
              ready: dict[int, RewardResult] | None = None) -> list[RewardResult]:
        """:meth:`rewards_of`, except those ``ready`` (by index); a reward function that failed
        is printed with the sample's id (the caller counts them), or ended the run already when
        ``reward.fatal_errors`` is set."""
        ready = ready or {}
        todo = [i for i in range(len(records)) if i not in ready]
        scored = dict(zip(todo, self.rewards_of([records[i] for i in todo], [samples[i] for i in todo])
                          if todo else []))
        results = [ready[i] if i in ready else scored[i] for i in range(len(records))]
        failed = [(record.sample_id, res.error) for record, res in zip(records, results) if res.error is not None]
        for sample_id, error in failed[:MAX_REWARD_ERRORS_PRINTED]:
            print(f"reward {self.cfg.reward.function!r} failed on sample {sample_id}: {error}",
                  file=sys.stderr, flush=True)
        return results

    def _group_rewards(self, results: list[RewardResult], samples: list[RolloutSample]) -> torch.Tensor:
        """``[G]`` rewards of one group, with overlong shaping."""
        rewards = torch.tensor([self.total_reward(r, s) for r, s in zip(results, samples)], dtype=torch.float64)
        if self.objective.overlong_penalty_max_len is not None:
            lengths = torch.tensor([len(s.output_ids) for s in samples])
            rewards = rewards + soft_overlong_penalty_S(
                lengths, self.objective.overlong_penalty_max_len, self.objective.overlong_penalty_cache_len
            )
        return rewards

    # ------------------------------------------------------------------ one step's groups

    def collect(self, step: int, state: TrainerState, metrics: dict, first: Round | None = None) -> Groups:
        """Collective: sample rounds until every rank holds enough groups with informative
        rewards (DAPO), or ``rollout.max_sampling_rounds`` are drawn; ``first``: the first
        round, generated ahead. Adds the rounds' reward, accuracy and sampling metrics."""
        r = self.cfg.rollout
        drawn, rounds = _Drawn(), 0
        while True:
            rounds += 1
            if first is not None:
                this, first = first, None
            else:
                problems = self.draw(state)
                this = Round(problems, self.generate(problems, step, rounds))
            check_versions(this.samples, state.weight_version, r.max_staleness)
            with phase_timer(metrics, "reward"):
                results = self.score(self.per_sample(this.problems), this.samples, this.ready)
            self._sort_round(drawn, this, results)
            enough = len(drawn.kept.problems) >= self.groups_per_rank
            if all_ranks_agree(enough, self.groups.dp) or rounds >= r.max_sampling_rounds:
                break
        # Every rank must train on the same number of groups (expert dispatch is collective):
        # top up with uninformative groups, which carry zero advantage.
        n, kept = self.groups_per_rank, drawn.kept
        chosen = Groups(kept.problems[:n], kept.samples[:n], kept.rewards[:n])
        missing = n - len(chosen.problems)
        chosen.problems.extend(drawn.dropped.problems[:missing])
        chosen.samples.extend(drawn.dropped.samples[:missing])
        chosen.rewards.extend(drawn.dropped.rewards[:missing])
        metrics.update(mean_over({
            "reward/mean": torch.cat(drawn.rewards).mean(),
            "rollout/accuracy": torch.tensor(drawn.correct, dtype=torch.float64).mean(),
            "rollout/response_length": torch.tensor(drawn.lengths, dtype=torch.float64).mean(),
            "sampling/rounds": torch.tensor(float(rounds)),
            "sampling/groups_drawn": torch.tensor(float(len(drawn.rewards))),
            "sampling/informative_frac": torch.tensor(len(kept.problems) / max(1, len(drawn.rewards))),
        }, self.groups.dp))
        metrics.update(self._reward_extras(drawn.extras, drawn.errors, drawn.timeouts))
        if self.multiturn is not None:
            metrics.update(self.agreed_means(drawn.trajectories))
        return chosen

    def _sort_round(self, drawn: _Drawn, this: Round, results: list[RewardResult]) -> None:
        """Add a scored round to ``drawn``: each group kept, or dropped as uninformative."""
        G = self.cfg.rollout.group_size
        drawn.errors += sum(res.error is not None for res in results)
        drawn.timeouts += sum(res.timed_out for res in results)
        for res in results:
            for name, value in res.extras.items():
                drawn.extras.setdefault(f"reward/{name}", []).append(value)
        for g, problem in enumerate(this.problems):
            group = this.samples[g * G : (g + 1) * G]
            group_results = results[g * G : (g + 1) * G]
            rewards = self._group_rewards(group_results, group)
            drawn.rewards.append(rewards)
            drawn.correct.extend(1.0 if self.total_reward(res, s) > 0 else 0.0 for res, s in zip(group_results, group))
            drawn.lengths.extend(len(s.output_ids) for s in group)
            if self.multiturn is not None:
                for name, values in trajectory_stats(group).items():
                    drawn.trajectories.setdefault(name, []).extend(values)
            informative = bool(dynamic_sampling_keep_S(rewards, torch.zeros(G, dtype=torch.int64), 1).any())
            target = drawn.kept if informative or not self.objective.dynamic_sampling else drawn.dropped
            target.problems.append(problem)
            target.samples.append(group)
            target.rewards.append(rewards)

    # ------------------------------------------------------------------ after the rollouts

    def balanced(self, chosen: Groups, metrics: dict) -> Groups:
        """With a token budget, whole groups re-dealt over the DP ranks so that tokens per rank
        balance (:mod:`megatron_rl.train.dp_balance`); collective over the DP group."""
        if self.cfg.train.micro_batch_tokens is None or self.groups.dp_size == 1:
            return chosen
        items = list(zip(chosen.problems, chosen.samples, chosen.rewards))
        tokens = [sum(len(s.prompt_ids) + len(s.output_ids) for s in group) for group in chosen.samples]
        mine, balance = rebalance_over_dp(items, tokens, self.groups, self.cfg.train.mini_batches)
        metrics.update(balance)
        return Groups(*(list(column) for column in zip(*mine)))

    def route_agreement_per_turn(self, samples: list[RolloutSample], old_record) -> dict[str, torch.Tensor]:
        """``routing/rollout_agreement/turn<k>``: share of (position, layer) pairs whose rollout
        routes (what R3 replays) are the experts the old-policy pass chose, among the positions
        turn k's engine pass computed (``turn_of_positions``), averaged over the DP group."""
        same, count = {}, {}
        for i, s in enumerate(samples):
            rollout_NLK = s.routed_experts.long()
            old_NLK = old_record.sample(i).expert_ids_TLK[:-1].long()
            if rollout_NLK.shape[1] != old_NLK.shape[1]:
                rollout_NLK = rollout_NLK[:, [n - 1 for n in old_record.layer_numbers]]
            agree_N = (rollout_NLK.sort(-1).values == old_NLK.sort(-1).values).all(-1).double().mean(-1)
            turn_N = turn_of_positions(len(s.prompt_ids), s.turns or [(0, len(s.output_ids))], agree_N.numel())
            for k in range(1, int(turn_N.max()) + 1):
                same[k] = same.get(k, 0.0) + float(agree_N[turn_N == k].sum())
                count[k] = count.get(k, 0.0) + float((turn_N == k).sum())
        values = {f"routing/rollout_agreement/turn{k}": [same[k] / max(count[k], 1.0)] for k in same}
        return self.agreed_means(values)

    def agreed_means(self, values: dict[str, list[float]]) -> dict[str, torch.Tensor]:
        """Collective: each name's mean over every rank's values (a rank may lack a name:
        the names are agreed on first, so every rank reduces the same tensor). An environment's
        count (:func:`~megatron_rl.rollout.multiturn.is_env_count`) is a mean over every
        trajectory (``env/turns`` has one value per trajectory), 0 where it was not reported."""
        names = set(values)
        if self.groups.dp_size > 1:
            names = set().union(*all_gather_objects(sorted(names), self.groups.dp))
        names = sorted(names)
        trajectories = len(values.get("env/turns", []))
        counted = [trajectories if is_env_count(n) else len(values.get(n, [])) for n in names]
        totals = torch.tensor([sum(values.get(n, [])) for n in names] + counted, dtype=torch.float64)
        if self.groups.dp_size > 1:
            all_reduce(totals, self.groups.dp)
        return {n: (totals[i] / totals[len(names) + i].clamp(min=1)).float() for i, n in enumerate(names)}

    def _reward_extras(self, extras: dict[str, list[float]], errors: int, timeouts: int) -> dict[str, torch.Tensor]:
        """Means of the reward functions' extra fields over the global batch, and the counts of
        responses whose reward failed (``reward/errors``) and, of those, ran out of time
        (``reward/timeouts``).

        Ranks may see different extra names (a reward may add a field only sometimes), so
        the names are agreed on first: every rank then reduces the same tensor.
        """
        names = set(extras)
        if self.groups.dp_size > 1:
            names = set().union(*all_gather_objects(sorted(names), self.groups.dp))
        names = sorted(names)
        sums = [sum(extras.get(n, [])) for n in names]
        counts = [len(extras.get(n, [])) for n in names]
        totals = torch.tensor([*sums, *counts, float(errors), float(timeouts)], dtype=torch.float64)
        if self.groups.dp_size > 1:
            all_reduce(totals, self.groups.dp)
        out = {n: (totals[i] / totals[len(names) + i].clamp(min=1)).float() for i, n in enumerate(names)}
        out["reward/errors"], out["reward/timeouts"] = totals[-2].float(), totals[-1].float()
        return out
