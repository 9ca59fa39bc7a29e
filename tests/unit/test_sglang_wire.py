"""SGLang wire format: routes, log-probs, whole responses, sample ledger (weight payloads:
test_sglang_conformance.py, judged by SGLang's own serializer)."""

import base64

import numpy as np
import pytest
import torch

from megatron_rl.rollout.engine import SamplingParams
from megatron_rl.rollout.sglang.client import RolloutRequestError, SampleLedger
from megatron_rl.rollout.sglang.wire import (
    GenerationAborted,
    MissingRoutesError,
    WireFormatError,
    decode_generate_response,
    decode_routed_experts,
    encode_routed_experts,
    generate_payload,
    generate_response_payload,
    parse_output_token_logprobs,
)
from moe_routing.validate import RoutingDataError

L, K, E = 3, 2, 8


def _routes(n: int, num_experts: int = E, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(num_experts, generator=gen)[:K] for _ in range(n * L)]).reshape(n, L, K)


def _decode(payload, prompt_len=4, output_len=3, **kw):
    args = dict(prompt_len=prompt_len, output_len=output_len, num_layers=L, topk=K, num_experts=E, source="sample 5")
    return decode_routed_experts(payload, **{**args, **kw})


def test_routes_round_trip_into_the_compact_dtype():
    routes = _routes(6)  # prompt 4 + output 3 - 1
    payload = encode_routed_experts(routes)
    assert len(base64.b64decode(payload)) == 6 * L * K * 4  # int32 on the wire
    decoded = _decode(payload)
    assert decoded.dtype == torch.uint8 and torch.equal(decoded.long(), routes)
    wide = _routes(6, num_experts=300)
    assert decode_routed_experts(encode_routed_experts(wide), prompt_len=4, output_len=3, num_layers=L, topk=K,
                                 num_experts=300, source="s").dtype == torch.int16


def test_routes_start_len_and_declared_dtype():
    routes = _routes(4)
    assert torch.equal(_decode(encode_routed_experts(routes), start_len=2).long(), routes)
    narrow = base64.b64encode(routes.numpy().astype(np.uint8).tobytes()).decode()
    assert torch.equal(_decode(narrow, start_len=2, dtype_name="uint8").long(), routes)
    with pytest.raises(WireFormatError, match="unknown routed_experts_dtype"):
        _decode(narrow, dtype_name="float32")


def test_wrong_route_length_names_sample_and_counts():
    payload = encode_routed_experts(_routes(5))
    with pytest.raises(WireFormatError) as err:
        _decode(payload)
    message = str(err.value)
    assert "sample 5" in message and "holds 30 int32 values, expected 36" in message
    assert "6 positions (prompt 4 + output 3 - 1 - start 0) x 3 layers x top-2" in message


def test_out_of_range_and_repeated_ids_name_layer_and_token():
    routes = _routes(6)
    routes[4, 1, 0] = E
    with pytest.raises(RoutingDataError, match="sample 5: layer 2 token 4: expert id 8 is outside"):
        _decode(encode_routed_experts(routes))
    routes = _routes(6)
    routes[2, 0, 1] = -1
    with pytest.raises(RoutingDataError, match="layer 1 token 2: expert id -1"):
        _decode(encode_routed_experts(routes))
    routes = _routes(6)
    routes[3, 2, 1] = routes[3, 2, 0]
    with pytest.raises(RoutingDataError, match="layer 3 token 3: expert repeated"):
        _decode(encode_routed_experts(routes))


def test_routes_that_are_not_base64():
    with pytest.raises(WireFormatError, match="not valid base64"):
        _decode("###")
    with pytest.raises(WireFormatError, match="must be a base64 string"):
        _decode([1, 2, 3])


def test_output_token_logprobs():
    ids, lp = parse_output_token_logprobs([[-0.5, 7, None], [0.0, 3, "x"]], [7, 3], source="s")
    assert ids == [7, 3] and lp.dtype == torch.float32 and lp.tolist() == [-0.5, 0.0]
    assert parse_output_token_logprobs([[-1.0, 9, None]], None, source="s")[0] == [9]
    for entries, ids, match in [
        ([[-0.5, 8, None]], [7], "output token 0 is 7 but its log-prob entry names 8"),
        ([[float("nan"), 7, None]], [7], "log-prob nan"),
        ([[0.5, 7, None]], [7], "need a finite value <= 0"),
        ([[-0.5, 7, None]], [7, 8], "1 output_token_logprobs entries for 2 output_ids"),
        ([[-0.5]], [7], r"not a \[logprob, token_id, text\] triple"),
        ({"a": 1}, [7], "must be a list"),
    ]:
        with pytest.raises(WireFormatError, match=match):
            parse_output_token_logprobs(entries, ids, source="s")


