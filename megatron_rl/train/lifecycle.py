"""A run's checkpoint lifecycle: where it starts, and the checkpoints it writes on the way.

A run directory that holds a checkpoint of its own always resumes from its latest one:
weights, optimizer, step, data position and weight version, and with asynchronous rollouts
the batch that was generated ahead. Otherwise the run starts at step 0 from the weights
the policy was built with (``init_checkpoint`` or random), warm-started when
``train.sft_steps`` > 0, and writes step 0 at once. Every checkpoint holds the batch generated
ahead whole (settled first), and is published (named by ``latest``) either at once or, for a
step's checkpoint (step 0's too), after the step's metrics row is logged
(:meth:`CheckpointLifecycle.publish`).

Owns the order; not the format on disk (``train.checkpoint``), the warm start itself
(``train.sft``) nor the batch generated ahead (``train.async_rollouts``).
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from megatron_rl.config_loading import to_dict
from megatron_rl.parallel.comm import rank
from megatron_rl.train.ahead_checkpoint import resume_batches, save_batches
from megatron_rl.train.checkpoint import (
    TrainerState,
    WrittenCheckpoint,
    load_checkpoint,
    parallel_layout,
    publish_checkpoint,
    write_checkpoint,
)

if TYPE_CHECKING:
    from megatron_rl.checkpoint.init_source import InitSource
    from megatron_rl.config import RunConfig
    from megatron_rl.parallel.groups import ParallelGroups
    from megatron_rl.train.async_rollouts import AsyncRollouts
    from megatron_rl.train.colocate import EngineTurns
    from megatron_rl.train.rollouts import RolloutSource


class CheckpointLifecycle:
    """Starting or resuming a run, and saving it (construct and call on every rank together).

    Args:
        cfg: the run config (``train.run_dir``, ``optim.checkpoint_sharding``; saved whole).
        groups: this rank's parallel groups.
        ddp: the DDP-wrapped policy stage.
        optimizer: its optimizer.
        turns: the engine's turns (told when the weights change).
        rollouts: the rollout source (what a resumed batch generated ahead is drawn from).
        ahead: the batch generated ahead, or None for synchronous rollouts.
        resume_path: the run's latest checkpoint, or None for a fresh start.
        init: the starting checkpoint of a fresh run (for the log line), or None.
        warm_start: the warm start of a fresh run, or None.
    """

    def __init__(self, cfg: RunConfig, groups: ParallelGroups, ddp, optimizer, turns: EngineTurns,
                 rollouts: RolloutSource, ahead: AsyncRollouts | None, resume_path: Path | None,
                 init: InitSource | None, warm_start: Callable[[], None] | None) -> None:
        self.cfg, self.groups, self.ddp, self.optimizer, self.turns = cfg, groups, ddp, optimizer, turns
        self.rollouts, self.ahead, self.resume_path = rollouts, ahead, resume_path
        self.init, self.warm_start = init, warm_start
        self.rank0 = rank(groups.world) == 0

    @property
    def resumed_step(self) -> int | None:
        """The step of the run's own checkpoint it continues (None: a fresh start)."""
        return int(self.resume_path.name.split("_")[-1]) if self.resume_path is not None else None

    def start(self) -> tuple[TrainerState, WrittenCheckpoint | None]:
        """Resume from the run's latest checkpoint, or start (the policy's weights as built),
        optionally warm-start, and write step 0's checkpoint (returned, for the caller to
        publish after step 0's row, as every step's: a run stopped before the row resumes
        at step 0 and logs it once)."""
        path = self.resume_path
        if path is not None:
            state = load_checkpoint(path, self.ddp, self.optimizer, self.groups.world)
            self.turns.weights_changed(state.weight_version)
            resume_batches(self.rollouts, path, state, self.ahead, self.cfg.rollout.stale_samples)
            if self.rank0:
                print(f"resumed from {path} (step {state.step})", flush=True)
            return state, None
        state = TrainerState(step=0, data_position=0, weight_version=0)
        if self.rank0 and self.init is not None:
            print(f"policy initialized from {self.init.path} ({self.init.hf.architecture})", flush=True)
        if self.warm_start is not None:
            self.warm_start()
            # The warm start changed the weights the engine was built with (same version 0).
            self.turns.weights_changed(state.weight_version)
        return state, self.save(state, publish=False)

    def save(self, state: TrainerState, publish: bool = True) -> WrittenCheckpoint:
        """Checkpoint, with the batch generated ahead when rollouts are asynchronous; published
        (named by ``latest``) unless the caller publishes it later (:meth:`publish`)."""
        write_more = None
        if self.ahead is not None:
            self.ahead.settle(state)
            write_more = functools.partial(save_batches, self.ahead, state=state)
        written = write_checkpoint(self.cfg.train.run_dir, self.ddp, self.optimizer, state, to_dict(self.cfg),
                                   self.groups.world, write_more, layout=parallel_layout(self.groups),
                                   sharding=self.cfg.optim.checkpoint_sharding)
        if publish:
            self.publish(written)
        return written

    def publish(self, written: WrittenCheckpoint) -> None:
        """Collective: name ``written`` as the run's latest checkpoint."""
        publish_checkpoint(written, self.groups.world)
