"""Wire conformance with SGLang 0.5.23 ``/generate`` responses: golden bodies built by SGLang's own code.

The fixtures in ``tests/fixtures/sglang_0_5_23`` are response bodies as 0.5.23 builds them
(each names the files and functions it was written from: the HTTP server's generate
handler, the tokenizer manager's ``_handle_batch_output`` and logprob helpers, the
scheduler's default ``logprob_start_len``, the finish reasons' ``to_json``, the routed-
experts capturer and its base64 encoding, the weight-version spans, a retraction and an abort
by ``/pause_generation``), with the raw values they were built from, which a reader must decode
from them. Shown: each body is what SGLang's own code builds from those raw values (its scheduler-
and tokenizer-manager-side functions and methods, taken from the installed source at test time and
run: the modules do not import on CPU); the client's decoder reads them to those values (routes
compared with the decoding SGLang itself documents: ``np.frombuffer(b64decode(s), np.int32)``); and
the stand-in's encoder writes a body with the same keys, in the same order, with the same JSON types
at every level, and the decoder reads what it writes.
"""

import __future__
import ast
import asyncio
import base64
import dataclasses
import enum
import functools
import http
import importlib.util
import json
import logging
import os
import time
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from megatron_rl.rollout.sglang.wire import (
    decode_generate_response,
    generate_response_payload,
)

FIXTURES = sorted((Path(__file__).resolve().parents[1] / "fixtures" / "sglang_0_5_23").glob("*.json"))


def _load(path: Path) -> dict:
    return json.loads(path.read_text())


def _decode(doc: dict, body: dict):
    d, req = doc["decoded"], doc["request"]
    return decode_generate_response(
        body, rid=req["rid"], prompt_len=len(req["input_ids"]), want_routes=req["return_routed_experts"],
        num_layers=d["num_layers"], topk=d["topk"], num_experts=d["num_experts"], source="fixture",
        allow_abort=d["finish_reason"] == "abort",
    )


