"""The stand-in's ``/pause_generation`` modes, ``/continue_generation`` and model-update lock, by
SGLang 0.5.23's rules (``megatron_rl/sglang_standin/pausing.py`` cites them; the request bodies
against SGLang's own definitions: ``test_sglang_conformance.py``).

A fake engine makes each token say which weights produced it: under version v a request's
token at output position i is ``10 * v + i`` with log-prob ``-v - i / 100``, and every
position a pass forwards is routed to experts ``(v, v + 1)``. With a modelled decode clock
(a response's tokens come one per ``LATENCY``), a pause lands inside a response; the weights
change (``/update_weight_version``) while paused, and the answer shows, token by token and
position by position, which pass produced what.
"""

import asyncio
from types import SimpleNamespace

import pytest
import torch
from aiohttp.test_utils import TestClient, TestServer

from megatron_rl.rollout.engine import RolloutSample
from megatron_rl.rollout.local.hf_prefix_cache import CachedPrefix
from megatron_rl.rollout.sglang.wire import decode_generate_response
from megatron_rl.sglang_standin.pausing import FLUSH_REFUSED
from megatron_rl.sglang_standin.server import ProtocolServer

LATENCY = 0.1
"""Seconds per token: a pause sent 0.35 s in lands after 3 of 24 tokens, with 2 s to spare under load."""
PROMPT = [3, 4, 5]
NEW = 24


class _Host:
    """Engine side of :class:`ProtocolServer` whose tokens, log-probs and routes name their version."""

    def __init__(self, kind: str = "hf"):
        self.engine_kind = kind
        self.model_cfg = SimpleNamespace(vocab_size=1000, max_position_embeddings=64, num_dense_layers=0)
        self.server = None
        self.engine = SimpleNamespace(generate=self._generate)
        self.weights = SimpleNamespace(begin=lambda: (True, "begun"))

    def _generate(self, prompts, params, *, return_routed_experts, seed, kv=None, control=None):
        v = int(self.server.engine_version)
        out = []
        for prompt in prompts:
            cached = None if kv is None else kv.lookup(prompt, need_routes=True)
            done = 0 if cached is None else len(cached.ids)
            ids = [10 * v + len(prompt) - len(PROMPT) + i for i in range(params.max_new_tokens)]
            fresh = torch.tensor([[v, v + 1]], dtype=torch.uint8).repeat(len(prompt) + len(ids) - 1 - done, 1, 1)
            routes = fresh if cached is None else torch.cat([cached.routes_CLK, fresh])
            if kv is not None:
                forwarded = (*prompt, *ids[:-1])
                kv.store(CachedPrefix(forwarded, [torch.zeros(1, len(forwarded), 1)], [torch.zeros(1, len(forwarded), 1)],
                                      routes))
            out.append(RolloutSample(prompt_ids=list(prompt), output_ids=ids, weight_version=v, routed_experts=routes,
                                     output_logprobs=torch.tensor([-v - i / 100 for i in range(len(ids))]),
                                     finish_reason="length"))
        return out

    async def call(self, fn, *args):
        return fn(*args)


def _server(kind: str = "hf") -> tuple[ProtocolServer, _Host]:
    host = _Host(kind)
    server = ProtocolServer(host, weight_version="1", token_latency_s=LATENCY)
    host.server = server
    return server, host


BODY = {"rid": "r", "input_ids": PROMPT, "return_logprob": True, "return_routed_experts": True,
        "sampling_params": {"max_new_tokens": NEW}}


def _decode(payload, *, abort=False):
    return decode_generate_response(payload, rid="r", prompt_len=len(PROMPT), want_routes=True, num_layers=1, topk=2,
                                    num_experts=8, source="test", allow_abort=abort)


async def _paused_mid_response(client, server, mode: str) -> asyncio.Future:
    """A request sent, paused in ``mode`` once a few of its tokens are out; returns the request."""
    request = asyncio.ensure_future(client.post("/generate", json=BODY))
    for _ in range(2000):
        if server.batcher.decoding:
            break
        await asyncio.sleep(0.005)
    await asyncio.sleep(LATENCY * 3.5)
    resp = await client.post("/pause_generation", json={"mode": mode})
    assert resp.status == 200 and (await resp.json())["status"] == "ok"
    return request


def _run(scenario):
    return asyncio.run(scenario())


