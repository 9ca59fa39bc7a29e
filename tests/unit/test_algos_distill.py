"""On-policy distillation terms (``algos.distill``): the loss and its gradient equal a by-hand
computation for both estimators, inside the whole objective (advantages, gate, masks,
aggregation), and the config's rules.

The by-hand sides below are written with Python floats and lists from the formulas in the
module docstring, gradients included (derived, not taken from autograd): the sampled
estimator's advantage ``c (log mu - log pi_old)`` times the gated ratio, and the top-k
estimator's coarse-grained reverse KL ``sum_k q_k (log q_k - log p_k) + q_tail (log q_tail -
log p_tail)`` with ``dD/db_k = q_k ((b_k - a_k) - (log q_tail - log p_tail))``.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from megatron_rl.algos import (
    ObjectiveConfigError,
    TokenBatch,
    compute_advantages,
    get_preset,
    policy_loss,
    seq_ids_from_cu_seqlens,
    topk_reverse_kl_T,
)
from megatron_rl.algos.distill import TAIL_MASS_EPS


def _batch(seed: int = 0):
    """Four sequences of 3-6 tokens, one with an environment's tokens masked out."""
    gen = torch.Generator().manual_seed(seed)
    lengths = [3, 5, 6, 4]
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)))
    n = int(cu[-1])
    old = -(torch.rand(n, generator=gen, dtype=torch.float64) * 3 + 0.05)
    # Inside the clip band for all but token 2 (ratio e^0.5 > 1.2: clipped where A > 0).
    logprobs = old + 0.05 * torch.randn(n, generator=gen, dtype=torch.float64)
    logprobs[2] = old[2] + 0.5
    teacher = old + torch.randn(n, generator=gen, dtype=torch.float64)
    teacher[2] = old[2] + 0.5  # a positive distillation advantage where the ratio is past 1.2
    mask = torch.ones(n, dtype=torch.bool)
    mask[8:10] = False  # sequence 1's last two tokens: an environment wrote them
    return dict(cu=cu, old=old, logprobs=logprobs, teacher=teacher, mask=mask,
                rewards=torch.tensor([1.0, 0.0, 1.0, 1.0], dtype=torch.float64))


def _advantages(cfg, b):
    return compute_advantages(cfg, rewards_S=b["rewards"], group_ids_S=torch.tensor([0, 0, 1, 1]),
                              seq_ids_T=seq_ids_from_cu_seqlens(b["cu"]), loss_mask_T=b["mask"], num_groups=2,
                              old_logprobs_T=b["old"], teacher_logprobs_T=b["teacher"])


def test_sampled_estimator_advantage_loss_and_gradient_by_hand():
    """GRPO at weight 0.5 plus distillation at weight 2: A_t = 0.5 A_grpo + 2 (log mu - log pi_old)
    on generated tokens; loss = token mean of max(-A r, -A clip(r, 0.8, 1.2)); its gradient
    -A r / N where the unclipped branch is taken, 0 where the clip is."""
    b = _batch()
    cfg = replace(get_preset("grpo"), kl_coef=0.0, rl_coef=0.5, distill_coef=2.0, aggregation="token_mean",
                  eps_low=0.2, eps_high=0.2)
    adv = _advantages(cfg, b)
    seq = seq_ids_from_cu_seqlens(b["cu"]).tolist()
    rewards = b["rewards"].tolist()
    # GRPO by hand: (R - mean) / (sample std + 1e-6) per group of two.
    grpo = []
    for g in (0, 1):
        r = rewards[2 * g: 2 * g + 2]
        mean = sum(r) / 2
        std = math.sqrt(sum((x - mean) ** 2 for x in r) / 1)
        grpo += [(x - mean) / (std + 1e-6) for x in r]
    mask, old, teacher, lp = (b[k].tolist() for k in ("mask", "old", "teacher", "logprobs"))
    want_adv = [0.5 * grpo[seq[t]] + (2.0 * (teacher[t] - old[t]) if mask[t] else 0.0) for t in range(len(seq))]
    assert adv.tolist() == pytest.approx(want_adv, abs=1e-12)

    logprobs = b["logprobs"].clone().requires_grad_(True)
    batch = TokenBatch(logprobs_T=logprobs, old_logprobs_T=b["old"], advantages_T=adv, loss_mask_T=b["mask"],
                       seq_ids_T=seq_ids_from_cu_seqlens(b["cu"]), num_seqs=4, teacher_logprobs_T=b["teacher"])
    loss, metrics = policy_loss(cfg, batch)
    loss.backward()
    kept = [t for t in range(len(seq)) if mask[t]]
    n = len(kept)
    want_loss, want_grad = 0.0, [0.0] * len(seq)
    for t in kept:
        r, a = math.exp(lp[t] - old[t]), want_adv[t]
        clipped = min(max(r, 0.8), 1.2)
        want_loss += max(-a * r, -a * clipped) / n
        if -a * r >= -a * clipped:  # the unclipped branch
            want_grad[t] = -a * r / n
    assert float(loss.detach()) == pytest.approx(want_loss, abs=1e-12)
    assert logprobs.grad.tolist() == pytest.approx(want_grad, abs=1e-12)
    assert want_grad[2] == 0.0 and want_adv[2] > 0  # the clipped token took part
    log_ratio = [lp[t] - teacher[t] for t in kept]
    assert float(metrics["distill/log_ratio/mean"]) == pytest.approx(sum(log_ratio) / n, abs=1e-12)


