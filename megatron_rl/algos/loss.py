"""The policy-loss entry point: masks -> gated surrogate -> token weights -> aggregation.

``policy_loss`` evaluates any :class:`ObjectiveConfig` on a packed batch and returns the
scalar loss plus a dict of 0-dim metric tensors (no ``.item()``, nothing fetched to the
host except the optional input check). It owns the order of the pieces:

1. validate the inputs (``cfg.check_inputs``; one host sync);
2. the kept-token mask: response mask, then overlong / 80-20 / STAPO (``algos.masks``),
   unless ``apply_filters=False`` says ``loss_mask_T`` already is that mask;
3. the per-token gated surrogate (``algos.surrogate``), RSPO ``before_clip`` inside it;
4. stop-gradient token weights: RSPO ``after_clip`` and the train/rollout mismatch
   correction (``algos.weights``) multiply the per-token loss;
5. KL (``cfg.kl_coef``) and entropy (``cfg.entropy_coef``) terms on the same kept tokens;
6. aggregation with the caller's global counts (``algos.aggregation``).

Micro-batching and data parallelism: split along sequences (sequence-level ratios need
all tokens of a sequence in one call), build the kept mask once on the whole mini-batch
with ``build_loss_mask`` when an 80/20 or STAPO filter is on, pass it with
``apply_filters=False``, pass the whole mini-batch's ``kept_counts`` as
``global_num_tokens`` / ``global_num_seqs``, and sum the returned losses.

Metrics (0-dim tensors; fractions and stats over kept tokens; a ``*`` is ``mean``, ``min``
and ``max``): ``loss/policy``, ``loss/kl``, ``loss/entropy`` (aggregated terms);
``count/kept_tokens``, ``count/kept_seqs``, ``count/truncated_seqs``; ``mask/kept_frac``
and ``mask/<overlong|entropy|stapo>_frac`` (share of response tokens removed);
``ratio/*`` (the ratio the gate saw; sequence units: the sequence ratio);
``clip/<low|high>_<token|seq>_frac`` (token: share of kept tokens on a bound; seq: share
of sequences with at least one) and ``clip/dual_token_frac``; ``kl/*`` (the configured
estimator, when reference log-probs are given); ``entropy/*``; ``weight/rspo/*`` (floored
when RSPO is on); ``weight/mismatch/*``, ``weight/mismatch_rejected_frac`` (zeroed) and
``weight/mismatch_outside_frac`` (ratio outside the band: truncated by TIS, zeroed by MIS/IcePop);
``mismatch/token_ratio/*`` (pi_old / pi_rollout per token, when rollout log-probs are given).

Shape legend: T tokens, S sequences.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .aggregation import Count, aggregate_kept
from .config import ObjectiveConfig
from .kl import kl_estimate_T
from .log_ratio import exp_log_ratio
from .masks import build_loss_mask
from .segments import KeptTokens, segment_sum
from .surrogate import SurrogateOut, compute_surrogate, rspo_weights_gated_term
from .validation import (
    InputError,
    check_shapes,
    finite_checks,
    first_bad_message,
    id_checks,
    run_value_checks,
)
from .weights import floor_router_shift_T, mismatch_log_ratio_T, mismatch_weight_T


def policy_loss(
    cfg: ObjectiveConfig,
    *,
    logprobs_T: Tensor,
    old_logprobs_T: Tensor | None,
    advantages_T: Tensor,
    loss_mask_T: Tensor,
    seq_ids_T: Tensor,
    num_seqs: int,
    rollout_logprobs_T: Tensor | None = None,
    ref_logprobs_T: Tensor | None = None,
    entropy_T: Tensor | None = None,
    rspo_gamma_T: Tensor | None = None,
    truncated_S: Tensor | None = None,
    global_num_tokens: Count = None,
    global_num_seqs: Count = None,
    apply_filters: bool = True,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Computes the configured policy loss on a packed batch.

    Args:
        cfg: the objective (a preset from ``algos.presets`` or any valid combination).
        logprobs_T: [T] current-policy log-probs of the sampled tokens; carries the gradient.
        old_logprobs_T: [T] old-policy log-probs; may be None only for ratio_unit 'none'
            without a mismatch correction.
        advantages_T: [T] advantages (``compute_advantages``), treated as constants.
        loss_mask_T: [T] bool (or 0/1 integer) response mask, or the full kept mask with
            ``apply_filters=False``.
        seq_ids_T: [T] int64 sequence id per token in [0, num_seqs)
            (``seq_ids_from_cu_seqlens`` converts ``cu_seqlens``).
        num_seqs: S, the number of sequences in this call.
        rollout_logprobs_T: [T] rollout-engine log-probs; needed by ``cfg.mismatch``.
        ref_logprobs_T: [T] reference log-probs; needed when ``cfg.kl_coef > 0``.
        entropy_T: [T] current-policy entropies; needed by the entropy bonus and filters.
            The bonus differentiates through it; the filters use it detached.
        rspo_gamma_T: [T] unfloored RSPO router-shift weights in (0, 1]; needed by RSPO.
        truncated_S: [S] bool, True for samples cut at the length limit (overlong filter).
        global_num_tokens: token_mean denominator over the whole batch (default: local).
        global_num_seqs: sequence-mode denominator over the whole batch (default: local).
        apply_filters: False when ``loss_mask_T`` already includes the configured masks.

    Inputs that the configuration does not use but that are given (rollout, reference,
    entropy, RSPO weights) only feed the metrics. A batch with no kept token gives a loss
    of exactly 0 that is still connected to ``logprobs_T`` (``backward`` gives zeros).

    Returns:
        (loss, metrics): the 0-dim loss, and 0-dim detached metric tensors (see the module
        docstring for the keys).

    Raises:
        InputError: a tensor is malformed, non-finite, or missing for the configuration.
    """
    tensors = dict(
        logprobs_T=logprobs_T,
        old_logprobs_T=old_logprobs_T,
        advantages_T=advantages_T,
        loss_mask_T=loss_mask_T,
        seq_ids_T=seq_ids_T,
        rollout_logprobs_T=rollout_logprobs_T,
        ref_logprobs_T=ref_logprobs_T,
        entropy_T=entropy_T,
        rspo_gamma_T=rspo_gamma_T,
        truncated_S=truncated_S,
    )
    _require_configured_inputs(cfg, tensors, apply_filters)
    if cfg.check_inputs:
        _check_inputs(tensors, num_seqs, global_num_tokens, global_num_seqs)
    metrics: dict[str, Tensor] = {}
    mask_T = loss_mask_T.bool()
    if apply_filters:
        mask_T, metrics = build_loss_mask(
            cfg,
            loss_mask_T=mask_T,
            seq_ids_T=seq_ids_T,
            logprobs_T=logprobs_T,
            advantages_T=advantages_T,
            entropy_T=entropy_T,
            truncated_S=truncated_S,
        )
    kept = KeptTokens.build(mask_T, seq_ids_T, num_seqs, logprobs_T.dtype)
    gamma_T = None
    if cfg.rspo_gamma_min is not None:
        gamma_T = floor_router_shift_T(rspo_gamma_T, cfg.rspo_gamma_min)
    surrogate, policy_T = _weighted_policy_terms(cfg, tensors, kept, gamma_T, metrics)

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
    if ref_logprobs_T is not None:
        # Without a KL term the estimate only feeds the metrics: no graph for it.
        kl_logprobs_T = logprobs_T if cfg.kl_coef > 0 else logprobs_T.detach()
        kl_T = kl_estimate_T(
            cfg.kl_estimator,
            kl_logprobs_T,
            ref_logprobs_T,
            log_ratio_clamp=cfg.log_ratio_clamp,
        )
    if cfg.kl_coef > 0:
        metrics["loss/kl"] = aggregate(kl_T)
        loss = loss + cfg.kl_coef * metrics["loss/kl"]
    if cfg.entropy_coef > 0:
        metrics["loss/entropy"] = aggregate(entropy_T)
        loss = loss - cfg.entropy_coef * metrics["loss/entropy"]
    metrics = {name: value.detach() for name, value in metrics.items()}
    metrics.update(_diagnostics(tensors, kept, surrogate, gamma_T, kl_T, cfg.log_ratio_clamp))
    return loss, metrics


