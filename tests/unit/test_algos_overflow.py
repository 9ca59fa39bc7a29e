"""Extreme log-ratios give finite losses and gradients and leave other tokens alone (issue 14).

``exp`` of a log-ratio above log(max float) (88.7 in fp32, 709.8 in fp64) is inf. Where a
clip, a saturated gate or an unused ``torch.where`` branch cut the inf out of the value,
autograd still multiplied the branch's zero gradient by the inf derivative of ``exp`` and
produced NaN. The batches here are built twice, once with ordinary log-ratios and once
with extreme ones on a few kept tokens, and the gradients are compared.

Shape legend: T tokens, S sequences.
"""

from __future__ import annotations

import math

import pytest
import torch

from megatron_rl.algos import (
    OBJECTIVE_PRESETS,
    ObjectiveConfigError,
    TokenBatch,
    build_loss_mask,
    get_preset,
    kl_estimate_T,
    policy_loss,
)

DTYPES = (torch.float32, torch.float64)
# +89 passes fp32's log(max float) by a hair; +-800 pass fp64's as well.
EXTREME_LOG_RATIOS = (100.0, -100.0, 89.0, 800.0, -800.0)
# Exponents of GSPO's sequence ratio and GMPO's geometric mean: +100 (A > 0 and A < 0),
# and +800, past fp64's limit too (A > 0, so GMPO's unused lower-clipped branch overflows).
MEAN_LOG_RATIO_SEQS = ((100.0, 100.0, 100.0), (150.0, 50.0, 100.0), (1000.0, 600.0, 800.0))
# Sequence-level ratio units: an extreme token legitimately changes its whole sequence.
SEQUENCE_UNITS = ("sequence", "sequence_token", "geometric")


def _batch(dtype: torch.dtype, *, extreme: bool) -> dict:
    """Sequences 0-1 (A = +1, -1) hold every extreme log-ratio next to ordinary tokens,
    sequences 2-4 (A = +0.8, -0.7, +0.6) have mean log-ratio +100, +100, +800, sequence 5
    has a masked extreme token, the rest are ordinary. ``extreme=False`` keeps the ordinary
    log-ratios on those positions; everything else (log-probs, masks, entropies) is equal."""
    gen = torch.Generator().manual_seed(14)
    n_special = len(EXTREME_LOG_RATIOS) + 2
    lengths = [n_special, n_special, 3, 3, 3] + [6 + i % 5 for i in range(16)]
    num_seqs = len(lengths)
    seq_ids_T = torch.repeat_interleave(torch.arange(num_seqs), torch.tensor(lengths))
    starts = [sum(lengths[:i]) for i in range(num_seqs)]
    n = sum(lengths)
    # p > 0.002 everywhere: STAPO's S2T mask must not hide the extreme tokens.
    logprobs_T = -(torch.rand(n, generator=gen, dtype=torch.float64) * 3 + 0.05)
    log_ratio_T = torch.rand(n, generator=gen, dtype=torch.float64) * 0.6 - 0.3
    signs_S = torch.where(torch.rand(num_seqs - 5, generator=gen) < 0.5, -1.0, 1.0)
    adv_S = torch.cat([torch.tensor([1.0, -1.0, 0.8, -0.7, 0.6]), signs_S * 0.9]).double()
    extreme_T = torch.zeros(n, dtype=torch.bool)
    values = {}
    for seq in (0, 1):
        for k, value in enumerate(EXTREME_LOG_RATIOS):
            values[starts[seq] + k] = value
    for seq, seq_values in zip((2, 3, 4), MEAN_LOG_RATIO_SEQS):
        for k, value in enumerate(seq_values):
            values[starts[seq] + k] = value
    masked_extreme = starts[5]
    values[masked_extreme] = 800.0
    for position, value in values.items():
        extreme_T[position] = True
        if extreme:
            log_ratio_T[position] = value
    loss_mask_T = torch.ones(n, dtype=torch.bool)
    loss_mask_T[masked_extreme] = False
    loss_mask_T[starts[6] + 2] = False
    # Highest entropies on the extreme tokens, so the 80/20 filter keeps them.
    entropy_T = torch.rand(n, generator=gen, dtype=torch.float64) + 5.0 * extreme_T
    old_T = logprobs_T - log_ratio_T
    batch = dict(
        logprobs_T=logprobs_T,
        old_logprobs_T=old_T,
        advantages_T=adv_S[seq_ids_T],
        loss_mask_T=loss_mask_T,
        seq_ids_T=seq_ids_T,
        num_seqs=num_seqs,
        # ref = old: the KL log-ratio is -d, so k3 sees exp(+100) on the d = -100 tokens.
        ref_logprobs_T=old_T.clone(),
        rollout_logprobs_T=old_T.clone(),
        entropy_T=entropy_T,
        rspo_gamma_T=torch.rand(n, generator=gen, dtype=torch.float64) * 0.5 + 0.5,
        truncated_S=torch.zeros(num_seqs, dtype=torch.bool),
    )
    floats = [k for k, v in batch.items() if torch.is_tensor(v) and v.is_floating_point()]
    cast = {k: batch[k].to(dtype) for k in floats}
    return batch | cast | {"extreme_T": extreme_T & loss_mask_T}


