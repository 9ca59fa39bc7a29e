"""Held-out evaluation: the policy's responses to the eval prompts, scored, and their statistics.

Owns :class:`Evaluator` (``eval/accuracy`` over ``eval.num_samples`` responses per eval
prompt, ``eval/pass@k``, ``eval/accuracy_greedy``, the fractions of responses whose reward
failed or timed out (``eval/reward_error_frac``, ``eval/reward_timeout_frac``), and for multi-turn rollouts the
trajectories' statistics) and the unbiased pass@k estimator of Chen et al. (2021): with
``n`` samples of which ``c`` are correct, ``pass@k = 1 - C(n-c, k) / C(n, k)``, the
probability that at least one of ``k`` samples drawn without replacement from the ``n`` is
correct, averaged over prompts. Does not own generation or scoring (the rollout source
generates through the engine and scores in the reward pool), nor when evaluation runs (the
trainer: ``train.eval_every``).
"""

from __future__ import annotations

from math import comb
from typing import TYPE_CHECKING, Sequence

import torch

from megatron_rl.parallel.comm import all_reduce
from megatron_rl.rollout.multiturn import trajectory_stats
from megatron_rl.train.rollouts import check_versions

if TYPE_CHECKING:
    from megatron_rl.data.prompts import PromptSet
    from megatron_rl.parallel.groups import ParallelGroups
    from megatron_rl.sections.train import EvalConfig
    from megatron_rl.train.colocate import EngineTurns
    from megatron_rl.train.rollouts import RolloutSource


def pass_at_k(correct_per_prompt: Sequence[int], n: int, k: int) -> float:
    """Sum over prompts of the unbiased pass@k (divide by the prompt count for the mean).

    Args:
        correct_per_prompt: correct responses ``c`` of each prompt (0 <= c <= n).
        n: responses per prompt.
        k: responses the metric may pick (1 <= k <= n).
    """
    if not 1 <= k <= n:
        raise ValueError(f"pass@k needs 1 <= k <= n, got k={k}, n={n}")
    total = 0.0
    for c in correct_per_prompt:
        if not 0 <= c <= n:
            raise ValueError(f"a prompt has {c} correct of {n} responses")
        # C(n - c, k) counts the k-subsets with no correct response.
        total += 1.0 - comb(n - c, k) / comb(n, k)
    return total


class Evaluator:
    """The run's held-out evaluation (construct and call on every rank together).

    Args:
        cfg: the ``eval`` section.
        seed: the run's seed (the sampling seeds of every evaluation).
        groups: this rank's parallel groups (each DP rank evaluates its share of the prompts).
        eval_set: the eval prompts (none: evaluation is skipped).
        rollouts: the rollout source (generation, scoring, this rank's share).
        turns: the engine's turns (a colocated engine gets the devices for the generation).
        engine: the rollout engine (the weight version every response must carry).
    """

    def __init__(self, cfg: EvalConfig, seed: int, groups: ParallelGroups, eval_set: PromptSet,
                 rollouts: RolloutSource, turns: EngineTurns, engine) -> None:
        self.cfg, self.seed, self.groups, self.eval_set = cfg, seed, groups, eval_set
        self.rollouts, self.turns, self.engine = rollouts, turns, engine

    def __call__(self) -> dict[str, torch.Tensor]:
        """Held-out accuracy and pass@k over ``eval.num_samples`` responses per eval prompt.

        A response counts as correct when its reward is positive. Greedy accuracy is added
        when ``eval.greedy`` is set and the sampled evaluation is not greedy already.
        """
        e = self.cfg
        if not self.eval_set.records:
            return {}  # no eval files: evaluation is optional
        records = self.eval_set.records[: e.max_prompts]
        records = records[: len(records) - len(records) % self.groups.dp_size]
        mine = self.rollouts.mine(records)
        n = e.num_samples
        asked = [r for r in mine for _ in range(n)]
        greedy = None
        with self.turns.generating():
            samples = self.rollouts.respond(asked, e.temperature, self.seed, return_routes=False)
            if e.greedy and e.temperature > 0:
                greedy = self.rollouts.respond(mine, 0.0, self.seed, return_routes=False)
        check_versions(samples, self.engine.weight_version)
        results = self.rollouts.score(asked, samples)
        rewards = [self.rollouts.total_reward(res, s) for res, s in zip(results, samples)]
        correct = [sum(reward > 0 for reward in rewards[i * n : (i + 1) * n]) for i in range(len(mine))]
        # A response whose reward failed counts as wrong: the fractions say how many did, and why.
        names = ["eval/accuracy", *(f"eval/pass@{k}" for k in e.pass_k), "eval/reward_error_frac",
                 "eval/reward_timeout_frac"]
        sums = [sum(correct) / n, *(pass_at_k(correct, n, k) for k in e.pass_k),
                sum(r.error is not None for r in results) / n, sum(r.timed_out for r in results) / n]
        if greedy is not None:
            names.append("eval/accuracy_greedy")
            sums.append(float(sum(self.rollouts.total_reward(res, s) > 0
                                  for res, s in zip(self.rollouts.score(mine, greedy), greedy))))
        totals = torch.tensor([*sums, float(len(mine))], dtype=torch.float64)
        if self.groups.dp_size > 1:
            all_reduce(totals, self.groups.dp)
        out = {name: (totals[i] / totals[-1]).float() for i, name in enumerate(names)}
        if self.rollouts.multiturn is not None:
            stats = trajectory_stats(samples)
            out.update({"eval/" + name.removeprefix("env/"): value
                        for name, value in self.rollouts.agreed_means(stats).items()})
        return out
