"""Wire conformance with SGLang 0.5.23 ``/generate`` responses written from SGLang's source.

The fixtures in ``tests/fixtures/sglang_0_5_23`` are response bodies as 0.5.23 builds them
(each names the files and functions it was written from: the HTTP server's generate
handler, the tokenizer manager's ``_handle_batch_output`` and logprob helpers, the
scheduler's default ``logprob_start_len``, the finish reasons' ``to_json``, the routed-
experts capturer and its base64 encoding, the weight-version spans, a retraction and an abort
by ``/pause_generation``), with the values a reader must decode from them. Shown: the client's decoder reads them to those values (routes compared with the
decoding SGLang itself documents: ``np.frombuffer(b64decode(s), np.int32)``); and the
stand-in's encoder writes a body with the same keys, in the same order, with the same
JSON types at every level, and the decoder reads what it writes. Their ``meta_info`` is also
checked against SGLang's own code, run where it can be and read where it cannot.
"""

import ast
import base64
import functools
import importlib.util
import json
import os
import types
from pathlib import Path
from typing import Any, Dict, List, Union

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


def _sglang_code(srt: Path, relative: str, names: tuple[str, ...], namespace: dict) -> dict[str, int]:
    """Run SGLang's own top-level definitions ``names`` of ``srt/relative`` in ``namespace`` (their modules
    do not import on CPU: schedule_batch reaches the GPU runtime); returns each one's first line."""
    tree = _parsed(srt / relative)
    found = {node.name: node for node in tree.body if getattr(node, "name", None) in names}
    assert sorted(found) == sorted(names), relative
    for name in names:  # in the order given: a base class first
        exec(compile(ast.Module([found[name]], []), f"{relative}:{found[name].lineno}", "exec"), namespace)
    return {name: node.lineno for name, node in found.items()}


@pytest.mark.parametrize("path", FIXTURES, ids=[p.stem for p in FIXTURES])
def test_the_fixtures_meta_info_is_what_sglangs_own_code_builds(path):
    """Issue 34: the fixtures were written by hand from SGLang's source. Their ``meta_info`` is checked
    here against SGLang 0.5.23's own code, run where it can be (the finish reasons' ``to_json``,
    ``add_weight_versions_to_meta_info``) and read at test time where it cannot (the first keys
    ``TokenizerManager._handle_batch_output`` writes, in order)."""
    srt = _sglang_srt()
    doc = _load(path)
    meta, want = doc["response"]["meta_info"], doc["decoded"]
    ns: dict = {"Union": Union, "List": List, "Dict": Dict, "Any": Any, "WeightVersionSpans": list}
    lines = _sglang_code(srt, "managers/schedule_batch.py",
                         ("BaseFinishReason", "FINISH_MATCHED_TOKEN", "FINISH_LENGTH", "FINISH_ABORT"), ns)
    lines.update(_sglang_code(srt, "utils/weight_versions.py", ("add_weight_versions_to_meta_info",), ns))
    finish = {"stop": lambda: ns["FINISH_MATCHED_TOKEN"](meta["finish_reason"]["matched"]),
              "length": lambda: ns["FINISH_LENGTH"](len(want["output_ids"])),
              "abort": lambda: ns["FINISH_ABORT"]()}[meta["finish_reason"]["type"]]()
    assert list(meta["finish_reason"].items()) == list(finish.to_json().items()), lines  # in SGLang's key order
    if meta["finish_reason"]["type"] == "stop":
        assert meta["finish_reason"]["matched"] == want["output_ids"][-1]
    built = {"weight_version": "launch"}
    spans = [types.SimpleNamespace(**span) for span in meta["weight_versions"]]
    ns["add_weight_versions_to_meta_info"](built, spans, len(want["output_ids"]))
    assert built == {"weight_version": meta["weight_version"], "weight_versions": meta["weight_versions"]}, lines
    assert [list(span) for span in built["weight_versions"]] == [list(span) for span in meta["weight_versions"]]
    # tokenizer_manager.py builds meta_info from a dict literal first (0.5.23: line 2507).
    handler = next(node for node in ast.walk(_parsed(srt / "managers" / "tokenizer_manager.py"))
                   if isinstance(node, ast.AsyncFunctionDef) and node.name == "_handle_batch_output")
    literal = next(node for node in ast.walk(handler) if isinstance(node, ast.Assign)
                   and ast.unparse(node.targets[0]) == "meta_info" and isinstance(node.value, ast.Dict))
    keys = [key.value for key in literal.value.keys]
    assert keys == ["id", "finish_reason", "prompt_tokens", "weight_version", "num_retractions"], literal.lineno
    assert list(meta)[:len(keys)] == keys
    assert meta["id"] == doc["request"]["rid"] and meta["prompt_tokens"] == len(doc["request"]["input_ids"])
