"""Every preset (and many combinations) equals a plainly written per-sequence reference.

The reference below is written from the formulas in objectives.md, independently of the
library: it loops over sequences in Python, works on one sequence's slice at a time, and
computes the batch-level masks with Python sorting. Both are evaluated in float64 on
random packed batches with varied lengths, ratios far outside every clip range and
positive, negative and zero advantages; the loss and its gradient w.r.t. the current
log-probs must agree to 1e-6.

``tools/bench_objectives.py`` imports ``reference_loss`` and ``make_batch`` from here.
"""

from __future__ import annotations

import math
from dataclasses import replace
from fractions import Fraction

import pytest
import torch

from megatron_rl.algos import OBJECTIVE_PRESETS, TokenBatch, get_preset, policy_loss

TOL = dict(rtol=0.0, atol=1e-6)


# ----------------------------------------------------------------------------- batches
def make_batch(
    seed: int,
    num_seqs: int = 12,
    max_len: int = 40,
    *,
    dtype=torch.float64,
    token_adv: bool = False,
) -> dict:
    """A random packed batch: varied lengths, three off-policy regimes, mixed-sign advantages."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, max_len + 1, (num_seqs,), generator=gen)
    lengths[0] = 1
    seq_ids = torch.repeat_interleave(torch.arange(num_seqs), lengths)
    n = int(lengths.sum())
    # Per sequence: near on-policy (inside GSPO's 3e-4 band), moderate, or far off-policy.
    scale_S = torch.tensor([1e-5, 0.15, 1.5], dtype=dtype)[
        torch.randint(0, 3, (num_seqs,), generator=gen)
    ]
    logprobs = -(torch.rand(n, generator=gen, dtype=dtype) * 9.0 + 0.01)
    old = logprobs - scale_S[seq_ids] * torch.randn(n, generator=gen, dtype=dtype)
    choices = torch.tensor([-1.3, -0.4, 0.0, 0.5, 1.7], dtype=dtype)
    adv_S = choices[torch.randint(0, 5, (num_seqs,), generator=gen)]
    advantages = adv_S[seq_ids]
    if token_adv:
        advantages = torch.randn(n, generator=gen, dtype=dtype)
        advantages[torch.rand(n, generator=gen) < 0.15] = 0.0
    mask = torch.rand(n, generator=gen) < 0.85
    mask[seq_ids == 1] = False  # one sequence with no response token at all
    return dict(
        logprobs_T=logprobs,
        old_logprobs_T=old,
        advantages_T=advantages,
        loss_mask_T=mask,
        seq_ids_T=seq_ids,
        num_seqs=num_seqs,
        rollout_logprobs_T=old + 0.4 * torch.randn(n, generator=gen, dtype=dtype),
        ref_logprobs_T=logprobs + 0.3 * torch.randn(n, generator=gen, dtype=dtype),
        entropy_T=torch.rand(n, generator=gen, dtype=dtype) * 3.0,
        rspo_gamma_T=torch.rand(n, generator=gen, dtype=dtype) * 0.7 + 0.3,
        truncated_S=torch.rand(num_seqs, generator=gen) < 0.25,
    )


# --------------------------------------------------------------------------- reference
def reference_masks(cfg, b: dict) -> list[bool]:
    """Kept-token flags, written with Python lists and sorting."""
    n = b["logprobs_T"].numel()
    seq = b["seq_ids_T"].tolist()
    base = [bool(m) for m in b["loss_mask_T"].tolist()]
    if cfg.overlong_filter:
        trunc = b["truncated_S"].tolist()
        base = [base[t] and not trunc[seq[t]] for t in range(n)]
    keep = list(base)
    ent = b["entropy_T"].tolist()
    if cfg.entropy_top_rho is not None:
        population = [t for t in range(n) if base[t]]
        k = math.ceil(Fraction(str(cfg.entropy_top_rho)) * len(population))
        top = set(sorted(population, key=lambda t: (-ent[t], t))[:k])
        keep = [keep[t] and t in top for t in range(n)]
    if cfg.stapo_tau_p is not None:
        lp, adv = b["logprobs_T"].tolist(), b["advantages_T"].tolist()
        cands = [
            t for t in range(n) if base[t] and adv[t] > 0 and math.exp(lp[t]) < cfg.stapo_tau_p
        ]
        if cands:
            thr = float(
                torch.quantile(
                    torch.tensor([ent[t] for t in cands], dtype=torch.float64), cfg.stapo_q
                )
            )
            silenced = {t for t in cands if ent[t] < thr}
            keep = [keep[t] and t not in silenced for t in range(n)]
    return keep


def reference_token_losses(cfg, lp, old, a, gamma):
    """Per-token loss of one sequence's kept tokens (1-D tensors of one sequence)."""
    d = lp - old
    if cfg.rspo_gamma_min is not None and cfg.rspo_apply == "before_clip":
        d = d + torch.log(gamma)
    if cfg.ratio_unit == "none":
        return -a * lp
    if cfg.ratio_unit == "geometric":
        up, down = d, d
        if cfg.gate == "clip":  # pessimistic side only: A > 0 caps the rise, A < 0 caps the fall
            up, down = torch.clamp(d, max=cfg.eps_high), torch.clamp(d, min=-cfg.eps_low)
        if cfg.rspo_gamma_min is not None and cfg.rspo_apply == "after_clip":
            up, down = up + torch.log(gamma), down + torch.log(gamma)
        ratio = torch.where(a > 0, torch.exp(up.mean()), torch.exp(down.mean()))
        return -a * ratio
    if cfg.ratio_unit == "token":
        x = torch.exp(d)
    elif cfg.ratio_unit == "sequence":
        x = torch.exp(d.mean()).expand(len(lp))
    else:  # sequence_token: sg[s_i] * pi / sg[pi]
        x = torch.exp(d.mean().detach()) * torch.exp(lp) / torch.exp(lp).detach()
    if cfg.gate == "clip":
        value = torch.maximum(-a * x, -a * torch.clamp(x, 1 - cfg.eps_low, 1 + cfg.eps_high))
        if cfg.dual_clip_c is not None:
            value = torch.where(a < 0, torch.minimum(value, -a * cfg.dual_clip_c), value)
        return value
    if cfg.gate == "soft":
        tau = torch.where(a > 0, torch.full_like(a, cfg.tau_pos), torch.full_like(a, cfg.tau_neg))
        return -a * torch.sigmoid(tau * (x - 1)) * 4 / tau
    if cfg.gate == "cispo":
        low = None if cfg.eps_low_is is None else 1 - cfg.eps_low_is
        value = -torch.clamp(x.detach(), min=low, max=1 + cfg.eps_high_is) * a * lp
        if cfg.cispo_trust_region_mask:
            outside = ((a > 0) & (x > 1 + cfg.eps_high)) | ((a < 0) & (x < 1 - cfg.eps_low))
            value = torch.where(outside, torch.zeros_like(value), value)
        return value
    return -a * x


