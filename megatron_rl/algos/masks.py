"""Token masks: which tokens enter the loss, its denominators and sequence ratios.

Owns the masks that remove tokens (as opposed to ``algos.weights``, which rescales them):

* response mask — given by the caller (``loss_mask_T``);
* overlong filtering (DAPO §3.4) — every token of a truncated sample is dropped;
* Beyond-80/20 (Wang et al.) — keep the ``k = ceil(rho * N)`` highest-entropy tokens of
  the N response tokens passed in (at least one when N > 0; ties keep the earlier token,
  where ``torch.topk`` leaves them unspecified);
* STAPO S2T — among candidate tokens (the token's advantage > 0, which for outcome
  rewards is the sequence's, and probability ``exp(log pi) < tau_p``)
  drop those whose entropy is strictly below the q-quantile (linear interpolation, as
  ``torch.quantile``) of the candidates' entropies.

Both batch-level filters use the response tokens that survive the overlong filter as
their population, each independently; the final mask is the AND of all. Entropy and
probability come from the current policy (the tensors passed in) and are used detached.
Denominators then count only kept tokens, as the papers define.

Because the 80/20 top-k and the STAPO quantile are batch statistics, a caller that splits
a mini-batch into micro-batches builds the mask once on the whole mini-batch with
:func:`build_loss_mask` and passes it with ``apply_filters=False`` to every micro-batch
call of ``policy_loss`` (see there). Everything here is sync-free: the top-k and the
quantile come from ``algos.order_stats`` (radix selection), not from ``.item()``.

Shape legend: T tokens, S sequences.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .batch import TokenBatch
from .config import ObjectiveConfig
from .order_stats import kth_smallest, top_k_mask

# rho * N is computed in float64; 0.7 * 10 = 7.000000000000001 must still give k = 7.
_CEIL_SLACK = 1e-9


def overlong_keep_T(truncated_S: Tensor, seq_ids_T: Tensor) -> Tensor:
    """[T] bool: False on every token of a truncated sequence (``truncated_S`` is [S] bool)."""
    return ~truncated_S.bool()[seq_ids_T]


def entropy_top_keep_T(entropy_T: Tensor, base_mask_T: Tensor, rho: float) -> Tensor:
    """[T] bool: the ``ceil(rho * N)`` highest-entropy tokens among the N in ``base_mask_T``.

    Args:
        entropy_T: [T] token entropies (detached here).
        base_mask_T: [T] bool population.
        rho: kept fraction in (0, 1].
    """
    n = base_mask_T.sum()
    k = torch.ceil(rho * n.double() - _CEIL_SLACK).long().clamp(min=torch.clamp(n, max=1))
    return top_k_mask(entropy_T.detach(), base_mask_T, k)


def stapo_keep_T(
    logprobs_T: Tensor,
    advantages_T: Tensor,
    entropy_T: Tensor,
    base_mask_T: Tensor,
    tau_p: float,
    q: float,
) -> Tensor:
    """[T] bool: False on the S2T-silenced tokens, True elsewhere.

    Args:
        logprobs_T: [T] current-policy log-probs (detached here).
        advantages_T: [T] advantages.
        entropy_T: [T] current-policy entropies (detached here).
        base_mask_T: [T] bool population.
        tau_p: probability threshold.
        q: entropy quantile in (0, 1].
    """
    entropy_T = entropy_T.detach()
    candidate_T = base_mask_T & (advantages_T > 0) & (logprobs_T.detach().exp() < tau_p)
    n = candidate_T.sum()
    # Linear interpolation between the order statistics at floor and ceil of q * (n - 1).
    pos = q * (n - 1).clamp(min=0).double()
    lo, hi = torch.floor(pos).long(), torch.ceil(pos).long()
    value_lo = kth_smallest(entropy_T, candidate_T, lo)
    # The next order statistic is value_lo again if it is tied, else the smallest value above it.
    above_T = candidate_T & (entropy_T > value_lo)
    next_value = torch.where(above_T, entropy_T, entropy_T.new_tensor(float("inf"))).amin()
    value_hi = torch.where((candidate_T & (entropy_T <= value_lo)).sum() > hi, value_lo, next_value)
    threshold = torch.lerp(value_lo, value_hi, (pos - lo.double()).to(entropy_T.dtype))
    return ~(candidate_T & (n > 0) & (entropy_T < threshold))


def build_loss_mask(cfg: ObjectiveConfig, batch: TokenBatch) -> tuple[Tensor, dict[str, Tensor]]:
    """Applies the configured masks on top of the response mask ``batch.loss_mask_T``.

    Args:
        cfg: objective configuration (overlong_filter, entropy_top_rho, stapo_tau_p/q).
        batch: the response mask and sequence ids, plus what the masks read:
            ``truncated_S`` (overlong filter), ``entropy_T`` (80/20, STAPO), ``logprobs_T``
            and ``advantages_T`` (STAPO).

    Returns:
        ([T] bool kept mask, metrics): ``mask/<name>_frac`` is the fraction of response
        tokens each mask removed (a token can be removed by several), as 0-dim tensors.

    Raises:
        InputError: an input the configured masks read is missing. Values are not
            checked here; ``policy_loss`` checks what it is given.
    """
    batch.require(cfg, loss=False, filters=True)
    response_T = batch.loss_mask_T.bool()
    base_T = response_T
    removed: dict[str, Tensor] = {}
    if cfg.overlong_filter:
        base_T = response_T & overlong_keep_T(batch.truncated_S, batch.seq_ids_T)
        removed["overlong"] = response_T & ~base_T
    kept_T = base_T
    if cfg.entropy_top_rho is not None:
        keep_T = entropy_top_keep_T(batch.entropy_T, base_T, cfg.entropy_top_rho)
        removed["entropy"] = base_T & ~keep_T
        kept_T = kept_T & keep_T
    if cfg.stapo_tau_p is not None:
        keep_T = stapo_keep_T(
            batch.logprobs_T, batch.advantages_T, batch.entropy_T, base_T, cfg.stapo_tau_p, cfg.stapo_q
        )
        removed["stapo"] = base_T & ~keep_T
        kept_T = kept_T & keep_T
    num_response = response_T.sum().clamp(min=1).double()
    metrics = {
        f"mask/{name}_frac": mask_T.sum().double() / num_response
        for name, mask_T in removed.items()
    }
    return kept_T, metrics