def _weighted_policy_terms(
    cfg: ObjectiveConfig,
    tensors: dict[str, Tensor | None],
    kept: KeptTokens,
    gamma_T: Tensor | None,
    metrics: dict[str, Tensor],
) -> tuple[SurrogateOut, Tensor]:
    """The gated surrogate times the stop-gradient token weights; adds the weight metrics."""
    surrogate = compute_surrogate(
        cfg,
        logprobs_T=tensors["logprobs_T"],
        old_logprobs_T=tensors["old_logprobs_T"],
        advantages_T=tensors["advantages_T"],
        kept=kept,
        log_gamma_T=None if gamma_T is None else gamma_T.log(),
    )
    policy_T = surrogate.loss_T
    if rspo_weights_gated_term(cfg):
        policy_T = policy_T * gamma_T
    if cfg.mismatch != "none":
        log_rho_T = mismatch_log_ratio_T(
            cfg.mismatch_level, tensors["old_logprobs_T"], tensors["rollout_logprobs_T"], kept
        )
        weight_T, rejected_T = mismatch_weight_T(cfg, log_rho_T)
        policy_T = policy_T * weight_T
        metrics.update(_kept_stats("weight/mismatch", weight_T, kept))
        metrics["weight/mismatch_rejected_frac"] = _fraction(rejected_T & kept.mask_T, kept)
        # TIS truncates instead of rejecting: this share says how often any correction acted.
        low, high = cfg.mismatch_bounds()
        rho_T = log_rho_T.detach().exp()
        metrics["weight/mismatch_outside_frac"] = _fraction(((rho_T < low) | (rho_T > high)) & kept.mask_T, kept)
    return surrogate, policy_T