def reference_weights(cfg, old, rollout, gamma):
    """Stop-gradient multipliers of one sequence's kept tokens."""
    w = torch.ones_like(old)
    if (
        cfg.rspo_gamma_min is not None
        and cfg.rspo_apply == "after_clip"
        and cfg.ratio_unit != "geometric"
    ):
        w = w * gamma
    if cfg.mismatch != "none":
        low, high = cfg.mismatch_bounds()
        rho = torch.exp(old - rollout)
        if cfg.mismatch_level == "sequence":
            rho = torch.prod(rho).expand(len(old))
        if cfg.mismatch == "tis":
            rho = torch.clamp(rho, low, high)
        else:
            rho = torch.where((rho >= low) & (rho <= high), rho, torch.zeros_like(rho))
        w = w * rho
    return w


def reference_loss(cfg, b: dict, global_num_tokens=None, global_num_seqs=None) -> torch.Tensor:
    """Loops over sequences; returns the scalar loss (differentiable w.r.t. logprobs_T)."""
    keep = reference_masks(cfg, b)
    tokens_of = {}
    for t, (s, k) in enumerate(zip(b["seq_ids_T"].tolist(), keep, strict=True)):
        if k:
            tokens_of.setdefault(s, []).append(t)
    per_seq = []  # (sum of token losses, number of kept tokens)
    for i in range(b["num_seqs"]):
        if i not in tokens_of:
            continue
        ix = torch.tensor(tokens_of[i])
        lp, old, adv = b["logprobs_T"][ix], b["old_logprobs_T"][ix], b["advantages_T"][ix]
        gamma = None
        if b.get("rspo_gamma_T") is not None:
            gamma = torch.clamp(b["rspo_gamma_T"][ix], min=cfg.rspo_gamma_min or 0.0)
        losses = reference_token_losses(cfg, lp, old, adv, gamma)
        losses = losses * reference_weights(cfg, old, b["rollout_logprobs_T"][ix], gamma)
        if cfg.kl_coef > 0:
            log_r = b["ref_logprobs_T"][ix] - lp
            kl = {"k1": -log_r, "k2": 0.5 * log_r**2, "k3": torch.exp(log_r) - 1 - log_r}[
                cfg.kl_estimator
            ]
            losses = losses + cfg.kl_coef * kl
        if cfg.entropy_coef > 0:
            losses = losses - cfg.entropy_coef * b["entropy_T"][ix]
        per_seq.append((losses.sum(), len(ix)))
    if not per_seq:
        return b["logprobs_T"].sum() * 0
    n_tokens = global_num_tokens if global_num_tokens is not None else sum(n for _, n in per_seq)
    n_seqs = global_num_seqs if global_num_seqs is not None else len(per_seq)
    if cfg.aggregation == "token_mean":
        return sum(s for s, _ in per_seq) / n_tokens
    if cfg.aggregation == "seq_mean_token_mean":
        return sum(s / n for s, n in per_seq) / n_seqs
    if cfg.aggregation == "seq_mean_token_sum":
        return sum(s for s, _ in per_seq) / n_seqs
    return sum(s / cfg.max_len for s, _ in per_seq) / n_seqs