def _json_type_tree(value):
    """The JSON shape of a value: dict keys in order with their types, list element types."""
    if isinstance(value, dict):
        return {k: _json_type_tree(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_json_type_tree(value[0])] if value else []
    return "number" if isinstance(value, (int, float)) and not isinstance(value, bool) else type(value).__name__


def test_fixtures_cite_sglang_sources():
    assert len(FIXTURES) >= 2
    for path in FIXTURES:
        doc = _load(path)
        assert doc["sglang_version"] == "0.5.23"
        cited = " ".join(doc["source"])
        for where in ("http_server.py: generate_request", "tokenizer_manager.py: TokenizerManager._handle_batch_output",
                      "detokenizer_manager.py", "routed_experts.py"):
            assert where in cited, (path.name, where)


@pytest.mark.parametrize("path", FIXTURES, ids=[p.stem for p in FIXTURES])
def test_client_decodes_the_golden_response(path):
    doc = _load(path)
    got, want = _decode(doc, doc["response"]), doc["decoded"]
    assert got.output_ids == want["output_ids"] and got.finish_reason == want["finish_reason"]
    assert got.weight_version == want["weight_version"] and got.rid == doc["request"]["rid"]
    assert got.token_versions == want["token_versions"]
    assert torch.equal(got.output_logprobs, torch.tensor(want["logprobs"], dtype=torch.float32))
    if want["routes"] is None:
        assert got.routed_experts is None
        return
    sglang_side = np.frombuffer(base64.b64decode(doc["response"]["meta_info"]["routed_experts"]), np.int32)
    expected = torch.tensor(want["routes"])
    assert tuple(expected.shape) == tuple(want["routes_shape"])
    assert want["routes_shape"][0] == len(doc["request"]["input_ids"]) + len(want["output_ids"]) - 1
    assert torch.equal(torch.from_numpy(sglang_side.copy()).reshape(expected.shape), expected)
    assert torch.equal(got.routed_experts.long(), expected)


@pytest.mark.parametrize("path", FIXTURES, ids=[p.stem for p in FIXTURES])
def test_stand_in_writes_the_golden_schema(path):
    doc = _load(path)
    golden, want = doc["response"], doc["decoded"]
    routes = torch.tensor(want["routes"], dtype=torch.uint8) if want["routes"] is not None else None
    ours = generate_response_payload(
        rid=doc["request"]["rid"], prompt_len=len(doc["request"]["input_ids"]), output_ids=want["output_ids"],
        output_logprobs=torch.tensor(want["logprobs"]), finish_reason=want["finish_reason"],
        weight_version=want["weight_version"], routed_experts=routes, e2e_latency=0.01,
        version_spans=[(s["version"], s["start"], s["end"]) for s in golden["meta_info"]["weight_versions"]],
        num_retractions=want.get("num_retractions", 0),
    )
    assert list(ours) == list(golden)
    assert list(ours["meta_info"]) == list(golden["meta_info"])
    assert _json_type_tree(ours) == _json_type_tree(golden)
    meta, gold = ours["meta_info"], golden["meta_info"]
    for key in ("finish_reason", "prompt_tokens", "output_token_logprobs_length", "completion_tokens",
                "input_token_logprobs", "routed_experts", "weight_versions", "weight_version", "num_retractions"):
        assert meta.get(key) == gold.get(key), key
    back = _decode(doc, json.loads(json.dumps(ours)))
    assert back.output_ids == want["output_ids"] and back.token_versions == want["token_versions"]


def _sglang_srt() -> Path:
    spec = importlib.util.find_spec("sglang")
    if spec is None:
        if os.environ.get("CI"):
            raise RuntimeError("sglang is not installed: the README's test command installs tests/requirements-sglang.txt")
        pytest.skip("sglang is not installed (pip install --no-deps -r tests/requirements-sglang.txt)")
    return Path(spec.submodule_search_locations[0]) / "srt"


@functools.cache
def _parsed(path: Path) -> ast.Module:
    return ast.parse(path.read_text())


def _sglang_code(srt: Path, relative: str, names: tuple[str, ...], namespace: dict, within: str = "") -> dict[str, int]:
    """Run SGLang's own definitions ``names`` of ``srt/relative`` (top level, or the methods of class
    ``within``; a name may be a module-level assignment) in ``namespace`` (their modules do not import
    on CPU: schedule_batch reaches the GPU runtime, the rest triton through ``srt/utils``); returns each
    one's first line. Annotations stay unevaluated, as under the ``from __future__ import annotations``
    of tokenizer_manager.py: they name classes of modules that do not import here."""
    tree = _parsed(srt / relative)
    body = next(node.body for node in tree.body if getattr(node, "name", None) == within) if within else tree.body
    found = {_defined(node): node for node in body if _defined(node) in names}
    assert sorted(found) == sorted(names), (relative, within)
    for name in names:  # in the order given: a base class first
        exec(_compile([found[name]], relative), namespace)
    return {name: node.lineno for name, node in found.items()}


def _defined(node: ast.stmt) -> str | None:
    if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
        return node.targets[0].id
    return getattr(node, "name", None)


def _compile(statements: list, relative: str):
    return compile(ast.Module(statements, []), relative, "exec", flags=__future__.annotations.compiler_flag,
                   dont_inherit=True)


class BatchTokenIDOutput(types.SimpleNamespace):
    """What the scheduler sends the tokenizer manager with ``--skip-tokenizer-init`` (io_struct.py): the
    fields set below, no others (a read of another fails)."""


class GenerateReqInput(types.SimpleNamespace):
    """The request after ``_normalize_single_inputs`` (io_struct.py:569-576): no top log-probs, no
    token-id log-probs, no sampling mask; ``return_text_in_logprobs`` its default (:247)."""


HANDLER = ("_handle_batch_output", "_stream_one_response", "_handle_abort_finish_reason", "_release_lora_once",
           "_get_scheduler_first_token_time", "convert_logprob_style", "add_logprob_to_meta_info",
           "detokenize_logprob_tokens", "detokenize_top_logprobs_tokens")
"""``TokenizerManager``'s methods a ``/generate`` response passes through, from the scheduler's output to
the body ``generate_request`` yields (http_server.py answers ``orjson_response`` of it)."""


@functools.cache
def _tokenizer_manager(srt: Path) -> dict:
    """SGLang's ``TokenizerManager`` class holding its methods ``HANDLER``, ``ReqState`` and the request
    time stats, with what they call: SGLang's own where it is a function or class of its pure code, a
    stand-in where it is a server's runtime (``get_serving``, ``get_spec``: 0.5.23's defaults)."""
    # ``dataclasses`` looks a class's module up in ``sys.modules``: this one stands for it.
    # SGLang's dependencies (tests/requirements-sglang.txt), imported here: the module skips without them
    import orjson
    import pybase64

    ns: dict = {"__name__": __name__, "dataclasses": dataclasses, "dataclass": dataclasses.dataclass,
                "field": dataclasses.field, "Enum": enum.Enum, "time": time, "asyncio": asyncio, "torch": torch,
                "HTTPStatus": http.HTTPStatus, "pybase64": pybase64, "orjson": orjson,
                "BatchTokenIDOutput": BatchTokenIDOutput, "GenerateReqInput": GenerateReqInput,
                "BatchStrOutput": type("BatchStrOutput", (), {}),
                "BatchEmbeddingOutput": type("BatchEmbeddingOutput", (), {}),
                # arg_groups/fields/serving.py: batch_notify_size 16; no speculative decoding
                "get_serving": lambda: types.SimpleNamespace(batch_notify_size=16),
                "get_spec": lambda: types.SimpleNamespace(speculative_algorithm=None)}
    _sglang_code(srt, "observability/trace.py", ("TraceNullContext",), ns)
    _sglang_code(srt, "disaggregation/utils.py", ("DisaggregationMode",), ns)
    _sglang_code(srt, "observability/req_time_stats.py", ("global_diff_realtime_monotonic", "convert_time_to_realtime",
                                                          "ReqTimeStatsBase", "APIServerReqTimeStats"), ns)
    _sglang_code(srt, "managers/io_struct.py", ("unwrap_from_pickle",), ns)
    _sglang_code(srt, "utils/json_response.py", ("ORJSON_RESPONSE_OPTIONS", "dumps_json"), ns)
    _sglang_code(srt, "beam_search/output.py", ("try_build_beam_search_out_dict",), ns)
    _sglang_code(srt, "utils/weight_versions.py", ("add_weight_versions_to_meta_info",), ns)
    _sglang_code(srt, "managers/tokenizer_manager.py", ("ReqState",), ns)
    _sglang_code(srt, "managers/tokenizer_manager.py", HANDLER, ns, within="TokenizerManager")
    ns["TokenizerManager"] = type("TokenizerManager", (), {name: ns.pop(name) for name in HANDLER})
    return ns


def _routes_as_the_capturer_returns(srt: Path, doc: dict):
    """The routes tensor the scheduler hands the tokenizer manager for the fixture's request: SGLang's
    ``BaseHostCache`` (its dtype) holds each forwarded token's routes at that token's KV slot (written
    as ``on_forward_end`` does, state_capturer/base.py), and ``BaseTopkCapturer.get_topk`` takes the
    request's rows, ``[routed_experts_start_len (0 by default, io_struct.py:268), seqlen - 1)``
    (batch_result_processor.py: ``_maybe_collect_routed_experts``). The fixture's routes are the
    forwarded tokens' (every one but the last): a row too many or too few changes what it returns."""
    want, req = doc["decoded"], doc["request"]
    if want["routes"] is None:
        return None
    ns: dict = {"torch": torch, "logger": logging.getLogger("sglang"), "_GB": 1 << 30,
                # pool_host/common.py's alloc_with_host_register less the CUDA registration of pinned memory
                # (its allocator object, read by nothing else, is not needed)
                "HostTensorAllocator": lambda: None,
                "ALLOC_MEMORY_FUNCS": {"cpu": lambda dims, dtype, device, pin_memory, allocator: torch.empty(dims, dtype=dtype)}}
    _sglang_code(srt, "state_capturer/base.py", ("get_tensor_size_bytes", "BaseHostCache"), ns)
    _sglang_code(srt, "state_capturer/base.py", ("get_topk",), ns, within="BaseTopkCapturer")
    forwarded = torch.tensor(want["routes"])
    seqlen = len(req["input_ids"]) + len(want["output_ids"])
    slots = torch.arange(2 * seqlen - 1, -1, -2, dtype=torch.int32)[:seqlen]  # a paged pool's slots: not in order
    capturer = types.SimpleNamespace(host_cache=ns["BaseHostCache"](
        2 * seqlen, want["num_layers"], want["topk"], name="routed_experts", device="cpu"))
    capturer.host_cache.buffer[slots[:len(forwarded)].long()] = forwarded.to(capturer.host_cache.buffer.dtype)
    pool = types.SimpleNamespace(req_to_token=slots[None])
    return ns["get_topk"](capturer, req_pool_idx=0, seqlen=seqlen, req_to_token_pool=pool, start_len=0)


def _weight_version_spans(srt: Path, output_ids: list, token_versions: list):
    """The spans the scheduler sends for a finished request whose tokens came from ``token_versions``:
    ``record_weight_version_events`` at each version change (as ``Scheduler.record_weight_version_change``
    calls it, managers/scheduler.py), ``compute_weight_version_spans`` at the end (output_streamer.py),
    both SGLang's, from utils/weight_versions.py."""
    import msgspec  # SGLang's dependency (tests/requirements-sglang.txt), as above

    ns: dict = {"dataclasses": dataclasses, "__name__": __name__, "msgspec": msgspec}
    _sglang_code(srt, "utils/weight_versions.py", ("WeightVersionSpan", "WeightVersionEvent",
                                                   "record_weight_version_events", "compute_weight_version_spans"), ns)
    req = types.SimpleNamespace(output_ids=[], weight_version_events=[])
    for t, token in enumerate(output_ids):
        if t and token_versions[t] != token_versions[t - 1]:
            ns["record_weight_version_events"]([req], old_version=token_versions[t - 1])
        req.output_ids.append(token)
    return ns["compute_weight_version_spans"](req.weight_version_events, current_version=token_versions[-1],
                                              num_output_tokens=len(output_ids))


def _response_as_sglang_builds_it(srt: Path, doc: dict, finish_reason: dict) -> dict:
    """The body SGLang's tokenizer manager answers the fixture's request with: ``_handle_batch_output``
    (0.5.23: tokenizer_manager.py:2480) run on the scheduler's ``BatchTokenIDOutput`` holding the
    fixture's raw values (output ids with their log-probs, no input log-prob: ``logprob_start_len``
    defaults to the prompt's length; each token's weight version as the scheduler's spans; the routes
    as the capturer returns them), while ``_stream_one_response`` (:1946) waits for it, as
    ``generate_request`` does, and yields the body. The manager holds only what these read (0.5.23's
    defaults: no metrics, no LoRA, no request dumps); an attribute they read that it lacks fails."""
    ns = _tokenizer_manager(srt)
    req, want = doc["request"], doc["decoded"]
    routes = _routes_as_the_capturer_returns(srt, doc)
    recv_obj = BatchTokenIDOutput(
        rids=[req["rid"]], time_stats=None, customized_info=None, beam_search_output=None,
        finished_reasons=[finish_reason], prompt_tokens=[len(req["input_ids"])],
        retraction_counts=[want.get("num_retractions", 0)], output_ids=[want["output_ids"]],
        input_token_logprobs_val=[[]], input_token_logprobs_idx=[[]],
        output_token_logprobs_val=[want["logprobs"]], output_token_logprobs_idx=[want["output_ids"]],
        reasoning_tokens=[0], completion_tokens=[len(want["output_ids"])], cached_tokens=[0],
        weight_versions=[_weight_version_spans(srt, want["output_ids"], want["token_versions"])],
        routed_experts=None if routes is None else [routes])
    obj = GenerateReqInput(rid=req["rid"], return_logprob=req["return_logprob"], top_logprobs_num=0,
                           token_ids_logprob=None, return_text_in_logprobs=False, return_sampling_mask=False,
                           stream=False, log_metrics=True, lora_path=None)
    manager = ns["TokenizerManager"]()
    manager.__dict__.update(
        enable_metrics=False, skip_tokenizer_init=True, tokenizer=None, incremental_streaming_output=False,
        enable_lora=False, dump_requests_folder=None, crash_dump_folder=None,
        config_value={"weight_version": "default"}.__getitem__,  # arg_groups/fields/serving.py
        request_logger=types.SimpleNamespace(log_finished_request=lambda obj, out, request: None),
        request_metrics_exporter_manager=types.SimpleNamespace(exporter_enabled=lambda: False))

    async def answer():
        time_stats = ns["APIServerReqTimeStats"]()
        time_stats.set_created_time()  # as _tokenize_one_request does when the request arrives
        state = ns["ReqState"](out_list=[], finished=False, event=asyncio.Event(), obj=obj, time_stats=time_stats)
        manager.rid_to_state = {req["rid"]: state}
        body = asyncio.ensure_future(anext(manager._stream_one_response(obj=obj, state=state, request=None)))
        await manager._handle_batch_output(recv_obj)
        return await body

    return json.loads(ns["dumps_json"](asyncio.run(answer())))  # what orjson_response sends


@pytest.mark.parametrize("path", FIXTURES, ids=[p.stem for p in FIXTURES])
def test_the_fixtures_are_what_sglangs_own_code_builds(path):
    """Issue 34: the fixtures were written by hand from SGLang's source. Each is the body SGLang 0.5.23's
    own code builds from the fixture's raw values: the finish reasons' ``to_json`` (schedule_batch.py),
    the weight-version spans and the routes as its scheduler makes them, and its tokenizer manager's
    handler with the logprob helpers (the ``[logprob, id, null]`` triples), ``add_weight_versions_to_meta_info``
    and the routes' base64, all taken from the installed source at test time and run. Two values are
    clock readings, not built from the fixture: ``e2e_latency`` and ``response_sent_to_client_ts``."""
    srt = _sglang_srt()
    doc = _load(path)
    golden, want = doc["response"], doc["decoded"]
    assert want["finish_reason"] != "stop" or want["output_ids"][-1] in doc["request"]["sampling_params"]["stop_token_ids"]
    ns: dict = {}
    _sglang_code(srt, "managers/schedule_batch.py",
                         ("BaseFinishReason", "FINISH_MATCHED_TOKEN", "FINISH_LENGTH", "FINISH_ABORT"), ns)
    finish = {"stop": lambda: ns["FINISH_MATCHED_TOKEN"](want["output_ids"][-1]),  # the stop token matched
              "length": lambda: ns["FINISH_LENGTH"](len(want["output_ids"])),
              "abort": lambda: ns["FINISH_ABORT"]()}[want["finish_reason"]]()
    built = _response_as_sglang_builds_it(srt, doc, finish.to_json())
    assert list(golden) == list(built)
    assert list(golden["meta_info"]) == list(built["meta_info"])  # SGLang's keys, in its order
    assert golden["output_ids"] == built["output_ids"]
    for key, value in built["meta_info"].items():
        if key in ("e2e_latency", "response_sent_to_client_ts"):
            assert isinstance(golden["meta_info"][key], float) and isinstance(value, float), key
        else:  # as JSON text: key order and number types at every level too (33.0 is not 33)
            assert json.dumps(golden["meta_info"][key]) == json.dumps(value), key
