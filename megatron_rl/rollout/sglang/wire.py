"""SGLang's wire format, encoded and decoded without any I/O (targets SGLang 0.5.23).

Shape legend: P prompt tokens, O output tokens, N = P + O - 1 - start forwarded positions
with routes, L MoE layers (SGLang's ``num_hidden_layers``; every layer of the models this
project trains is MoE), K top-K, E experts per layer.

Owns the JSON of ``POST /generate`` (request fields ``rid``, ``input_ids``,
``sampling_params``, ``return_logprob``, ``return_routed_experts``,
``routed_experts_start_len``; response ``output_ids`` and ``meta_info`` with ``id``,
``finish_reason``, ``weight_version``, ``output_token_logprobs`` as
``[logprob, token_id, text_or_null]`` triples, and ``routed_experts``: base64 of the raw
bytes of a C-order int32 array ``[N, L, K]``), and the prompt-scoring form a distillation
teacher answers (:func:`score_payload`: ``max_new_tokens`` 0, ``logprob_start_len``,
``top_logprobs_num``; :func:`decode_score_response`). Both sides live here so that the client and
the stand-in cannot drift apart. Does not own HTTP, retries or weight updates
(:mod:`~megatron_rl.rollout.sglang.weight_payload`).

Routes are validated (length, id range, repeated experts) and narrowed to the compact id
dtype (uint8 for E <= 256) as soon as they are decoded, so int32 payloads never pile up in
host memory: a response's int32 bytes live only while that one response is decoded.
"""

from __future__ import annotations

import base64
import binascii
import math
from dataclasses import dataclass, field
from typing import Any, Literal, Sequence

import numpy as np
import torch

from megatron_rl.rollout.engine import SamplingParams
from moe_routing.types import compact_id_dtype
from moe_routing.validate import RoutingDataError

SGLANG_VERSION = "0.5.23"
"""The SGLang release whose HTTP protocol this module speaks."""

_ROUTE_DTYPES = {"int32": np.int32, "int16": np.int16, "uint16": np.uint16, "uint8": np.uint8}
"""Route element types a server may declare in ``meta_info.routed_experts_dtype``; 0.5.23
sends no such field and always int32."""


_LOGPROB_SLACK = 1e-4
"""Largest log-prob accepted: rounding in a server's log-softmax can land just above 0."""


class WireFormatError(ValueError):
    """A response does not follow SGLang's protocol; the message names the request."""


class MissingRoutesError(WireFormatError):
    """Routes were requested but the response has none: the server runs without
    ``--enable-return-routed-experts``, which no retry fixes."""


class GenerationAborted(RuntimeError):
    """The server aborted the request (``finish_reason.type == "abort"``)."""


@dataclass(kw_only=True)
class GenerateResult:
    """One decoded ``/generate`` response."""

    rid: str
    """Request id the server echoed in ``meta_info.id``."""
    output_ids: list[int]
    """Generated token ids (the stop token included, when one was produced)."""
    output_logprobs: torch.Tensor
    """``[O]`` fp32 log-probs of the generated tokens."""
    finish_reason: Literal["stop", "length"]
    """Why generation ended."""
    weight_version: str | None
    """``meta_info.weight_version``: the weights that served the request."""
    routed_experts: torch.Tensor | None
    """``[N, L, K]`` expert ids in the compact dtype, when requested."""
    meta: dict = field(default_factory=dict)
    """Token counts and latency from ``meta_info``."""


# --------------------------------------------------------------------------- requests


def sampling_params_payload(params: SamplingParams, *, sampling_seed: int | None = None) -> dict:
    """``sampling_params`` for SGLang (top_k 0 means off here, -1 there)."""
    payload = {
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k if params.top_k > 0 else -1,
        "max_new_tokens": params.max_new_tokens,
        "stop_token_ids": list(params.stop_token_ids),
    }
    if sampling_seed is not None:
        payload["sampling_seed"] = sampling_seed
    return payload


