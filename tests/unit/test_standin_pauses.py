"""The stand-in's ``/pause_generation`` modes, ``/continue_generation`` and model-update lock, by
SGLang 0.5.23's rules (``megatron_rl/sglang_standin/pausing.py`` cites them; the request bodies
against SGLang's own definitions: ``test_sglang_conformance.py``).

A fake engine makes each token say which weights produced it: under version v a request's
token at output position i is ``10 * v + i`` with log-prob ``-v - i / 100``, and every
position a pass forwards is routed to experts ``(v, v + 1)``. With a modelled decode clock
(a response's tokens come one per ``LATENCY``), a pause lands inside a response; the weights
change (``/update_weight_version``) while paused, and the answer shows, token by token and
position by position, which pass produced what. A slower fake decodes one token per step in
a thread, checking its control between steps as the hf engine does, so a pause lands inside
an engine call.
"""

import asyncio
import dataclasses
import time
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


class _SteppingHost(_Host):
    """Computes each response one token per ``step_s`` on a thread of its own, checking the call's
    control between steps as the hf engine does (a stopped call returns every response cut after
    the step it was in)."""

    def __init__(self):
        super().__init__()
        self.model_cfg = SimpleNamespace(vocab_size=1000, max_position_embeddings=512, num_dense_layers=0)
        self.engine = SimpleNamespace(generate=self._decode)
        self.step_s, self.steps = STEP_S, 0

    def _decode(self, prompts, params, *, return_routed_experts, seed, kv=None, control=None):
        whole = self._generate(prompts, params, return_routed_experts=return_routed_experts, seed=seed, kv=kv)
        for n in range(1, params.max_new_tokens):
            time.sleep(self.step_s)
            self.steps += 1
            if control is not None and control.stopping:
                return [self._cut(sample, n, kv) for sample in whole]
        return whole

    @staticmethod
    def _cut(sample, n, kv):
        forwarded = (*sample.prompt_ids, *sample.output_ids[:n - 1])
        routes = sample.routed_experts[:len(forwarded)]
        if kv is not None:
            kv.store(CachedPrefix(forwarded, [torch.zeros(1, len(forwarded), 1)], [torch.zeros(1, len(forwarded), 1)],
                                  routes))
        return dataclasses.replace(sample, output_ids=sample.output_ids[:n], output_logprobs=sample.output_logprobs[:n],
                                   routed_experts=routes, finish_reason="abort")

    async def call(self, fn, *args):
        return await asyncio.to_thread(fn, *args)


STEP_S = 0.05
"""The stepping fake's decode step: its call of ``LONG`` tokens takes 20 s unless stopped."""
LONG = 400


def _server(kind: str = "hf", latency: float = LATENCY, host=None) -> tuple[ProtocolServer, _Host]:
    host = host or _Host(kind)
    server = ProtocolServer(host, weight_version="1", token_latency_s=latency)
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


async def _paused_inside_the_call(client, server, host, mode: str):
    """A long request sent, paused in ``mode`` while its engine call runs (step 3 or later); returns
    the request, the engine's step count when the server took the pause, and the pause's status."""
    long_body = {**BODY, "sampling_params": {"max_new_tokens": LONG}}
    request = asyncio.ensure_future(client.post("/generate", json=long_body))
    for _ in range(4000):
        if host.steps >= 3:
            break
        await asyncio.sleep(0.005)
    taken = []
    pause = server.batcher.pause
    server.batcher.pause = lambda m: (taken.append(host.steps), pause(m))
    resp = await asyncio.wait_for(client.post("/pause_generation", json={"mode": mode}), 60)
    return request, taken[0], resp.status


@pytest.mark.parametrize("latency", [LATENCY, 0.0])
def test_an_abort_pause_stops_the_engine_call_at_its_next_step(latency):
    """Before, the pause waited for the whole call (here 20 s). The request is answered with the tokens
    the call decoded before the stop, with the modelled clock or without (its steps were their clock)."""
    async def scenario():
        server, host = _server(latency=latency, host=_SteppingHost())
        async with TestClient(TestServer(server.app())) as client:
            request, taken, status = await _paused_inside_the_call(client, server, host, "abort")
            stopped = host.steps
            payload = await (await asyncio.wait_for(request, 60)).json()
            return taken, stopped, status, payload

    taken, stopped, status, payload = _run(scenario)
    assert status == 200 and stopped - taken <= 1 and stopped < LONG  # the step it was in, then no more
    assert payload["meta_info"]["finish_reason"]["type"] == "abort"
    got = _decode(payload, abort=True)
    assert got.output_ids == [10 + i for i in range(stopped)]


@pytest.mark.parametrize("latency", [LATENCY, 0.0])
@pytest.mark.parametrize("mode", ["retract", "in_place"])
def test_a_call_a_pause_stopped_is_continued_from_its_tokens_under_the_new_weights(mode, latency):
    """The tokens decoded before the stop count as produced, with the modelled clock or without: kept,
    and the rest computed after the continue under the new weights, by the rules of each mode. (With
    the clock they once counted as none, so a push never landed inside a response whose call it stopped.)"""
    async def scenario():
        server, host = _server(latency=latency, host=_SteppingHost())
        async with TestClient(TestServer(server.app())) as client:
            request, taken, status = await _paused_inside_the_call(client, server, host, mode)
            for _ in range(12000):  # until the call came back (cut), at most a minute
                if server.batcher.parked or request.done():
                    break
                await asyncio.sleep(0.005)
            stopped = host.steps
            host.step_s, server.batcher.token_latency_s = 0.0, 0.0  # the rest answered once computed
            await client.post("/update_weight_version", json={"new_version": "2"})
            await client.post("/continue_generation", json={})
            return taken, stopped, status, await (await asyncio.wait_for(request, 60)).json()

    taken, stopped, status, payload = _run(scenario)
    got = _decode(payload)
    n = got.token_versions.count("1")
    assert status == 200 and stopped - taken <= 1 and n == stopped
    assert got.token_versions == ["1"] * n + ["2"] * (LONG - n)
    assert got.output_ids == [10 + i for i in range(n)] + [20 + n + i for i in range(LONG - n)]
    positions = got.routed_experts[:, 0, 0].tolist()
    cut = len(PROMPT) + n - 1
    assert positions == ([2] * len(positions) if mode == "retract" else [1] * cut + [2] * (len(positions) - cut))


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