# ------------------------------------------------------------------------------- tests
def _loss_and_grad(fn, b):
    lp = b["logprobs_T"].detach().clone().requires_grad_(True)
    loss = fn({**b, "logprobs_T": lp})
    (grad,) = torch.autograd.grad(loss, lp)
    return loss.detach(), grad


def assert_matches_reference(cfg, b):
    def library(batch):
        return policy_loss(cfg, TokenBatch(**batch))[0]

    got_loss, got_grad = _loss_and_grad(library, b)
    want_loss, want_grad = _loss_and_grad(lambda batch: reference_loss(cfg, batch), b)
    torch.testing.assert_close(got_loss, want_loss, **TOL)
    torch.testing.assert_close(got_grad, want_grad, **TOL)
    assert want_grad.abs().sum() > 0, "degenerate case: the reference gradient is zero"


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("name", OBJECTIVE_PRESETS.names())
def test_preset_matches_reference(name, seed):
    assert_matches_reference(get_preset(name), make_batch(seed))


@pytest.mark.parametrize("name", ["gspo_token", "grpo", "gmpo", "sapo", "cispo", "reinforce_pp"])
def test_preset_with_token_advantages_matches_reference(name):
    assert_matches_reference(get_preset(name), make_batch(7, token_adv=True))


COMBINATIONS = {
    "gspo+stapo+rspo_after+tis": dict(
        base="gspo", stapo_tau_p=0.002, rspo_gamma_min=0.6, mismatch="tis"
    ),
    "gspo+rspo_before+seq_tis": dict(
        base="gspo",
        rspo_gamma_min=0.5,
        rspo_apply="before_clip",
        mismatch="tis",
        mismatch_level="sequence",
        mismatch_high=3.0,
    ),
    "gspo_token+stapo+icepop": dict(base="gspo_token", stapo_tau_p=0.002, mismatch="icepop"),
    "grpo+dual_clip+seq_mis": dict(
        base="grpo",
        dual_clip_c=3.0,
        mismatch="mis",
        mismatch_level="sequence",
        mismatch_low=0.1,
        mismatch_high=10.0,
    ),
    "dapo+overlong+8020+stapo+k2+entropy": dict(
        base="dapo",
        overlong_filter=True,
        entropy_top_rho=0.3,
        stapo_tau_p=0.01,
        kl_estimator="k2",
        kl_coef=0.1,
        entropy_coef=0.01,
    ),
    "cispo+trust_mask+lower+token_mis": dict(
        base="cispo", cispo_trust_region_mask=True, eps_low_is=0.5, mismatch="mis"
    ),
    "cispo+rspo_before": dict(base="cispo", rspo_gamma_min=0.4, rspo_apply="before_clip"),
    "sapo+rspo_before": dict(base="sapo", rspo_gamma_min=0.5, rspo_apply="before_clip"),
    "sapo_sequence_token": dict(base="sapo", ratio_unit="sequence_token"),
    "sapo_sequence+token_mean": dict(base="sapo", ratio_unit="sequence", aggregation="token_mean"),
    "gmpo+rspo_before+icepop": dict(
        base="gmpo", rspo_gamma_min=0.5, rspo_apply="before_clip", mismatch="icepop"
    ),
    "gmpo_no_clip+seq_sum": dict(base="gmpo", gate="none", aggregation="seq_mean_token_sum"),
    "rspo+constant_normalizer": dict(base="rspo", aggregation="constant_normalizer", max_len=50),
    "token_no_gate": dict(base="ppo", gate="none"),
    "gspo_dual_clip": dict(base="gspo", dual_clip_c=1.5, eps_low=0.1, eps_high=0.1),
    "rloo+k1_loss+rspo_after": dict(
        base="rloo", kl_estimator="k1", kl_coef=0.05, rspo_gamma_min=0.5
    ),
    "reinforce+k3+token_mean": dict(base="rloo", kl_coef=0.2, aggregation="token_mean"),
    "grpo+k3+seq_sum": dict(base="grpo", aggregation="seq_mean_token_sum"),
}


