"""Asynchronous rollouts with a staleness bound (``rollout.max_staleness: k``), and partial rollouts.

With ``max_staleness: 0`` (the default) the RL loop is synchronous: a step generates its
samples with the weights it trains, then trains, then pushes the new weights. With ``k > 0``
a producer runs ahead of the trainer: the first sampling round of each of the next ``k``
steps is generated on the SGLang servers (their own processes: disaggregated GPUs; on CPU
the stand-in) while a step trains, and a bounded buffer holds them (at most ``k`` batches,
in flight or generated and scored). Step s trains the batch launched at step s - k, at
version v = s - 1; every sample and every token carries the version that produced it.

* **Order of a step** (every rank, main thread): join step s's batch (wait for its last
  responses; its rewards were scored by the thread that generated it); launch step s + k's
  batch under v; train; then the weight push, by one of two policies:

  - ``rollout.partial: false``: requests finish under the version that started them. A push
    happens only with nothing in flight, so it waits: at step s + 1's join, every batch in
    flight is let finish first (the drain), then version s is pushed. Every response has one
    version. With k > 1 the drain means every batch in flight finishes at the next push, so a
    deeper buffer buys no more overlap than k = 1 (measured: ``tools/bench_async.py``); it
    only holds samples longer.
  - ``rollout.partial: true``: the new weights are pushed right after the update, with the
    batches in flight paused around the push (SGLang's ``/pause_generation`` in
    ``rollout.partial_mode``, :mod:`megatron_rl.rollout.sglang.pause`): their responses go on
    under the new weights, each token tagged with the version that produced it (and its
    behaviour log-prob and routes from that pass, :mod:`megatron_rl.rollout.sglang.partial`).
    A long response no longer holds a push back: the tail of a long-tailed batch is generated
    while the next steps train.

  In both, a sample is at most k versions old when trained (launched at version s - k - 1,
  trained at s - 1), by construction; the trainer checks it
  (:func:`megatron_rl.train.rollouts.check_versions`).
* **Rewards** are scored off the critical path: the thread that generated a batch scores it
  as soon as its samples are in (:class:`ScoreAhead`); the results reach the model-parallel
  peers at the join. A sample asked for again at the join, or a batch restored from a
  checkpoint, is scored at the join, by the same function on the same inputs.
* **Threads.** Only HTTP and scoring run off the main thread: a model-parallel leader's
  background thread per batch has its own event loop and client
  (:meth:`SGLangEngine.start_generate`); broadcasts to its peers, finding restarted servers,
  pauses and weight pushes are collectives, which the main thread alone issues (gloo groups
  are not safe to use from two threads). With ``rollout.env`` the leader's thread runs the
  whole multi-turn rollout (``megatron_rl.train.rollouts.Background``); a turn a push cuts
  continues under the new weights.
* **Faults.** A server that dies during background generation costs retries: the thread
  retries within the client's budget; a server that came back behind (its launch weights)
  is set aside, and the samples it still owed are asked for again at the join, after the
  collective re-push of the trainer's weights. None is lost, none is counted twice (the
  client's ledger keeps one answer per sample).
* **Losses** (AReaL's decoupled objective, which this repo already has): the "old"
  log-probs of the PPO ratio are the proximal policy, the trainer's own pass at the start of
  the step (version v); the behaviour log-probs are each token's, from the version that
  produced it, and TIS, MIS and IcePop correct between the two per token, so staleness is
  corrected with the train/rollout mismatch. R3 replays, per position, the routes of the
  engine pass that computed it.
* **Checkpoints and exactly once.** Evaluation (without partial rollouts) and checkpoints
  first settle: every batch in flight is let finish (joined) and the current weights pushed,
  so a checkpoint holds the k batches generated ahead whole, with their versions
  (:mod:`megatron_rl.train.ahead_checkpoint`): the buffer is checkpointed, not re-asked, so a
  resumed run trains exactly the samples an uninterrupted one would, none twice, none
  skipped. The last step generates ahead too, so a finished run extended later continues as
  an uninterrupted longer run would have.
* **Deterministic mode.** The interleaving is fixed (join, launch, train, push); threads
  share no state until the join. With a server that answers each request on its own (the
  stand-in's ``--max-batch 1``) and without partial rollouts a run is reproducible bit for
  bit. With partial rollouts, where a push lands in a response depends on timing (as on real
  servers): runs agree in what they train (each prompt once, every token within the bound)
  and bit for bit only over the batches a checkpoint holds.

Owns the buffer and its order. It draws, generates and scores through the small interface
:class:`RoundSource` (:class:`megatron_rl.train.rollouts.RolloutSource` is the one the trainer
passes); the sampling rounds and scoring live there, the losses in :mod:`megatron_rl.train.trainer`.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Protocol

import torch

from megatron_rl.parallel.comm import broadcast_object, max_over, mean_over
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
    """What the batches in flight need of the rollouts: the data order, background generation
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
    """The trainer's batches generated ahead (``rollout.max_staleness`` k > 0); every method is
    called on every rank together, in the main thread.

    Args:
        source: draws, generates and scores.
        max_staleness: k, the batches kept ahead.
        partial: push right after each update, pausing the batches in flight (else a push
            waits until nothing is in flight).
    """

    def __init__(self, source: RoundSource, max_staleness: int, partial: bool) -> None:
        self.source, self.engine = source, source.engine
        self.k, self.partial = max_staleness, partial
        self.ahead: deque[NextBatch] = deque()
        """The batches of the coming steps, in step order."""
        self.scored_ahead = 0.0
        """Share of the last taken batch's samples whose rewards were scored ahead."""
        self.stale_dropped = 0
        """Groups of batches restored from a checkpoint that were too old to train (``rollout.stale_samples``)."""

    # ------------------------------------------------------------------ the step

    def take(self, step: int, state: TrainerState, metrics: dict) -> Round | None:
        """Step ``step``'s first round (with the rewards already scored) if it was generated
        ahead, else None; either way the servers hold the trainer's weights when this returns.
        Adds ``time/rollout_join`` (waiting for the batch) and ``time/weight_sync`` to ``metrics``."""
        batch = None
        if self.ahead and self.ahead[0].step < step:
            raise RuntimeError(f"the batch generated ahead for step {self.ahead[0].step} was never trained "
                               f"(now at step {step})")
        if self.ahead and self.ahead[0].step == step:
            batch = self.ahead.popleft()
            with phase_timer(metrics, "rollout_join"):
                self._join(batch, state)
        with phase_timer(metrics, "weight_sync"):
            self.push(state)
        self.scored_ahead = 0.0
        if batch is None:
            return None
        self.scored_ahead = len(batch.ready or {}) / max(1, len(batch.samples))
        return Round(batch.problems, batch.samples, batch.ready)

    def fill(self, step: int, state: TrainerState) -> None:
        """Launch the batches of steps ``step + 1 .. step + k`` not launched yet, in step order."""
        last = self.ahead[-1].step if self.ahead else step
        for coming in range(max(last, step) + 1, step + self.k + 1):
            self.launch(coming, state)

    def launch(self, step: int, state: TrainerState) -> None:
        """Draw step ``step``'s first round of prompts and generate it in the background."""
        start = state.data_position
        problems = self.source.draw(state)
        scoring = ScoreAhead(self.source, self.source.per_sample(problems))
        pending = self.source.start_generate(problems, step, 1, on_samples=scoring)
        self.ahead.append(NextBatch(step, start, state.data_position, problems, pending, scoring=scoring))

    def weights_changed(self, state: TrainerState) -> None:
        """After an update: with partial rollouts the new weights go out now, the batches in
        flight paused around the push; else the push waits for the next :meth:`take`."""
        if self.partial:
            self.push(state)

    def settle(self, state: TrainerState, *, everything: bool = True) -> None:
        """Let every batch in flight finish and push the current weights (before a checkpoint,
        which then holds every batch whole); ``everything=False`` (before an evaluation): only
        what the push needs (with partial rollouts nothing: the weights went out already)."""
        if everything or not self.partial:
            for batch in self.ahead:
                self._join(batch, state)
        self.push(state)

    def push(self, state: TrainerState) -> None:
        """The trainer's weights to the servers, if they do not hold them yet; without partial
        rollouts every batch in flight is let finish first (nothing may run during a push)."""
        if self.engine.weight_version == state.weight_version:
            return
        if not self.partial:
            for batch in self.ahead:  # the drain: all their requests end before any re-push at a join
                _wait(batch.pending)
            for batch in self.ahead:
                self._join(batch, state)
        self.engine.update_weights(state.weight_version)

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

    def metrics(self, samples: list[RolloutSample], state: TrainerState) -> dict[str, torch.Tensor]:
        """Over the step's samples of every rank: ``rollout/staleness_mean``/``_max`` (versions
        between a sample's oldest token and the weights it trains), ``rollout/staleness/lag<d>``
        (share of samples d versions old, d = 0 .. k), ``rollout/token_staleness_mean`` (the
        same per generated token), ``rollout/mixed_version_frac`` (samples whose tokens come
        from more than one version), ``rollout/rewards_scored_ahead`` and
        ``rollout/stale_dropped`` (groups of restored batches too old to train, this run)."""
        v = state.weight_version
        ages = torch.tensor([float(v - s.weight_version) for s in samples], dtype=torch.float64)
        token_ages = torch.cat([(v - s.versions()[s.loss_mask()]).double() for s in samples])
        mixed = torch.tensor([float(s.token_versions is not None and len(set(s.token_versions.tolist())) > 1)
                              for s in samples], dtype=torch.float64)
        dp = self.source.groups.dp
        out = mean_over({"rollout/staleness_mean": ages.mean(), "rollout/token_staleness_mean": token_ages.mean(),
                         "rollout/mixed_version_frac": mixed.mean(),
                         "rollout/rewards_scored_ahead": torch.tensor(self.scored_ahead),
                         **{f"rollout/staleness/lag{d}": (ages == d).double().mean() for d in range(self.k + 1)}},
                        dp)
        out["rollout/staleness_max"] = max_over(ages.max().reshape(1), dp)[0].float()
        out["rollout/stale_dropped"] = torch.tensor(float(self.stale_dropped))
        return out


def _wait(pending) -> None:
    """Until a background round's thread (the model-parallel leader's; none on its peers) is done."""
    thread = getattr(pending, "thread", None)
    if thread is not None:
        thread.join()
