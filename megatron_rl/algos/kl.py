"""KL-to-reference estimators (Schulman's k1, k2, k3) and the k1 penalty for rewards.

With tokens sampled from pi_theta and ``log r = log pi_ref - log pi_theta`` per token:

* ``k1 = -log r`` — unbiased value; as a loss its gradient is ``grad log pi``, whose
  expectation under pi_theta is **zero**: k1 as a loss term does not pull towards pi_ref.
* ``k2 = 0.5 (log r)^2`` — biased value; gradient ``(log pi - log pi_ref) grad log pi``,
  whose expectation is **grad KL(pi_theta || pi_ref)** (the reverse KL it estimates).
* ``k3 = (r - 1) - log r`` — unbiased, low-variance value (GRPO's eq. 4); gradient
  ``(1 - r) grad log pi``, whose expectation is **grad KL(pi_ref || pi_theta)** (forward KL).

(objectives.md §14, checked numerically in §19.8 and in the tests.) k3's ``log r`` is
clamped to ``+-log_ratio_clamp`` (default 20, as verl) before both of its terms, because
``exp(log r)`` overflows to inf once ``pi_theta`` is e^88.7 (fp32) times less likely than
``pi_ref``. Inside the clamp k3 is exact; beyond it the estimate is held at its value at
the bound and the token gets no KL gradient (clamping only the exponential would flip the
sign of the gradient there). Unlike verl, the value of k3 is not clamped (verl: ±10). k1
and k2 have no exponential and are never clamped.

For KL in the reward, ``kl_reward_penalty_T`` gives ``-beta * (log pi_old - log pi_ref)``
(k1 at the sampling policy, as verl's ``compute_rewards``), detached.

This module owns the estimators only; aggregation happens in ``algos.aggregation``.

Shape legend: T tokens.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .log_ratio import DEFAULT_LOG_RATIO_CLAMP, clamp_log_ratio


def kl_estimate_T(
    estimator: str,
    logprobs_T: Tensor,
    ref_logprobs_T: Tensor,
    *,
    log_ratio_clamp: float = DEFAULT_LOG_RATIO_CLAMP,
) -> Tensor:
    """Per-token KL estimate, differentiable through ``logprobs_T``.

    Args:
        estimator: 'k1', 'k2' or 'k3'.
        logprobs_T: [T] log pi_theta of the sampled tokens.
        ref_logprobs_T: [T] log pi_ref of the same tokens (treated as a constant).
        log_ratio_clamp: k3 only: ``log r`` is clamped to ``[-c, c]`` (see the module).

    Returns:
        [T] estimate.
    """
    log_r_T = ref_logprobs_T.detach() - logprobs_T
    if estimator == "k1":
        return -log_r_T
    if estimator == "k2":
        return 0.5 * log_r_T * log_r_T
    if estimator == "k3":
        # One clamped log r for both terms: the gradient beyond the clamp is 0, not +1.
        log_r_T = clamp_log_ratio(log_r_T, log_ratio_clamp)
        # expm1 keeps precision when pi_theta is close to pi_ref (r - 1 ~ 0).
        return torch.expm1(log_r_T) - log_r_T
    raise ValueError(f"unknown KL estimator {estimator!r}; available: k1, k2, k3")


def kl_reward_penalty_T(old_logprobs_T: Tensor, ref_logprobs_T: Tensor, coef: float) -> Tensor:
    """Per-token reward term ``-coef * (log pi_old - log pi_ref)`` (k1), without gradient.

    Args:
        old_logprobs_T: [T] log-probs of the sampling (old) policy.
        ref_logprobs_T: [T] log-probs of the reference policy.
        coef: beta >= 0.

    Returns:
        [T] penalty to add to the token rewards (see ``advantages.token_returns_T``).
    """
    return (-coef * (old_logprobs_T - ref_logprobs_T)).detach()
