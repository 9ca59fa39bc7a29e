"""Autograd confirms every stop-gradient and the gradient semantics of each piece."""

from __future__ import annotations

import pytest
import torch

from megatron_rl.algos import TokenBatch, get_preset, kl_estimate_T, policy_loss

F64 = torch.float64
TOL = dict(rtol=0.0, atol=1e-10)


def _batch(seed: int, num_seqs: int = 10, *, constant_adv: bool = True) -> dict:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 25, (num_seqs,), generator=gen)
    seq_ids = torch.repeat_interleave(torch.arange(num_seqs), lengths)
    n = int(lengths.sum())
    logprobs = -(torch.rand(n, generator=gen, dtype=F64) * 6 + 0.05)
    # Half the sequences almost on-policy (unclipped under GSPO), half far off.
    scale_S = torch.where(torch.arange(num_seqs) % 2 == 0, 1e-5, 1.0).to(F64)
    adv = (
        torch.randn(num_seqs, generator=gen, dtype=F64)[seq_ids]
        if constant_adv
        else torch.randn(n, generator=gen, dtype=F64)
    )
    return dict(
        logprobs_T=logprobs,
        old_logprobs_T=logprobs - scale_S[seq_ids] * torch.randn(n, generator=gen, dtype=F64),
        advantages_T=adv,
        loss_mask_T=torch.rand(n, generator=gen) < 0.9,
        seq_ids_T=seq_ids,
        num_seqs=num_seqs,
    )


def _grad(cfg, b: dict, **extra):
    lp = b["logprobs_T"].clone().requires_grad_(True)
    loss, _ = policy_loss(cfg, TokenBatch(**{**b, "logprobs_T": lp}, **extra))
    (grad,) = torch.autograd.grad(loss, lp)
    return loss.detach(), grad


def test_cispo_gradient_is_clipped_weight_times_advantage():
    b = _batch(0)
    cfg = get_preset("cispo")
    _, grad = _grad(cfg, b)
    mask = b["loss_mask_T"]
    weight = torch.exp(b["logprobs_T"] - b["old_logprobs_T"]).clamp(max=1.2)
    expected = torch.where(
        mask, -weight * b["advantages_T"] / int(mask.sum()), torch.zeros_like(weight)
    )
    torch.testing.assert_close(grad, expected, **TOL)
    assert (weight == 1.2).any() and (
        weight < 0.5
    ).any()  # truncated and far-below weights both covered


@pytest.mark.parametrize("aggregation", ["seq_mean_token_mean", "token_mean", "seq_mean_token_sum"])
@pytest.mark.parametrize("gate", ["clip", "none", "soft"])
def test_gspo_token_equals_gspo_for_constant_advantages(aggregation, gate):
    b = _batch(1)
    seq_loss, seq_grad = _grad(get_preset("gspo", aggregation=aggregation, gate=gate), b)
    tok_loss, tok_grad = _grad(get_preset("gspo_token", aggregation=aggregation, gate=gate), b)
    torch.testing.assert_close(tok_loss, seq_loss, **TOL)
    torch.testing.assert_close(tok_grad, seq_grad, **TOL)
    assert seq_grad.abs().sum() > 0


def test_gspo_token_differs_from_gspo_for_token_advantages():
    b = _batch(2, constant_adv=False)
    _, seq_grad = _grad(get_preset("gspo", gate="none"), b)
    _, tok_grad = _grad(get_preset("gspo_token", gate="none"), b)
    assert not torch.allclose(tok_grad, seq_grad, rtol=0.0, atol=1e-6)


def test_sapo_gradient_weight_is_one_on_policy():
    b = _batch(3, constant_adv=False)
    b["old_logprobs_T"] = b["logprobs_T"].clone()  # r = 1 everywhere
    cfg = get_preset("sapo", aggregation="token_mean")
    _, grad = _grad(cfg, b)
    mask = b["loss_mask_T"]
    expected = torch.where(mask, -b["advantages_T"] / int(mask.sum()), torch.zeros_like(grad))
    torch.testing.assert_close(grad, expected, **TOL)  # both tau_pos and tau_neg tokens
    assert (b["advantages_T"][mask] > 0).any() and (b["advantages_T"][mask] < 0).any()


def _expected_kl_gradient(name: str, logits: torch.Tensor, ref_probs: torch.Tensor) -> torch.Tensor:
    """E_{x ~ pi}[grad_z k(x)] by exact enumeration of the categorical."""
    z = logits.clone().requires_grad_(True)
    logp = torch.log_softmax(z, 0)
    per_x = kl_estimate_T(name, logp, ref_probs.log())
    (grad,) = torch.autograd.grad((logp.exp().detach() * per_x).sum(), z)
    return grad