def _response(**overrides):
    args = dict(rid="b-0.a0", prompt_len=4, output_ids=[5, 6, 2], output_logprobs=torch.tensor([-0.1, -0.2, -0.3]),
                finish_reason="stop", weight_version="3", routed_experts=_routes(6))
    return generate_response_payload(**{**args, **overrides})


def _decode_response(body, want_routes=True, rid="b-0.a0"):
    return decode_generate_response(body, rid=rid, prompt_len=4, want_routes=want_routes, num_layers=L, topk=K,
                                    num_experts=E, source="sample 0")


def test_whole_response_round_trip():
    body = _response()
    assert body["meta_info"]["finish_reason"] == {"type": "stop", "matched": 2}
    assert body["meta_info"]["output_token_logprobs"][1] == [pytest.approx(-0.2), 6, None]
    result = _decode_response(body)
    assert result.output_ids == [5, 6, 2] and result.finish_reason == "stop" and result.weight_version == "3"
    assert torch.allclose(result.output_logprobs, torch.tensor([-0.1, -0.2, -0.3]))
    assert torch.equal(result.routed_experts.long(), _routes(6))
    assert result.meta["completion_tokens"] == 3
    length = _decode_response(_response(finish_reason="length"), want_routes=False)
    assert length.finish_reason == "length" and length.routed_experts is None


def test_response_faults():
    with pytest.raises(WireFormatError, match="for request 'b-0.a0', expected 'b-0.a1'"):
        _decode_response(_response(), rid="b-0.a1")
    body = _response()
    body["meta_info"]["finish_reason"] = {"type": "abort", "message": "weights updating"}
    with pytest.raises(GenerationAborted, match="weights updating"):
        _decode_response(body)
    body = _response(routed_experts=None)
    with pytest.raises(MissingRoutesError, match="--enable-return-routed-experts"):
        _decode_response(body)
    body = _response()
    del body["meta_info"]["output_token_logprobs"]
    with pytest.raises(WireFormatError, match="was return_logprob sent"):
        _decode_response(body)
    with pytest.raises(WireFormatError, match="not an object with a meta_info"):
        _decode_response([_response()])
    body = _response()
    body["meta_info"]["finish_reason"] = None
    with pytest.raises(WireFormatError, match="finish_reason None"):
        _decode_response(body)


def test_generate_payload_fields():
    params = SamplingParams(temperature=0.7, top_p=0.9, top_k=0, max_new_tokens=5, stop_token_ids=(2,))
    body = generate_payload(rid="x.a0", prompt_ids=[1, 2], params=params, return_routed_experts=True, sampling_seed=11)
    assert body == {
        "rid": "x.a0", "input_ids": [1, 2], "return_logprob": True, "stream": False,
        "return_routed_experts": True, "routed_experts_start_len": 0,
        "sampling_params": {"temperature": 0.7, "top_p": 0.9, "top_k": -1, "max_new_tokens": 5,
                            "stop_token_ids": [2], "sampling_seed": 11},
    }
    plain = generate_payload(rid="y", prompt_ids=[3], params=SamplingParams(top_k=4), return_routed_experts=False)
    assert "return_routed_experts" not in plain and plain["sampling_params"]["top_k"] == 4


def test_ledger_keeps_the_first_result_and_checks_completeness():
    ledger = SampleLedger("b", 3)
    assert ledger.add(0, "first") and ledger.add(2, "c")
    assert not ledger.add(0, "again") and ledger.duplicates == 1
    with pytest.raises(RolloutRequestError, match=r"1 of 3 samples have no result: \[1\]"):
        ledger.results()
    ledger.add(1, "b")
    assert ledger.results() == ["first", "b", "c"]
    with pytest.raises(RolloutRequestError, match="unknown sample 3"):
        ledger.add(3, "x")