def _loss_and_grad(cfg, batch: dict):
    inputs = {k: v for k, v in batch.items() if k != "extreme_T"}
    lp = inputs.pop("logprobs_T").clone().requires_grad_(True)
    loss, _ = policy_loss(cfg, TokenBatch(logprobs_T=lp, **inputs))
    (grad_T,) = torch.autograd.grad(loss, lp)
    return loss.detach(), grad_T


def _nonfinite(values_T) -> list[int]:
    return (~torch.isfinite(values_T)).nonzero().flatten().tolist()


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp64"])
@pytest.mark.parametrize("preset", OBJECTIVE_PRESETS.names())
def test_extreme_log_ratios_give_finite_gradients_and_leave_other_tokens_alone(preset, dtype):
    cfg = get_preset(preset)
    ext, base = _batch(dtype, extreme=True), _batch(dtype, extreme=False)
    kept_T, _ = build_loss_mask(
        cfg, TokenBatch(**{k: v for k, v in ext.items() if k != "extreme_T"})
    )
    assert kept_T[ext["extreme_T"]].all()  # the masks do not hide what is tested
    loss, grad_T = _loss_and_grad(cfg, ext)
    _, base_grad_T = _loss_and_grad(cfg, base)
    assert not _nonfinite(grad_T), f"non-finite gradient at tokens {_nonfinite(grad_T)}"
    assert torch.isfinite(loss), f"loss = {loss}"
    if cfg.ratio_unit in SEQUENCE_UNITS:
        touched_S = torch.zeros(ext["num_seqs"], dtype=torch.bool)
        touched_S[ext["seq_ids_T"][ext["extreme_T"]]] = True
        untouched_T = ~touched_S[ext["seq_ids_T"]]
    else:
        untouched_T = ~ext["extreme_T"]
    assert untouched_T.sum() > 20 and base_grad_T[untouched_T].abs().sum() > 0
    torch.testing.assert_close(grad_T[untouched_T], base_grad_T[untouched_T], rtol=0, atol=0)


def _one_sequence(log_ratios, adv: float, dtype=torch.float32):
    n = len(log_ratios)
    lp = torch.full((n,), -1.0, dtype=dtype)
    return dict(
        logprobs_T=lp,
        old_logprobs_T=lp - torch.tensor(log_ratios, dtype=dtype),
        advantages_T=torch.full((n,), adv, dtype=dtype),
        loss_mask_T=torch.ones(n, dtype=torch.bool),
        seq_ids_T=torch.zeros(n, dtype=torch.long),
        num_seqs=1,
    )


@pytest.mark.parametrize("preset", ["ppo", "dapo", "sapo", "gspo", "gspo_token"])
@pytest.mark.parametrize("log_ratio", [89.0, 100.0])
def test_cut_off_ratio_beyond_the_clamp_has_exactly_zero_gradient_in_fp32(preset, log_ratio):
    # A > 0 and r = e^89: the clip bound (or SAPO's saturated sigmoid) cuts the ratio off,
    # so the true gradient is 0; exp(89) = inf in fp32 used to turn it into 0 * inf = NaN.
    loss, grad_T = _loss_and_grad(get_preset(preset), _one_sequence([log_ratio], 1.0))
    assert torch.isfinite(loss)
    assert torch.equal(grad_T, torch.zeros(1))


@pytest.mark.parametrize("preset", ["gspo", "gspo_token"])
def test_sequence_ratio_beyond_the_clamp_leaves_no_nan_in_its_sequence(preset):
    # Mean log-ratio +100 with A > 0: clipped, so every token of the sequence has gradient 0.
    loss, grad_T = _loss_and_grad(get_preset(preset), _one_sequence([250.0, -50.0, 100.0], 1.0))
    assert torch.isfinite(loss)
    assert torch.equal(grad_T, torch.zeros(3))


