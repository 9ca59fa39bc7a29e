"""The gated surrogate: ratio unit x gate -> per-token loss (minimised, = -objective).

Every objective is written as a per-token loss ``loss_T``; the aggregation
(``algos.aggregation``) turns it into a scalar. Sequence-level objectives put their
per-sequence value on each kept token of the sequence, so seq-mean-token-mean
aggregation reproduces ``1/G sum_i`` exactly (value and gradient), and any other
aggregation is a well-defined combination.

Ratio units (``d_t = log pi_theta - log pi_old`` on kept tokens):

* ``token``: ``x_t = exp(d_t)``.
* ``sequence`` (GSPO): ``x_t = s_i = exp(mean_{t in i} d_t)``; the gate sees the sequence
  ratio, each token uses its own advantage (constant advantages give GSPO exactly).
* ``sequence_token`` (GSPO-token): ``x_t = sg[s_i] * exp(log pi_t - sg[log pi_t])``: the
  value is ``s_i``, the gradient w.r.t. ``log pi_t`` is ``s_i`` (not ``s_i / |y_i|``).
* ``geometric`` (GMPO): per-token log-space clip on the pessimistic side,
  ``d~ = min(d, eps_high)`` if A > 0 else ``max(d, -eps_low)``, then
  ``ratio_i = exp(mean_t d~_t)``; loss ``-A * ratio_i``. With token advantages of mixed
  sign the two one-sided means are both computed and each token takes its side.
* ``none`` (REINFORCE): loss ``-A * log pi``.

The means of sequence units run over the sequence's **kept** tokens (after all masks),
so a masked token has no path to the loss. They need every token of a sequence in the
same call. Gates (x is the unit's ratio):

* ``clip``: ``max(-A x, -A clip(x, 1 - eps_low, 1 + eps_high))``, and with dual clip,
  for A < 0 only, ``min(that, -A c)``;
* ``soft`` (SAPO): ``-A * sigmoid(tau (x - 1)) * 4 / tau``, tau = tau_pos if A > 0 else
  tau_neg; differentiated through x (weight on A grad log pi is ``4p(1-p) x``);
* ``cispo``: ``-sg(clip(x, 1 - eps_low_is, 1 + eps_high_is)) * A * log pi`` (optionally
  times the unified-form trust-region mask);
* ``none``: ``-A x``.

RSPO ``before_clip`` multiplies the ratio by ``sg[gamma]`` before the gate (for sequence
units: ``log gamma_t`` joins ``d_t`` inside the mean); ``after_clip`` for the geometric
unit puts ``log gamma_t`` next to the clipped ``d~_t`` inside the geometric mean (RSPO's
``prod_t (W_t gamma_t)`` with gamma always down-weighting); for every other unit the
caller multiplies the gated per-token loss by ``gamma_t`` (see ``algos.loss``).

Every ``exp`` above is ``algos.log_ratio.exp_log_ratio``: the exponent (``d_t``, the
sequence mean, GMPO's mean of clipped ``d~``) is clamped to ``+-cfg.log_ratio_clamp``
(default 20, as verl) so no ratio overflows into a NaN gradient; inside the clamp ratios
are exact, and the clip bands lie inside it (``algos.log_ratio`` lists what changes
beyond). GMPO's geometric means of the side a sequence does not use are computed on a
zeroed exponent, so an unused ``torch.where`` branch has nothing to leak.

Shape legend: T tokens, S sequences.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .batch import TokenBatch
from .config import ObjectiveConfig
from .log_ratio import exp_log_ratio
from .segments import KeptTokens, segment_sum


@dataclass(frozen=True)
class SurrogateOut:
    """Per-token surrogate and its diagnostics (diagnostics are detached)."""

    loss_T: Tensor
    """[T] per-token loss (before token weights), 0 on masked tokens."""
    ratio_T: Tensor
    """[T] ratio the gate saw (sequence units: the sequence ratio), detached."""
    clip_low_T: Tensor | None
    """[T] bool: lower bound active (clip: zero gradient; cispo: weight raised); None: no bound."""
    clip_high_T: Tensor | None
    """[T] bool: the upper bound is active; None when the gate has no upper bound."""
    dual_clip_T: Tensor | None
    """[T] bool: the dual-clip cap is active (A < 0, x > c); None without dual clip."""


def compute_surrogate(
    cfg: ObjectiveConfig, batch: TokenBatch, kept: KeptTokens, log_gamma_T: Tensor | None
) -> SurrogateOut:
    """Evaluates the configured ratio unit and gate on kept tokens.

    Args:
        cfg: objective configuration.
        batch: ``logprobs_T`` (carries the gradient), ``old_logprobs_T`` (constant; unused
            for ratio_unit 'none') and ``advantages_T`` (constant).
        kept: the kept tokens and their per-sequence counts.
        log_gamma_T: [T] log of the floored RSPO weight (detached), or None without RSPO.

    Returns:
        The per-token loss and diagnostics.
    """
    logprobs_T = batch.logprobs_T
    adv_T = batch.advantages_T.detach()
    if cfg.ratio_unit == "none":
        loss_T = -adv_T * logprobs_T * kept.weight_T
        return SurrogateOut(loss_T, torch.ones_like(loss_T).detach(), None, None, None)
    # Masked log-ratios become 0 before exp, so no overflow there can reach a value or gradient.
    log_ratio_T = (logprobs_T - batch.old_logprobs_T.detach()) * kept.weight_T
    rspo_before = log_gamma_T is not None and cfg.rspo_apply == "before_clip"
    if rspo_before:
        log_ratio_T = log_ratio_T + log_gamma_T * kept.weight_T
    if cfg.ratio_unit == "geometric":
        rspo_inside = log_gamma_T if (log_gamma_T is not None and not rspo_before) else None
        out = _geometric(cfg, log_ratio_T, adv_T, kept, rspo_inside)
    else:
        ratio_T = _unit_ratio(cfg, log_ratio_T, logprobs_T, kept)
        out = _GATES[cfg.gate](cfg, ratio_T, adv_T, logprobs_T)
    flags = [
        None if f is None else f & kept.mask_T
        for f in (out.clip_low_T, out.clip_high_T, out.dual_clip_T)
    ]
    return SurrogateOut(out.loss_T * kept.weight_T, out.ratio_T.detach(), *flags)


def _unit_ratio(
    cfg: ObjectiveConfig, log_ratio_T: Tensor, logprobs_T: Tensor, kept: KeptTokens
) -> Tensor:
    c = cfg.log_ratio_clamp
    if cfg.ratio_unit == "token":
        return exp_log_ratio(log_ratio_T, c)
    if cfg.ratio_unit == "sequence":
        return kept.to_tokens(exp_log_ratio(kept.seq_mean(log_ratio_T), c))
    # sequence_token: value s_i, gradient s_i per token through pi_t / sg[pi_t]; clamped as
    # a whole, so a sequence beyond the clamp gives no token a gradient, as GSPO does.
    log_s_T = kept.to_tokens(kept.seq_mean(log_ratio_T.detach()))
    return exp_log_ratio(log_s_T + (logprobs_T - logprobs_T.detach()), c)


def _geometric(
    cfg: ObjectiveConfig,
    log_ratio_T: Tensor,
    adv_T: Tensor,
    kept: KeptTokens,
    log_gamma_T: Tensor | None,
) -> SurrogateOut:
    clipping = cfg.gate == "clip"
    pos_T = log_ratio_T.clamp(max=cfg.eps_high) if clipping else log_ratio_T
    if log_gamma_T is not None:
        pos_T = pos_T + log_gamma_T
    if not clipping:
        ratio_T = kept.to_tokens(exp_log_ratio(kept.seq_mean(pos_T), cfg.log_ratio_clamp))
        return SurrogateOut(-adv_T * ratio_T, ratio_T, None, None, None)
    neg_T = log_ratio_T.clamp(min=-cfg.eps_low)
    if log_gamma_T is not None:
        neg_T = neg_T + log_gamma_T
    ratio_T = torch.where(
        adv_T > 0,
        _side_ratio_T(cfg, pos_T, adv_T > 0, kept),
        _side_ratio_T(cfg, neg_T, adv_T <= 0, kept),
    )
    high_T = (adv_T > 0) & (log_ratio_T > cfg.eps_high)
    low_T = (adv_T < 0) & (log_ratio_T < -cfg.eps_low)
    return SurrogateOut(-adv_T * ratio_T, ratio_T, low_T, high_T, None)


def _side_ratio_T(
    cfg: ObjectiveConfig, side_log_T: Tensor, on_side_T: Tensor, kept: KeptTokens
) -> Tensor:
    """[T] GMPO ratio of one pessimistic side: ``exp(mean_t side_log)`` of the token's sequence.

    A sequence with no kept token on this side never selects the ratio, so its exponent is
    replaced by 0 *before* ``exp`` (double-where): the unselected branch then has an
    ordinary value and its zero gradient stays zero, whatever the exponent was, instead of
    relying on the clamp alone (0 * inf = NaN once an exponent passes the dtype's range).
    """
    on_side_S = segment_sum((on_side_T & kept.mask_T).long(), kept.seq_ids_T, kept.num_seqs) > 0
    mean_S = kept.seq_mean(side_log_T)
    safe_mean_S = torch.where(on_side_S, mean_S, torch.zeros_like(mean_S))
    return kept.to_tokens(exp_log_ratio(safe_mean_S, cfg.log_ratio_clamp))


def _clip_gate(
    cfg: ObjectiveConfig, x_T: Tensor, adv_T: Tensor, logprobs_T: Tensor
) -> SurrogateOut:
    lower, upper = 1.0 - cfg.eps_low, 1.0 + cfg.eps_high
    loss_T = torch.maximum(-adv_T * x_T, -adv_T * x_T.clamp(min=lower, max=upper))
    dual_T = None
    if cfg.dual_clip_c is not None:
        loss_T = torch.where(adv_T < 0, torch.minimum(loss_T, -adv_T * cfg.dual_clip_c), loss_T)
        dual_T = (adv_T < 0) & (x_T > cfg.dual_clip_c)
    low_T = (adv_T < 0) & (x_T < lower)
    high_T = (adv_T > 0) & (x_T > upper)
    return SurrogateOut(loss_T, x_T, low_T, high_T, dual_T)


def _soft_gate(
    cfg: ObjectiveConfig, x_T: Tensor, adv_T: Tensor, logprobs_T: Tensor
) -> SurrogateOut:
    # Scalars become tensors of x's dtype: a float32 1.05 would not be the paper's tau_neg.
    tau_T = torch.where(adv_T > 0, x_T.new_tensor(cfg.tau_pos), x_T.new_tensor(cfg.tau_neg))
    gate_T = torch.sigmoid(tau_T * (x_T - 1.0)) * (4.0 / tau_T)
    return SurrogateOut(-adv_T * gate_T, x_T, None, None, None)


def _cispo_gate(
    cfg: ObjectiveConfig, x_T: Tensor, adv_T: Tensor, logprobs_T: Tensor
) -> SurrogateOut:
    lower = None if cfg.eps_low_is is None else 1.0 - cfg.eps_low_is
    upper = 1.0 + cfg.eps_high_is
    weight_T = x_T.detach().clamp(min=lower, max=upper)
    loss_T = -weight_T * adv_T * logprobs_T
    if cfg.cispo_trust_region_mask:
        outside_T = ((adv_T > 0) & (x_T > 1.0 + cfg.eps_high)) | (
            (adv_T < 0) & (x_T < 1.0 - cfg.eps_low)
        )
        loss_T = torch.where(outside_T, torch.zeros_like(loss_T), loss_T)
    low_T = x_T < lower if lower is not None else None
    return SurrogateOut(loss_T, x_T, low_T, x_T > upper, None)


def _no_gate(cfg: ObjectiveConfig, x_T: Tensor, adv_T: Tensor, logprobs_T: Tensor) -> SurrogateOut:
    return SurrogateOut(-adv_T * x_T, x_T, None, None, None)


_GATES = {"clip": _clip_gate, "soft": _soft_gate, "cispo": _cispo_gate, "none": _no_gate}


def rspo_weights_gated_term(cfg: ObjectiveConfig) -> bool:
    """True when RSPO's gamma multiplies the gated per-token loss (outside the surrogate)."""
    return (
        cfg.rspo_gamma_min is not None
        and cfg.rspo_apply == "after_clip"
        and cfg.ratio_unit != "geometric"
    )
