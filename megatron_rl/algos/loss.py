"""The policy-loss entry point: masks -> gated surrogate -> token weights -> aggregation.

``policy_loss`` evaluates any :class:`ObjectiveConfig` on a packed batch and returns the
scalar loss plus a dict of 0-dim metric tensors (no ``.item()``, nothing fetched to the
host except the optional input check). It owns the order of the pieces:

1. check that the configuration's inputs are given, and their values (``cfg.check_inputs``;
   one host sync); shapes were checked when the ``TokenBatch`` was built;
2. the kept-token mask: response mask, then overlong / 80-20 / STAPO (``algos.masks``),
   unless ``apply_filters=False`` says ``batch.loss_mask_T`` already is that mask;
3. the per-token gated surrogate (``algos.surrogate``), RSPO ``before_clip`` inside it;
4. stop-gradient token weights: RSPO ``after_clip`` and the train/rollout mismatch
   correction (``algos.weights``) multiply the per-token loss;
5. KL (``cfg.kl_coef``), entropy (``cfg.entropy_coef``) and top-k distillation
   (``cfg.distill_coef`` with ``distill_estimator='topk'``, ``algos.distill``) terms on the same
   kept tokens (the sampled distillation estimator is in the advantages already);
6. aggregation with the caller's global counts (``algos.aggregation``).

Micro-batching and data parallelism: split along sequences (sequence-level ratios need
all tokens of a sequence in one call), build the kept mask once on the whole mini-batch
with ``build_loss_mask`` when an 80/20 or STAPO filter is on, pass it with
``apply_filters=False``, pass the whole mini-batch's ``kept_counts`` as
``global_num_tokens`` / ``global_num_seqs``, and sum the returned losses.

Metrics (0-dim tensors; fractions and stats over kept tokens; a ``*`` is ``mean``, ``min``
and ``max``): ``loss/policy``, ``loss/kl``, ``loss/entropy`` (aggregated terms);
``loss/distill`` (the top-k term); ``count/kept_tokens``, ``count/kept_seqs``, ``count/truncated_seqs``; ``mask/kept_frac``
and ``mask/<overlong|entropy|stapo>_frac`` (share of response tokens removed);
``ratio/*`` (the ratio the gate saw; sequence units: the sequence ratio);
``clip/<low|high>_<token|seq>_frac`` (token: share of kept tokens on a bound; seq: share
of sequences with at least one) and ``clip/dual_token_frac``; ``kl/*`` (the configured
estimator, when reference log-probs are given); ``entropy/*``; ``weight/rspo/*`` (floored
when RSPO is on); ``weight/mismatch/*``, ``weight/mismatch_rejected_frac`` (zeroed) and
``weight/mismatch_outside_frac`` (ratio outside the band: truncated by TIS, zeroed by MIS/IcePop);
``mismatch/token_ratio/*`` (pi_old / pi_rollout per token, when rollout log-probs are given);
``distill/log_ratio/*`` (``log pi - log mu`` of the sampled tokens, the sampled estimate of the
reverse KL, when teacher log-probs are given) and ``distill/topk_kl/*`` (the top-k term).

Shape legend: T tokens, S sequences.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .aggregation import Count, aggregate_kept
from .batch import TokenBatch
from .config import ObjectiveConfig
from .kl import kl_estimate_T
from .log_ratio import exp_log_ratio
from .masks import build_loss_mask
from .segments import KeptTokens, segment_sum
from .surrogate import SurrogateOut, compute_surrogate, rspo_weights_gated_term
from .validation import count_checks, run_value_checks
from .weights import floor_router_shift_T, mismatch_log_ratio_T, mismatch_weight_T


def policy_loss(
    cfg: ObjectiveConfig,
    batch: TokenBatch,
    *,
    global_num_tokens: Count = None,
    global_num_seqs: Count = None,
    apply_filters: bool = True,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Computes the configured policy loss on a packed batch.

    Args:
        cfg: the objective (a preset from ``algos.presets`` or any valid combination).
        batch: the inputs (``algos.batch.TokenBatch``); ``logprobs_T`` carries the
            gradient, ``loss_mask_T`` is the response mask (the full kept mask with
            ``apply_filters=False``); what else ``cfg`` reads: ``TokenBatch.require``.
        global_num_tokens: token_mean denominator over the whole batch (default: local).
        global_num_seqs: sequence-mode denominator over the whole batch (default: local).
        apply_filters: False when ``batch.loss_mask_T`` already includes the configured masks.

    Inputs that the configuration does not use but that are given (rollout, reference,
    entropy, RSPO weights) only feed the metrics. A batch with no kept token gives a loss
    of exactly 0 that is still connected to ``logprobs_T`` (``backward`` gives zeros).

    Returns:
        (loss, metrics): the 0-dim loss, and 0-dim detached metric tensors (see the module
        docstring for the keys).

    Raises:
        InputError: an input is missing for the configuration, or non-finite or out of
            range (value checks with ``cfg.check_inputs``).
    """
    batch.require(cfg, loss=True, filters=apply_filters)
    if cfg.check_inputs:
        counts = {"global_num_tokens": global_num_tokens, "global_num_seqs": global_num_seqs}
        run_value_checks(batch.value_checks() + count_checks(counts))
    metrics: dict[str, Tensor] = {}
    mask_T = batch.loss_mask_T.bool()
    if apply_filters:
        mask_T, metrics = build_loss_mask(cfg, batch)
    kept = KeptTokens.build(mask_T, batch.seq_ids_T, batch.num_seqs, batch.logprobs_T.dtype)
    gamma_T = None
    if cfg.rspo_gamma_min is not None:
        gamma_T = floor_router_shift_T(batch.rspo_gamma_T, cfg.rspo_gamma_min)
    surrogate, policy_T = _weighted_policy_terms(cfg, batch, kept, gamma_T, metrics)

    def aggregate(values_T: Tensor) -> Tensor:
        return aggregate_kept(
            values_T,
            kept,
            cfg.aggregation,
            max_len=cfg.max_len,
            global_num_tokens=global_num_tokens,
            global_num_seqs=global_num_seqs,
        )

    loss = aggregate(policy_T)
    metrics["loss/policy"] = loss.detach()
    kl_T = None
    if batch.ref_logprobs_T is not None:
        # Without a KL term the estimate only feeds the metrics: no graph for it.
        kl_logprobs_T = batch.logprobs_T if cfg.kl_coef > 0 else batch.logprobs_T.detach()
        kl_T = kl_estimate_T(
            cfg.kl_estimator, kl_logprobs_T, batch.ref_logprobs_T, log_ratio_clamp=cfg.log_ratio_clamp
        )
    if cfg.kl_coef > 0:
        metrics["loss/kl"] = aggregate(kl_T)
        loss = loss + cfg.kl_coef * metrics["loss/kl"]
    if cfg.entropy_coef > 0:
        metrics["loss/entropy"] = aggregate(batch.entropy_T)
        loss = loss - cfg.entropy_coef * metrics["loss/entropy"]
    if cfg.distill_coef > 0 and cfg.distill_estimator == "topk":
        metrics["loss/distill"] = aggregate(batch.distill_T)
        loss = loss + cfg.distill_coef * metrics["loss/distill"]
    metrics = {name: value.detach() for name, value in metrics.items()}
    metrics.update(_diagnostics(batch, kept, surrogate, gamma_T, kl_T, cfg.log_ratio_clamp))
    return loss, metrics