def test_abort_answers_a_running_request_with_the_tokens_it_has():
    async def scenario():
        server, _ = _server()
        async with TestClient(TestServer(server.app())) as client:
            request = await _paused_mid_response(client, server, "abort")
            answer = await asyncio.wait_for(request, 10)
            waiting = asyncio.ensure_future(client.post("/generate", json=BODY))  # waits for the continue
            await asyncio.sleep(0.2)
            held = not waiting.done()
            server.batcher.token_latency_s = 0.0
            await client.post("/continue_generation", json={})
            later = await asyncio.wait_for(waiting, 10)
            return await answer.json(), held, await later.json()

    payload, held, later = _run(scenario)
    assert payload["meta_info"]["finish_reason"] == {"type": "abort", "message": "Aborted", "status_code": None,
                                                     "err_type": None}
    got = _decode(payload, abort=True)
    n = len(got.output_ids)
    assert 1 <= n < NEW and got.output_ids == [10 + i for i in range(n)]
    assert got.token_versions == ["1"] * n and got.routed_experts.shape[0] == len(PROMPT) + n - 1
    assert held and len(_decode(later).output_ids) == NEW


@pytest.mark.parametrize("mode", ["retract", "in_place"])
def test_a_request_kept_by_a_pause_continues_under_the_new_weights(mode):
    async def scenario():
        server, _ = _server()
        async with TestClient(TestServer(server.app())) as client:
            request = await _paused_mid_response(client, server, mode)
            flush = await client.post("/flush_cache")
            updated = server._updated({"weight_version": "2", "flush_cache": True}, "loaded")
            await client.post("/update_weight_version", json={"new_version": "2"})
            server.batcher.token_latency_s = 0.0  # the rest is answered as soon as it is computed
            await client.post("/continue_generation", json={})
            return await (await asyncio.wait_for(request, 10)).json(), flush.status, updated

    payload, flush_status, updated = _run(scenario)
    got = _decode(payload)
    n = got.token_versions.count("1")
    assert 1 <= n < NEW and got.token_versions == ["1"] * n + ["2"] * (NEW - n)
    # The tokens before the cut are the first pass's; the rest the new weights', continuing at n.
    assert got.output_ids == [10 + i for i in range(n)] + [20 + n + i for i in range(NEW - n)]
    assert torch.equal(got.output_logprobs[:n], torch.tensor([-1 - i / 100 for i in range(n)]))
    assert torch.equal(got.output_logprobs[n:], torch.tensor([-2 - i / 100 for i in range(NEW - n)]))
    positions = got.routed_experts[:, 0, 0].tolist()
    assert len(positions) == len(PROMPT) + NEW - 1
    cut = len(PROMPT) + n - 1  # positions before it were forwarded by the first pass
    if mode == "retract":  # the KV (and the routes SGLang captures with it) recomputed under version 2
        assert positions == [2] * len(positions)
        assert payload["meta_info"]["num_retractions"] == 1 and flush_status == 200 and updated == (True, "loaded")
    else:  # in place: the old KV stays, and with it the old positions' routes; flushing is refused
        assert positions == [1] * cut + [2] * (len(positions) - cut)
        assert flush_status == 400 and updated == (False, FLUSH_REFUSED)


def test_an_unpaused_weight_update_waits_for_the_running_requests():
    short = {**BODY, "sampling_params": {"max_new_tokens": 6}}

    async def scenario():
        server, _ = _server()
        async with TestClient(TestServer(server.app())) as client:
            request = asyncio.ensure_future(client.post("/generate", json=short))
            while not server.batcher.decoding:
                await asyncio.sleep(0.005)
            begin = asyncio.ensure_future(client.post("/begin_weight_update", json={}))
            await asyncio.sleep(LATENCY * 2)
            waited = not begin.done() and not request.done()
            await asyncio.wait_for(request, 10)
            await asyncio.wait_for(begin, 10)
            # Paused, the same call goes through while a request runs.
            second = asyncio.ensure_future(client.post("/generate", json=short))
            while not server.batcher.decoding:
                await asyncio.sleep(0.005)
            await client.post("/pause_generation", json={"mode": "in_place"})
            begin = await asyncio.wait_for(client.post("/begin_weight_update", json={}), 2)
            await client.post("/continue_generation", json={})
            await asyncio.wait_for(second, 10)
            return waited, begin.status

    waited, status = _run(scenario)
    assert waited and status == 200


def test_what_the_stand_in_refuses():
    async def scenario():
        server, _ = _server(kind="megatron")
        async with TestClient(TestServer(server.app())) as client:
            bad = await client.post("/pause_generation", json={"mode": "drain"})
            in_place = await client.post("/pause_generation", json={"mode": "in_place"})
            idle_continue = await client.post("/continue_generation", json={})
            return bad.status, in_place.status, (await in_place.json())["message"], idle_continue.status

    bad, in_place, message, idle_continue = _run(scenario)
    assert bad == 422 and in_place == 400 and "megatron engine keeps no KV cache" in message
    assert idle_continue == 200  # SGLang accepts a continue with nothing paused
