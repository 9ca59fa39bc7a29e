"""The protocol server's modelled GPU decode time (``--token-latency-s``, benchmarks only).

A batch "decodes" (sleeps its latency) beside the batches after it, as SGLang's continuous
batching lets a request that arrives later decode alongside the running ones; a server
that held its batcher for the sleep would serialise requests that arrive a little apart
(two trainer ranks, a background thread) and model a GPU far slower than the latency says.
Checked by order of events, not by timing: the engine computes a second request while the
first one, whose modelled decode lasts minutes, is still unanswered.
"""

import asyncio
from types import SimpleNamespace

import torch
from aiohttp.test_utils import TestClient, TestServer

from megatron_rl.rollout.engine import RolloutSample
from megatron_rl.sglang_standin.server import ProtocolServer

MINUTES = 300.0
"""The first request's modelled decode time: far beyond anything the test waits for."""


class _FakeHost:
    """The engine side of :class:`ProtocolServer`: answers every prompt with tokens [1, 2]."""

    def __init__(self):
        self.model_cfg = SimpleNamespace(vocab_size=16, max_position_embeddings=64, num_dense_layers=0)
        self.calls = 0
        self.engine = SimpleNamespace(generate=self._generate)

    def _generate(self, prompts, params, *, return_routed_experts, seed):
        self.calls += 1
        return [RolloutSample(prompt_ids=list(p), output_ids=[1, 2], output_logprobs=torch.tensor([-0.5, -0.25]),
                              finish_reason="length", weight_version=0, routed_experts=None) for p in prompts]

    async def call(self, fn, *args):
        return fn(*args)


async def _until(condition, limit_s: float = 30.0) -> bool:
    for _ in range(int(limit_s / 0.01)):
        if condition():
            return True
        await asyncio.sleep(0.01)
    return condition()


def test_a_later_request_is_computed_while_an_earlier_batch_decodes():
    async def scenario():
        host = _FakeHost()
        server = ProtocolServer(host, token_latency_s=MINUTES / 2)  # 2 tokens: a 5-minute decode
        async with TestClient(TestServer(server.app())) as client:
            body = {"input_ids": [3, 4], "sampling_params": {"max_new_tokens": 2}}
            first = asyncio.ensure_future(client.post("/generate", json=body))
            assert await _until(lambda: host.calls == 1)
            second = asyncio.ensure_future(client.post("/generate", json={**body, "input_ids": [5]}))
            computed = await _until(lambda: host.calls == 2)
            unanswered = not first.done()
            first.cancel(), second.cancel()
        # Leaving the client stopped the server: the batches still "decoding" were cancelled.
        return computed, unanswered, len(server.batcher.decoding)

    computed, unanswered, left = asyncio.run(scenario())
    assert computed and unanswered and left == 0


def test_without_latency_the_answer_is_immediate():
    async def scenario():
        server = ProtocolServer(_FakeHost())
        async with TestClient(TestServer(server.app())) as client:
            resp = await client.post("/generate", json={"input_ids": [3], "sampling_params": {"max_new_tokens": 2}})
            return resp.status, await resp.json()

    status, payload = asyncio.run(scenario())
    assert status == 200 and payload["output_ids"] == [1, 2], payload


def test_the_long_tail_knob_lets_a_fixed_share_of_requests_run_to_the_cap():
    """``--long-tail``: the share of requests chosen by their seed ignore their stop tokens, the
    same requests every time (benchmarks of a long-tailed task, ``tools/bench_async.py``)."""
    import random

    from megatron_rl.sglang_standin.requests import parse_generate

    cfg = SimpleNamespace(vocab_size=16, max_position_embeddings=64)

    def stops(seed: int, share: float) -> tuple:
        body = {"input_ids": [3], "sampling_params": {"max_new_tokens": 8, "stop_token_ids": [2], "sampling_seed": seed}}
        return parse_generate(body, cfg, deterministic=False, seeds=random.Random(), default_rid="r",
                              long_tail=share)[2].stop_token_ids

    long = [seed for seed in range(2000) if stops(seed, 0.05) == ()]
    assert 60 <= len(long) <= 140 and all(stops(seed, 0.05) == () for seed in long)
    assert all(stops(seed, 0.0) == (2,) for seed in range(200))
