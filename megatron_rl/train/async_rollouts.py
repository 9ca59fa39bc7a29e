"""Asynchronous rollouts with a staleness bound (``rollout.max_staleness``).

With ``max_staleness: 0`` (the default) the RL loop is synchronous: a step generates its
samples with the weights it trains, then trains, then pushes the new weights. With
``max_staleness: 1`` the first sampling round of step s+1 is generated while step s trains,
on SGLang servers in their own processes (disaggregated GPUs; on CPU the protocol server),
so a sample may come from weights one version older than the ones it trains.

Design (one batch in flight, "finish under the old version"):

* Step s (the trainer holds version v = s - 1): join the batch generated in the background
  for step s, push version v (deferred from the end of step s - 1), start step s + 1's
  first round in the background under v, then score step s's samples and train. With
  dynamic sampling, step s's further rounds (if its rewards ask for them) are generated
  synchronously under v, tagged v, before step s + 1's round starts: their prompts come
  first in the data order, and nothing else is in flight while they run. Every weight push
  happens in the main thread while no request is in flight, so every request is generated
  entirely by one version and tagged with the version the server reported; the trainer
  checks each sample is at most ``max_staleness`` versions old. We chose this over
  aborting in-flight requests at a push and continuing them under the new weights (slime's
  and miles's partial rollouts): with one batch in flight the push is free (the batch was
  due anyway), a response has a single behaviour policy (no per-token version tags, no
  mixed routes), and the servers never need an abort-and-resume protocol; the price is
  that a deeper pipeline (k > 1) would need pushes with requests in flight, so only 0 and 1
  are offered.
* Rewards are scored off the critical path too: the thread that generated a batch scores
  it as soon as its samples arrive (the reward pool serves one caller at a time), and the
  model-parallel leader's results are broadcast to its peers at the join. A sample asked
  for again at the join, or a batch restored from a checkpoint, is scored then, by the
  same function on the same inputs.
* Only HTTP and scoring run off the main thread: a model-parallel leader's background
  thread has its own event loop and client (:meth:`SGLangEngine.start_generate`); the
  broadcast to its peers, the all-gather that finds restarted servers and any weight push
  are collectives, which the main thread alone issues (gloo groups are not safe to use
  from two threads).
  With ``rollout.env`` the leader's thread runs the whole multi-turn rollout (every turn
  over HTTP against the one version the servers hold, the environments in its own daemon
  threads; ``megatron_rl.train.rollouts.Background``) and the join hands its trajectories
  to the peers; a server found behind there fails the batch instead of being re-pushed.
  A server that dies during background generation costs retries: the thread retries
  within the client's budget; a server that came back behind (its launch weights) is set
  aside, and the samples it still owed are asked for again when the batch is joined,
  after the collective re-push of the trainer's weights (version v by then), and carry
  the version that generated them. None is lost, none is counted twice (the client's
  ledger keeps one answer per sample).
* Losses (AReaL's decoupled objective, which this repo already has): the "old" log-probs
  of the PPO ratio are the proximal policy, the trainer's own pass at the start of the step
  (version v); the rollout log-probs each sample carries are the behaviour policy, the
  engine's at the version that generated it, and TIS, MIS and IcePop correct between the
  two, so staleness is corrected with the train/rollout mismatch. R3 replays the routes a
  sample carries, produced with its tokens by that same version.
* Evaluation, checkpoints and the end of the run first "settle": join the batch in flight
  and push the current weights, so evaluation sees this step's policy, and a checkpoint
  stores the already-generated batch of the next step with its versions
  (``<checkpoint>/rollouts/rank_NNNNN.pt``, written before the checkpoint is published):
  a resumed run trains exactly the samples an uninterrupted one would, none twice, none
  skipped. The last step generates ahead too, so the final checkpoint holds step N + 1's
  batch: a finished run extended later (``train.steps`` raised) continues as an
  uninterrupted longer run would have; a run that is never extended pays one batch of
  background generation it does not use. A checkpoint whose batch cannot be used (another data-parallel size, or a run
  resumed with ``max_staleness: 0``) gives its prompts back (the data position is rewound
  to the batch's first prompt), so they are drawn again, still exactly once.
* Deterministic by construction: the interleaving is fixed (join, push, launch, train);
  threads share no state until the join. With a server that answers each request on its
  own (``protocol_server --max-batch 1``) a run is reproducible bit for bit, and tests
  compare runs exactly.

Owns the in-flight batch and its checkpoint file. It draws, generates and scores through
the small interface :class:`RoundSource` (:class:`megatron_rl.train.rollouts.RolloutSource`
is the one the trainer passes); the sampling rounds and scoring live there, the losses in
:mod:`megatron_rl.train.trainer`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Protocol

import torch

from megatron_rl.parallel.comm import broadcast_object, max_over, mean_over
from megatron_rl.parallel.comm import rank as rank_in
from megatron_rl.train.phases import phase_timer
from megatron_rl.train.rollouts import Round

if TYPE_CHECKING:
    from megatron_rl.data.prompts import PromptRecord
    from megatron_rl.parallel.groups import ParallelGroups
    from megatron_rl.rewards.core import RewardResult
    from megatron_rl.rollout.engine import RolloutSample
    from megatron_rl.rollout.sglang.engine import PendingGeneration, SGLangEngine
    from megatron_rl.train.checkpoint import TrainerState


class RoundSource(Protocol):
    """What the batch in flight needs of the rollouts: the data order, background generation
    of a round, and rewards."""

    groups: ParallelGroups
    """The run's process groups."""
    engine: SGLangEngine
    """The rollout engine (one that generates in the background)."""

    def draw(self, state: TrainerState) -> list[PromptRecord]:
        """This rank's prompts of the next sampling round (advances the data position)."""
        ...

    def problems_at(self, start: int, end: int) -> list[PromptRecord]:
        """This rank's prompts at positions ``start`` .. ``end - 1`` of the training order."""
        ...

    def per_sample(self, problems: list[PromptRecord]) -> list[PromptRecord]:
        """Each prompt repeated for its group's responses."""
        ...

    def start_generate(self, problems: list[PromptRecord], step: int, round_: int,
                       on_samples: Callable[[dict[int, RolloutSample]], None]) -> PendingGeneration:
        """Round ``round_`` of ``step`` generated in the background."""
        ...

    def finish_generate(self, pending: PendingGeneration, version: int) -> list[RolloutSample]:
        """Collective: wait for a round begun by :meth:`start_generate` (``version``: the trainer's now)."""
        ...

    def rewards_of(self, records: list[PromptRecord], samples: list[RolloutSample]) -> list[RewardResult]:
        """Rewards of ``samples[i]`` answering ``records[i]`` (safe off the main thread)."""
        ...


