"""The worked numbers of objectives.md §19, reproduced through the public API."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_rl.algos import (
    TokenBatch,
    aggregate_loss,
    build_loss_mask,
    compute_advantages,
    dr_grpo_advantages_S,
    get_preset,
    grpo_advantages_S,
    kl_estimate_T,
    policy_loss,
    rloo_advantages_S,
    soft_overlong_penalty_S,
)
from megatron_rl.algos.segments import KeptTokens
from megatron_rl.algos.weights import (
    floor_router_shift_T,
    mismatch_log_ratio_T,
    mismatch_weight_T,
)

F64 = torch.float64
TOL = dict(rtol=0.0, atol=1e-6)


def t(values, dtype=F64):
    return torch.tensor(values, dtype=dtype)


def single_token_loss(cfg, ratio: float, adv: float, old: float = -2.0):
    """Loss and d loss / d log pi of one single-token sequence with the given ratio."""
    lp = t([old + math.log(ratio)]).requires_grad_(True)
    loss, metrics = policy_loss(
        cfg,
        TokenBatch(
            logprobs_T=lp,
            old_logprobs_T=t([old]),
            advantages_T=t([adv]),
            loss_mask_T=torch.ones(1, dtype=torch.bool),
            seq_ids_T=torch.zeros(1, dtype=torch.long),
            num_seqs=1,
        ),
    )
    (grad,) = torch.autograd.grad(loss, lp)
    return float(loss.detach()), float(grad[0]), metrics


# §19.1 --------------------------------------------------------------------------------
def test_19_1_group_advantages():
    r = t([0, 0, 1, 0])
    g = torch.zeros(4, dtype=torch.long)
    torch.testing.assert_close(
        grpo_advantages_S(r, g, 1), t([-0.499999, -0.499999, 1.499997, -0.499999]), **TOL
    )
    torch.testing.assert_close(
        grpo_advantages_S(r, g, 1, std_estimator="population", eps=0.0),
        t([-0.577350, -0.577350, 1.732051, -0.577350]),
        **TOL,
    )
    torch.testing.assert_close(dr_grpo_advantages_S(r, g, 1), t([-0.25, -0.25, 0.75, -0.25]), **TOL)
    torch.testing.assert_close(rloo_advantages_S(r, g, 1), t([-1 / 3, -1 / 3, 1.0, -1 / 3]), **TOL)


@pytest.mark.parametrize(
    "lengths,expected",
    [
        ([3, 3, 3, 3], [-0.552771, -0.552771, 1.658312, -0.552771]),
        ([2, 4, 3, 5], [-0.503236, -0.503236, 1.845200, -0.503236]),
    ],
)
def test_19_1_reinforce_pp_baseline_whitens_over_tokens(lengths, expected):
    seq_ids = torch.repeat_interleave(torch.arange(4), torch.tensor(lengths))
    adv_T = compute_advantages(
        get_preset("reinforce_pp", advantage="reinforce_pp_baseline", kl_in_reward_coef=0.0),
        rewards_S=t([0, 0, 1, 0]),
        group_ids_S=torch.zeros(4, dtype=torch.long),
        seq_ids_T=seq_ids,
        loss_mask_T=torch.ones(len(seq_ids), dtype=torch.bool),
        num_groups=1,
    )
    first = torch.cumsum(torch.tensor([0] + lengths[:-1]), 0)
    torch.testing.assert_close(adv_T[first], t(expected), **TOL)


def test_19_1_other_groups_in_one_batch():
    rewards = t([1, 0, 1, 0, 1, 1, 1, 0, 1, 1, 1, 1, 0.5, 0.51, 0.49, 0.5])
    groups = torch.arange(4).repeat_interleave(4)
    torch.testing.assert_close(
        grpo_advantages_S(rewards, groups, 4),
        t(
            [
                0.866024,
                -0.866024,
                0.866024,
                -0.866024,
                0.499999,
                0.499999,
                0.499999,
                -1.499997,
                0,
                0,
                0,
                0,
                0,
                1.224595,
                -1.224595,
                0,
            ]
        ),
        **TOL,
    )
    torch.testing.assert_close(
        dr_grpo_advantages_S(rewards, groups, 4),
        t([0.5, -0.5, 0.5, -0.5, 0.25, 0.25, 0.25, -0.75, 0, 0, 0, 0, 0, 0.01, -0.01, 0]),
        **TOL,
    )
    third = 1 / 3
    torch.testing.assert_close(
        rloo_advantages_S(rewards, groups, 4),
        t(
            [
                2 * third,
                -2 * third,
                2 * third,
                -2 * third,
                third,
                third,
                third,
                -1,
                0,
                0,
                0,
                0,
                0,
                0.01 * 4 / 3,
                -0.01 * 4 / 3,
                0,
            ]
        ),
        **TOL,
    )


# §19.2 --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "ratio,adv,ppo_value,ppo_zero_grad,dapo_value,dapo_zero_grad",
    [
        (1.30, 1.5, 1.8, True, 1.92, True),
        (1.25, 1.5, 1.8, True, 1.875, False),
        (0.70, -0.5, -0.4, True, -0.4, True),
        (0.70, 0.5, 0.35, False, 0.35, False),
        (1.50, -0.5, -0.75, False, -0.75, False),
        (4.00, -0.5, -2.0, False, -2.0, False),
    ],
)
def test_19_2_clipped_surrogate(ratio, adv, ppo_value, ppo_zero_grad, dapo_value, dapo_zero_grad):
    for preset, value, zero_grad in (
        ("ppo", ppo_value, ppo_zero_grad),
        ("dapo", dapo_value, dapo_zero_grad),
    ):
        loss, grad, metrics = single_token_loss(get_preset(preset), ratio, adv)
        assert loss == pytest.approx(-value, abs=1e-12)  # loss = -objective
        assert (grad == 0.0) == zero_grad
        clipped = float(metrics["clip/low_token_frac"] + metrics["clip/high_token_frac"])
        assert clipped == (1.0 if zero_grad else 0.0)


def test_19_2_dual_clip():
    loss, grad, metrics = single_token_loss(get_preset("ppo", dual_clip_c=3.0), 4.0, -0.5)
    assert loss == pytest.approx(1.5, abs=1e-12)
    assert grad == 0.0 and float(metrics["clip/dual_token_frac"]) == 1.0
    loss, _, _ = single_token_loss(get_preset("ppo"), 4.0, -0.5)
    assert loss == pytest.approx(2.0, abs=1e-12)


# §19.3 --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "mode,max_len,expected",
    [
        ("token_mean", None, 3.5),
        ("seq_mean_token_mean", None, 3.0),
        ("seq_mean_token_sum", None, 10.5),
        ("constant_normalizer", 8, 1.3125),
    ],
)
def test_19_3_aggregation(mode, max_len, expected):
    loss_T = t([1, 2, 3, 4, 5, 6])
    seq_ids = torch.tensor([0, 0, 1, 1, 1, 1])
    kept = TokenBatch(loss_mask_T=torch.ones(6, dtype=torch.bool), seq_ids_T=seq_ids, num_seqs=2)
    got = aggregate_loss(loss_T, kept, mode, max_len=max_len)
    assert float(got) == pytest.approx(expected, abs=1e-12)


# §19.4 --------------------------------------------------------------------------------
def _one_sequence(cfg, log_ratios, advantages):
    n = len(log_ratios)
    old = torch.full((n,), -1.5, dtype=F64)
    lp = (old + t(log_ratios)).requires_grad_(True)
    loss, metrics = policy_loss(
        cfg,
        TokenBatch(
            logprobs_T=lp,
            old_logprobs_T=old,
            advantages_T=t(advantages),
            loss_mask_T=torch.ones(n, dtype=torch.bool),
            seq_ids_T=torch.zeros(n, dtype=torch.long),
            num_seqs=1,
        ),
    )
    (grad,) = torch.autograd.grad(loss, lp)
    return loss.detach(), grad, metrics


def test_19_4_gspo_sequence_ratio_and_clip():
    log_ratios = [math.log(x) for x in (1.10, 0.95, 1.30, 0.90)]
    loss, grad, metrics = _one_sequence(get_preset("gspo"), log_ratios, [1.0] * 4)
    assert float(metrics["ratio/mean"]) == pytest.approx(1.0515394, abs=1e-6)
    assert float(loss) == pytest.approx(-1.0004, abs=1e-12)  # clipped to 1 + 4e-4
    assert (grad == 0).all() and float(metrics["clip/high_seq_frac"]) == 1.0
    # Token-level clipping at eps = 0.2 would clip only the 1.30 token.
    _, _, token_metrics = _one_sequence(get_preset("ppo"), log_ratios, [1.0] * 4)
    assert float(token_metrics["clip/high_token_frac"]) == 0.25
    _, _, metrics = _one_sequence(get_preset("gspo"), [0.1, -0.05, 0.2, -0.1], [1.0] * 4)
    assert float(metrics["ratio/mean"]) == pytest.approx(1.0382120, abs=1e-6)
    loss, grad, metrics = _one_sequence(get_preset("gspo"), [1e-4, -2e-4, 5e-4], [1.0] * 3)
    s = 1.0001333422226173
    assert float(metrics["ratio/mean"]) == pytest.approx(s, abs=1e-12)
    torch.testing.assert_close(grad, torch.full((3,), -s / 3, dtype=F64), rtol=0.0, atol=1e-12)


def test_19_4_gspo_token_gradient_is_s_per_token():
    log_ratios, adv = [0.1, -0.05, 0.2, -0.1], [1.0, 0.0, 0.0, 0.0]
    s = math.exp(0.0375)
    _, grad_token, _ = _one_sequence(
        get_preset("gspo_token", gate="none", aggregation="seq_mean_token_sum"), log_ratios, adv
    )
    torch.testing.assert_close(grad_token, t([-s, 0, 0, 0]), rtol=0.0, atol=1e-12)
    _, grad_seq, _ = _one_sequence(
        get_preset("gspo", gate="none", aggregation="seq_mean_token_sum"), log_ratios, adv
    )
    torch.testing.assert_close(grad_seq, torch.full((4,), -s / 4, dtype=F64), rtol=0.0, atol=1e-12)


# §19.5 --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "ratio,tau,gate_value,weight_times_r",
    [
        (1.0, 1.0, 2.0, 1.0),
        (1.2, 1.0, 2.199336, 1.188080),
        (1.2, 1.05, 2.104030, 1.186867),
        (0.8, 1.05, 1.705494, 0.791244),
        (2.0, 1.0, 2.924234, 1.572895),
        (3.0, 1.05, 3.393917, 1.166336),
    ],
)
def test_19_5_sapo_gate(ratio, tau, gate_value, weight_times_r):
    adv = (
        1.0 if tau == 1.0 else -1.0
    )  # the preset uses tau_pos = 1.0 for A > 0, tau_neg = 1.05 otherwise
    loss, grad, _ = single_token_loss(get_preset("sapo"), ratio, adv)
    assert loss == pytest.approx(-adv * gate_value, abs=1e-6)
    assert grad == pytest.approx(-adv * weight_times_r, abs=1e-6)


# §19.6 --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "ratio,verl_weight,trl_weight",
    [(0.3, 0.3, 0.3), (1.0, 1.0, 1.0), (1.5, 1.2, 1.5), (5.0, 1.2, 5.0)],
)
def test_19_6_cispo_weight(ratio, verl_weight, trl_weight):
    for cfg, weight in (
        (get_preset("cispo"), verl_weight),
        (get_preset("cispo", eps_high_is=4.0), trl_weight),
    ):
        _, grad, _ = single_token_loss(cfg, ratio, 1.0)
        assert grad == pytest.approx(-weight, abs=1e-12)  # never zero, unlike PPO's clip
    _, ppo_grad, _ = single_token_loss(get_preset("ppo"), 1.5, 1.0)
    assert ppo_grad == 0.0


# §19.7 --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "log_ratios,adv,expected_loss",
    [
        ([0.5, -0.1, 0.2], 1.0, -1.181360),
        ([0.5, -0.1, 0.2], -1.0, 1.221403),
        ([-0.6, 0.1, 0.0], -1.0, 0.904837),
        ([-0.6, 0.1, 0.0], 1.0, -0.846482),
    ],
)
def test_19_7_gmpo(log_ratios, adv, expected_loss):
    loss, grad, _ = _one_sequence(get_preset("gmpo"), log_ratios, [adv] * 3)
    assert float(loss) == pytest.approx(expected_loss, abs=1e-6)
    clipped = [(adv > 0 and d > 0.4) or (adv < 0 and d < -0.4) for d in log_ratios]
    assert [float(g) == 0.0 for g in grad] == clipped  # clipped tokens leave the gradient


# §19.8 --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "p_theta,p_ref,k1,k2,k3",
    [
        (0.5, 0.4, 0.223144, 0.024897, 0.023144),
        (0.4, 0.5, -0.223144, 0.024897, 0.026856),
        (0.9, 0.1, 2.197225, 2.413898, 1.308336),
    ],
)
def test_19_8_kl_values(p_theta, p_ref, k1, k2, k3):
    lp, ref = t([math.log(p_theta)]), t([math.log(p_ref)])
    for name, expected in (("k1", k1), ("k2", k2), ("k3", k3)):
        assert float(kl_estimate_T(name, lp, ref)[0]) == pytest.approx(expected, abs=1e-6)


def test_19_8_k1_k3_are_unbiased():
    q, p = t([0.5, 0.3, 0.2]), t([0.4, 0.4, 0.2])
    true_kl = float((q * (q / p).log()).sum())
    assert true_kl == pytest.approx(0.025267, abs=1e-6)
    for name in ("k1", "k3"):
        assert float((q * kl_estimate_T(name, q.log(), p.log())).sum()) == pytest.approx(
            true_kl, abs=1e-12
        )


# §19.9 --------------------------------------------------------------------------------
def test_19_9_soft_overlong_punishment():
    got = soft_overlong_penalty_S(
        torch.tensor([10000, 16384, 16385, 18432, 20480, 20481]), 20480, 4096
    )
    torch.testing.assert_close(got, t([0, 0, -1 / 4096, -0.5, -1.0, -1.0]), rtol=0.0, atol=1e-12)
    assert float(got[2]) == pytest.approx(-0.000244, abs=1e-6)


# §19.10 -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "rho,tis,icepop,mis",
    [
        (math.exp(0.9), 2.0, 2.459603, 0.0),
        (0.4, 0.4, 0.0, 0.0),
        (0.5, 0.5, 0.5, 0.5),
        (1.3, 1.3, 1.3, 1.3),
        (5.0, 2.0, 5.0, 0.0),
        (6.0, 2.0, 0.0, 0.0),
    ],
)
def test_19_10_mismatch_weights(rho, tis, icepop, mis):
    log_rho = t([math.log(rho)])
    for mode, expected in (("tis", tis), ("icepop", icepop), ("mis", mis)):
        weight, rejected = mismatch_weight_T(get_preset("ppo", mismatch=mode), log_rho)
        assert float(weight[0]) == pytest.approx(expected, abs=1e-6)
        assert bool(rejected[0]) == (expected == 0.0)


def test_19_10_sequence_level_weight():
    ratios = t([1.1, 0.9, 1.3, 1.05])
    kept = KeptTokens.build(
        torch.ones(4, dtype=torch.bool), torch.zeros(4, dtype=torch.long), 1, F64
    )
    batch = TokenBatch(
        old_logprobs_T=ratios.log(),
        rollout_logprobs_T=torch.zeros(4, dtype=F64),
        loss_mask_T=torch.ones(4, dtype=torch.bool),
        seq_ids_T=torch.zeros(4, dtype=torch.long),
        num_seqs=1,
    )
    log_rho = mismatch_log_ratio_T("sequence", batch, kept)
    weight, _ = mismatch_weight_T(
        get_preset("ppo", mismatch="tis", mismatch_level="sequence"), log_rho
    )
    torch.testing.assert_close(weight, torch.full((4,), 1.35135, dtype=F64), rtol=0.0, atol=1e-6)


# §19.11, §19.12 -----------------------------------------------------------------------
LOSSES = t([0.2, -0.1, 0.4, 0.3, 0.0, 0.1, 0.5, -0.2, 0.3, 0.1])
ONE_SEQ = torch.zeros(10, dtype=torch.long)


def _one_seq(mask_T):
    return TokenBatch(loss_mask_T=mask_T, seq_ids_T=ONE_SEQ, num_seqs=1)


def test_19_11_stapo_mask_and_renormalisation():
    # Candidates (A > 0, p < 0.002) at tokens 2, 5, 7, 9 with entropies 0.1, 0.5, 1.2, 2.0.
    adv = t([-1, -1, 1, 1, -1, 1, 1, 1, -1, 1])
    probs = t([0.5, 0.001, 0.001, 0.3, 0.001, 0.001, 0.2, 0.0015, 0.001, 0.001])
    entropy = t([0.0, 0.0, 0.1, 0.0, 0.0, 0.5, 0.0, 1.2, 0.0, 2.0])
    mask, metrics = build_loss_mask(
        get_preset("stapo"),
        TokenBatch(
            loss_mask_T=torch.ones(10, dtype=torch.bool),
            seq_ids_T=ONE_SEQ,
            num_seqs=1,
            logprobs_T=probs.log(),
            advantages_T=adv,
            entropy_T=entropy,
        ),
    )
    assert torch.nonzero(~mask).flatten().tolist() == [2, 5, 7]  # below the 75th percentile 1.4
    assert float(metrics["mask/stapo_frac"]) == pytest.approx(0.3)
    assert float(aggregate_loss(LOSSES, _one_seq(mask), "token_mean")) == pytest.approx(
        0.185714, abs=1e-6
    )
    assert float(
        aggregate_loss(LOSSES, _one_seq(torch.ones(10, dtype=torch.bool)), "token_mean")
    ) == pytest.approx(0.16)


def test_19_12_entropy_top_20_percent():
    entropy = t([0.05, 2.3, 0.1, 0.02, 1.7, 0.3, 0.01, 0.9, 0.04, 0.2])
    mask, _ = build_loss_mask(
        get_preset("entropy_8020"),
        TokenBatch(
            loss_mask_T=torch.ones(10, dtype=torch.bool),
            seq_ids_T=ONE_SEQ,
            num_seqs=1,
            entropy_T=entropy,
        ),
    )
    assert torch.nonzero(mask).flatten().tolist() == [1, 4]
    assert float(aggregate_loss(LOSSES, _one_seq(mask), "token_mean")) == pytest.approx(
        -0.05, abs=1e-12
    )


# §19.13 -------------------------------------------------------------------------------
def test_19_13_rspo_floor_applied_once():
    gamma = math.exp(-0.15)
    assert gamma == pytest.approx(0.860708, abs=1e-6)
    torch.testing.assert_close(
        floor_router_shift_T(t([gamma, 0.5, 1.0]), 0.8), t([gamma, 0.8, 1.0]), rtol=0.0, atol=0.0
    )
    cfg = get_preset("ppo", rspo_gamma_min=0.8)
    base = dict(
        old_logprobs_T=t([-2.0]),
        advantages_T=t([1.0]),
        loss_mask_T=torch.ones(1, dtype=torch.bool),
        seq_ids_T=torch.zeros(1, dtype=torch.long),
        num_seqs=1,
    )
    plain, _ = policy_loss(get_preset("ppo"), TokenBatch(logprobs_T=t([-1.9]), **base))
    for raw, effective in ((0.5, 0.8), (gamma, gamma)):
        loss, metrics = policy_loss(
            cfg, TokenBatch(logprobs_T=t([-1.9]), rspo_gamma_T=t([raw]), **base)
        )
        assert float(loss) == pytest.approx(effective * float(plain), abs=1e-12)
        assert float(metrics["weight/rspo/mean"]) == pytest.approx(effective, abs=1e-12)
