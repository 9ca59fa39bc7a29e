"""SGLang's wire format, encoded and decoded without any I/O (targets SGLang 0.5.23).

Shape legend: P prompt tokens, O output tokens, N = P + O - 1 - start forwarded positions
with routes, L MoE layers (SGLang's ``num_hidden_layers``; every layer of the models this
project trains is MoE), K top-K, E experts per layer.

Owns the JSON of ``POST /generate`` (request fields ``rid``, ``input_ids``,
``sampling_params``, ``return_logprob``, ``return_routed_experts``,
``routed_experts_start_len``; response ``output_ids`` and ``meta_info`` with ``id``,
``finish_reason``, ``weight_version``, ``output_token_logprobs`` as
``[logprob, token_id, text_or_null]`` triples, ``weight_versions``: the spans of output
tokens each weight version produced, and ``routed_experts``: base64 of the raw bytes of a
C-order int32 array ``[N, L, K]``), and of ``/pause_generation`` and ``/continue_generation``.
Both sides live here so that the client and the stand-in cannot drift apart. Does not own HTTP,
retries, weight updates (:mod:`~megatron_rl.rollout.sglang.weight_payload`) or the
prompt-scoring form (:mod:`~megatron_rl.rollout.sglang.score_wire`).

Weight versions per token (SGLang 0.5.23, ``srt/utils/weight_versions.py``): at every
weight-version change the scheduler notes, for each live request with output, the old
version and its output length so far (``record_weight_version_events``, ``:39-50``;
``managers/scheduler.py:5636-5655``); a finished (or aborted) request's events become spans
``{"version", "start", "end"}`` over its output tokens (``compute_weight_version_spans``,
``:66-87``; ``managers/scheduler_components/output_streamer.py:541-554``), written to
``meta_info.weight_versions`` with ``weight_version`` set to the last span's
(``add_weight_versions_to_meta_info``, ``:90-110``; ``managers/tokenizer_manager.py:2560-2567``,
``:3609-3613``). A request paused with ``/pause_generation`` mode ``abort`` ends with
``finish_reason {"type": "abort", ...}`` and the tokens it had (``managers/scheduler.py:
5800-5812``: ``FINISH_ABORT()`` without a status code answers normally,
``managers/tokenizer_manager.py:1891-1921``).

Routes are validated (length, id range, repeated experts) and narrowed to the compact id
dtype (uint8 for E <= 256) as soon as they are decoded, so int32 payloads never pile up in
host memory: a response's int32 bytes live only while that one response is decoded.
"""

from __future__ import annotations

import base64
import binascii
import math
import time
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


LOGPROB_SLACK = 1e-4
"""Largest log-prob accepted: rounding in a server's log-softmax can land just above 0."""


class WireFormatError(ValueError):
    """A response does not follow SGLang's protocol; the message names the request."""


class MissingRoutesError(WireFormatError):
    """Routes were requested but the response has none: the server runs without
    ``--enable-return-routed-experts``, which no retry fixes."""


class GenerationAborted(RuntimeError):
    """The server aborted the request (``finish_reason.type == "abort"``)."""


PAUSE_MODES = ("abort", "retract", "in_place")
"""``/pause_generation`` modes (``io_struct.py:1927-1946``, ``PauseGenerationReqInput.mode``)."""


def pause_generation_body(mode: str) -> dict:
    """``POST /pause_generation``: ``abort`` ends the running requests with what they have;
    ``retract`` puts them back in the queue (their KV is recomputed after
    ``/continue_generation``); ``in_place`` keeps them and their KV as they are."""
    if mode not in PAUSE_MODES:
        raise ValueError(f"pause mode {mode!r} is not one of {PAUSE_MODES}")
    return {"mode": mode}


def continue_generation_body() -> dict:
    """``POST /continue_generation`` (``io_struct.py:1949-1956``: ``torch_empty_cache`` defaults to true)."""
    return {"torch_empty_cache": True}