@pytest.mark.parametrize("combo", sorted(COMBINATIONS))
def test_combination_matches_reference(combo):
    spec = dict(COMBINATIONS[combo])
    cfg = get_preset(spec.pop("base"), **spec)
    for seed in (3, 4):
        assert_matches_reference(cfg, make_batch(seed, token_adv=(seed == 4)))


def test_reference_covers_far_off_policy_and_all_advantage_signs():
    b = make_batch(0)
    ratio = torch.exp(b["logprobs_T"] - b["old_logprobs_T"])[b["loss_mask_T"]]
    assert (ratio > 2).any() and (ratio < 0.5).any() and ((ratio - 1).abs() < 1e-4).any()
    adv = b["advantages_T"][b["loss_mask_T"]]
    assert (adv > 0).any() and (adv < 0).any() and (adv == 0).any()


def test_global_counts_are_used_as_denominators():
    b = make_batch(5)
    for name in ("dapo", "grpo", "dr_grpo"):
        cfg = get_preset(name)
        got = policy_loss(cfg, TokenBatch(**b), global_num_tokens=1000, global_num_seqs=50)[0]
        want = reference_loss(cfg, b, global_num_tokens=1000, global_num_seqs=50)
        torch.testing.assert_close(got, want, **TOL)


def test_entropy_bonus_gradient_reaches_entropy():
    cfg = replace(get_preset("dapo"), entropy_coef=0.1)
    b = make_batch(2)
    entropy = b["entropy_T"].clone().requires_grad_(True)
    loss, _ = policy_loss(cfg, TokenBatch(**{**b, "entropy_T": entropy}))
    (grad,) = torch.autograd.grad(loss, entropy)
    kept = b["loss_mask_T"]
    torch.testing.assert_close(
        grad[kept], torch.full_like(grad[kept], -0.1 / int(kept.sum())), **TOL
    )
    assert (grad[~kept] == 0).all()
