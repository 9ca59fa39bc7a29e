"""Micro-batches with the whole batch's counts sum to the whole-batch loss and gradient."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_rl.algos import (
    OBJECTIVE_PRESETS,
    TokenBatch,
    build_loss_mask,
    get_preset,
    kept_counts,
    policy_loss,
)

TOL = dict(rtol=0.0, atol=1e-6)


def _batch(seed: int, num_seqs: int = 16) -> dict:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 30, (num_seqs,), generator=gen)
    seq_ids = torch.repeat_interleave(torch.arange(num_seqs), lengths)
    n = int(lengths.sum())
    logprobs = -(torch.rand(n, generator=gen, dtype=torch.float64) * 8.0 + 0.01)
    return dict(
        logprobs_T=logprobs,
        old_logprobs_T=logprobs + 0.6 * torch.randn(n, generator=gen, dtype=torch.float64),
        advantages_T=torch.randn(num_seqs, generator=gen, dtype=torch.float64)[seq_ids],
        loss_mask_T=torch.rand(n, generator=gen) < 0.8,
        seq_ids_T=seq_ids,
        num_seqs=num_seqs,
        rollout_logprobs_T=logprobs + 0.3 * torch.randn(n, generator=gen, dtype=torch.float64),
        ref_logprobs_T=logprobs + 0.3 * torch.randn(n, generator=gen, dtype=torch.float64),
        entropy_T=torch.rand(n, generator=gen, dtype=torch.float64) * 3.0,
        rspo_gamma_T=torch.rand(n, generator=gen, dtype=torch.float64) * 0.5 + 0.5,
        truncated_S=torch.rand(num_seqs, generator=gen) < 0.2,
    )


def _slice(b: dict, lp: torch.Tensor, mask: torch.Tensor, first: int, last: int) -> dict:
    """Sequences [first, last) with their own 0-based ids; lp is sliced so grads accumulate."""
    tokens = (b["seq_ids_T"] >= first) & (b["seq_ids_T"] < last)
    out = {k: v[tokens] for k, v in b.items() if k.endswith("_T")}
    out.update(
        logprobs_T=lp[tokens],
        loss_mask_T=mask[tokens],
        seq_ids_T=b["seq_ids_T"][tokens] - first,
        num_seqs=last - first,
        truncated_S=b["truncated_S"][first:last],
    )
    return out


def _whole_and_split(cfg, b: dict, bounds: list[int]):
    lp_whole = b["logprobs_T"].clone().requires_grad_(True)
    whole, _ = policy_loss(cfg, TokenBatch(**{**b, "logprobs_T": lp_whole}))
    (grad_whole,) = torch.autograd.grad(whole, lp_whole)

    lp = b["logprobs_T"].clone().requires_grad_(True)
    inputs = TokenBatch(
        loss_mask_T=b["loss_mask_T"],
        seq_ids_T=b["seq_ids_T"],
        num_seqs=b["num_seqs"],
        logprobs_T=lp,
        advantages_T=b["advantages_T"],
        entropy_T=b["entropy_T"],
        truncated_S=b["truncated_S"],
    )
    mask, _ = build_loss_mask(cfg, inputs)
    num_tokens, num_seqs = kept_counts(dataclasses.replace(inputs, loss_mask_T=mask))
    total = torch.zeros((), dtype=torch.float64)
    for first, last in zip(bounds[:-1], bounds[1:], strict=True):
        part = _slice(b, lp, mask, first, last)
        loss, _ = policy_loss(
            cfg,
            TokenBatch(**part),
            global_num_tokens=num_tokens,
            global_num_seqs=num_seqs,
            apply_filters=False,
        )
        total = total + loss
    (grad_split,) = torch.autograd.grad(total, lp)
    return whole.detach(), grad_whole, total.detach(), grad_split


@pytest.mark.parametrize("name", OBJECTIVE_PRESETS.names())
def test_micro_batches_reproduce_whole_batch(name):
    cfg = get_preset(name, overlong_filter=True, mismatch="tis", mismatch_level="sequence")
    b = _batch(11)
    whole, grad_whole, split, grad_split = _whole_and_split(cfg, b, [0, 3, 4, 10, 16])
    torch.testing.assert_close(split, whole, **TOL)
    torch.testing.assert_close(grad_split, grad_whole, **TOL)
    assert grad_whole.abs().sum() > 0


@pytest.mark.parametrize(
    "aggregation",
    ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "constant_normalizer"],
)
def test_micro_batches_for_every_aggregation(aggregation):
    max_len = 64 if aggregation == "constant_normalizer" else None
    cfg = get_preset(
        "dapo", aggregation=aggregation, max_len=max_len, kl_coef=0.1, entropy_top_rho=0.5
    )
    b = _batch(12, num_seqs=20)
    whole, grad_whole, split, grad_split = _whole_and_split(cfg, b, [0, 1, 7, 8, 20])
    torch.testing.assert_close(split, whole, **TOL)
    torch.testing.assert_close(grad_split, grad_whole, **TOL)


def test_without_global_counts_micro_batches_differ():
    # The global counts matter: local denominators give a different (wrong) total.
    cfg = get_preset("dapo")
    b = _batch(13)
    whole, _ = policy_loss(cfg, TokenBatch(**b))
    lp = b["logprobs_T"]
    parts = [
        policy_loss(cfg, TokenBatch(**_slice(b, lp, b["loss_mask_T"], first, last)))[0]
        for first, last in ((0, 5), (5, 16))
    ]
    assert not torch.allclose(sum(parts), whole, rtol=0.0, atol=1e-6)
