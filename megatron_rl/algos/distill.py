"""On-policy distillation: the per-token reverse KL from the student to a teacher, on the
student's own samples, as a term of the gated objective.

With tokens ``x_t`` sampled by the student ``pi`` and a frozen teacher ``mu`` scoring the same
prefixes, the per-token reverse KL ``KL(pi(.|s_t) || mu(.|s_t))`` enters the objective in one
of two ways (``ObjectiveConfig.distill_estimator``):

* ``sampled``, the sampled token's log-ratio: ``log pi(x_t) - log mu(x_t)`` is an unbiased
  estimate of the reverse KL at ``s_t`` (``x_t ~ pi``). Its negative, times
  ``distill_coef``, is a per-token advantage added to ``rl_coef`` times the reward
  advantage (:func:`distill_advantages_T`), with the student's side taken from the old-policy
  pass (a constant, like every advantage). The gated surrogate then makes it a policy
  gradient: at ratio 1 the gradient of ``-A r`` is ``(log pi_old - log mu) grad log pi``,
  whose expectation is ``grad KL(pi || mu)`` per token (the teacher's log-prob at future
  positions is not credited back, the "discount 0" choice of Thinking Machines' on-policy
  distillation and of slime, verl and prime-rl). Clipping, token weights, masks, filters and
  the aggregation all apply as to any advantage.
* ``topk``, the teacher's top-k: with the teacher's K most likely ids ``v_k`` at ``s_t``
  and both models' log-probs there, the reverse KL of the two distributions coarse-grained
  into those K tokens and one bucket for the rest of the vocabulary
  (:func:`topk_reverse_kl_T`)::

      D_t = sum_k q_k (log q_k - log p_k) + q_tail (log q_tail - log p_tail),
      q_k = pi(v_k), p_k = mu(v_k), q_tail = 1 - sum_k q_k, p_tail = 1 - sum_k p_k.

  It is an exact KL (so >= 0, and 0 only where the two agree on the K tokens), a lower bound
  of the full reverse KL (coarse-graining never raises a KL), and equal to it when the
  teacher's top-k hold all of both models' mass. It is differentiated directly through the
  student's log-probs at the K ids (no sampling estimator), ``d D / d log q_k = q_k ((log q_k
  - log p_k) - (log q_tail - log p_tail))``, and enters the loss as
  ``distill_coef * aggregate(D)`` over the same kept tokens and with the same aggregation as
  the policy term (``algos.loss``). This is the tail-bucket form verl writes for the forward
  KL (``forward_kl_topk_tail``), taken in the reverse direction the sampled estimator has.

Both use the teachers' and the student's distributions at temperature 1: an SGLang teacher's
prompt log-probs are those of the raw logits (its input log-prob path applies no temperature:
``sglang/srt/layers/logprob_processor.py:586-740``, ``log_softmax`` of each chunk's logits or
the same normalizer on the fast path; only sampled output tokens see it, ``:417-427``), and so
are a trainer-run
teacher's; the student's side matches them. With ``rollout.temperature`` 1 (the usual
on-policy-distillation setting, and the demo's) that is also the distribution the student
samples from; at another temperature the samples come from the tempered student, whose
ratio the gate sees, while the distillation signal still compares the untempered
distributions (verl likewise forces its teachers to temperature 1).

Shape legend: T tokens, K the teacher's top-k.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .validation import InputError, finite_checks, run_value_checks

TAIL_MASS_EPS = 1e-6
"""Smallest probability mass the tail bucket is taken to have inside a log (both models):
a teacher whose top-k hold all its mass in fp32 would otherwise make ``log p_tail`` -inf."""


def distill_advantages_T(
    teacher_logprobs_T: Tensor,
    old_logprobs_T: Tensor,
    loss_mask_T: Tensor,
    coef: float,
) -> Tensor:
    """``[T]`` the sampled-token distillation advantage ``coef (log mu(x_t) - log pi_old(x_t))``.

    Zero on tokens outside ``loss_mask_T`` (an environment's tokens: the student never sampled
    them). Detached: it is an advantage.

    Args:
        teacher_logprobs_T: [T] the teacher's log-probs of the sampled tokens.
        old_logprobs_T: [T] the student's (old-policy pass) log-probs of the same tokens.
        loss_mask_T: [T] bool, the tokens the student generated.
        coef: ``distill_coef`` >= 0.
    """
    if teacher_logprobs_T.shape != old_logprobs_T.shape:
        raise InputError(f"teacher_logprobs_T has shape {tuple(teacher_logprobs_T.shape)} but old_logprobs_T "
                         f"{tuple(old_logprobs_T.shape)}")
    log_ratio_T = teacher_logprobs_T.detach().double() - old_logprobs_T.detach().double()
    return torch.where(loss_mask_T.bool(), coef * log_ratio_T, torch.zeros_like(log_ratio_T))


def with_distillation_T(cfg, rl_advantages_T: Tensor, teacher_logprobs_T: Tensor | None,
                        old_logprobs_T: Tensor | None, loss_mask_T: Tensor) -> Tensor:
    """``[T]`` ``cfg.rl_coef`` times the reward advantages, plus the sampled distillation advantage
    (:func:`distill_advantages_T`) when ``cfg.distill_coef > 0`` with the ``sampled`` estimator.

    Args:
        cfg: the objective (``rl_coef``, ``distill_coef``, ``distill_estimator``, ``check_inputs``).
        rl_advantages_T: [T] the advantage estimator's output.
        teacher_logprobs_T: [T] or None; required by the sampled estimator.
        old_logprobs_T: [T] or None; required by the sampled estimator.
        loss_mask_T: [T] bool, the generated tokens.

    Raises:
        InputError: a required input is missing, or (``check_inputs``) a teacher log-prob is not finite.
    """
    advantages_T = rl_advantages_T if cfg.rl_coef == 1 else cfg.rl_coef * rl_advantages_T
    if cfg.distill_coef == 0 or cfg.distill_estimator != "sampled":
        return advantages_T
    if teacher_logprobs_T is None or old_logprobs_T is None:
        raise InputError("teacher_logprobs_T and old_logprobs_T are required by ObjectiveConfig.distill_coef > 0 "
                         "(distill_estimator='sampled')")
    if cfg.check_inputs:
        run_value_checks(finite_checks({"teacher_logprobs_T": teacher_logprobs_T}))
    distill_T = distill_advantages_T(teacher_logprobs_T, old_logprobs_T, loss_mask_T, cfg.distill_coef)
    return advantages_T + distill_T.to(advantages_T.dtype)


def _log_tail(logprobs_TK: Tensor) -> Tensor:
    """``[T]`` log of ``1 - sum_k exp(logprobs_TK)``, floored at ``log(TAIL_MASS_EPS)``.

    ``-expm1(logsumexp)`` keeps the precision of a tail much smaller than 1 - sum (the sum
    rounds to 1 long before the tail is 0 in fp32).
    """
    tail_T = -torch.expm1(torch.logsumexp(logprobs_TK, dim=-1))
    return torch.log(tail_T.clamp_min(TAIL_MASS_EPS))


def topk_reverse_kl_T(student_topk_logprobs_TK: Tensor, teacher_topk_logprobs_TK: Tensor) -> Tensor:
    """``[T]`` reverse KL of student and teacher coarse-grained into the teacher's top-k + a tail.

    Args:
        student_topk_logprobs_TK: [T, K] the student's log-probs at the teacher's top-k ids;
            carries the gradient.
        teacher_topk_logprobs_TK: [T, K] the teacher's log-probs there (constants).

    Returns:
        [T] ``D_t`` (module docstring), differentiable through the student's log-probs. The
        tails' masses enter their logs floored at :data:`TAIL_MASS_EPS`; the student's tail
        mass itself multiplies its log unfloored, so the value stays an exact KL of the
        coarse-grained distributions up to that floor.
    """
    if student_topk_logprobs_TK.dim() != 2 or student_topk_logprobs_TK.shape != teacher_topk_logprobs_TK.shape:
        raise InputError(f"student_topk_logprobs_TK {tuple(student_topk_logprobs_TK.shape)} and "
                         f"teacher_topk_logprobs_TK {tuple(teacher_topk_logprobs_TK.shape)} must both be [T, K]")
    student_TK = student_topk_logprobs_TK
    teacher_TK = teacher_topk_logprobs_TK.detach().to(student_TK.dtype)
    head_T = (student_TK.exp() * (student_TK - teacher_TK)).sum(dim=-1)
    log_q_tail_T = _log_tail(student_TK)
    log_p_tail_T = _log_tail(teacher_TK)
    q_tail_T = (-torch.expm1(torch.logsumexp(student_TK, dim=-1))).clamp_min(0.0)
    return head_T + q_tail_T * (log_q_tail_T - log_p_tail_T)


def teacher_topk_mass_T(teacher_topk_logprobs_TK: Tensor) -> Tensor:
    """``[T]`` the teacher's probability mass on its own top-k (how much the top-k estimator sees)."""
    return torch.logsumexp(teacher_topk_logprobs_TK.detach(), dim=-1).exp()