@dataclass
class NextBatch:
    """The first sampling round of a coming step, in flight or generated."""

    step: int
    """The RL step it is for."""
    start: int
    """Data position of its first prompt (``state.data_position`` when it was drawn)."""
    end: int
    """Data position after its last prompt."""
    problems: list[PromptRecord]
    """This data-parallel rank's prompts (one per group)."""
    pending: PendingGeneration | None
    """The background generation, until joined."""
    samples: list[RolloutSample] | None = None
    """G responses per prompt, once joined."""
    scoring: ScoreAhead | None = None
    """Rewards scored by the generation thread (the model-parallel leader's), until joined."""
    ready: dict[int, RewardResult] | None = None
    """Rewards of ``samples`` already scored, by index, once joined (None: none)."""


class ScoreAhead:
    """Scores a batch generated ahead in its generation thread, as soon as the samples
    arrive, so that scoring overlaps training as generation does (the engine's
    ``on_samples``). Its errors wait for the join, where the main thread raises them."""

    def __init__(self, source: RoundSource, records: list[PromptRecord]) -> None:
        self.source, self.records = source, records
        self.results: dict[int, tuple[list[int], RewardResult]] = {}
        """Index -> (the scored response's token ids, its reward)."""
        self.error: BaseException | None = None

    def __call__(self, samples: dict[int, RolloutSample]) -> None:
        try:
            order = sorted(samples)
            scored = self.source.rewards_of([self.records[i] for i in order], [samples[i] for i in order])
            self.results = {i: (list(samples[i].output_ids), r) for i, r in zip(order, scored)}
        except BaseException as err:  # noqa: BLE001 - raised by the main thread at the join
            self.error = err


