"""A second model layout over the run's processes: another TP / EP / ETP / PP (and so DP) than
the policy's, for a model that is only scored (a distillation teacher).

Owns :class:`ModelLayout`: Megatron's groups of that layout, created once beside the policy's
(collective over the world, every rank together) and made current only inside
:meth:`ModelLayout.active`, which restores the policy's on exit
(:mod:`~megatron_rl.parallel.mcore_state` says how); and :func:`redistribute`, which moves
per-sample work between two layouts' data-parallel replicas and brings the results back.
Building the layout draws nothing from the policy's random streams: the CPU generator and
Megatron's model-parallel RNG tracker are restored after. Does not own what runs in the
layout (``megatron_rl.train.teachers``).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Sequence

import torch
from megatron.core import parallel_state, tensor_parallel

from megatron_rl.parallel import mcore_state
from megatron_rl.parallel.comm import all_gather_objects, rank
from megatron_rl.parallel.groups import ParallelGroups, current_groups
from megatron_rl.sections import ParallelConfig


@contextlib.contextmanager
def random_streams_kept() -> Iterator[None]:
    """Whatever runs inside draws from the CPU generator and the model-parallel RNG tracker;
    both are put back as they were on exit."""
    cpu = torch.get_rng_state()
    tracker = tensor_parallel.get_cuda_rng_tracker()
    states = tracker.get_states()
    try:
        yield
    finally:
        torch.set_rng_state(cpu)
        tracker.set_states(states)


class ModelLayout:
    """Megatron's groups of ``parallel`` beside the current (policy's) layout.

    Collective over the world: every rank constructs it together, after the policy's
    ``model_parallel`` and inside it. Context parallelism is not supported (CP = 1).

    Args:
        parallel: the layout; its ``world_size`` is the world's.
    """

    def __init__(self, parallel: ParallelConfig) -> None:
        if parallel.context_parallel_size != 1:
            raise ValueError("a second model layout runs without context parallelism")
        self.parallel = parallel
        policy = mcore_state.save()
        mcore_state.clear()
        try:
            parallel_state.initialize_model_parallel(
                tensor_model_parallel_size=parallel.tensor_model_parallel_size,
                pipeline_model_parallel_size=parallel.pipeline_model_parallel_size,
                expert_model_parallel_size=parallel.expert_model_parallel_size,
                expert_tensor_parallel_size=parallel.expert_tensor_parallel_size,
            )
            self._state = mcore_state.save()
            self.groups: ParallelGroups = current_groups(parallel)
            """This rank's groups in the layout."""
        finally:
            mcore_state.restore(policy)
        self._closed = False

    @contextlib.contextmanager
    def active(self) -> Iterator[ParallelGroups]:
        """The layout is Megatron's current one inside; the outer layout comes back on exit."""
        if self._closed:
            raise RuntimeError("the model layout was closed")
        outer = mcore_state.save()
        mcore_state.restore(self._state)
        try:
            yield self.groups
        finally:
            mcore_state.restore(outer)

    def close(self) -> None:
        """Destroy the layout's groups (Megatron's own teardown, run with the layout current)."""
        if self._closed:
            return
        with self.active():
            parallel_state.destroy_model_parallel()
            self._state = mcore_state.save()
        self._closed = True


def leaders_items(items: Sequence[Any], groups: ParallelGroups) -> list[Any]:
    """Every data-parallel replica's items, replica by replica (collective over the world):
    each replica's model-parallel rank 0 contributes its own."""
    mine = list(items) if rank(groups.mp) == 0 else None
    gathered = all_gather_objects((groups.dp_rank, mine), groups.world)
    by_replica = {dp: got for dp, got in gathered if got is not None}
    return [item for dp in sorted(by_replica) for item in by_replica[dp]]


def redistribute(items: Sequence[Any], source: ParallelGroups, target: ParallelGroups,
                 work: Callable[[list[Any]], list[Any]]) -> list[Any]:
    """Run ``work`` on items held by ``source``'s replicas, in ``target``'s replicas; results
    back in ``source``'s order. Collective over the world.

    Every replica of ``source`` holds its own ``items`` (the same on its model-parallel
    ranks). All of them are gathered, dealt to ``target``'s data-parallel replicas (item j
    to replica j mod DP), ``work`` runs on each replica's share on every one of its ranks
    (collectively, with the same share on each), and the results come back to the replica
    of ``source`` that holds each item. A replica of ``target`` dealt nothing runs ``work``
    on the first item and its result is dropped (its collectives must still run); with no
    item anywhere nothing runs.
    """
    everyone = leaders_items(list(items), source)
    if not everyone:
        return []
    dp = target.dp_size
    share = list(range(target.dp_rank, len(everyone), dp))
    results = work([everyone[j] for j in (share or [0])])
    if not share:
        results = []
    mine = list(zip(share, results)) if rank(target.mp) == 0 else []
    placed = dict(pair for got in all_gather_objects(mine, target.world) for pair in got)
    offsets = all_gather_objects((source.dp_rank, len(items)), source.world)
    start = sum(n for dp_rank, n in dict(offsets).items() if dp_rank < source.dp_rank)
    return [placed[start + j] for j in range(len(items))]

