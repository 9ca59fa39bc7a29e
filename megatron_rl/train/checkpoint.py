"""Save and resume the whole training state in Megatron's distributed checkpoint format.

Layout of ``<run_dir>/checkpoints``::

    step_000010/            Megatron distributed checkpoint: model + optimizer (any layout)
    step_000010/trainer_state.json   step, data position, engine weight version, config
    step_000010/rng/rank_00003.pt    each rank's torch RNG state
    latest                  the name of the newest *complete* checkpoint

A checkpoint directory counts only once ``latest`` names it, and ``latest`` is replaced
atomically after every rank has finished writing, so a run killed mid-save resumes from
the previous checkpoint and nothing half-written is ever read. The RL loop draws all its
randomness from generators seeded by (seed, step, round), so step, data position and
weights are enough to continue exactly; the RNG states are saved for anything else.

A plain optimizer that has not stepped yet holds no per-parameter state (Adam creates its
moments at the first step): such a checkpoint stores none, says so in
``trainer_state.json``, and loads as a fresh optimizer, exactly what the saving run held.
Megatron's distributed optimizer (``optim.distributed``) always stores its state (before
the first step: step 0 and zero moments, which update exactly like none), in the format
``optim.checkpoint_sharding`` names. ``trainer_state.json`` also records the layout and the
optimizer it was written with (``layout``, ``optimizer``), so that a resume into another
layout is checked before any process starts (``train/prepare.py``).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator

import torch
from torch.distributed import ProcessGroup

from megatron_rl.parallel import comm
from megatron_rl.train.disk_space import reporting_a_full_disk

if TYPE_CHECKING:
    from megatron_rl.parallel.groups import ParallelGroups


@dataclass
class TrainerState:
    """Progress of the RL loop (what a resumed run needs besides the weights)."""

    step: int
    """Steps completed (0: after the warm start, before any RL step)."""
    data_position: int
    """Prompts consumed from the training order."""
    weight_version: int
    """Version of the weights the rollout engine serves."""


def _checkpoint_root(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest complete checkpoint of a run, or None."""
    pointer = _checkpoint_root(run_dir) / "latest"
    if not pointer.exists():
        return None
    path = _checkpoint_root(run_dir) / pointer.read_text().strip()
    if not (path / "trainer_state.json").exists():
        raise RuntimeError(f"{pointer} names {path.name}, which has no trainer_state.json")
    return path


def parallel_layout(groups: ParallelGroups) -> dict[str, int]:
    """The layout a checkpoint is written under, as ``trainer_state.json`` records it."""
    return {"tensor_model_parallel_size": groups.tp_size, "pipeline_model_parallel_size": groups.pp_size,
            "expert_model_parallel_size": groups.ep_size, "expert_tensor_parallel_size": groups.etp_size,
            "data_parallel_size": groups.dp_size, "world_size": comm.size(groups.world)}


@dataclass
class WrittenCheckpoint:
    """A checkpoint whose files every rank has written, not yet named by ``latest``."""

    root: Path
    path: Path
    trainer_state: dict
    """What ``trainer_state.json`` will hold (rank 0 writes it when publishing)."""


