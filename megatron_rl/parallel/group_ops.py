"""Small questions a loop asks its process groups: which rank am I, do all ranks agree, the
largest value, the mean of named metrics.

Owns :func:`rank_in`, :func:`all_ranks_agree`, :func:`max_over` and :func:`mean_over`,
next to the collectives of :mod:`megatron_rl.parallel.comm` (which moves the tensors to the
group's device). Like comm, every helper takes its group explicitly
(``ParallelGroups.world`` for every rank of the run); on a group of one rank the reductions
issue no collective.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_rl.parallel.comm import all_reduce


def rank_in(group: dist.ProcessGroup) -> int:
    """This process's rank inside ``group``."""
    return dist.get_rank(group)


def all_ranks_agree(flag: bool, group: dist.ProcessGroup) -> bool:
    """Collective: True when ``flag`` is True on every rank of ``group``."""
    agreed = torch.tensor([1 if flag else 0])
    if dist.get_world_size(group) > 1:
        all_reduce(agreed, group, op=dist.ReduceOp.MIN)
    return bool(agreed.item())


def max_over(tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """In-place element-wise maximum of ``tensor`` over ``group``; returns it."""
    if dist.get_world_size(group) > 1:
        all_reduce(tensor, group, op=dist.ReduceOp.MAX)
    return tensor


def mean_over(values: dict[str, torch.Tensor], group: dist.ProcessGroup) -> dict[str, torch.Tensor]:
    """Collective: each named scalar's mean over the ranks of ``group`` (one all-reduce, in
    float64, names in sorted order on every rank), as float32."""
    names = sorted(values)
    stacked = torch.stack([values[n].double().reshape(()) for n in names])
    size = dist.get_world_size(group)
    if size > 1:
        all_reduce(stacked, group)
        stacked /= size
    return {n: stacked[i].float() for i, n in enumerate(names)}
