"""What the client checks about SGLang servers before it uses their samples.

* **Log-prob convention.** The trainer scores ``log_softmax(logits / T)`` at each sample's
  temperature (``train.policy_temperature: sampling``), which is what SGLang 0.5.23 returns for a
  sampled request by default: ``srt/layers/sampler.py:275`` divides the logits by the
  temperatures in place, ``:294-299`` takes their softmax, ``:312-316`` returns ``log(probs)``;
  top-p / top-k sample from a sorted copy (``:821-838``) or inside FlashInfer's kernel and
  leave ``probs`` whole, so the log-probs are of the untruncated T-scaled distribution. A server
  started with ``SGLANG_RETURN_ORIGINAL_LOGPROB=1`` returns ``log_softmax(logits)`` instead
  (``:82``, ``:231-237``, ``:319-323``), what ``train.policy_temperature: one`` (the T = 1
  objective) needs; greedy requests get raw log-probs either way (``:208-223``).
  ``megatron_rl.rollout.sglang.server`` launches servers in the run's convention and the client
  verifies it (it does not convert: one log-prob cannot be rescaled without the whole
  distribution): :func:`probe_logprob_convention` asks the same prompts at T = 1 and at
  T = 0.01 with ``top_p`` so small that only the most likely token survives, so both answers are
  the same tokens. Raw log-probs are the same at both temperatures; scaled ones at T = 0.01 are
  those of ``softmax(100 z)``, nearly 0 for the top token unless another is within a few
  hundredths of a nat of it, so they rise most of the way from the T = 1 value to 0
  (:func:`convention_of`). On tokens the model is already sure of (log-prob near 0 at T = 1) the
  two conventions agree and the probe cannot, and need not, tell them apart; a rise between the
  two bands (near-ties, bf16 batch noise) tells nothing either, and is let pass. It runs before
  the first request at a temperature other than 0 and 1 (at those two both conventions agree).
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

PROBE_TEMPERATURE = 0.01
"""Temperature the probe compares with T = 1: scaled log-probs of the top token come near 0."""
PROBE_TOP_P = 1e-6
"""Keeps only the most likely token, so both probes sample the same tokens."""
PROBE_PROMPTS = [[3 + (7 * i + 5 * j) % 53 for j in range(8)] for i in range(4)]
"""Token ids any vocabulary holds; arbitrary text leaves the next token uncertain."""
UNSURE = 0.05
"""Mean ``-log p`` of the probe's tokens at T = 1 below which the conventions agree too closely to
be told apart (and so need not be): raw ones differ only by batch numerics there, ~1e-6 in fp32
and ~1e-2 at worst in bf16."""
SCALED_RISE = 0.5
"""Share of the way from the T = 1 log-prob to 0 that the cold one rises at least on a scaling
server (one whose top tokens are clear of the next rises nearly all of it)."""
RAW_RISE = 0.1
"""Share it rises at most on a raw server (batch numerics only)."""


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


def convention_of(logprobs_at_one: list[float], logprobs_cold: list[float]) -> str | None:
    """``"scaled"`` or ``"raw"`` from the same tokens' log-probs at T = 1 and at :data:`PROBE_TEMPERATURE`,
    or None when they cannot tell: tokens too sure at T = 1 for the conventions to differ
    (:data:`UNSURE`), or a rise between :data:`RAW_RISE` and :data:`SCALED_RISE` of the room."""
    if not logprobs_at_one:
        return None
    room = -sum(logprobs_at_one) / len(logprobs_at_one)
    if room < UNSURE:
        return None
    rise = sum(b - a for a, b in zip(logprobs_at_one, logprobs_cold)) / len(logprobs_at_one)
    if rise >= SCALED_RISE * room:
        return "scaled"
    return "raw" if rise <= RAW_RISE * room else None


async def probe_logprob_convention(session: aiohttp.ClientSession, url: str, timeout_s: float,
                                   raw: bool = False) -> str | None:
    """The server's log-prob convention (:func:`convention_of`; see the module docstring).

    Raises:
        RolloutRequestError: the server's convention is not the run's (``raw``: the T = 1
            objective's), named, with the fix.
    """
    at_one, cold = await asyncio.gather(_probe(session, url, 1.0, timeout_s),
                                        _probe(session, url, PROBE_TEMPERATURE, timeout_s))
    one, low = [], []
    for a, b in zip(at_one, cold):
        for token_a, token_b, lp_a, lp_b in zip(a.output_ids, b.output_ids, a.output_logprobs, b.output_logprobs):
            if token_a != token_b:
                break  # a near-tie broken differently: the rest of the answers differ
            one.append(float(lp_a))
            low.append(float(lp_b))
    found = convention_of(one, low)
    if found == ("scaled" if raw else "raw"):
        wanted = "log_softmax(logits)" if raw else "log_softmax(logits / T), the distribution it samples"
        fix = ("start the server with SGLANG_RETURN_ORIGINAL_LOGPROB=1 (python -m megatron_rl.rollout.sglang.server "
               "--original-logprobs)" if raw else "start it without SGLANG_RETURN_ORIGINAL_LOGPROB "
               "(python -m megatron_rl.rollout.sglang.server unsets it)")
        raise RolloutRequestError(
            f"SGLang server {url} returns {found} log-probs (the same tokens at T = 1 and T = {PROBE_TEMPERATURE}: "
            f"mean {sum(one) / len(one):.3f} and {sum(low) / len(low):.3f} nats), but this run "
            f"(train.policy_temperature={'one' if raw else 'sampling'}) scores {wanted}; {fix} "
            "(srt/layers/sampler.py:82)")
    return found


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