@dataclass(kw_only=True)
class GenerateResult:
    """One decoded ``/generate`` response."""

    rid: str
    """Request id the server echoed in ``meta_info.id``."""
    output_ids: list[int]
    """Generated token ids (the stop token included, when one was produced)."""
    output_logprobs: torch.Tensor
    """``[O]`` fp32 log-probs of the generated tokens."""
    finish_reason: Literal["stop", "length", "abort"]
    """Why generation ended ("abort": paused with mode ``abort``; only when the caller allows it)."""
    weight_version: str | None
    """``meta_info.weight_version``: the weights that served the request (the last ones)."""
    token_versions: list[str] | None = None
    """The weight version of each output token (``meta_info.weight_versions``), or None
    when the server sent no spans."""
    routed_experts: torch.Tensor | None
    """``[N, L, K]`` expert ids in the compact dtype, when requested."""
    meta: dict = field(default_factory=dict)
    """Token counts and latency from ``meta_info``."""


@dataclass(frozen=True)
class RouteShape:
    """What decoded routes must look like for the trained model."""

    num_layers: int
    """L: decoder layers (the columns SGLang sends)."""
    topk: int
    """K."""
    num_experts: int
    """E."""
    moe_layers: tuple[int, ...] | None = None
    """0-based indices of the MoE layers among the L; decoded routes keep only these columns
    (SGLang sends zeros for dense layers). None: every layer is an MoE layer."""


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
        if not number or not math.isfinite(logprob) or logprob > LOGPROB_SLACK:
            raise WireFormatError(f"{source}: output token {i} has log-prob {logprob!r} (need a finite value <= 0)")
        if isinstance(token, bool) or not isinstance(token, int):
            raise WireFormatError(f"{source}: output_token_logprobs[{i}] token id {token!r} is not an integer")
        if output_ids is not None and token != output_ids[i]:
            raise WireFormatError(f"{source}: output token {i} is {output_ids[i]} but its log-prob entry names {token}")
        ids.append(token)
        values.append(float(logprob))
    return ids, torch.tensor(values, dtype=torch.float32)


