"""What the client checks about SGLang servers before it uses their samples.

* **Log-prob convention.** The trainer compares rollout log-probs with its own
  ``log_softmax(logits)`` of the raw logits (``mismatch/*``, TIS, MIS, IcePop). SGLang 0.5.23
  returns ``log_softmax(logits / T)`` for a sampled (non-greedy) request unless the server
  was started with ``SGLANG_RETURN_ORIGINAL_LOGPROB=1`` (``srt/layers/sampler.py:82``,
  ``:186-196``, ``:273-323``), which ``megatron_rl.rollout.sglang.server`` sets. The client
  verifies it, it does not convert (a single log-prob cannot be rescaled without the whole
  distribution): :func:`probe_logprob_convention` asks the same prompts at T = 1 and at
  T = 0.5 with ``top_p`` so small that only the most likely token survives, so both answers
  are the same tokens; with raw log-probs they carry the same values, with scaled ones each
  value at T = 0.5 is higher (``log_softmax(2 l)`` of the top token exceeds ``log_softmax(l)``
  unless the distribution is a point mass). It runs before the first request at a
  temperature other than 0 and 1 (at those two both conventions agree).
* **Seeded sampling.** SGLang ignores ``sampling_param.sampling_seed`` without
  ``--enable-deterministic-inference`` (``srt/sampling/sampling_batch_info.py:128``,
  ``:157-172``); a run that asks for seeded sampling (``rollout.sglang.deterministic_inference``)
  needs every server's ``/server_info`` to say ``enable_deterministic_inference``.

Owns the probe's requests and both decisions; does not own HTTP sessions or retries.
"""

from __future__ import annotations

import asyncio
import json
import uuid

import aiohttp

from megatron_rl.rollout.engine import SamplingParams
from megatron_rl.rollout.sglang.ledger import RolloutRequestError
from megatron_rl.rollout.sglang.wire import decode_generate_response, generate_payload

PROBE_TEMPERATURE = 0.5
"""Temperature the probe compares with T = 1 (scaled log-probs move by a factor 1 / T)."""
PROBE_TOP_P = 1e-6
"""Keeps only the most likely token, so both probes sample the same tokens."""
PROBE_PROMPTS = [[3 + (7 * i + 5 * j) % 53 for j in range(8)] for i in range(4)]
"""Token ids any vocabulary holds; arbitrary text leaves the next token uncertain."""
SCALED_GAP = 0.05
"""Mean log-prob rise at T = 0.5 above which a server scales by the temperature (raw ones
differ only by batch numerics, ~1e-6 in fp32 and ~1e-2 at worst in bf16)."""


async def _probe(session: aiohttp.ClientSession, url: str, temperature: float, timeout_s: float) -> list:
    params = SamplingParams(temperature=temperature, top_p=PROBE_TOP_P, max_new_tokens=4)
    results = []
    for i, prompt in enumerate(PROBE_PROMPTS):
        rid = f"logprob-convention-{uuid.uuid4().hex[:8]}-{i}"
        payload = generate_payload(rid=rid, prompt_ids=prompt, params=params, return_routed_experts=False)
        async with session.post(url + "/generate", json=payload,
                                timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            status, body = resp.status, await resp.read()
        if status != 200:
            raise RolloutRequestError(f"{url}: the log-prob convention probe got HTTP {status}: {body[:300]!r}")
        results.append(decode_generate_response(json.loads(body), rid=rid, prompt_len=len(prompt), want_routes=False,
                                                num_layers=0, topk=0, num_experts=0, source=f"probe {rid} of {url}"))
    return results


async def probe_logprob_convention(session: aiohttp.ClientSession, url: str, timeout_s: float) -> float:
    """The mean log-prob rise from T = 1 to T = 0.5 over the probe's tokens (see the module docstring).

    Raises:
        RolloutRequestError: the server returns temperature-scaled log-probs (named, with the fix).
    """
    at_one, at_half = await asyncio.gather(_probe(session, url, 1.0, timeout_s),
                                           _probe(session, url, PROBE_TEMPERATURE, timeout_s))
    gaps = []
    for a, b in zip(at_one, at_half):
        for token_a, token_b, lp_a, lp_b in zip(a.output_ids, b.output_ids, a.output_logprobs, b.output_logprobs):
            if token_a != token_b:
                break  # a near-tie broken differently: the rest of the answers differ
            gaps.append(float(lp_b - lp_a))
    gap = sum(gaps) / max(len(gaps), 1)
    if gap > SCALED_GAP:
        raise RolloutRequestError(
            f"SGLang server {url} returns temperature-scaled log-probs (log_softmax(logits / T): the same tokens "
            f"score {gap:.3f} nats higher on average at T = {PROBE_TEMPERATURE} than at T = 1), but the trainer "
            "compares raw log_softmax(logits); start the server with SGLANG_RETURN_ORIGINAL_LOGPROB=1 in its "
            "environment (srt/layers/sampler.py:82; python -m megatron_rl.rollout.sglang.server sets it)")
    return gap


def check_deterministic(infos: dict[str, dict]) -> None:
    """Every server runs with ``--enable-deterministic-inference`` (its ``/server_info``).

    Raises:
        RolloutRequestError: naming the servers without it.
    """
    lacking = [url for url, info in infos.items() if not info.get("enable_deterministic_inference")]
    if lacking:
        raise RolloutRequestError(
            "rollout.sglang.deterministic_inference is true, but SGLang server(s) "
            f"{', '.join(lacking)} run without --enable-deterministic-inference (their /server_info), so they "
            "ignore sampling_seed (srt/sampling/sampling_batch_info.py:157-172); start them with it "
            "(python -m megatron_rl.rollout.sglang.server --deterministic-inference)")
