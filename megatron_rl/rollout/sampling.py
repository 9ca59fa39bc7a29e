"""Next-token sampling from full-vocabulary logits (pure torch).

Shape legend: B sequences, V vocabulary.

Temperature 0 is greedy. Otherwise logits are divided by the temperature, restricted to
the top-k tokens (k > 0) and to the smallest set whose probability reaches top-p, then
sampled with the caller's generator, so that every rank holding the same logits and the
same generator state draws the same tokens. :func:`sampled_logprobs` scores the drawn tokens
in either convention an engine may report.
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
    logits_BV = logits_BV / temperature
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
    probs_BV = logits_BV.softmax(dim=-1)
    return torch.multinomial(probs_BV, 1, generator=generator)[:, 0]


def sampled_logprobs(logits_BV: torch.Tensor, tokens_B: torch.Tensor, *, temperature: float,
                     after_temperature: bool = False) -> torch.Tensor:
    """``[B]`` fp32 log-probs of ``tokens_B``: ``log_softmax(logits)`` over the full vocabulary
    (the trainer's convention), or with ``after_temperature`` and T > 0 ``log_softmax(logits / T)``,
    what SGLang returns for sampled requests unless started with ``SGLANG_RETURN_ORIGINAL_LOGPROB``
    (its ``srt/layers/sampler.py:273-317``; greedy requests get the raw ones, ``:208-223``)."""
    logits_BV = logits_BV.float()
    if after_temperature and temperature > 0:
        logits_BV = logits_BV / temperature
    return logits_BV.log_softmax(-1).gather(-1, tokens_B[:, None])[:, 0]
