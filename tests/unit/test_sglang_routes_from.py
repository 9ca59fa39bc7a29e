"""SGLang's ``routed_experts_start_len`` on our side of the wire (multi-turn rollouts ask each
turn only for the positions no earlier turn covered).

Per the released SGLang 0.5.23 wheel (``srt/managers/io_struct.py:264-268``,
``srt/managers/scheduler.py:3300-3318``): the response holds routes for positions
``[start_len, seqlen - 1)``, and a start outside ``[0, prompt tokens]`` is refused with a 400. The request carries the start,
the response decodes to that many rows (any other count is refused), and the CPU stand-in
refuses what SGLang refuses.
"""

import pytest
import torch

from megatron_rl.rollout.engine import SamplingParams
from megatron_rl.sglang_standin.server import ProtocolServer
from megatron_rl.rollout.sglang.wire import (
    WireFormatError,
    decode_generate_response,
    generate_payload,
    generate_response_payload,
)

L, K, E = 3, 2, 8


def _routes(n: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    return torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(n * L)]).reshape(n, L, K)


def test_the_request_carries_the_start_and_the_response_decodes_from_it():
    payload = generate_payload(rid="b-0.a0", prompt_ids=list(range(9)), params=SamplingParams(max_new_tokens=4),
                               return_routed_experts=True, routes_from=6)
    assert payload["routed_experts_start_len"] == 6
    # 9 prompt + 3 output tokens, routes from position 6: rows 6 .. 10.
    body = generate_response_payload(rid="b-0.a0", prompt_len=9, output_ids=[5, 6, 2],
                                     output_logprobs=torch.tensor([-0.1, -0.2, -0.3]), finish_reason="stop",
                                     weight_version="3", routed_experts=_routes(5))
    args = dict(rid="b-0.a0", prompt_len=9, want_routes=True, num_layers=L, topk=K, num_experts=E, source="sample 0")
    result = decode_generate_response(body, **args, start_len=6)
    assert torch.equal(result.routed_experts.long(), _routes(5))
    with pytest.raises(WireFormatError, match="routed_experts holds"):
        decode_generate_response(body, **args, start_len=0)


def test_the_stand_in_refuses_a_start_outside_the_prompt_as_sglang_does():
    assert ProtocolServer._routes_start({}, [1, 2, 3]) == 0
    assert ProtocolServer._routes_start({"routed_experts_start_len": 3}, [1, 2, 3]) == 3
    for bad in (-1, 4, "2", True):
        with pytest.raises(ValueError, match=r"routed_experts_start_len .* must be in \[0, 3\]"):
            ProtocolServer._routes_start({"routed_experts_start_len": bad}, [1, 2, 3])