def finish_reason_payload(reason: Literal["stop", "length", "abort"], output_ids: Sequence[int]) -> dict:
    """``meta_info.finish_reason`` as SGLang writes it (``schedule_batch.py``: ``FINISH_MATCHED_TOKEN``,
    ``FINISH_LENGTH``, ``FINISH_ABORT.to_json`` ``:332-345``, its message "Aborted" by default)."""
    if reason == "stop":
        return {"type": "stop", "matched": int(output_ids[-1])}
    if reason == "abort":
        return {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
    return {"type": "length", "length": len(output_ids)}


def weight_versions_payload(spans: Sequence[tuple[str, int, int]]) -> list[dict]:
    """``meta_info.weight_versions``: ``{"version", "start", "end"}`` per span of output tokens."""
    return [{"version": str(v), "start": int(a), "end": int(b)} for v, a, b in spans]


def parse_weight_versions(entries: Any, num_tokens: int, *, source: str) -> list[str]:
    """The weight version of each of ``num_tokens`` output tokens from ``meta_info.weight_versions``.

    Raises:
        WireFormatError: spans that are not objects with a string version and integer bounds,
            or that do not tile ``[0, num_tokens)`` in order.
    """
    if not isinstance(entries, list) or not entries:
        raise WireFormatError(f"{source}: weight_versions must be a non-empty list of spans, got {entries!r}")
    versions: list[str] = []
    for i, span in enumerate(entries):
        ok = isinstance(span, dict) and isinstance(span.get("version"), str) and all(
            isinstance(span.get(k), int) and not isinstance(span.get(k), bool) for k in ("start", "end"))
        if not ok or span["start"] != len(versions) or span["end"] < span["start"]:
            raise WireFormatError(f"{source}: weight_versions[{i}] = {span!r} does not continue the spans at token "
                                  f"{len(versions)}")
        versions.extend([span["version"]] * (span["end"] - span["start"]))
    if len(versions) != num_tokens:
        raise WireFormatError(f"{source}: weight_versions cover {len(versions)} tokens of {num_tokens}")
    return versions


def generate_response_payload(
    *,
    rid: str,
    prompt_len: int,
    output_ids: Sequence[int],
    output_logprobs: torch.Tensor,
    finish_reason: Literal["stop", "length", "abort"],
    weight_version: str,
    routed_experts: torch.Tensor | None,
    e2e_latency: float = 0.0,
    version_spans: Sequence[tuple[str, int, int]] | None = None,
    num_retractions: int = 0,
) -> dict:
    """The body SGLang returns for one non-streaming ``/generate`` request with ``return_logprob``
    from a server launched with ``--skip-tokenizer-init`` (no ``text``): the fields and order of
    0.5.23's ``TokenizerManager._handle_batch_output`` (golden copies in
    ``tests/fixtures/sglang_0_5_23``). ``input_token_logprobs`` is empty: the default
    ``logprob_start_len`` starts scoring after the prompt. ``version_spans``: which version
    produced which output tokens (default: ``weight_version`` all of them); ``weight_version``
    is then the last span's."""
    spans = list(version_spans) if version_spans else [(weight_version, 0, len(output_ids))]
    meta = {
        "id": rid,
        "finish_reason": finish_reason_payload(finish_reason, output_ids),
        "prompt_tokens": prompt_len,
        "weight_version": str(spans[-1][0]),
        "num_retractions": num_retractions,
        "input_token_logprobs": [],
        "output_token_logprobs": output_token_logprobs_payload(output_logprobs, output_ids),
        "output_token_logprobs_length": len(output_ids),
        "reasoning_tokens": 0,
        "completion_tokens": len(output_ids),
        "cached_tokens": 0,
        "weight_versions": weight_versions_payload(spans),
    }
    if routed_experts is not None:
        meta["routed_experts"] = encode_routed_experts(routed_experts)
    meta["e2e_latency"] = e2e_latency
    # Written as the finished body is sent (``TokenizerManager._stream_one_response``,
    # ``managers/tokenizer_manager.py:2023-2029``): wall-clock seconds.
    meta["response_sent_to_client_ts"] = time.time()
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
    allow_abort: bool = False,
) -> GenerateResult:
    """Check and decode one ``/generate`` response body (already parsed from JSON).

    ``moe_layers``: as for :func:`decode_routed_experts` (the routes keep the MoE layers only);
    ``start_len``: the request's ``routed_experts_start_len``; ``allow_abort``: an aborted
    request (a pause in mode ``abort``) is a result with the tokens it had, possibly none
    (then without routes), instead of :class:`GenerationAborted`.

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
    reason = parse_finish_reason(meta.get("finish_reason"), source, allow_abort)
    output_ids = body.get("output_ids")
    if output_ids is not None and (not isinstance(output_ids, list)
                                   or not all(isinstance(t, int) and not isinstance(t, bool) for t in output_ids)):
        raise WireFormatError(f"{source}: output_ids must be a list of integers")
    if "output_token_logprobs" not in meta:
        raise WireFormatError(f"{source}: meta_info has no output_token_logprobs (was return_logprob sent?)")
    ids, logprobs = parse_output_token_logprobs(meta["output_token_logprobs"], output_ids, source=source)
    if not ids and reason != "abort":
        raise WireFormatError(f"{source}: the response has no generated token")
    token_versions = None
    if "weight_versions" in meta:
        token_versions = parse_weight_versions(meta["weight_versions"], len(ids), source=source)
    routes = None
    if want_routes and ids:
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
        token_versions=token_versions,
        routed_experts=routes,
        meta={k: meta[k] for k in ("prompt_tokens", "completion_tokens", "cached_tokens", "e2e_latency") if k in meta},
    )


def parse_finish_reason(value: Any, source: str, allow_abort: bool = False) -> Literal["stop", "length", "abort"]:
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "abort" and allow_abort and value.get("status_code") is None:
        return kind
    if kind == "abort":
        raise GenerationAborted(f"{source}: the server aborted the request ({value.get('message', 'no message')})")
    if kind not in ("stop", "length"):
        raise WireFormatError(f"{source}: finish_reason {value!r} is not a stop/length/abort object")
    return kind