def write_checkpoint(run_dir: str | Path, model, optimizer, state: TrainerState, config: dict,
                     group: ProcessGroup, write_more: Callable[[Path], None] | None = None,
                     layout: dict[str, int] | None = None, sharding: str = "fully_reshardable") -> WrittenCheckpoint:
    """Collectively (over ``group``, every rank: ``ParallelGroups.world``) write model,
    optimizer and RNG state; :func:`publish_checkpoint` makes it the one a resume reads.

    ``write_more(path)``, called on every rank, adds files of its own (the rollouts generated
    ahead, :mod:`megatron_rl.train.async_rollouts`). ``layout`` (:func:`parallel_layout`) is
    recorded for the resume check; ``sharding`` is the distributed optimizer's checkpoint
    format (``optim.checkpoint_sharding``)."""
    # Megatron is imported where a checkpoint is written or read: the entry point's own
    # process, which only looks for the latest one, imports none (seconds at every start).
    from megatron_rl.parallel.checkpoint import (
        has_optimizer_state,
        optimizer_sharding,
        save_training_state,
    )

    root = _checkpoint_root(run_dir)
    path = root / f"step_{state.step:06d}"
    rank = comm.rank(group)
    if rank == 0:
        path.mkdir(parents=True, exist_ok=True)
        for stale in path.glob("*"):
            if stale.is_file():
                stale.unlink()
    comm.barrier(group)
    optimizer_format = optimizer_sharding(model, sharding) if optimizer is not None else None
    with_optimizer_state = optimizer_format is not None or has_optimizer_state(optimizer)
    with _unpublished_removed_on_failure(root, path, rank), reporting_a_full_disk(path, f"saving checkpoint {path.name}"):
        save_training_state(model, optimizer, path, optimizer_format)
        (path / "rng").mkdir(exist_ok=True)
        torch.save({"torch": torch.get_rng_state()}, path / "rng" / f"rank_{rank:05d}.pt")
        if write_more is not None:
            write_more(path)
    comm.barrier(group)
    body = {"step": state.step, "data_position": state.data_position,
            "weight_version": state.weight_version, "optimizer_state": with_optimizer_state,
            "optimizer": {"distributed": optimizer_format is not None, "sharding": optimizer_format},
            **({"layout": layout} if layout is not None else {}),
            "config": config}
    return WrittenCheckpoint(root, path, body)


def publish_checkpoint(written: WrittenCheckpoint, group: ProcessGroup) -> Path:
    """Collectively: write ``trainer_state.json`` and point ``latest`` at the checkpoint."""
    if comm.rank(group) == 0:
        path = written.path
        with _unpublished_removed_on_failure(written.root, path, 0), \
                reporting_a_full_disk(path, f"saving checkpoint {path.name}"):
            (path / "trainer_state.json").write_text(json.dumps(written.trainer_state, indent=1))
            tmp = written.root / "latest.tmp"
            tmp.write_text(path.name)
        os.replace(tmp, written.root / "latest")  # atomic: readers see the old or the new name
    comm.barrier(group)
    return written.path


@contextlib.contextmanager
def _unpublished_removed_on_failure(root: Path, path: Path, rank: int) -> Iterator[None]:
    """A checkpoint directory whose writing failed (a full disk) is removed by rank 0, unless
    ``latest`` names it: a resume never reads it, and it would hold the space it took."""
    try:
        yield
    except BaseException:
        latest = root / "latest"
        if rank == 0 and not (latest.exists() and latest.read_text().strip() == path.name):
            shutil.rmtree(path, ignore_errors=True)
            (root / "latest.tmp").unlink(missing_ok=True)
        raise


def save_checkpoint(run_dir: str | Path, model, optimizer, state: TrainerState, config: dict,
                    group: ProcessGroup, write_more: Callable[[Path], None] | None = None,
                    layout: dict[str, int] | None = None, sharding: str = "fully_reshardable") -> Path:
    """Collectively write a checkpoint (:func:`write_checkpoint`) and publish it."""
    written = write_checkpoint(run_dir, model, optimizer, state, config, group, write_more, layout, sharding)
    return publish_checkpoint(written, group)


def load_checkpoint(path: Path, model, optimizer, group: ProcessGroup) -> TrainerState:
    """Collectively (over ``group``, every rank) load a checkpoint (written under any layout
    its optimizer format reshards to) into model and optimizer."""
    from megatron_rl.parallel.checkpoint import load_training_state

    body = json.loads((path / "trainer_state.json").read_text())
    # Checkpoints from before the flag: only step 0 (saved right after the warm start, before
    # the first RL step) was written by an optimizer without state.
    with_optimizer_state = body.get("optimizer_state", body["step"] > 0)
    load_training_state(model, optimizer, path, with_optimizer_state)
    rng = path / "rng" / f"rank_{comm.rank(group):05d}.pt"
    if rng.exists():
        torch.set_rng_state(torch.load(rng)["torch"])
    return TrainerState(step=body["step"], data_position=body["data_position"], weight_version=body["weight_version"])
