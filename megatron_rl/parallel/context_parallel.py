"""Per-token values of a context-parallel row, whole again on every CP rank.

Shape legend: T tokens of a packed micro-batch row, T_cp = T / CP tokens one CP rank runs,
R response rows of the micro-batch.

Under context parallelism each CP rank runs its zig-zag share of the row
(``PackedMicroBatch.local_rows``); everything downstream of the model (log-probs, entropies,
the objective, routing records) is defined on the whole row, in sample order. Two ways back:

- :func:`response_logprobs_entropy`: each rank scores the response rows it holds, with labels
  taken from the whole row before it was cut (Megatron-LM's RL does the same), writes them
  into a zero ``[R]`` vector and the vectors are summed over CP (exact: every row has one
  owner, the others add 0). The sum's backward is the identity: every CP rank computes the
  same objective from the same summed vector, so each rank's gradient at its own rows is the
  whole gradient there; the attention's key/value all-gather returns the gradients of the
  keys and values to their owners, and DDP sums the parameter gradients over the dp x cp
  group. The objective's code is the one of a single process.
- :func:`whole_row`: values of a rank's ``T_cp`` rows (routing records, no gradient)
  all-gathered over CP and put in row order; :func:`values_at_rows` the same for a few rows
  (the last position of each sequence, which the embedded engine samples from).

Does not own the partition (``packing``) or the attention (``packed_attention``).
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from megatron_rl.parallel.comm import all_gather_cat, all_reduce, sum_identity_backward
from megatron_rl.parallel.packing import PackedMicroBatch, response_targets
from megatron_rl.parallel.vocab_parallel import vocab_parallel_logprobs_entropy


def sum_over_context_parallel(values: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """``values`` summed over the CP ranks; gradients pass back unchanged (one objective, computed
    identically on every CP rank)."""
    return sum_identity_backward(values, group)


def whole_row(local_TX: torch.Tensor, mb: PackedMicroBatch, group: dist.ProcessGroup | None) -> torch.Tensor:
    """``[T, ...]`` in row order from every CP rank's ``[T_cp, ...]`` values of ``mb`` (no gradient)."""
    if mb.cp_size == 1:
        return local_TX
    return all_gather_cat(local_TX, group)[mb.cp_row_order.to(local_TX.device)]


def values_at_rows(
    values_1TX: torch.Tensor, mb: PackedMicroBatch, rows_R: torch.Tensor, group: dist.ProcessGroup | None
) -> torch.Tensor:
    """``[R, ...]``: this rank's model output ``[1, T_cp, ...]`` at row positions ``rows_R`` of the
    whole row, on every CP rank (no gradient): each row comes from the rank that holds it."""
    if mb.cp_size == 1:
        return values_1TX[0, rows_R.to(values_1TX.device)]
    local_R = mb.local_position_of_row[rows_R.cpu()]
    owned = torch.nonzero(local_R >= 0)[:, 0]
    out = values_1TX.new_zeros(rows_R.numel(), *values_1TX.shape[2:])
    out[owned.to(out.device)] = values_1TX[0, local_R[owned].to(out.device)]
    return all_reduce(out, group)  # one owner per row, zeros elsewhere: an exact sum


def response_logprobs_entropy(
    mb: PackedMicroBatch,
    logits_1TV: torch.Tensor,
    prompt_lengths: Sequence[int],
    groups,
    temperature_R: torch.Tensor | None = None,
    **vocab_parallel_kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``[R]`` log-probs and entropies of the micro-batch's response rows, on every CP rank.

    Args:
        mb: the micro-batch (its CP rank says which rows ``logits_1TV`` holds).
        logits_1TV: the model's vocab-parallel logits of this rank's rows ``[1, T_cp, V_local]``.
        prompt_lengths: prompt tokens of each sample of the batch (by sample id).
        groups: ``ParallelGroups`` (TP for the vocabulary, CP for the row).
        temperature_R: ``[R]`` sampling temperature of each response row (None: 1).
        **vocab_parallel_kwargs: forwarded to ``vocab_parallel_logprobs_entropy``.

    Returns:
        ``(logprobs_R, entropy_R)`` in the order of ``packing.response_rows``; the entropy is
        None when not computed.
    """
    device = logits_1TV.device
    if mb.cp_size == 1:
        rows_R, targets_R = response_targets(mb, prompt_lengths, device)
        return vocab_parallel_logprobs_entropy(logits_1TV[0, rows_R], targets_R, groups.tp,
                                               temperature_T=temperature_R, **vocab_parallel_kwargs)
    rows_R, targets_R = response_targets(mb, prompt_lengths, torch.device("cpu"))  # index math on the host
    local_R = mb.local_position_of_row[rows_R]
    owned = torch.nonzero(local_R >= 0)[:, 0]
    logprobs_O, entropy_O = vocab_parallel_logprobs_entropy(
        logits_1TV[0, local_R[owned].to(device)], targets_R[owned].to(device), groups.tp,
        temperature_T=None if temperature_R is None else temperature_R[owned.to(temperature_R.device)],
        **vocab_parallel_kwargs
    )
    values_KO = torch.stack([logprobs_O] if entropy_O is None else [logprobs_O, entropy_O])
    values_KR = values_KO.new_zeros(values_KO.shape[0], rows_R.numel()).index_copy(1, owned.to(device), values_KO)
    values_KR = sum_over_context_parallel(values_KR, groups.cp)
    return values_KR[0], (None if entropy_O is None else values_KR[1])
