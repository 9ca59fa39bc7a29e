"""Metrics are detached 0-dim tensors with the values their names promise."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_rl.algos import TokenBatch, get_preset, policy_loss

F64 = torch.float64


def _batch():
    gen = torch.Generator().manual_seed(3)
    seq_ids = torch.repeat_interleave(torch.arange(6), torch.tensor([5, 1, 8, 3, 7, 4]))
    n = seq_ids.numel()
    logprobs = -(torch.rand(n, generator=gen, dtype=F64) * 5 + 0.01)
    mask = torch.rand(n, generator=gen) < 0.8
    mask[seq_ids == 1] = False
    return dict(
        logprobs_T=logprobs.requires_grad_(True),
        old_logprobs_T=logprobs.detach() + 0.5 * torch.randn(n, generator=gen, dtype=F64),
        advantages_T=torch.tensor([1.0, -1.0, -0.5, 2.0, 0.0, -2.0], dtype=F64)[seq_ids],
        loss_mask_T=mask,
        seq_ids_T=seq_ids,
        num_seqs=6,
        rollout_logprobs_T=logprobs.detach() + 0.2 * torch.randn(n, generator=gen, dtype=F64),
        ref_logprobs_T=logprobs.detach() + 0.3 * torch.randn(n, generator=gen, dtype=F64),
        entropy_T=torch.rand(n, generator=gen, dtype=F64),
        rspo_gamma_T=torch.rand(n, generator=gen, dtype=F64) * 0.5 + 0.5,
        truncated_S=torch.tensor([False, False, True, False, False, False]),
    )


def test_metric_values():
    b = _batch()
    cfg = get_preset(
        "ppo",
        rspo_gamma_min=0.7,
        mismatch="icepop",
        mismatch_low=0.9,
        mismatch_high=1.1,
        overlong_filter=True,
    )
    _, m = policy_loss(cfg, TokenBatch(**b))
    assert all(
        isinstance(v, torch.Tensor) and v.dim() == 0 and not v.requires_grad for v in m.values()
    )
    kept = b["loss_mask_T"] & ~b["truncated_S"][b["seq_ids_T"]]
    adv = b["advantages_T"]
    ratio = torch.exp(b["logprobs_T"].detach() - b["old_logprobs_T"])[kept]
    assert int(m["count/kept_tokens"]) == int(kept.sum())
    assert int(m["count/kept_seqs"]) == len(set(b["seq_ids_T"][kept].tolist()))
    assert int(m["count/truncated_seqs"]) == 1
    assert float(m["mask/kept_frac"]) == pytest.approx(float(kept.sum() / b["loss_mask_T"].sum()))
    assert float(m["mask/overlong_frac"]) == pytest.approx(
        float((b["loss_mask_T"] & ~kept).sum() / b["loss_mask_T"].sum())
    )
    assert float(m["ratio/mean"]) == pytest.approx(float(ratio.mean()))
    assert float(m["ratio/min"]) == float(ratio.min()) and float(m["ratio/max"]) == float(
        ratio.max()
    )
    high = (adv[kept] > 0) & (ratio > 1.2)
    low = (adv[kept] < 0) & (ratio < 0.8)
    assert float(m["clip/high_token_frac"]) == pytest.approx(float(high.double().mean()))
    assert float(m["clip/low_token_frac"]) == pytest.approx(float(low.double().mean()))
    seqs = b["seq_ids_T"][kept]
    num_seqs = len(set(seqs.tolist()))
    assert float(m["clip/high_seq_frac"]) == pytest.approx(len(set(seqs[high].tolist())) / num_seqs)
    assert float(m["clip/low_seq_frac"]) == pytest.approx(len(set(seqs[low].tolist())) / num_seqs)
    log_r = b["ref_logprobs_T"] - b["logprobs_T"].detach()
    assert float(m["kl/mean"]) == pytest.approx(float((torch.expm1(log_r) - log_r)[kept].mean()))
    assert float(m["entropy/max"]) == float(b["entropy_T"][kept].max())
    gamma = b["rspo_gamma_T"].clamp(min=0.7)[kept]
    assert float(m["weight/rspo/min"]) == float(gamma.min()) and float(
        m["weight/rspo/mean"]
    ) == pytest.approx(float(gamma.mean()))
    rho = torch.exp(b["old_logprobs_T"] - b["rollout_logprobs_T"])[kept]
    assert float(m["mismatch/token_ratio/max"]) == pytest.approx(float(rho.max()))
    rejected = (rho < 0.9) | (rho > 1.1)
    assert (
        0
        < float(m["weight/mismatch_rejected_frac"])
        == pytest.approx(float(rejected.double().mean()))
    )
    assert float(m["weight/mismatch/max"]) == pytest.approx(float(rho[~rejected].max()))
    assert float(m["weight/mismatch_outside_frac"]) == float(m["weight/mismatch_rejected_frac"])
    _, tis = policy_loss(dataclasses.replace(cfg, mismatch="tis", mismatch_low=0.0), TokenBatch(**b))
    assert float(tis["weight/mismatch_rejected_frac"]) == 0
    assert 0 < float(tis["weight/mismatch_outside_frac"]) == pytest.approx(float((rho > 1.1).double().mean()))
    assert float(tis["weight/mismatch/max"]) == pytest.approx(1.1)


def test_metrics_of_sequence_unit_use_the_sequence_ratio():
    b = _batch()
    _, m = policy_loss(get_preset("gspo"), TokenBatch(**b))
    kept = b["loss_mask_T"]
    log_r = (b["logprobs_T"].detach() - b["old_logprobs_T"]) * kept
    seq_ratio = [
        float(torch.exp(log_r[(b["seq_ids_T"] == i) & kept].mean())) for i in (0, 2, 3, 4, 5)
    ]
    assert float(m["ratio/max"]) == pytest.approx(max(seq_ratio)) and float(
        m["ratio/min"]
    ) == pytest.approx(min(seq_ratio))
    assert float(m["loss/policy"]) != 0.0
