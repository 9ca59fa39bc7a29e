"""Segmented reductions over a packed token axis.

Owns the small vectorized kernels every other module uses to move between tokens and
sequences (or sequences and groups): sums and counts per segment, broadcasting back, the
first index of a segment and the conversion from ``cu_seqlens``. All of them are
``index_add_`` / ``scatter_reduce_`` / ``repeat_interleave`` calls: no Python loop over
segments and no host synchronisation. It owns no objective logic.

Shape legend: T tokens, S sequences, G groups, S1 = S + 1 (cumulative offsets).
Segment ids need not be sorted for the sums and counts; they must lie in ``[0, n)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


def seq_ids_from_cu_seqlens(cu_seqlens_S1: Tensor) -> Tensor:
    """Converts cumulative sequence offsets into a per-token sequence id.

    Args:
        cu_seqlens_S1: [S + 1] int offsets, ``cu_seqlens_S1[0] == 0``, nondecreasing.

    Returns:
        [T] int64 sequence id of every token, ``T = cu_seqlens_S1[-1]``.
    """
    if cu_seqlens_S1.dim() != 1 or cu_seqlens_S1.numel() < 2:
        raise ValueError(
            "cu_seqlens_S1 must be 1-D with at least 2 entries, "
            f"got shape {tuple(cu_seqlens_S1.shape)}"
        )
    if cu_seqlens_S1.dtype.is_floating_point or cu_seqlens_S1.dtype == torch.bool:
        raise ValueError(f"cu_seqlens_S1 must be an integer tensor, got {cu_seqlens_S1.dtype}")
    lengths_S = cu_seqlens_S1[1:] - cu_seqlens_S1[:-1]
    if bool(cu_seqlens_S1[0] != 0) or bool((lengths_S < 0).any()):
        raise ValueError("cu_seqlens_S1 must start at 0 and be nondecreasing")
    seq_index_S = torch.arange(lengths_S.numel(), device=cu_seqlens_S1.device)
    return torch.repeat_interleave(seq_index_S, lengths_S.long())


def segment_sum(values_T: Tensor, seg_ids_T: Tensor, num_segments: int) -> Tensor:
    """Sums ``values_T`` per segment; differentiable w.r.t. ``values_T``.

    Args:
        values_T: [T] values (any dtype that ``index_add_`` accepts).
        seg_ids_T: [T] int64 segment ids in ``[0, num_segments)``.
        num_segments: number of segments N.

    Returns:
        [N] per-segment sums (0 for an empty segment).
    """
    out_N = values_T.new_zeros(num_segments)
    return out_N.index_add(0, seg_ids_T, values_T)


def segment_count(mask_T: Tensor, seg_ids_T: Tensor, num_segments: int) -> Tensor:
    """Counts the True entries of ``mask_T`` per segment.

    Returns:
        [N] int64 counts.
    """
    return segment_sum(mask_T.long(), seg_ids_T, num_segments)


@dataclass(frozen=True)
class KeptTokens:
    """The kept tokens of a packed batch and their per-sequence counts, built once per call.

    Masking multiplies by ``weight_T`` (0/1 in the compute dtype) rather than calling
    ``torch.where``, which is several times slower on CPU; the values it multiplies must be
    finite, which the input checks and the zeroed masked log-ratios guarantee.
    """

    mask_T: Tensor
    """[T] bool kept tokens."""
    weight_T: Tensor
    """[T] the same as 0/1 floats in the compute dtype."""
    seq_ids_T: Tensor
    """[T] int64 sequence ids."""
    num_seqs: int
    """S."""
    count_S: Tensor
    """[S] kept tokens per sequence, as floats of at least 32 bits (exact below 2^24)."""

    @classmethod
    def build(
        cls, mask_T: Tensor, seq_ids_T: Tensor, num_seqs: int, dtype: torch.dtype
    ) -> KeptTokens:
        """Counts the kept tokens of every sequence (one segmented sum)."""
        weight_T = mask_T.to(dtype)
        count_dtype = torch.promote_types(dtype, torch.float32)
        count_src_T = weight_T if count_dtype == dtype else mask_T.to(count_dtype)
        return cls(
            mask_T, weight_T, seq_ids_T, num_seqs, segment_sum(count_src_T, seq_ids_T, num_seqs)
        )

    def seq_sum(self, values_T: Tensor) -> Tensor:
        """[S] sums over kept tokens of ``values_T`` (finite)."""
        return segment_sum(values_T * self.weight_T, self.seq_ids_T, self.num_seqs)

    def seq_mean(self, values_T: Tensor) -> Tensor:
        """[S] means over kept tokens of ``values_T`` (finite); 0 for a sequence with none."""
        return self.seq_sum(values_T) / self.count_S.clamp(min=1)

    def to_tokens(self, values_S: Tensor) -> Tensor:
        """[S] -> [T]: every token gets its sequence's value."""
        return values_S.index_select(0, self.seq_ids_T)


def segment_amin_amax(
    values_T: Tensor, seg_ids_T: Tensor, num_segments: int
) -> tuple[Tensor, Tensor]:
    """Per-segment minimum and maximum (not differentiable).

    Returns:
        ([N], [N]) minima and maxima; an empty segment gives (+inf, -inf).
    """
    values_T = values_T.detach()
    lo_N = values_T.new_full((num_segments,), float("inf")).scatter_reduce(
        0, seg_ids_T, values_T, "amin"
    )
    hi_N = values_T.new_full((num_segments,), float("-inf")).scatter_reduce(
        0, seg_ids_T, values_T, "amax"
    )
    return lo_N, hi_N


def segment_first_index(seg_ids_T: Tensor, num_segments: int) -> Tensor:
    """Index of the first token of every segment (T for an empty segment).

    Returns:
        [N] int64 positions on the token axis.
    """
    positions_T = torch.arange(seg_ids_T.numel(), device=seg_ids_T.device)
    first_N = torch.full(
        (num_segments,), seg_ids_T.numel(), dtype=torch.long, device=seg_ids_T.device
    )
    return first_N.scatter_reduce(0, seg_ids_T, positions_T, "amin")
