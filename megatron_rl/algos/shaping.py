"""Reward shaping and group filtering that run before the advantages.

Owns DAPO's soft overlong punishment (added to the correctness reward) and the dynamic
sampling predicate (keep a group only if its rewards are not all equal). Both are pure
functions of per-sequence tensors; which sequences to resample or drop is the trainer's
business.

Shape legend: S sequences, G groups.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .segments import segment_amin_amax


def soft_overlong_penalty_S(lengths_S: Tensor, max_len: int, cache_len: int) -> Tensor:
    """DAPO eq. 13: 0 up to ``max_len - cache_len``, then linear down to -1 at ``max_len``.

    ``R = 0`` if ``|y| <= L_max - L_cache``; ``((L_max - L_cache) - |y|) / L_cache`` if
    ``|y| <= L_max``; ``-1`` beyond.

    Args:
        lengths_S: [S] response lengths in tokens.
        max_len: L_max (DAPO: 20480).
        cache_len: L_cache (DAPO: 4096), ``0 < cache_len < max_len``.

    Returns:
        [S] float64 penalty in [-1, 0].
    """
    if not 0 < cache_len < max_len:
        raise ValueError(
            "soft overlong punishment needs 0 < cache_len < max_len, "
            f"got cache_len={cache_len}, max_len={max_len}"
        )
    lengths_S = lengths_S.double()
    start = max_len - cache_len
    ramp_S = (start - lengths_S) / cache_len
    return torch.where(
        lengths_S <= start,
        torch.zeros_like(lengths_S),
        torch.where(lengths_S <= max_len, ramp_S, -torch.ones_like(lengths_S)),
    )


def dynamic_sampling_keep_S(rewards_S: Tensor, group_ids_S: Tensor, num_groups: int) -> Tensor:
    """DAPO dynamic sampling: True for sequences whose group's rewards are not all equal.

    Equality is exact (a group of one is never kept: it has no spread). A group whose
    rewards differ only by rounding counts as informative; quantise rewards first if that
    matters.

    Args:
        rewards_S: [S] rewards.
        group_ids_S: [S] int64 group ids in [0, num_groups).
        num_groups: G.

    Returns:
        [S] bool.
    """
    low_G, high_G = segment_amin_amax(rewards_S, group_ids_S, num_groups)
    return (high_G > low_G)[group_ids_S]
