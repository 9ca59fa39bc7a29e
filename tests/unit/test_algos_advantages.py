"""Advantage estimators and reward shaping against plain per-group / per-sequence loops."""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from megatron_rl.algos import (
    compute_advantages,
    dynamic_sampling_keep_S,
    get_preset,
    kl_reward_penalty_T,
    seq_ids_from_cu_seqlens,
)

F64 = torch.float64
TOL = dict(rtol=0.0, atol=1e-10)


def _batch(seed: int, num_groups: int = 7):
    gen = torch.Generator().manual_seed(seed)
    sizes = torch.randint(1, 6, (num_groups,), generator=gen)
    sizes[0] = 1  # a group of one
    group_ids = torch.repeat_interleave(torch.arange(num_groups), sizes)
    num_seqs = int(sizes.sum())
    rewards = torch.randint(0, 3, (num_seqs,), generator=gen).to(F64) + 0.1 * torch.randn(
        num_seqs, generator=gen, dtype=F64
    )
    rewards[group_ids == 1] = 0.7  # a group of equal rewards
    lengths = torch.randint(1, 9, (num_seqs,), generator=gen)
    seq_ids = torch.repeat_interleave(torch.arange(num_seqs), lengths)
    mask = torch.rand(seq_ids.numel(), generator=gen) < 0.8
    old = -torch.rand(seq_ids.numel(), generator=gen, dtype=F64) * 3
    ref = old + 0.2 * torch.randn(seq_ids.numel(), generator=gen, dtype=F64)
    return (
        dict(
            rewards_S=rewards,
            group_ids_S=group_ids,
            seq_ids_T=seq_ids,
            loss_mask_T=mask,
            num_groups=num_groups,
        ),
        old,
        ref,
    )


def _reference_seq_advantages(name, rewards, groups, std_estimator="sample", eps=1e-6):
    out = []
    for i, r in enumerate(rewards):
        members = [rewards[j] for j in range(len(rewards)) if groups[j] == groups[i]]
        mean = sum(members) / len(members)
        if len(members) == 1:
            out.append(0.0)
        elif name == "grpo":
            std = (
                statistics.stdev(members)
                if std_estimator == "sample"
                else statistics.pstdev(members)
            )
            out.append(0.0 if std == 0 else (r - mean) / (std + eps))
        elif name == "dr_grpo":
            out.append(r - mean)
        else:  # rloo
            others = [rewards[j] for j in range(len(rewards)) if groups[j] == groups[i] and j != i]
            out.append(r - sum(others) / len(others))
    return out


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo"])
@pytest.mark.parametrize("std_estimator", ["sample", "population"])
def test_group_estimators_match_loop(name, std_estimator):
    inputs, _, _ = _batch(0)
    cfg = get_preset("grpo", advantage=name, std_estimator=std_estimator, kl_coef=0.0)
    adv_T = compute_advantages(cfg, **inputs)
    want_S = _reference_seq_advantages(
        name, inputs["rewards_S"].tolist(), inputs["group_ids_S"].tolist(), std_estimator
    )
    torch.testing.assert_close(adv_T, torch.tensor(want_S, dtype=F64)[inputs["seq_ids_T"]], **TOL)
    seq_of_group0 = (inputs["group_ids_S"] == 0).nonzero().flatten()
    assert (adv_T[torch.isin(inputs["seq_ids_T"], seq_of_group0)] == 0).all()  # group of one -> 0


def test_grpo_equal_rewards_with_zero_eps_is_zero_not_nan():
    inputs, _, _ = _batch(1)
    adv_T = compute_advantages(get_preset("grpo", adv_std_eps=0.0), **inputs)
    assert torch.isfinite(adv_T).all()
    assert (
        adv_T[torch.isin(inputs["seq_ids_T"], (inputs["group_ids_S"] == 1).nonzero().flatten())]
        == 0
    ).all()


def _reference_returns(rewards, seq_ids, mask, token_rewards):
    out = [0.0] * len(seq_ids)
    for i, r in enumerate(rewards):
        tokens = [t for t in range(len(seq_ids)) if seq_ids[t] == i]
        running = r
        for t in reversed(tokens):
            if mask[t]:
                running += token_rewards[t]
                out[t] = running
    return out


def _reference_whiten(values, mask, sample=True, eps=1e-8):
    kept = [v for v, m in zip(values, mask, strict=True) if m]
    mean = sum(kept) / len(kept)
    var = sum((v - mean) ** 2 for v in kept) / (len(kept) - 1 if sample else len(kept))
    return [
        (v - mean) / math.sqrt(var + eps) if m else 0.0 for v, m in zip(values, mask, strict=True)
    ]


