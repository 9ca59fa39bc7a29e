"""The stand-in's prompt scoring: a prefill-only ``/generate`` answered as SGLang 0.5.23 answers it.

A request with ``sampling_params.max_new_tokens`` 0 generates nothing (SGLang's prefill-only
request, ``managers/schedule_batch.py:1500-1506``); with ``return_logprob`` and
``logprob_start_len`` s, the answer's ``meta_info.input_token_logprobs`` holds the entries of
tokens ``s ..`` of ``input_ids``, the first with a null log-prob, and with ``top_logprobs_num``
k, ``input_top_logprobs`` the top-k of the same positions (the layout and its sources:
:func:`megatron_rl.rollout.sglang.score_wire.score_entries_payload`); ``output_ids`` is empty and
the finish reason ``length`` 0 (the token the prefill samples is cut at ``max_new_tokens``:
``schedule_batch.py:2036-2041``). A ``logprob_start_len`` past the input is refused with
SGLang's message (``managers/scheduler.py:3275-3281``); a negative one other than -1 too, and
-1 asks for no input log-probs (``:3260-3273``). Log-probs are the served model's raw
``log_softmax`` over its vocabulary, whatever the sampling parameters (the input log-prob path
applies no temperature, ``layers/logprob_processor.py:586-740``), computed by the served
Megatron model's log-prob pass (``parallel.logprobs.compute_logprobs``, the trainer's own).
Owns the parse and the answer; not HTTP (:mod:`~megatron_rl.sglang_standin.server`).
"""

from __future__ import annotations

import time
from typing import Any

import torch
from aiohttp import web

from megatron_rl.rollout.sglang.score_wire import score_entries_payload


def is_scoring(body: Any) -> bool:
    """Whether ``body`` is a prefill-only request (``max_new_tokens`` 0)."""
    params = body.get("sampling_params") if isinstance(body, dict) else None
    return isinstance(params, dict) and params.get("max_new_tokens") == 0


def parse_scoring(body: dict, vocab_size: int, longest: int) -> tuple[str, list[int], int, int]:
    """``(rid, input_ids, logprob_start_len, top_logprobs_num)``; ``ValueError`` (HTTP 400) as SGLang refuses."""
    ids = body.get("input_ids")
    if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and 0 <= t < vocab_size for t in ids):
        raise ValueError(f"input_ids must be a non-empty list of token ids in [0, {vocab_size})")
    if len(ids) > longest:
        raise ValueError(f"input ({len(ids)} tokens) exceeds the context length {longest}")
    start = body.get("logprob_start_len", -1) if body.get("return_logprob") else -1
    if not isinstance(start, int) or isinstance(start, bool) or start < -1:
        raise ValueError(f"logprob_start_len {start!r} must be an integer >= -1")
    if start == -1:
        start = len(ids)  # prefill-only without a start: no input log-probs (scheduler.py:3265-3268)
    if start > len(ids):
        raise ValueError(f"req.logprob_start_len={start} is higher than the number of input tokens "
                         f"len(req.origin_input_ids)={len(ids)}. Please use a smaller logprob_start_len.")
    topk = body.get("top_logprobs_num") or 0
    if not isinstance(topk, int) or topk < 0 or topk > vocab_size:
        raise ValueError(f"top_logprobs_num {topk!r} must be an integer in [0, {vocab_size}]")
    return str(body.get("rid") or "score"), ids, start, topk


def score(host, ids: list[int], start: int, topk: int) -> dict:
    """``meta_info``'s log-prob fields for tokens ``start ..`` (on the engine thread)."""
    from megatron_rl.parallel.logprobs import compute_logprobs

    vocab = host.model_cfg.vocab_size
    if start >= len(ids) - 1:  # nothing after the first entry, whose log-prob is null
        empty = torch.zeros(0)
        top = (torch.zeros(0, topk, dtype=torch.int64), torch.zeros(0, topk)) if topk else (None, None)
        return score_entries_payload(ids, start, empty, vocab, *top) if start < len(ids) else {
            "input_token_logprobs": [], **({"input_top_logprobs": []} if topk else {})}
    result = compute_logprobs(host.model, host.groups, [torch.tensor(ids)], [start + 1], topk=topk)
    return score_entries_payload(ids, start, result.logprobs_T, vocab, result.topk_ids_TK, result.topk_logprobs_TK)


async def answer_scoring(host, body: dict, weight_version: str, started: float) -> web.Response:
    """The JSON response to a prefill-only request (``ValueError``: a request SGLang refuses)."""
    rid, ids, start, topk = parse_scoring(body, host.model_cfg.vocab_size, host.model_cfg.max_position_embeddings)
    entries = await host.call(score, host, ids, start, topk)
    meta = {
        "id": rid, "finish_reason": {"type": "length", "length": 0}, "prompt_tokens": len(ids),
        "weight_version": weight_version, "num_retractions": 0, **entries, "output_token_logprobs": [],
        "output_token_logprobs_length": 0, "reasoning_tokens": 0, "completion_tokens": 0, "cached_tokens": 0,
        "e2e_latency": time.monotonic() - started,
        "response_sent_to_client_ts": time.time(),  # as every finished body (wire.generate_response_payload)
    }
    return web.json_response({"output_ids": [], "meta_info": meta})
