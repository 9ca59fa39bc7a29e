"""Log-probabilities at chosen token ids, and the top-k of the distribution, from vocab-parallel
logits, for the top-k distillation estimator (``megatron_rl.algos.distill``).

Shape legend: R response rows, V_local this rank's vocabulary shard, K ids per row.

With the log-prob ``lp_x = z_x - lse`` of each row's target ``x`` from the vocab-parallel
log-softmax (``parallel.vocab_parallel``), the log-prob of any id ``v`` is
``z_v - z_x + lp_x``: only the logits at ``v`` and ``x`` are needed, each held by one tensor-
parallel rank. :func:`logits_at` gathers them (each rank takes the ids its shard holds, the
others add 0, one SUM over TP); its backward is the identity, because every TP rank computes
the same objective from the summed values (Megatron's "reduce from the tensor-parallel
region"). The gradient of ``z_v - z_x + lp_x`` is then ``onehot(v) - onehot(x) + (onehot(x) -
p) = onehot(v) - p``, the gradient of ``log p_v``, with no second pass over the vocabulary.

:func:`topk_logprobs` (no gradient: the teachers' side) takes each shard's top-k of its real
columns (padding excluded), gathers the ``TP x K`` candidates and keeps the best K, in
decreasing log-prob order as ``torch.topk`` gives them.

:func:`response_logprobs_at` is the training forward's use: the micro-batch's response rows,
under context parallelism each rank its own rows, whole again after a sum over CP whose
backward is the identity (``context_parallel``). Does not own the log-softmax itself or the
rows (``packing``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_rl.parallel.comm import all_gather_cat, group_rank_and_size, sum_identity_backward
from megatron_rl.parallel.context_parallel import sum_over_context_parallel
from megatron_rl.parallel.packing import PackedMicroBatch, response_targets


def logits_at(logits_RV: torch.Tensor, ids_RK: torch.Tensor, tp_group: dist.ProcessGroup | None) -> torch.Tensor:
    """``[R, K]`` logits at global ids ``ids_RK`` (differentiable), summed over the TP shards."""
    tp_rank, tp_size = group_rank_and_size(tp_group)
    v_local = logits_RV.shape[1]
    local_RK = ids_RK - tp_rank * v_local
    held_RK = (local_RK >= 0) & (local_RK < v_local)
    values_RK = logits_RV.gather(1, local_RK.clamp(0, v_local - 1)).float() * held_RK
    return sum_identity_backward(values_RK, tp_group)


def logprobs_at(logits_RV: torch.Tensor, ids_RK: torch.Tensor, targets_R: torch.Tensor, logprobs_R: torch.Tensor,
                tp_group: dist.ProcessGroup | None) -> torch.Tensor:
    """``[R, K]`` log-probs at ``ids_RK`` from the targets' log-probs ``logprobs_R`` (differentiable
    through both): ``z_v - z_x + lp_x``."""
    z_RK1 = logits_at(logits_RV, torch.cat([ids_RK, targets_R[:, None]], dim=1), tp_group)
    return z_RK1[:, :-1] - z_RK1[:, -1:] + logprobs_R[:, None].to(z_RK1.dtype)


@torch.no_grad()
def topk_logprobs(logits_RV: torch.Tensor, targets_R: torch.Tensor, logprobs_R: torch.Tensor, k: int,
                  tp_group: dist.ProcessGroup | None, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids_RK, logprobs_RK)``: each row's K most likely ids among the first ``vocab_size``
    (the rest is padding) and their log-probs (fp32), the same on every TP rank."""
    tp_rank, tp_size = group_rank_and_size(tp_group)
    v_local = logits_RV.shape[1]
    start = tp_rank * v_local
    valid = max(0, min(v_local, vocab_size - start))
    if k > vocab_size:
        raise ValueError(f"top-{k} of a vocabulary of {vocab_size}")
    z_RV = logits_RV[:, :valid].float()
    local = min(k, valid)
    vals, idx = z_RV.topk(local, dim=-1) if local else (z_RV[:, :0], z_RV[:, :0].long())
    pad = k - local
    if pad:
        vals = torch.cat([vals, vals.new_full((vals.shape[0], pad), float("-inf"))], dim=1)
        idx = torch.cat([idx, idx.new_zeros((idx.shape[0], pad))], dim=1)
    ids = idx + start
    if tp_size > 1:
        vals = all_gather_cat(vals, tp_group, dim=1)
        ids = all_gather_cat(ids, tp_group, dim=1)
    best, where = vals.topk(k, dim=-1)
    ids_RK = ids.gather(1, where)
    lse_R = logits_at(logits_RV, targets_R[:, None], tp_group)[:, 0] - logprobs_R.float()
    return ids_RK, best - lse_R[:, None]


def response_logprobs_at(mb: PackedMicroBatch, logits_1TV: torch.Tensor, prompt_lengths, groups,
                         ids_RK: torch.Tensor, logprobs_R: torch.Tensor) -> torch.Tensor:
    """``[R, K]`` log-probs at ``ids_RK`` of the micro-batch's response rows (the order of
    ``packing.response_rows``), differentiable, on every CP rank.

    Args:
        mb: the micro-batch (its CP rank says which rows ``logits_1TV`` holds).
        logits_1TV: this rank's vocab-parallel logits ``[1, T_cp, V_local]``.
        prompt_lengths: prompt tokens of each sample of the batch (by sample id).
        groups: ``ParallelGroups`` (TP for the vocabulary, CP for the row).
        ids_RK: the ids per response row.
        logprobs_R: the rows' target log-probs (``context_parallel.response_logprobs_entropy``), whole.
    """
    device = logits_1TV.device
    if mb.cp_size == 1:
        rows_R, targets_R = response_targets(mb, prompt_lengths, device)
        return logprobs_at(logits_1TV[0, rows_R], ids_RK.to(device), targets_R, logprobs_R, groups.tp)
    rows_R, targets_R = response_targets(mb, prompt_lengths, torch.device("cpu"))
    local_R = mb.local_position_of_row[rows_R]
    owned = torch.nonzero(local_R >= 0)[:, 0]
    ids_RK1 = torch.cat([ids_RK.cpu(), targets_R[:, None]], dim=1)
    z_OK1 = logits_at(logits_1TV[0, local_R[owned].to(device)], ids_RK1[owned].to(device), groups.tp)
    z_RK1 = z_OK1.new_zeros(rows_R.numel(), ids_RK1.shape[1]).index_copy(0, owned.to(device), z_OK1)
    z_RK1 = sum_over_context_parallel(z_RK1, groups.cp)
    return z_RK1[:, :-1] - z_RK1[:, -1:] + logprobs_R[:, None].to(z_RK1.dtype)