@pytest.mark.parametrize("name", ["reinforce", "reinforce_pp", "reinforce_pp_baseline"])
@pytest.mark.parametrize("beta", [0.0, 0.05])
def test_token_estimators_match_loop(name, beta):
    inputs, old, ref = _batch(2)
    cfg = get_preset("reinforce_pp", advantage=name, kl_in_reward_coef=beta)
    adv_T = compute_advantages(cfg, **inputs, old_logprobs_T=old, ref_logprobs_T=ref)
    seq_ids, mask = inputs["seq_ids_T"].tolist(), inputs["loss_mask_T"].tolist()
    penalty = (-beta * (old - ref)).tolist()
    rewards = inputs["rewards_S"].tolist()
    if name == "reinforce_pp_baseline":
        # Group-mean subtraction of the total (outcome + summed KL penalty) reward, then whitening.
        totals = [
            rewards[i] + sum(penalty[t] for t in range(len(seq_ids)) if seq_ids[t] == i and mask[t])
            for i in range(len(rewards))
        ]
        centred = _reference_seq_advantages("dr_grpo", totals, inputs["group_ids_S"].tolist())
        want = _reference_whiten([centred[s] for s in seq_ids], mask)
    else:
        want = _reference_returns(rewards, seq_ids, mask, penalty)
        if name == "reinforce_pp":
            want = _reference_whiten(want, mask)
    torch.testing.assert_close(adv_T, torch.tensor(want, dtype=F64), **TOL)


def test_kl_in_reward_enters_group_rewards():
    inputs, old, ref = _batch(3)
    cfg = get_preset("rloo")  # kl_in_reward_coef = 0.03
    adv_T = compute_advantages(cfg, **inputs, old_logprobs_T=old, ref_logprobs_T=ref)
    penalty_T = kl_reward_penalty_T(old, ref, 0.03)
    seq_ids, mask = inputs["seq_ids_T"].tolist(), inputs["loss_mask_T"].tolist()
    totals = [
        float(inputs["rewards_S"][i])
        + sum(float(penalty_T[t]) for t in range(len(seq_ids)) if seq_ids[t] == i and mask[t])
        for i in range(inputs["rewards_S"].numel())
    ]
    want_S = _reference_seq_advantages("rloo", totals, inputs["group_ids_S"].tolist())
    torch.testing.assert_close(adv_T, torch.tensor(want_S, dtype=F64)[inputs["seq_ids_T"]], **TOL)
    with pytest.raises(ValueError, match="ref_logprobs_T"):
        compute_advantages(cfg, **inputs)


def test_whitening_of_fewer_than_two_tokens_is_zero():
    cfg = get_preset("reinforce_pp", kl_in_reward_coef=0.0)
    adv_T = compute_advantages(
        cfg,
        rewards_S=torch.tensor([2.0], dtype=F64),
        group_ids_S=torch.zeros(1, dtype=torch.long),
        seq_ids_T=torch.zeros(3, dtype=torch.long),
        loss_mask_T=torch.tensor([False, True, False]),
        num_groups=1,
    )
    assert (adv_T == 0).all()


def test_advantages_reject_unordered_tokens_and_bad_groups():
    inputs, _, _ = _batch(4)
    cfg = get_preset("reinforce_pp", kl_in_reward_coef=0.0)
    shuffled = dict(inputs, seq_ids_T=inputs["seq_ids_T"].flip(0))
    with pytest.raises(ValueError, match="seq_ids_T decreases"):
        compute_advantages(cfg, **shuffled)
    bad_groups = dict(inputs, group_ids_S=inputs["group_ids_S"] + 100)
    with pytest.raises(ValueError, match="group_ids_S has an id outside"):
        compute_advantages(cfg, **bad_groups)
    nan_rewards = dict(inputs, rewards_S=inputs["rewards_S"].clone())
    nan_rewards["rewards_S"][2] = float("nan")
    with pytest.raises(ValueError, match="rewards_S contains NaN/inf at sequence 2"):
        compute_advantages(cfg, **nan_rewards)


def test_dynamic_sampling_keeps_groups_with_spread():
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.5, 0.5], dtype=F64)
    groups = torch.tensor([0, 0, 1, 1, 2, 3, 4, 4])
    keep = dynamic_sampling_keep_S(rewards, groups, 5)
    assert keep.tolist() == [False, False, True, True, False, False, False, False]


def test_seq_ids_from_cu_seqlens():
    assert seq_ids_from_cu_seqlens(torch.tensor([0, 2, 2, 5])).tolist() == [0, 0, 2, 2, 2]
    with pytest.raises(ValueError, match="nondecreasing"):
        seq_ids_from_cu_seqlens(torch.tensor([0, 3, 2]))
