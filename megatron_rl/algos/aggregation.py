"""Loss aggregation: per-token losses -> one scalar, with caller-supplied global counts.

Modes (kept tokens only; ``n_i`` = kept tokens of sequence i):

* ``token_mean`` (DAPO, verl default): ``sum_{i,t} l_{i,t} / N_tokens``;
* ``seq_mean_token_mean`` (GRPO paper): ``sum_i (sum_t l_{i,t} / n_i) / N_seqs``;
* ``seq_mean_token_sum``: ``sum_i sum_t l_{i,t} / N_seqs``;
* ``constant_normalizer`` (Dr. GRPO as oat/TRL): ``sum_i (sum_t l_{i,t} / L_max) / N_seqs``.

``N_tokens`` / ``N_seqs`` default to the local counts (kept tokens; sequences with at least
one kept token). To make micro-batches or data-parallel ranks add up to the whole-batch
loss and gradient, pass the whole batch's counts as ``global_num_tokens`` /
``global_num_seqs`` and **sum** the per-call losses (no further averaging). The per-sequence
``1/n_i`` needs every token of a sequence in one call; the other modes do not.

Denominators are clamped to at least 1: an all-masked batch gives exactly 0, still
connected to the graph, so ``backward()`` runs and yields zero gradients.

Shape legend: T tokens, S sequences.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from .batch import TokenBatch
from .segments import KeptTokens

Count = int | float | Tensor | None


def kept_counts(batch: TokenBatch) -> tuple[Tensor, Tensor]:
    """(kept tokens, sequences with at least one kept token) of ``batch.loss_mask_T``.

    Returns 0-dim int64 tensors: the numbers to all-reduce (or sum over micro-batches)
    into the ``global_num_tokens`` / ``global_num_seqs`` arguments.
    """
    count_S = KeptTokens.build(
        batch.loss_mask_T.bool(), batch.seq_ids_T, batch.num_seqs, torch.float64
    ).count_S
    return count_S.sum().long(), (count_S > 0).sum()


def aggregate_loss(
    loss_T: Tensor,
    batch: TokenBatch,
    mode: str,
    *,
    max_len: int | None = None,
    global_num_tokens: Count = None,
    global_num_seqs: Count = None,
) -> Tensor:
    """Aggregates per-token losses over the kept tokens ``batch.loss_mask_T``.

    Args:
        loss_T: [T] per-token losses (finite on masked tokens too).
        batch: the kept mask, sequence ids and S.
        mode: one of token_mean, seq_mean_token_mean, seq_mean_token_sum, constant_normalizer.
        max_len: L_max for constant_normalizer.
        global_num_tokens: token_mean denominator (default: local kept tokens).
        global_num_seqs: sequence-mode denominator (default: local sequences with kept tokens).

    Returns:
        0-dim loss.
    """
    kept = KeptTokens.build(batch.loss_mask_T.bool(), batch.seq_ids_T, batch.num_seqs, loss_T.dtype)
    return aggregate_kept(
        loss_T,
        kept,
        mode,
        max_len=max_len,
        global_num_tokens=global_num_tokens,
        global_num_seqs=global_num_seqs,
    )


def aggregate_kept(
    loss_T: Tensor,
    kept: KeptTokens,
    mode: str,
    *,
    max_len: int | None = None,
    global_num_tokens: Count = None,
    global_num_seqs: Count = None,
) -> Tensor:
    """:func:`aggregate_loss` on an already built :class:`KeptTokens`."""
    if mode == "token_mean":
        denom = _denominator(global_num_tokens, lambda: kept.count_S.sum(), loss_T)
        return (loss_T * kept.weight_T).sum() / denom
    try:
        per_seq = _PER_SEQUENCE[mode]
    except KeyError:
        raise ValueError(
            f"unknown aggregation {mode!r}; available: token_mean, {', '.join(_PER_SEQUENCE)}"
        ) from None
    seq_loss_S = per_seq(kept.seq_sum(loss_T), kept.count_S, max_len)
    denom = _denominator(global_num_seqs, lambda: (kept.count_S > 0).sum(), loss_T)
    return seq_loss_S.sum() / denom


def _denominator(given: Count, local: Callable[[], Tensor], like: Tensor) -> Tensor:
    count = local() if given is None else given
    return torch.as_tensor(count, device=like.device).to(like.dtype).clamp(min=1)


def _token_mean_per_seq(sum_S: Tensor, count_S: Tensor, max_len: int | None) -> Tensor:
    return sum_S / count_S.clamp(min=1)


def _token_sum_per_seq(sum_S: Tensor, count_S: Tensor, max_len: int | None) -> Tensor:
    return sum_S


def _constant_per_seq(sum_S: Tensor, count_S: Tensor, max_len: int | None) -> Tensor:
    if max_len is None or max_len < 1:
        raise ValueError(f"constant_normalizer needs max_len >= 1, got {max_len!r}")
    return sum_S / max_len


_PER_SEQUENCE = {
    "seq_mean_token_mean": _token_mean_per_seq,
    "seq_mean_token_sum": _token_sum_per_seq,
    "constant_normalizer": _constant_per_seq,
}