def generate_payload(
    *,
    rid: str,
    prompt_ids: Sequence[int],
    params: SamplingParams,
    return_routed_experts: bool,
    sampling_seed: int | None = None,
    routes_from: int = 0,
) -> dict:
    """The JSON body of one non-streaming ``/generate`` request (``routes_from``: the
    ``routed_experts_start_len``, the first position whose routes come back)."""
    payload = {
        "rid": rid,
        "input_ids": [int(t) for t in prompt_ids],
        "sampling_params": sampling_params_payload(params, sampling_seed=sampling_seed),
        "return_logprob": True,
        "stream": False,
    }
    if return_routed_experts:
        payload["return_routed_experts"] = True
        payload["routed_experts_start_len"] = routes_from
    return payload


# --------------------------------------------------------------------------- routes


def encode_routed_experts(expert_ids_NLK: torch.Tensor) -> str:
    """Base64 of the C-order int32 bytes of ``[N, L, K]`` ids, as SGLang sends them."""
    array = expert_ids_NLK.detach().to(torch.int32).contiguous().numpy()
    return base64.b64encode(array.tobytes()).decode("ascii")


def decode_routed_experts(
    payload: Any,
    *,
    prompt_len: int,
    output_len: int,
    num_layers: int,
    topk: int,
    num_experts: int,
    source: str,
    start_len: int = 0,
    dtype_name: str | None = None,
    moe_layers: Sequence[int] | None = None,
) -> torch.Tensor:
    """Validated ``[N, L, K]`` ids in the compact dtype from a ``routed_experts`` payload.

    Args:
        payload: the base64 string of ``meta_info.routed_experts``.
        prompt_len: P.
        output_len: O.
        num_layers: L.
        topk: K.
        num_experts: E (ids must lie in ``[0, E)``).
        source: what the payload belongs to, for messages ("sample 3 (rid ...) from URL").
        start_len: ``routed_experts_start_len`` of the request.
        dtype_name: ``meta_info.routed_experts_dtype`` when the server declared one.
        moe_layers: 0-based indices of the MoE layers among the L decoder layers; the other
            columns (dense layers, which SGLang never writes and sends as zeros) are dropped
            before validation, so the result has ``len(moe_layers)`` columns. None: every layer.

    Raises:
        WireFormatError: not base64, wrong length or an unknown element type.
        RoutingDataError: an id out of range or an expert repeated within a token.
    """
    if not isinstance(payload, str):
        raise WireFormatError(f"{source}: routed_experts must be a base64 string, got {type(payload).__name__}")
    dtype = _ROUTE_DTYPES.get(dtype_name or "int32")
    if dtype is None:
        raise WireFormatError(f"{source}: unknown routed_experts_dtype {dtype_name!r}")
    try:
        raw = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as err:
        raise WireFormatError(f"{source}: routed_experts is not valid base64 ({err})") from None
    itemsize = np.dtype(dtype).itemsize
    num_tokens = prompt_len + output_len - 1 - start_len
    expected = num_tokens * num_layers * topk
    if len(raw) != expected * itemsize:
        raise WireFormatError(
            f"{source}: routed_experts holds {len(raw) / itemsize:g} {np.dtype(dtype).name} values, expected "
            f"{expected} = {num_tokens} positions (prompt {prompt_len} + output {output_len} - 1 - start "
            f"{start_len}) x {num_layers} layers x top-{topk}"
        )
    ids = np.frombuffer(raw, dtype=dtype).reshape(num_tokens, num_layers, topk)
    columns = list(range(num_layers)) if moe_layers is None else list(moe_layers)
    if moe_layers is not None:
        ids = ids[:, columns]
    bad = (ids < 0) | (ids >= num_experts)
    if bad.any():
        token, layer, slot = (int(v) for v in np.argwhere(bad)[0])
        raise RoutingDataError(
            f"{source}: layer {columns[layer] + 1} token {token}: expert id {int(ids[token, layer, slot])} "
            f"is outside [0, {num_experts})"
        )
    compact = ids.astype(_numpy_dtype(compact_id_dtype(num_experts)))
    del raw, ids
    ordered = np.sort(compact, axis=-1)
    repeated = (ordered[..., 1:] == ordered[..., :-1]).any(axis=-1)
    if repeated.any():
        token, layer = (int(v) for v in np.argwhere(repeated)[0])
        raise RoutingDataError(
            f"{source}: layer {columns[layer] + 1} token {token}: expert repeated in {compact[token, layer].tolist()}"
        )
    return torch.from_numpy(compact)