def _weighted_policy_terms(
    cfg: ObjectiveConfig,
    batch: TokenBatch,
    kept: KeptTokens,
    gamma_T: Tensor | None,
    metrics: dict[str, Tensor],
) -> tuple[SurrogateOut, Tensor]:
    """The gated surrogate times the stop-gradient token weights; adds the weight metrics."""
    surrogate = compute_surrogate(cfg, batch, kept, None if gamma_T is None else gamma_T.log())
    policy_T = surrogate.loss_T
    if rspo_weights_gated_term(cfg):
        policy_T = policy_T * gamma_T
    if cfg.mismatch != "none":
        log_rho_T = mismatch_log_ratio_T(cfg.mismatch_level, batch, kept)
        weight_T, rejected_T = mismatch_weight_T(cfg, log_rho_T)
        policy_T = policy_T * weight_T
        metrics.update(_kept_stats("weight/mismatch", weight_T, kept))
        metrics["weight/mismatch_rejected_frac"] = _fraction(rejected_T & kept.mask_T, kept)
        # TIS truncates instead of rejecting: this share says how often any correction acted.
        low, high = cfg.mismatch_bounds()
        rho_T = log_rho_T.detach().exp()
        metrics["weight/mismatch_outside_frac"] = _fraction(((rho_T < low) | (rho_T > high)) & kept.mask_T, kept)
    return surrogate, policy_T


