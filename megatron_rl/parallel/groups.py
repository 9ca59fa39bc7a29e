"""Megatron parallel state for a :class:`~megatron_rl.config.ParallelConfig`.

Owns: creating and tearing down Megatron-Core's model-parallel groups and RNG trackers,
and handing the groups to the rest of the code as one explicit :class:`ParallelGroups`
value (math and collectives receive groups as arguments; nothing below this module reads
``parallel_state`` on its own). Does not own the default process group, which the
launcher (torchrun, SLURM or the test harness) creates.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel

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
    """Model-parallel group (TP x PP): the ranks that together hold one model copy."""
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

    @property
    def is_first_stage(self) -> bool:
        """This rank holds the embedding."""
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        """This rank holds the output layer and produces logits."""
        return self.pp_rank == self.pp_size - 1


def current_groups(parallel: ParallelConfig) -> ParallelGroups:
    """Snapshot of the initialized Megatron groups for this rank."""
    ps = parallel_state
    return ParallelGroups(
        tp=ps.get_tensor_model_parallel_group(),
        pp=ps.get_pipeline_model_parallel_group(),
        ep=ps.get_expert_model_parallel_group(),
        dp=ps.get_data_parallel_group(),
        mp=ps.get_model_parallel_group(),
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
    )


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
    try:
        torch.manual_seed(seed)
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
        yield current_groups(parallel)
    finally:
        parallel_state.destroy_model_parallel()