def _numpy_dtype(dtype: torch.dtype) -> type:
    return {torch.uint8: np.uint8, torch.int16: np.int16, torch.int32: np.int32}[dtype]


# --------------------------------------------------------------------------- responses


def output_token_logprobs_payload(logprobs_O: torch.Tensor, output_ids: Sequence[int]) -> list:
    """``meta_info.output_token_logprobs``: ``[logprob, token_id, null]`` per generated token."""
    return [[float(lp), int(t), None] for lp, t in zip(logprobs_O.tolist(), output_ids)]


def parse_output_token_logprobs(
    entries: Any, output_ids: Sequence[int] | None, *, source: str
) -> tuple[list[int], torch.Tensor]:
    """Token ids and ``[O]`` fp32 log-probs from ``meta_info.output_token_logprobs``.

    Args:
        entries: the JSON list of ``[logprob, token_id, text_or_null]``.
        output_ids: the response's ``output_ids`` to check against (None: take the ids here).
        source: names the request in messages.
    """
    if not isinstance(entries, list):
        raise WireFormatError(f"{source}: output_token_logprobs must be a list, got {type(entries).__name__}")
    if output_ids is not None and len(entries) != len(output_ids):
        raise WireFormatError(
            f"{source}: {len(entries)} output_token_logprobs entries for {len(output_ids)} output_ids"
        )
    ids, values = [], []
    for i, entry in enumerate(entries):
        if not isinstance(entry, (list, tuple)) or len(entry) < 2:
            raise WireFormatError(f"{source}: output_token_logprobs[{i}] is not a [logprob, token_id, text] triple")
        logprob, token = entry[0], entry[1]
        number = isinstance(logprob, (int, float)) and not isinstance(logprob, bool)
        if not number or not math.isfinite(logprob) or logprob > _LOGPROB_SLACK:
            raise WireFormatError(f"{source}: output token {i} has log-prob {logprob!r} (need a finite value <= 0)")
        if isinstance(token, bool) or not isinstance(token, int):
            raise WireFormatError(f"{source}: output_token_logprobs[{i}] token id {token!r} is not an integer")
        if output_ids is not None and token != output_ids[i]:
            raise WireFormatError(f"{source}: output token {i} is {output_ids[i]} but its log-prob entry names {token}")
        ids.append(token)
        values.append(float(logprob))
    return ids, torch.tensor(values, dtype=torch.float32)


def finish_reason_payload(reason: Literal["stop", "length"], output_ids: Sequence[int]) -> dict:
    """``meta_info.finish_reason`` as SGLang writes it."""
    if reason == "stop":
        return {"type": "stop", "matched": int(output_ids[-1])}
    return {"type": "length", "length": len(output_ids)}


def generate_response_payload(
    *,
    rid: str,
    prompt_len: int,
    output_ids: Sequence[int],
    output_logprobs: torch.Tensor,
    finish_reason: Literal["stop", "length"],
    weight_version: str,
    routed_experts: torch.Tensor | None,
    e2e_latency: float = 0.0,
) -> dict:
    """The body SGLang returns for one non-streaming ``/generate`` request with ``return_logprob``
    from a server launched with ``--skip-tokenizer-init`` (no ``text``): the fields and order of
    0.5.23's ``TokenizerManager._handle_batch_output`` (golden copies in
    ``tests/fixtures/sglang_0_5_23``). ``input_token_logprobs`` is empty: the default
    ``logprob_start_len`` starts scoring after the prompt."""
    meta = {
        "id": rid,
        "finish_reason": finish_reason_payload(finish_reason, output_ids),
        "prompt_tokens": prompt_len,
        "weight_version": weight_version,
        "num_retractions": 0,
        "input_token_logprobs": [],
        "output_token_logprobs": output_token_logprobs_payload(output_logprobs, output_ids),
        "output_token_logprobs_length": len(output_ids),
        "reasoning_tokens": 0,
        "completion_tokens": len(output_ids),
        "cached_tokens": 0,
    }
    if routed_experts is not None:
        meta["routed_experts"] = encode_routed_experts(routed_experts)
    meta["e2e_latency"] = e2e_latency
    return {"output_ids": [int(t) for t in output_ids], "meta_info": meta}