@torch.no_grad()
def _diagnostics(
    batch: TokenBatch,
    kept: KeptTokens,
    surrogate: SurrogateOut,
    gamma_T: Tensor | None,
    kl_T: Tensor | None,
    log_ratio_clamp: float,
) -> dict[str, Tensor]:
    num_kept_seqs = (kept.count_S > 0).sum()
    metrics = {"count/kept_tokens": kept.count_S.sum().long(), "count/kept_seqs": num_kept_seqs}
    num_response = batch.loss_mask_T.bool().sum().clamp(min=1).double()
    metrics["mask/kept_frac"] = kept.count_S.sum().double() / num_response
    metrics.update(_kept_stats("ratio", surrogate.ratio_T, kept))
    zero = torch.zeros((), dtype=torch.float64, device=kept.mask_T.device)
    for side, flags_T in (("low", surrogate.clip_low_T), ("high", surrogate.clip_high_T)):
        # A gate without this bound never clips: skip the passes over the tokens.
        token_frac = seq_frac = zero
        if flags_T is not None:
            token_frac = _fraction(flags_T, kept)
            seq_flagged_S = segment_sum(
                flags_T.to(kept.count_S.dtype), kept.seq_ids_T, kept.num_seqs
            )
            seq_frac = (seq_flagged_S > 0).sum().double() / num_kept_seqs.clamp(min=1).double()
        metrics[f"clip/{side}_token_frac"] = token_frac
        metrics[f"clip/{side}_seq_frac"] = seq_frac
    dual_T = surrogate.dual_clip_T
    metrics["clip/dual_token_frac"] = zero if dual_T is None else _fraction(dual_T, kept)
    if kl_T is not None:
        metrics.update(_kept_stats("kl", kl_T, kept))
    if batch.entropy_T is not None:
        metrics.update(_kept_stats("entropy", batch.entropy_T, kept))
    if batch.rspo_gamma_T is not None:
        metrics.update(
            _kept_stats("weight/rspo", batch.rspo_gamma_T if gamma_T is None else gamma_T, kept)
        )
    if batch.rollout_logprobs_T is not None and batch.old_logprobs_T is not None:
        log_rho_T = batch.old_logprobs_T.detach() - batch.rollout_logprobs_T.detach()
        # Clamped like every ratio, so one extreme token cannot make the mean inf.
        rho_T = exp_log_ratio(log_rho_T * kept.weight_T, log_ratio_clamp)
        metrics.update(_kept_stats("mismatch/token_ratio", rho_T, kept))
    if batch.truncated_S is not None:
        metrics["count/truncated_seqs"] = batch.truncated_S.bool().sum()
    if batch.teacher_logprobs_T is not None and batch.logprobs_T is not None:
        metrics.update(_kept_stats("distill/log_ratio", batch.logprobs_T - batch.teacher_logprobs_T, kept))
    if batch.distill_T is not None:
        metrics.update(_kept_stats("distill/topk_kl", batch.distill_T, kept))
    return metrics


def _fraction(flags_T: Tensor, kept: KeptTokens) -> Tensor:
    """Share of kept tokens flagged (``flags_T`` must already be False off the kept tokens)."""
    return flags_T.sum().double() / kept.count_S.sum().clamp(min=1).double()


def _kept_stats(prefix: str, values_T: Tensor, kept: KeptTokens) -> dict[str, Tensor]:
    """Mean/min/max over the kept tokens; all 0 when nothing is kept."""
    values_T = values_T.detach()
    mean = (values_T * kept.weight_T).sum() / kept.count_S.sum().clamp(min=1)
    # Masked entries take the kept mean, which lies inside [min, max] of the kept values;
    # v * 1 + mean * 0 is exactly v, so the kept values are not rounded.
    filled_T = values_T * kept.weight_T + mean * (1 - kept.weight_T)
    low, high = torch.aminmax(filled_T)
    return {f"{prefix}/mean": mean, f"{prefix}/min": low, f"{prefix}/max": high}