@pytest.mark.parametrize("clamp", [None, 700.0])
@pytest.mark.parametrize("preset", ["gmpo", "rspo"])
def test_unused_where_branch_cannot_leak_nan(preset, clamp):
    # A > 0 uses the upper-clipped geometric mean; the lower-clipped one (mean +100 here,
    # exp = inf in fp32) is computed but not selected, so its gradient must not reach the
    # tokens. A clamp of 700 lets exp overflow in fp32: the unused branch must be safe alone.
    cfg = get_preset(preset, **({} if clamp is None else {"log_ratio_clamp": clamp}))
    log_ratios = [300.0, 0.1, -0.1]
    batch = _one_sequence(log_ratios, 1.0)
    gamma_T = torch.tensor([0.9, 1.0, 0.85])
    extra = {"rspo_gamma_T": gamma_T} if cfg.rspo_gamma_min is not None else {}
    loss, grad_T = _loss_and_grad(cfg, batch | extra)
    clipped = torch.tensor([cfg.eps_high, 0.1, -0.1], dtype=torch.float64)
    if extra:
        clipped = clipped + gamma_T.double().log()
    ratio = math.exp(float(clipped.mean()))
    # 1/G sum_i -A ratio_i, one sequence: the clipped token drops out, the others get -ratio/3.
    expected_T = torch.tensor([0.0, -ratio / 3, -ratio / 3])
    assert torch.isfinite(loss)
    torch.testing.assert_close(grad_T, expected_T, rtol=1e-6, atol=0)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp64"])
def test_k3_kl_is_finite_beyond_the_clamp_and_exact_inside(dtype):
    # log r = log pi_ref - log pi: +800 overflows exp in both dtypes.
    ref_T = torch.tensor([0.0, 0.0, -1.0, -1.0], dtype=dtype)
    lp_T = torch.tensor([-800.0, -100.0, -1.3, -0.8], dtype=dtype, requires_grad=True)
    kl_T = kl_estimate_T("k3", lp_T, ref_T)
    (grad_T,) = torch.autograd.grad(kl_T.sum(), lp_T)
    assert not _nonfinite(kl_T) and not _nonfinite(grad_T)
    log_r = (ref_T - lp_T.detach())[2:]
    torch.testing.assert_close(kl_T[2:].detach(), torch.expm1(log_r) - log_r, rtol=0, atol=0)
    torch.testing.assert_close(grad_T[2:], 1 - torch.exp(log_r), rtol=1e-12, atol=1e-7)


def test_mismatch_weight_without_upper_bound_cannot_overflow():
    # Sequence-level IS with no truncation: the product of many token ratios is exp(sum).
    cfg = get_preset(
        "ppo", mismatch="tis", mismatch_level="sequence", mismatch_high=float("inf")
    )
    batch = _one_sequence([0.1, -0.1, 0.05], -1.0)
    batch["rollout_logprobs_T"] = batch["old_logprobs_T"] - 300.0
    loss, grad_T = _loss_and_grad(cfg, batch)
    assert torch.isfinite(loss) and not _nonfinite(grad_T)


def test_log_ratio_clamp_is_validated():
    assert get_preset("ppo").log_ratio_clamp == 20.0
    for bad in (0.0, -1.0, float("inf")):
        with pytest.raises(ObjectiveConfigError, match="log_ratio_clamp"):
            get_preset("ppo", log_ratio_clamp=bad)
    # A clip band the clamp would cut into would no longer be exact.
    with pytest.raises(ObjectiveConfigError, match="log_ratio_clamp"):
        get_preset("ppo", eps_high=2.0, log_ratio_clamp=1.0)
    with pytest.raises(ObjectiveConfigError, match="log_ratio_clamp"):
        get_preset("gmpo", log_ratio_clamp=0.3)
    with pytest.raises(ObjectiveConfigError, match="log_ratio_clamp"):
        get_preset("ppo", dual_clip_c=3.0, log_ratio_clamp=1.0)
    assert get_preset("ppo", log_ratio_clamp=1.0).log_ratio_clamp == 1.0


def test_clamp_is_the_configured_one():
    # Beyond +c the unclipped gate 'none' holds the value -A e^c and has zero gradient.
    cfg = get_preset("ppo", gate="none", log_ratio_clamp=5.0)
    loss, grad_T = _loss_and_grad(cfg, _one_sequence([6.0], -1.0, torch.float64))
    assert float(loss) == pytest.approx(math.exp(5.0), rel=1e-12)
    assert torch.equal(grad_T, torch.zeros(1, dtype=torch.float64))