def decode_generate_response(
    body: Any,
    *,
    rid: str,
    prompt_len: int,
    want_routes: bool,
    num_layers: int,
    topk: int,
    num_experts: int,
    source: str,
    moe_layers: Sequence[int] | None = None,
    start_len: int = 0,
) -> GenerateResult:
    """Check and decode one ``/generate`` response body (already parsed from JSON).

    ``moe_layers``: as for :func:`decode_routed_experts` (the routes keep the MoE layers only);
    ``start_len``: the request's ``routed_experts_start_len``.

    Raises:
        WireFormatError: a missing or malformed field, a response for another request,
            or a routes payload of the wrong length.
        MissingRoutesError: routes were requested and none came back.
        RoutingDataError: routes with out-of-range or repeated expert ids.
        GenerationAborted: the server aborted the request.
    """
    if not isinstance(body, dict) or not isinstance(body.get("meta_info"), dict):
        raise WireFormatError(f"{source}: response is not an object with a meta_info object")
    meta = body["meta_info"]
    if meta.get("id", rid) != rid:
        raise WireFormatError(f"{source}: response is for request {meta.get('id')!r}, expected {rid!r}")
    reason = _finish_reason(meta.get("finish_reason"), source)
    output_ids = body.get("output_ids")
    if output_ids is not None and (not isinstance(output_ids, list)
                                   or not all(isinstance(t, int) and not isinstance(t, bool) for t in output_ids)):
        raise WireFormatError(f"{source}: output_ids must be a list of integers")
    if "output_token_logprobs" not in meta:
        raise WireFormatError(f"{source}: meta_info has no output_token_logprobs (was return_logprob sent?)")
    ids, logprobs = parse_output_token_logprobs(meta["output_token_logprobs"], output_ids, source=source)
    if not ids:
        raise WireFormatError(f"{source}: the response has no generated token")
    routes = None
    if want_routes:
        if meta.get("routed_experts") is None:
            raise MissingRoutesError(
                f"{source}: meta_info has no routed_experts; launch SGLang with --enable-return-routed-experts"
            )
        routes = decode_routed_experts(
            meta["routed_experts"], prompt_len=prompt_len, output_len=len(ids), num_layers=num_layers,
            topk=topk, num_experts=num_experts, source=source, dtype_name=meta.get("routed_experts_dtype"),
            moe_layers=moe_layers, start_len=start_len,
        )
    version = meta.get("weight_version")
    return GenerateResult(
        rid=rid,
        output_ids=ids,
        output_logprobs=logprobs,
        finish_reason=reason,
        weight_version=None if version is None else str(version),
        routed_experts=routes,
        meta={k: meta[k] for k in ("prompt_tokens", "completion_tokens", "cached_tokens", "e2e_latency") if k in meta},
    )


def _finish_reason(value: Any, source: str) -> Literal["stop", "length"]:
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "abort":
        raise GenerationAborted(f"{source}: the server aborted the request ({value.get('message', 'no message')})")
    if kind not in ("stop", "length"):
        raise WireFormatError(f"{source}: finish_reason {value!r} is not a stop/length/abort object")
    return kind


# --------------------------------------------------------------------------- prompt scoring


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
    _finish_reason(meta.get("finish_reason"), source)
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
    if not number or not math.isfinite(value) or value > _LOGPROB_SLACK:
        raise WireFormatError(f"{where} has log-prob {value!r} (need a finite value <= 0)")
    return float(value)
