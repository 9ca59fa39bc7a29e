"""Megatron parallel state for a :class:`~megatron_rl.config.ParallelConfig`.

Owns: creating and tearing down Megatron-Core's model-parallel groups and RNG trackers,
and handing the groups to the rest of the code as one explicit :class:`ParallelGroups`
value (math and collectives receive groups as arguments; nothing below this module reads
``parallel_state`` on its own). Does not own the default process group, which the
launcher (torchrun, SLURM or the test harness) creates.

Under context parallelism the ranks that hold one data-parallel replica's samples are
TP x CP x PP, while Megatron's model-parallel group is TP x PP only; ``ParallelGroups.mp``
is the former (a group this module creates), because every use of it (rollouts generated
once per replica and shared, scoring results broadcast) is about holding the same samples.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel

from megatron_rl.parallel.comm import all_gather_cat
from megatron_rl.sections import ParallelConfig


@dataclass(frozen=True)
class ParallelGroups:
    """The process groups one rank belongs to, with its ranks inside them."""

    tp: dist.ProcessGroup
    """Tensor-parallel group (vocabulary, heads, sequence-parallel shards)."""
    pp: dist.ProcessGroup
    """Pipeline-parallel group (stages)."""
    ep: dist.ProcessGroup
    """Expert-parallel group."""
    dp: dist.ProcessGroup
    """Data-parallel group of the dense weights."""
    mp: dist.ProcessGroup
    """The ranks that hold one data-parallel replica's samples: TP x CP x PP (Megatron's
    model-parallel group when CP = 1)."""
    tp_rank: int
    """Rank inside the TP group."""
    tp_size: int
    """TP group size."""
    pp_rank: int
    """Pipeline stage index."""
    pp_size: int
    """Number of pipeline stages."""
    ep_rank: int
    """Rank inside the EP group."""
    ep_size: int
    """EP group size."""
    dp_rank: int
    """Rank inside the DP group."""
    dp_size: int
    """DP group size."""
    sequence_parallel: bool
    """Whether activations are sharded along the sequence over TP."""
    etp: dist.ProcessGroup
    """Expert tensor-parallel group (each expert's weights sharded over it)."""
    etp_size: int
    """Expert-TP group size (1: experts are not tensor-sharded)."""
    world: dist.ProcessGroup
    """Every rank of the run (the default group), named so that collectives over it say so."""
    cp: dist.ProcessGroup | None = None
    """Context-parallel group: the ranks that share each packed row (None: no CP)."""
    cp_rank: int = 0
    """Rank inside the CP group."""
    cp_size: int = 1
    """CP group size."""

    @property
    def is_first_stage(self) -> bool:
        """This rank holds the embedding."""
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        """This rank holds the output layer and produces logits."""
        return self.pp_rank == self.pp_size - 1


def current_groups(parallel: ParallelConfig, replica: dist.ProcessGroup | None = None) -> ParallelGroups:
    """Snapshot of the initialized Megatron groups for this rank.

    Args:
        parallel: the layout.
        replica: the TP x CP x PP group (:func:`replica_group`); None takes Megatron's
            model-parallel group, which it is when CP = 1.
    """
    ps = parallel_state
    cp_size = ps.get_context_parallel_world_size()
    return ParallelGroups(
        tp=ps.get_tensor_model_parallel_group(),
        pp=ps.get_pipeline_model_parallel_group(),
        ep=ps.get_expert_model_parallel_group(),
        dp=ps.get_data_parallel_group(),
        mp=ps.get_model_parallel_group() if replica is None else replica,
        tp_rank=ps.get_tensor_model_parallel_rank(),
        tp_size=ps.get_tensor_model_parallel_world_size(),
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        pp_size=ps.get_pipeline_model_parallel_world_size(),
        ep_rank=ps.get_expert_model_parallel_rank(),
        ep_size=ps.get_expert_model_parallel_world_size(),
        dp_rank=ps.get_data_parallel_rank(),
        dp_size=ps.get_data_parallel_world_size(),
        sequence_parallel=parallel.sequence_parallel_enabled(),
        etp=ps.get_expert_tensor_parallel_group(),
        etp_size=ps.get_expert_tensor_parallel_world_size(),
        world=dist.group.WORLD,
        cp=ps.get_context_parallel_group() if cp_size > 1 else None,
        cp_rank=ps.get_context_parallel_rank(),
        cp_size=cp_size,
    )


def replica_groups() -> tuple[dist.ProcessGroup, list[dist.ProcessGroup]]:
    """This rank's TP x CP x PP group and every such group (to destroy them later).

    Ranks with the same data-parallel rank hold the same replica's samples. Every rank
    creates every group, in data-parallel-rank order, as ``new_group`` requires.
    """
    world = dist.group.WORLD
    dp_rank = parallel_state.get_data_parallel_rank()
    coordinate_R = all_gather_cat(torch.tensor([dp_rank], dtype=torch.int64), world)
    created = [
        dist.new_group(torch.nonzero(coordinate_R == d)[:, 0].tolist())
        for d in range(parallel_state.get_data_parallel_world_size())
    ]
    return created[dp_rank], created


@contextlib.contextmanager
def model_parallel(parallel: ParallelConfig, seed: int) -> Iterator[ParallelGroups]:
    """Initialize Megatron's groups and RNG trackers; destroy them on exit.

    The default process group must already exist. The layout must have been validated
    against the world size (``megatron_rl.config.validate``).
    """
    if not dist.is_initialized():
        raise RuntimeError("model_parallel() needs torch.distributed initialized first")
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=parallel.tensor_model_parallel_size,
        pipeline_model_parallel_size=parallel.pipeline_model_parallel_size,
        context_parallel_size=parallel.context_parallel_size,
        expert_model_parallel_size=parallel.expert_model_parallel_size,
        # Passed here and not only in the model config: TP2 x EP2 on 4 ranks needs ETP=1
        # at group creation, otherwise expert-TP defaults to TP.
        expert_tensor_parallel_size=parallel.expert_tensor_parallel_size,
    )
    created: list[dist.ProcessGroup] = []
    try:
        replica = None
        if parallel.context_parallel_size > 1:
            replica, created = replica_groups()
        torch.manual_seed(seed)
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
        yield current_groups(parallel, replica)
    finally:
        for group in created:
            dist.destroy_process_group(group)
        parallel_state.destroy_model_parallel()