def test_pure_distillation_ignores_the_rewards():
    """rl_coef 0: the advantage is the distillation term alone, whatever the rewards."""
    b = _batch(1)
    cfg = replace(get_preset("grpo"), kl_coef=0.0, rl_coef=0.0, distill_coef=1.0)
    adv = _advantages(cfg, b)
    b["rewards"] = torch.tensor([5.0, -3.0, 0.0, 2.0], dtype=torch.float64)
    assert torch.equal(_advantages(cfg, b), adv)
    assert torch.equal(adv, torch.where(b["mask"], b["teacher"] - b["old"], torch.zeros_like(adv)))


def _topk_by_hand(b_k: list[float], a_k: list[float]) -> tuple[float, list[float]]:
    """D and dD/db_k from the formulas, in Python floats."""
    q = [math.exp(x) for x in b_k]
    p = [math.exp(x) for x in a_k]
    q_tail, p_tail = 1 - sum(q), 1 - sum(p)
    log_q_tail = math.log(max(q_tail, TAIL_MASS_EPS))
    log_p_tail = math.log(max(p_tail, TAIL_MASS_EPS))
    value = sum(qk * (bk - ak) for qk, bk, ak in zip(q, b_k, a_k)) + q_tail * (log_q_tail - log_p_tail)
    grad = [qk * ((bk - ak) - (log_q_tail - log_p_tail)) for qk, bk, ak in zip(q, b_k, a_k)]
    return value, grad


def test_topk_estimator_value_and_gradient_by_hand():
    """D_t and its gradient w.r.t. the student's top-k log-probs and, through the softmax,
    w.r.t. the logits (the path the training forward takes), token by token."""
    gen = torch.Generator().manual_seed(3)
    T, V, K = 5, 11, 3
    logits = torch.randn(T, V, generator=gen, dtype=torch.float64, requires_grad=True)
    teacher_logits = torch.randn(T, V, generator=gen, dtype=torch.float64) * 2
    teacher_lp = torch.log_softmax(teacher_logits, -1)
    top_lp, top_ids = teacher_lp.topk(K, dim=-1)
    student_top = torch.log_softmax(logits, -1).gather(1, top_ids)
    value = topk_reverse_kl_T(student_top, top_lp)
    upstream = torch.randn(T, generator=gen, dtype=torch.float64)
    (value * upstream).sum().backward()
    probs = torch.softmax(logits.detach(), -1).tolist()
    for t in range(T):
        want, grad_b = _topk_by_hand(student_top[t].tolist(), top_lp[t].tolist())
        assert float(value[t].detach()) == pytest.approx(want, abs=1e-12)
        assert float(value[t].detach()) >= 0  # an exact KL of the coarse-grained distributions
        # d/dz_j sum_k g_k (onehot(v_k) - p) = g_j [j is a top-k id] - p_j sum_k g_k
        ids = top_ids[t].tolist()
        want_z = [float(upstream[t]) * ((grad_b[ids.index(j)] if j in ids else 0.0) - probs[t][j] * sum(grad_b))
                  for j in range(V)]
        assert logits.grad[t].tolist() == pytest.approx(want_z, abs=1e-12)


