"""Next-token sampling from full-vocabulary logits (pure torch).

Shape legend: B sequences, V vocabulary.

Temperature 0 is greedy. Otherwise logits are divided by the temperature, restricted to
the top-k tokens (k > 0) and to the smallest set whose probability reaches top-p, then
sampled with the caller's generator, so that every rank holding the same logits and the
same generator state draws the same tokens. :func:`sampled_logprobs` scores the drawn tokens
in either convention an engine may report.

What the log-probs leave out: engines report (and the trainer scores) ``log_softmax(logits / T)``
over the whole vocabulary, as SGLang does by default, not the top-p / top-k renormalized
distribution the token was drawn from. Per token the two differ by exactly
``log pi_trunc(y) - log pi_T(y) = -log(mass kept)`` (:func:`kept_log_mass`), which the local
engines report with every sample (``RolloutSample.truncation_logratio``).
"""

from __future__ import annotations

import torch


def sample_next_tokens(
    logits_BV: torch.Tensor,
    *,
    temperature: float,
    top_p: float = 1.0,
    top_k: int = 0,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Token ids ``[B]`` drawn from ``logits_BV`` under the sampling parameters."""
    if temperature < 0 or not 0 < top_p <= 1 or top_k < 0:
        raise ValueError(f"bad sampling parameters: temperature={temperature}, top_p={top_p}, top_k={top_k}")
    logits_BV = logits_BV.float()
    if temperature == 0:
        return logits_BV.argmax(dim=-1)
    probs_BV = truncated_logits(logits_BV / temperature, top_p=top_p, top_k=top_k).softmax(dim=-1)
    return torch.multinomial(probs_BV, 1, generator=generator)[:, 0]


def truncated_logits(logits_BV: torch.Tensor, *, top_p: float, top_k: int) -> torch.Tensor:
    """Temperature-divided logits with the tokens top-k and then top-p drop set to ``-inf``."""
    if top_k > 0 and top_k < logits_BV.shape[-1]:
        kth = logits_BV.topk(top_k, dim=-1).values[:, -1:]
        logits_BV = logits_BV.masked_fill(logits_BV < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = logits_BV.sort(dim=-1, descending=True)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        # Drop a token when the mass before it already reaches top_p (the first always stays).
        drop_sorted = (cumulative - sorted_logits.softmax(dim=-1)) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
        logits_BV = logits_BV.masked_fill(drop, float("-inf"))
    return logits_BV


def kept_log_mass(logits_BV: torch.Tensor, *, temperature: float, top_p: float = 1.0, top_k: int = 0) -> torch.Tensor:
    """``[B]`` fp32 log of the probability mass of ``softmax(logits / T)`` that top-k / top-p keep
    (0 where nothing is cut, and at T = 0): minus the per-token log-ratio between the truncated
    distribution a token is drawn from and the whole one its log-prob describes."""
    logits_BV = logits_BV.float()
    if temperature == 0 or (top_p >= 1.0 and top_k <= 0):
        return logits_BV.new_zeros(logits_BV.shape[0])
    scaled_BV = logits_BV / temperature
    kept_BV = torch.isfinite(truncated_logits(scaled_BV, top_p=top_p, top_k=top_k))
    log_probs_BV = scaled_BV.log_softmax(dim=-1)
    return log_probs_BV.masked_fill(~kept_BV, float("-inf")).logsumexp(dim=-1).clamp_max(0.0)


def sampled_logprobs(logits_BV: torch.Tensor, tokens_B: torch.Tensor, *, temperature: float,
                     after_temperature: bool = True) -> torch.Tensor:
    """``[B]`` fp32 log-probs of ``tokens_B``: with ``after_temperature`` and T > 0
    ``log_softmax(logits / T)`` over the full vocabulary, the distribution sampled from and what
    SGLang returns for sampled requests by default (its ``srt/layers/sampler.py:274-316``:
    ``logits.div_(temperatures)``, softmax, ``torch.log(probs)``; top-p / top-k sample from a
    sorted copy and leave ``probs`` whole); greedy requests get the raw ones (``:208-223``).
    Without ``after_temperature``: ``log_softmax(logits)`` (the T = 1 objective,
    ``objective.policy_temperature=one``; SGLang with ``SGLANG_RETURN_ORIGINAL_LOGPROB``)."""
    logits_BV = logits_BV.float()
    if after_temperature and temperature > 0:
        logits_BV = logits_BV / temperature
    return logits_BV.log_softmax(-1).gather(-1, tokens_B[:, None])[:, 0]