def _require_configured_inputs(
    cfg: ObjectiveConfig, tensors: dict[str, Tensor | None], apply_filters: bool
) -> None:
    needs = {
        "old_logprobs_T": cfg.ratio_unit != "none" or cfg.mismatch != "none",
        "rollout_logprobs_T": cfg.mismatch != "none",
        "ref_logprobs_T": cfg.kl_coef > 0,
        "entropy_T": cfg.entropy_coef > 0
        or (apply_filters and (cfg.entropy_top_rho is not None or cfg.stapo_tau_p is not None)),
        "rspo_gamma_T": cfg.rspo_gamma_min is not None,
        "truncated_S": apply_filters and cfg.overlong_filter,
    }
    for name, needed in needs.items():
        if needed and tensors[name] is None:
            raise InputError(f"{name} is required by this ObjectiveConfig but was not given")


def _check_inputs(
    tensors: dict[str, Tensor | None],
    num_seqs: int,
    global_num_tokens: Count,
    global_num_seqs: Count,
) -> None:
    floating = (
        "logprobs_T",
        "old_logprobs_T",
        "advantages_T",
        "rollout_logprobs_T",
        "ref_logprobs_T",
        "entropy_T",
        "rspo_gamma_T",
    )
    per_token = {
        name: tensors[name] for name in (*floating[:3], "loss_mask_T", "seq_ids_T", *floating[3:])
    }
    check_shapes(
        per_token=per_token,
        per_seq={"truncated_S": tensors["truncated_S"]},
        num_seqs=num_seqs,
        floating=floating,
    )
    checks = finite_checks({name: tensors[name] for name in floating})
    checks += id_checks(
        tensors["seq_ids_T"],
        num_seqs,
        {"loss_mask_T": tensors["loss_mask_T"], "truncated_S": tensors["truncated_S"]},
    )
    gamma_T = tensors["rspo_gamma_T"]
    if gamma_T is not None:
        low, high = torch.aminmax(gamma_T.detach())
        message = first_bad_message(
            "rspo_gamma_T", lambda: (gamma_T <= 0) | (gamma_T > 1), "is outside (0, 1]"
        )
        checks.append(("rspo_gamma_T", (low > 0) & (high <= 1), message))
    for name, count in (
        ("global_num_tokens", global_num_tokens),
        ("global_num_seqs", global_num_seqs),
    ):
        if count is None:
            continue
        if (
            isinstance(count, bool)
            or not isinstance(count, (int, float, Tensor))
            or torch.as_tensor(count).numel() != 1
        ):
            raise InputError(f"{name} must be a number or a 1-element tensor, got {count!r}")
        value = torch.as_tensor(count).reshape(1)
        ok = torch.isfinite(value.double()) & (value >= 0)
        checks.append(
            (
                name,
                ok.all(),
                first_bad_message(name, lambda ok=ok: ~ok, "is negative or not finite"),
            )
        )
    run_value_checks(checks)


@torch.no_grad()
def _diagnostics(
    tensors: dict[str, Tensor | None],
    kept: KeptTokens,
    surrogate: SurrogateOut,
    gamma_T: Tensor | None,
    kl_T: Tensor | None,
    log_ratio_clamp: float,
) -> dict[str, Tensor]:
    num_kept_seqs = (kept.count_S > 0).sum()
    metrics = {"count/kept_tokens": kept.count_S.sum().long(), "count/kept_seqs": num_kept_seqs}
    num_response = tensors["loss_mask_T"].bool().sum().clamp(min=1).double()
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
    if tensors["entropy_T"] is not None:
        metrics.update(_kept_stats("entropy", tensors["entropy_T"], kept))
    if tensors["rspo_gamma_T"] is not None:
        metrics.update(
            _kept_stats(
                "weight/rspo", tensors["rspo_gamma_T"] if gamma_T is None else gamma_T, kept
            )
        )
    if tensors["rollout_logprobs_T"] is not None and tensors["old_logprobs_T"] is not None:
        log_rho_T = tensors["old_logprobs_T"].detach() - tensors["rollout_logprobs_T"].detach()
        # Clamped like every ratio, so one extreme token cannot make the mean inf.
        rho_T = exp_log_ratio(log_rho_T * kept.weight_T, log_ratio_clamp)
        metrics.update(_kept_stats("mismatch/token_ratio", rho_T, kept))
    if tensors["truncated_S"] is not None:
        metrics["count/truncated_seqs"] = tensors["truncated_S"].bool().sum()
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