def test_topk_estimator_is_zero_where_the_models_agree_and_floors_a_full_teacher_tail():
    """Same distribution: 0 and no gradient. A teacher whose top-k hold all its mass: the tail's
    log is floored, the value stays finite and the by-hand formula holds."""
    lp = torch.log_softmax(torch.randn(4, 6, dtype=torch.float64), -1)
    top, _ = lp.topk(3, dim=-1)
    student = top.clone().requires_grad_(True)
    value = topk_reverse_kl_T(student, top)
    value.sum().backward()
    assert value.abs().max() < 1e-12 and student.grad.abs().max() < 1e-12
    full = torch.log(torch.tensor([[0.5, 0.5]], dtype=torch.float64))
    student = torch.log(torch.tensor([[0.4, 0.3]], dtype=torch.float64))
    got = topk_reverse_kl_T(student, full)
    assert torch.isfinite(got).all()
    assert float(got[0]) == pytest.approx(_topk_by_hand(student[0].tolist(), full[0].tolist())[0], abs=1e-12)


def test_topk_term_in_the_objective_by_hand():
    """rl_coef 0, distill_coef 1.5, top-k, seq-mean-token-mean: loss = 1.5 x the mean over
    sequences of each one's mean D over its kept tokens; its gradient w.r.t. the student's
    top-k log-probs follows; environment tokens take no part."""
    b = _batch(2)
    gen = torch.Generator().manual_seed(4)
    n, K = int(b["cu"][-1]), 4
    teacher_top = torch.log_softmax(torch.randn(n, 9, generator=gen, dtype=torch.float64), -1).topk(K, dim=-1)[0]
    student_top = torch.log_softmax(torch.randn(n, 9, generator=gen, dtype=torch.float64), -1)[:, :K]
    student_top.requires_grad_(True)
    cfg = replace(get_preset("grpo"), kl_coef=0.0, rl_coef=0.0, distill_coef=1.5, distill_estimator="topk")
    adv = _advantages(cfg, b)
    assert adv.abs().max() == 0  # the top-k estimator puts nothing into the advantages
    seq_ids = seq_ids_from_cu_seqlens(b["cu"])
    batch = TokenBatch(logprobs_T=b["logprobs"].clone().requires_grad_(True), old_logprobs_T=b["old"],
                       advantages_T=adv, loss_mask_T=b["mask"], seq_ids_T=seq_ids, num_seqs=4,
                       distill_T=topk_reverse_kl_T(student_top, teacher_top))
    loss, metrics = policy_loss(replace(cfg, aggregation="seq_mean_token_mean"), batch)
    loss.backward()
    mask, seq = b["mask"].tolist(), seq_ids.tolist()
    per_token = [_topk_by_hand(student_top[t].tolist(), teacher_top[t].tolist()) for t in range(n)]
    kept_per_seq = [sum(1 for t in range(n) if seq[t] == s and mask[t]) for s in range(4)]
    want = sum(sum(per_token[t][0] for t in range(n) if seq[t] == s and mask[t]) / kept_per_seq[s]
               for s in range(4)) / 4
    assert float(loss.detach()) == pytest.approx(1.5 * want, abs=1e-12)
    for t in range(n):
        scale = 1.5 / (4 * kept_per_seq[seq[t]]) if mask[t] else 0.0
        assert student_top.grad[t].tolist() == pytest.approx([scale * g for g in per_token[t][1]], abs=1e-12)
    assert float(metrics["loss/distill"]) == pytest.approx(want, abs=1e-12)


def test_distillation_rules():
    with pytest.raises(ObjectiveConfigError, match="rl_coef: is 0 and so is distill_coef"):
        replace(get_preset("grpo"), kl_coef=0.0, rl_coef=0.0)
    with pytest.raises(ObjectiveConfigError, match="distill_estimator='forward' is not one of sampled, topk"):
        replace(get_preset("grpo"), kl_coef=0.0, distill_estimator="forward")
    with pytest.raises(ObjectiveConfigError, match="distill_coef: must be >= 0"):
        replace(get_preset("grpo"), kl_coef=0.0, distill_coef=-1.0)
    b = _batch()
    cfg = replace(get_preset("grpo"), kl_coef=0.0, distill_coef=1.0)
    with pytest.raises(ValueError, match="teacher_logprobs_T and old_logprobs_T are required"):
        compute_advantages(cfg, rewards_S=b["rewards"], group_ids_S=torch.tensor([0, 0, 1, 1]),
                           seq_ids_T=seq_ids_from_cu_seqlens(b["cu"]), loss_mask_T=b["mask"], num_groups=2)
    b["teacher"][1] = float("nan")
    with pytest.raises(ValueError, match="teacher_logprobs_T"):
        _advantages(cfg, b)
