"""Stop-gradient token weights: RSPO router shift and train/rollout mismatch corrections.

Owns two per-token weights that rescale (never remove from the denominators) a token's
contribution. Both are built from frozen quantities and are returned detached:

* **RSPO** ``gamma_T``: the caller passes the router-shift weight computed from the
  router record (``moe_routing.shift``), *unfloored*; the floor ``max(gamma, gamma_min)``
  is applied here and nowhere else, so it is applied exactly once. Where it enters the
  surrogate (``before_clip``: rescale the ratio; ``after_clip``: weight the gated term)
  is decided in ``algos.surrogate``.
* **Mismatch** between the trainer's old policy and the rollout engine,
  ``rho_t = pi_old(y_t) / pi_rollout(y_t)``; at sequence level ``rho_i = prod_t rho_t``
  over the sequence's kept tokens (the unbiased sequence correction; "kept", like every
  sequence-level quantity of the library, so that a precomputed mask reproduces it):

  - ``tis``: truncate, ``clamp(rho, low, high)`` (TIS: ``min(rho, C)`` with low = 0);
  - ``mis`` / ``icepop``: keep ``rho`` inside ``[low, high]``, weight 0 outside (the token
    or sequence is discarded but still counts in the denominators, as IcePop's
    ``1/|y_i|`` and MIS define). The two differ only in their default band.

  Everything is computed in log space, so a sequence product of many ratios cannot
  overflow before it is truncated or rejected; the exponential is
  ``algos.log_ratio.exp_log_ratio``, so even an unbounded band (``mismatch_high = inf``)
  gives weights of at most ``e^log_ratio_clamp``. The weights are constants, so the clamp
  changes no gradient path, only the weight of a token beyond ``e^+-c``.

Shape legend: T tokens, S sequences.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .batch import TokenBatch
from .config import ObjectiveConfig
from .log_ratio import exp_log_ratio
from .segments import KeptTokens


def floor_router_shift_T(gamma_T: Tensor, gamma_min: float) -> Tensor:
    """RSPO weight ``sg[max(gamma, gamma_min)]``; [T] -> [T] detached."""
    return gamma_T.detach().clamp(min=gamma_min)


def mismatch_log_ratio_T(level: str, batch: TokenBatch, kept: KeptTokens) -> Tensor:
    """Log of the train/rollout ratio each token is corrected with (detached).

    Args:
        level: 'token' or 'sequence'.
        batch: ``old_logprobs_T`` (log pi_old) and ``rollout_logprobs_T`` (log pi_rollout).
        kept: the kept tokens.

    Returns:
        [T] ``log rho_t`` (token level) or ``log rho_i`` broadcast to the tokens of
        sequence i (sequence level); 0 on tokens that are not kept.
    """
    log_rho_T = (batch.old_logprobs_T.detach() - batch.rollout_logprobs_T.detach()) * kept.weight_T
    if level == "sequence":
        log_rho_T = kept.to_tokens(kept.seq_sum(log_rho_T)) * kept.weight_T
    return log_rho_T


def mismatch_weight_T(cfg: ObjectiveConfig, log_rho_T: Tensor) -> tuple[Tensor, Tensor]:
    """Applies the configured correction to ``log rho``.

    Args:
        cfg: objective configuration (mismatch mode and band).
        log_rho_T: [T] from :func:`mismatch_log_ratio_T`.

    Returns:
        ([T] weight, [T] bool rejected): the weight is ``exp(log rho)`` truncated (tis)
        or zeroed outside the band (mis, icepop); ``rejected`` marks the zeroed tokens.
    """
    low, high = cfg.mismatch_bounds()
    log_low = math.log(low) if low > 0 else float("-inf")
    log_high = math.log(high)
    banded_T = exp_log_ratio(log_rho_T.clamp(min=log_low, max=log_high), cfg.log_ratio_clamp)
    if cfg.mismatch == "tis":
        return banded_T, torch.zeros_like(log_rho_T, dtype=torch.bool)
    inside_T = (log_rho_T >= log_low) & (log_rho_T <= log_high)
    # exp of the banded value: the rejected entries never overflow, and are then zeroed.
    return banded_T * inside_T.to(log_rho_T.dtype), ~inside_T