def test_kl_estimators_gradient_semantics():
    logits, ref = (
        torch.tensor([0.3, -0.2, 0.5, 0.0], dtype=F64),
        torch.tensor([0.1, 0.4, 0.3, 0.2], dtype=F64),
    )
    z = logits.clone().requires_grad_(True)
    p = torch.softmax(z, 0)
    (grad_reverse,) = torch.autograd.grad((p * (p / ref).log()).sum(), z)
    z = logits.clone().requires_grad_(True)
    p = torch.softmax(z, 0)
    (grad_forward,) = torch.autograd.grad((ref * (ref / p).log()).sum(), z)
    torch.testing.assert_close(
        _expected_kl_gradient("k1", logits, ref), torch.zeros(4, dtype=F64), **TOL
    )
    torch.testing.assert_close(_expected_kl_gradient("k2", logits, ref), grad_reverse, **TOL)
    torch.testing.assert_close(_expected_kl_gradient("k3", logits, ref), grad_forward, **TOL)
    # objectives.md §19.8 numbers.
    torch.testing.assert_close(
        grad_reverse,
        torch.tensor([0.233779, -0.178793, -0.022011, -0.032975], dtype=F64),
        rtol=0,
        atol=1e-6,
    )
    torch.testing.assert_close(
        grad_forward,
        torch.tensor([0.180210, -0.230044, 0.042249, 0.007585], dtype=F64),
        rtol=0,
        atol=1e-6,
    )


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_loss_term_per_token_gradient(estimator):
    b = _batch(4)
    b["advantages_T"] = torch.zeros_like(b["advantages_T"])  # isolate the KL term
    ref = b["logprobs_T"] + 0.5 * torch.randn(
        b["logprobs_T"].shape, dtype=F64, generator=torch.Generator().manual_seed(9)
    )
    cfg = get_preset("dapo", kl_estimator=estimator, kl_coef=0.3)
    _, grad = _grad(cfg, b, ref_logprobs_T=ref)
    mask, lp = b["loss_mask_T"], b["logprobs_T"]
    per_token = {"k1": torch.ones_like(lp), "k2": lp - ref, "k3": 1 - torch.exp(ref - lp)}[
        estimator
    ]
    expected = torch.where(mask, 0.3 * per_token / int(mask.sum()), torch.zeros_like(lp))
    torch.testing.assert_close(grad, expected, **TOL)


@pytest.mark.parametrize(
    "overrides",
    [
        dict(base="rspo"),
        dict(base="rspo", rspo_apply="before_clip"),
        dict(base="grpo", rspo_gamma_min=0.5),
        dict(
            base="gspo",
            rspo_gamma_min=0.5,
            rspo_apply="before_clip",
            mismatch="tis",
            mismatch_level="sequence",
        ),
        dict(base="cispo", rspo_gamma_min=0.5, mismatch="icepop", stapo_tau_p=0.01),
        dict(base="entropy_8020", rspo_gamma_min=0.0, mismatch="mis", kl_coef=0.1),
    ],
)
def test_weights_masks_and_constants_carry_no_gradient(overrides):
    overrides = dict(overrides)
    cfg = get_preset(overrides.pop("base"), **overrides)
    b = _batch(5)
    gen = torch.Generator().manual_seed(1)
    n = b["logprobs_T"].numel()
    constants = dict(
        old_logprobs_T=b["old_logprobs_T"],
        advantages_T=b["advantages_T"],
        rollout_logprobs_T=b["old_logprobs_T"] + 0.3 * torch.randn(n, dtype=F64, generator=gen),
        ref_logprobs_T=b["logprobs_T"] + 0.3 * torch.randn(n, dtype=F64, generator=gen),
        entropy_T=torch.rand(n, dtype=F64, generator=gen),
        rspo_gamma_T=torch.rand(n, dtype=F64, generator=gen) * 0.6 + 0.4,
    )
    leaves = {k: v.clone().requires_grad_(True) for k, v in constants.items()}
    lp = b["logprobs_T"].clone().requires_grad_(True)
    loss, _ = policy_loss(cfg, TokenBatch(**{**b, **leaves, "logprobs_T": lp}))
    grads = torch.autograd.grad(loss, [lp, *leaves.values()], allow_unused=True)
    assert grads[0].abs().sum() > 0
    for name, grad in zip(leaves, grads[1:], strict=True):
        assert grad is None or (grad == 0).all(), f"{name} received a gradient"


def test_ppo_gradient_is_ratio_times_advantage_inside_the_band():
    b = _batch(6)
    cfg = get_preset("ppo", aggregation="token_mean")
    _, grad = _grad(cfg, b)
    mask, adv = b["loss_mask_T"], b["advantages_T"]
    ratio = torch.exp(b["logprobs_T"] - b["old_logprobs_T"])
    clipped = ((adv > 0) & (ratio > 1.2)) | ((adv < 0) & (ratio < 0.8))
    expected = torch.where(mask & ~clipped, -ratio * adv / int(mask.sum()), torch.zeros_like(ratio))
    torch.testing.assert_close(grad, expected, **TOL)
    assert (clipped & mask).any() and (~clipped & mask).any()