class AsyncRollouts:
    """The trainer's batch in flight (``rollout.max_staleness`` > 0); every method is called
    on every rank together, in the main thread."""

    def __init__(self, source: RoundSource) -> None:
        self.source = source
        self.engine = source.engine
        self.next: NextBatch | None = None
        self.scored_ahead = 0.0
        """Share of the last taken batch's samples whose rewards were scored ahead."""

    # ------------------------------------------------------------------ the step

    def take(self, step: int, state: TrainerState, metrics: dict) -> Round | None:
        """Step ``step``'s first round (with the rewards already scored) if it was generated
        ahead, else None; either way the servers hold the trainer's weights when this returns. Adds
        ``time/rollout_join`` (waiting for the batch) and ``time/weight_sync`` to ``metrics``."""
        batch, self.next = self.next, None
        if batch is not None and batch.step != step:
            raise RuntimeError(f"the batch generated ahead is for step {batch.step}, not {step}")
        if batch is not None:
            with phase_timer(metrics, "rollout_join"):
                self._join(batch, state)
        with phase_timer(metrics, "weight_sync"):
            self._push(state)
        self.scored_ahead = 0.0
        if batch is None:
            return None
        self.scored_ahead = len(batch.ready or {}) / max(1, len(batch.samples))
        return Round(batch.problems, batch.samples, batch.ready)

    def launch(self, step: int, state: TrainerState) -> None:
        """Draw step ``step``'s first round of prompts and generate it in the background."""
        start = state.data_position
        problems = self.source.draw(state)
        scoring = ScoreAhead(self.source, self.source.per_sample(problems))
        pending = self.source.start_generate(problems, step, 1, on_samples=scoring)
        self.next = NextBatch(step, start, state.data_position, problems, pending, scoring=scoring)

    def settle(self, state: TrainerState) -> None:
        """Join the batch in flight (kept for its step) and push the current weights."""
        if self.next is not None:
            self._join(self.next, state)
        self._push(state)

    def _join(self, batch: NextBatch, state: TrainerState) -> None:
        if batch.samples is not None:
            return
        batch.samples = self.source.finish_generate(batch.pending, state.weight_version)
        batch.pending, scoring, batch.scoring = None, batch.scoring, None
        if scoring is None:
            return
        if scoring.error is not None:
            raise scoring.error
        results = scoring.results
        mp = self.source.groups.mp
        if mp.size() > 1:  # the leader scored; its peers take its results (one scoring per sample)
            results = broadcast_object(results, 0, mp)
        # A sample asked for again at the join (its server restarted) is a new response: scored later.
        batch.ready = {i: result for i, (ids, result) in results.items()
                       if list(batch.samples[i].output_ids) == ids}

    def _push(self, state: TrainerState) -> None:
        if self.engine.weight_version != state.weight_version:
            self.engine.update_weights(state.weight_version)

    def metrics(self, samples: list[RolloutSample], state: TrainerState) -> dict[str, torch.Tensor]:
        """``rollout/staleness_mean``/``_max``: versions between a trained sample's generating
        weights and the weights it trains, over the step's samples of every rank;
        ``rollout/rewards_scored_ahead``: share of the step's first round scored in the
        background (below 1 after a resume, or when a restarted server's samples came late)."""
        ages = torch.tensor([float(state.weight_version - s.weight_version) for s in samples], dtype=torch.float64)
        dp = self.source.groups.dp
        out = mean_over({"rollout/staleness_mean": ages.mean(),
                         "rollout/rewards_scored_ahead": torch.tensor(self.scored_ahead)}, dp)
        out["rollout/staleness_max"] = max_over(ages.max().reshape(1), dp)[0].float()
        return out

    # ------------------------------------------------------------------ checkpoints

    def save(self, checkpoint: Path, state: TrainerState) -> None:
        """Write the generated batch (or that there is none) into ``checkpoint`` before it is
        published: its prompts and positions (``rollouts/batch.json``, rank 0) and each
        rank's samples; call :meth:`settle` first. Every rank calls it (``save_checkpoint``'s
        ``write_more``), and the checkpoint is published after all have."""
        batch, groups = self.next, self.source.groups
        rank = rank_in(groups.world)
        root = Path(checkpoint) / "rollouts"
        root.mkdir(parents=True, exist_ok=True)
        if batch is not None:
            torch.save({"samples": batch.samples, "sample_ids": [p.sample_id for p in batch.problems]},
                       _rank_file(checkpoint, rank))
        if rank == 0:
            about = None if batch is None else {"step": batch.step, "start": batch.start, "end": batch.end,
                                                "dp_size": groups.dp_size}
            (root / "batch.json").write_text(json.dumps({"saved_at_step": state.step, "batch": about}))


def _rank_file(checkpoint: Path, rank: int) -> Path:
    """Where the rank ``rank`` of the world keeps its samples of the batch in ``checkpoint``."""
    return Path(checkpoint) / "rollouts" / f"rank_{rank:05d}.pt"


def resume_batch(source: RoundSource, checkpoint: Path, state: TrainerState, asynchronous: bool) -> NextBatch | None:
    """The batch a checkpoint holds for its next step, ready to train, or None.

    Only a checkpoint written with ``max_staleness`` > 0 holds one (files a run before it
    left in the same directory are never read: the checkpoint's own config says). When this
    run cannot train it as saved (``asynchronous`` is False, or another data-parallel size), the
    batch's prompts are given back: ``state.data_position`` is rewound to its first prompt,
    the same on every rank (``batch.json`` says where).
    """
    saved_cfg = json.loads((Path(checkpoint) / "trainer_state.json").read_text())["config"]
    if saved_cfg.get("rollout", {}).get("max_staleness", 0) == 0:
        return None
    about = json.loads((Path(checkpoint) / "rollouts" / "batch.json").read_text())["batch"]
    if about is None:
        return None
    rank = rank_in(source.groups.world)
    if not asynchronous or about["dp_size"] != source.groups.dp_size:
        state.data_position = about["start"]
        if rank == 0:
            print(f"{Path(checkpoint).name}: the rollouts generated ahead for step {about['step']} are not used (this "
                  "run is synchronous or has another data-parallel size); their prompts are drawn again", flush=True)
        return None
    saved = torch.load(_rank_file(checkpoint, rank), weights_only=False)
    problems = source.problems_at(about["start"], about["end"])
    if [p.sample_id for p in problems] != saved["sample_ids"]:
        raise RuntimeError(f"{_rank_file(checkpoint, rank)}: the saved rollouts answer other prompts than the training "
                           f"order gives at positions {about['start']}..{about['end']} (the data changed since)")
    return NextBatch(about["step"], about["start"], about["end"], problems, None, saved["samples"])
