"""SGLang's prompt-scoring form, encoded and decoded without any I/O (targets SGLang 0.5.23).

Owns the request a distillation teacher answers (:func:`score_payload`: ``max_new_tokens`` 0,
``logprob_start_len``, ``top_logprobs_num``), the stand-in's answer (:func:`score_entries_payload`)
and its decoding (:func:`decode_score_response`); both sides live here so that the client and the
stand-in cannot drift apart. Does not own ``/generate``'s sampling form
(:mod:`~megatron_rl.rollout.sglang.wire`) or HTTP.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch

from megatron_rl.rollout.sglang.wire import LOGPROB_SLACK, WireFormatError, parse_finish_reason


def score_payload(*, rid: str, input_ids: Sequence[int], logprob_start_len: int, top_logprobs_num: int = 0) -> dict:
    """The JSON body asking SGLang for the log-probs of ``input_ids[logprob_start_len + 1:]``
    under the served model, generating nothing: a prefill-only request (``max_new_tokens`` 0,
    ``schedule_batch.py:1500-1506``), with the top ``top_logprobs_num`` log-probs at each of
    those positions. Prompt log-probs are the raw ``log_softmax(logits)`` whatever the sampling
    parameters (``layers/logprob_processor.py:586-740``)."""
    payload = {
        "rid": rid,
        "input_ids": [int(t) for t in input_ids],
        "sampling_params": {"max_new_tokens": 0},
        "return_logprob": True,
        "logprob_start_len": int(logprob_start_len),
        "stream": False,
    }
    if top_logprobs_num:
        payload["top_logprobs_num"] = int(top_logprobs_num)
    return payload


def score_entries_payload(input_ids: Sequence[int], start: int, logprobs_N: torch.Tensor, vocab_size: int,
                          top_ids_NK: torch.Tensor | None = None, top_logprobs_NK: torch.Tensor | None = None) -> dict:
    """``meta_info``'s ``input_token_logprobs`` (and ``input_top_logprobs``) as SGLang 0.5.23 writes
    them for tokens ``start ..`` of ``input_ids``: the first entry's log-prob is None (no position
    before it was scored), entry j the log-prob of token ``start + j`` (from position ``start + j -
    1``; ``scheduler_components/logprob_result_processor.py:26-37``); a token id past
    ``vocab_size - 2`` is reported as 0 (``:49-56``); top-k rows likewise, None first
    (``:58-83``); each entry ``[logprob, token_id, null]`` (``tokenizer_manager.py:3098-3136``).

    Args:
        logprobs_N: ``[N]`` log-probs of tokens ``start + 1 ..``.
    """
    ids = [int(t) for t in input_ids[start:]]
    reported = [t if t < vocab_size - 1 else 0 for t in ids]
    values = [None] + [float(v) for v in logprobs_N.tolist()]
    meta = {"input_token_logprobs": [[v, t, None] for v, t in zip(values, reported)]}
    if top_ids_NK is not None:
        rows = [None] + [[[float(v), int(t), None] for v, t in zip(vs, ts)]
                         for vs, ts in zip(top_logprobs_NK.tolist(), top_ids_NK.tolist())]
        meta["input_top_logprobs"] = rows
    return meta


def decode_score_response(body: Any, *, rid: str, input_ids: Sequence[int], start: int, topk: int,
                          source: str) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``([N] log-probs, [N, K] ids, [N, K] log-probs)`` of tokens ``start + 1 ..`` from a
    :func:`score_payload` response (the top-k None without ``topk``).

    Raises:
        WireFormatError: a missing or malformed field, a response for another request, an
            entry for another token, or a log-prob that is not a finite value <= 0.
    """
    if not isinstance(body, dict) or not isinstance(body.get("meta_info"), dict):
        raise WireFormatError(f"{source}: response is not an object with a meta_info object")
    meta = body["meta_info"]
    if meta.get("id", rid) != rid:
        raise WireFormatError(f"{source}: response is for request {meta.get('id')!r}, expected {rid!r}")
    parse_finish_reason(meta.get("finish_reason"), source)
    entries = meta.get("input_token_logprobs")
    expected = len(input_ids) - start
    if not isinstance(entries, list) or len(entries) != expected:
        got = len(entries) if isinstance(entries, list) else type(entries).__name__
        raise WireFormatError(f"{source}: input_token_logprobs has {got} entries, expected {expected} "
                              f"(tokens {start}..{len(input_ids) - 1}; was logprob_start_len sent?)")
    values = []
    for j, entry in enumerate(entries[1:], start=1):
        token = int(input_ids[start + j])
        if not isinstance(entry, (list, tuple)) or len(entry) < 2 or entry[1] not in (token, 0):
            raise WireFormatError(f"{source}: input_token_logprobs[{j}] is {entry!r}, not token {token}'s entry")
        values.append(_checked_logprob(entry[0], f"{source}: input token {start + j}"))
    top_ids = top_lp = None
    if topk:
        rows = meta.get("input_top_logprobs")
        if not isinstance(rows, list) or len(rows) != expected:
            raise WireFormatError(f"{source}: input_top_logprobs must hold {expected} rows (was top_logprobs_num sent?)")
        top_ids, top_lp = torch.zeros(expected - 1, topk, dtype=torch.int64), torch.zeros(expected - 1, topk)
        for j, row in enumerate(rows[1:]):
            if not isinstance(row, list) or len(row) != topk:
                raise WireFormatError(f"{source}: input_top_logprobs[{j + 1}] holds {row!r}, not {topk} entries")
            for k, entry in enumerate(row):
                top_lp[j, k] = _checked_logprob(entry[0] if isinstance(entry, (list, tuple)) else None,
                                                f"{source}: top-{topk} entry {k} of input token {start + j + 1}")
                top_ids[j, k] = int(entry[1])
    return torch.tensor(values, dtype=torch.float32), top_ids, top_lp


def _checked_logprob(value: Any, where: str) -> float:
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not number or not math.isfinite(value) or value > LOGPROB_SLACK:
        raise WireFormatError(f"{where} has log-prob {value!r} (need a finite value <= 0)")
    return float(value)
