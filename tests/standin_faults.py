"""The CPU SGLang stand-in with fault injection and counters, for the tests.

    python tests/standin_faults.py --config configs/demo_task.yaml --port 30000 [stand-in options]

:class:`FaultInjectingServer` extends the product's
:class:`~megatron_rl.sglang_standin.server.ProtocolServer` (same command line, same
endpoints) with two test endpoints:

* ``POST /_test/fault`` ``{"kind": K, "times": n, "delay_s": s}`` makes the next ``n``
  ``/generate`` requests fail as K: ``http_500``, ``malformed_json`` (half a body),
  ``delay`` (sleep ``delay_s`` before answering), ``wrong_route_length`` (one position's
  routes missing), ``no_routes`` (as if launched without ``--enable-return-routed-experts``),
  ``stale_version`` (another weight version reported) or ``abort``; or the next ``n`` weight
  updates that carry tensors as ``stop_on_update`` (the server SIGSTOPs itself on receiving
  it: a server that hangs mid-push); or ``hang_scheduler``: the engine thread (the stand-in's
  scheduler) blocks until the fault is disarmed, while the HTTP front end answers what it
  answers alone (``/ping``). ``times`` 0 disarms.
* ``GET /_test/stats``: ``generate_requests`` (received), ``responses`` (answered 200),
  ``faults_fired`` by kind, the served ``weight_version``, ``sessions`` ended, the last
  session's report (``not_updated``, ``dropped``, ``skipped`` names, ``loaded`` count) and
  ``megatron_compiles`` (:func:`megatron_compiles`).
* ``GET /_test/calls``: the memory, generation-control and weight-update calls received, in
  order, each ``[path, tags]`` (``tags`` of a release or resume, else null), with one
  ``["/generate", n]`` for each run of ``n`` generate requests (the order of a colocated turn).
* ``GET /_test/weights``: the SHA-256 of every served tensor under its HF name, as the
  stand-in holds it now (pushed weights compared tensor by tensor).
* ``POST /_test/latency`` ``{"token_latency_s": s}``: the modelled decode time per token from
  now on (responses computed from then on decode at that pace: a test makes a batch's
  responses outlast a step, so that a weight push lands inside them); ``GET
  /_test/progress``: ``[produced, total]`` tokens of each response the clock is producing.

A fault that changes the answer is applied to the body the stand-in wrote, so the stand-in
itself stays as the product runs it.
"""

from __future__ import annotations

import asyncio
import base64
import gc
import hashlib
import json
import os
import signal
import sys
import threading
import time

import numpy as np
import torch
from aiohttp import web

from megatron_rl.checkpoint.mapping import split
from megatron_rl.sglang_standin.server import ProtocolServer, argument_parser, serve

FAULT_KINDS = ("http_500", "malformed_json", "delay", "wrong_route_length", "no_routes", "stale_version", "abort",
               "stop_on_update", "hang_scheduler")
"""Faults ``POST /_test/fault`` can arm."""


def megatron_compiles() -> bool | None:
    """Whether Megatron's fusions are ``torch.compile``'d in this process (its ``jit_fuser``
    wraps them as it is imported); None where Megatron is not imported."""
    if "megatron.core.transformer.moe.router" not in sys.modules:
        return None
    from megatron.core.transformer.moe.router import TopKRouter

    return hasattr(TopKRouter._apply_expert_bias, "_torchdynamo_orig_callable")


class FaultInjectingServer(ProtocolServer):
    """:class:`ProtocolServer` with ``/_test/fault`` and ``/_test/stats``."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.faults: dict[str, int] = {}
        """Armed fault kind -> requests it still applies to."""
        self.delay_s = 0.0
        """Sleep of the ``delay`` fault."""
        self.requests = 0
        self.responses = 0
        self.fired: dict[str, int] = {}
        self.calls: list[list] = []
        """What ``/_test/calls`` answers."""
        self.scheduler_free = threading.Event()
        """Cleared while ``hang_scheduler`` holds the engine thread."""
        self.scheduler_free.set()

    def app(self) -> web.Application:
        app = super().app()
        app.middlewares.append(self._log_call)
        app.add_routes([web.post("/_test/fault", self.arm_fault), web.get("/_test/stats", self.stats),
                        web.get("/_test/weights", self.weights), web.get("/_test/calls", self.call_log),
                        web.post("/_test/latency", self.set_latency), web.get("/_test/progress", self.progress)])
        return app

    @web.middleware
    async def _log_call(self, request: web.Request, handler):
        path = request.path
        if path == "/generate":
            if self.calls and self.calls[-1][0] == path:
                self.calls[-1][1] += 1
            else:
                self.calls.append([path, 1])
        elif path.endswith(("_memory_occupation", "_generation", "_weight_update")) or path.startswith("/update_weights"):
            body = await request.json() if request.body_exists and path.endswith("_occupation") else {}
            self.calls.append([path, body.get("tags") if isinstance(body, dict) else None])
        return await handler(request)

    async def call_log(self, request: web.Request) -> web.Response:
        """The calls received so far (see the module docstring)."""
        return web.json_response(self.calls)

    async def arm_fault(self, request: web.Request) -> web.Response:
        """Make the next ``times`` ``/generate`` requests fail as ``kind``."""
        b = await request.json()
        if b.get("kind") not in FAULT_KINDS:
            return self._result(False, f"unknown fault {b.get('kind')!r}; known: {list(FAULT_KINDS)}")
        self.faults[b["kind"]] = int(b.get("times", 1))
        self.delay_s = float(b.get("delay_s", self.delay_s))
        if b["kind"] == "hang_scheduler":
            if self.faults["hang_scheduler"] and self.scheduler_free.is_set():
                self.scheduler_free.clear()
                asyncio.ensure_future(self.host.call(self.scheduler_free.wait))
            elif not self.faults["hang_scheduler"]:
                self.scheduler_free.set()
        return self._result(True, f"armed {b['kind']} x{self.faults[b['kind']]}")

    async def set_latency(self, request: web.Request) -> web.Response:
        """The modelled decode time per token from now on."""
        self.batcher.token_latency_s = float((await request.json())["token_latency_s"])
        return self._result(True, f"token latency {self.batcher.token_latency_s:g}s")

    async def progress(self, request: web.Request) -> web.Response:
        """``[produced, total]`` tokens of each response being decoded."""
        now, latency = time.monotonic(), self.batcher.token_latency_s
        answer = []
        for r in list(self.batcher.decoding):
            sample, _, t0, _, _ = r.decoding
            total = len(sample.output_ids)
            answer.append([total if latency <= 0 else min(total, int((now - t0) / latency)), total])
        return web.json_response(answer)

    async def stats(self, request: web.Request) -> web.Response:
        """Request, response and fault counters, and the served weight version."""
        report = self.host.weights.last_session
        last = None if report is None else {"loaded": len(report.loaded), "not_updated": report.not_updated,
                                            "dropped": report.dropped, "skipped": report.skipped}
        return web.json_response({"generate_requests": self.requests, "responses": self.responses,
                                  "faults_fired": self.fired, "weight_version": self.weight_version,
                                  "sessions": self.counters.sessions, "last_session": last,
                                  "megatron_compiles": megatron_compiles()})

    async def weights(self, request: web.Request) -> web.Response:
        """SHA-256 of each served tensor by HF name (its bytes as the model holds them)."""
        def digests() -> dict[str, str]:
            served = self.host.weights
            out = {}
            for name, pairs in served.parts.items():
                weight, part = pairs[0]  # every pair holds the HF tensor whole (a stacked one: once per expert)
                tensor = split(weight, served.params[weight.megatron].detach(), served.model_cfg)[part]
                out[name] = hashlib.sha256(tensor.contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
            return out

        return web.json_response(await self.host.call(digests))

    def _take_fault(self, kinds=FAULT_KINDS[:-2]) -> str | None:
        for kind, left in self.faults.items():
            if left > 0 and kind in kinds:
                self.faults[kind] = left - 1
                self.fired[kind] = self.fired.get(kind, 0) + 1
                return kind
        return None

    async def _maybe_stop(self, carries_tensors: bool) -> None:
        if carries_tensors and self._take_fault(("stop_on_update",)):
            os.kill(os.getpid(), signal.SIGSTOP)  # resumed by the test's SIGCONT

    async def update_from_tensor(self, request: web.Request) -> web.Response:
        await self._maybe_stop(True)
        return await super().update_from_tensor(request)

    async def update_from_distributed(self, request: web.Request) -> web.Response:
        body = await request.json()
        await self._maybe_stop(bool(body.get("names")))
        return await super().update_from_distributed(request)

    async def generate(self, request: web.Request) -> web.Response:
        self.requests += 1
        fault = self._take_fault()
        if fault == "http_500":
            return web.json_response({"object": "error", "message": "injected HTTP 500", "code": 500}, status=500)
        if fault == "delay":
            await asyncio.sleep(self.delay_s)
        response = await super().generate(request)
        if response.status != 200:
            return response
        self.responses += 1
        if fault is None or fault == "delay":
            return response
        payload = json.loads(response.text)
        meta = payload["meta_info"]
        if fault == "wrong_route_length" and "routed_experts" in meta:
            model = self.host.model_cfg
            ids = np.frombuffer(base64.b64decode(meta["routed_experts"]), dtype=np.int32)
            meta["routed_experts"] = base64.b64encode(
                ids.reshape(-1, model.num_layers, model.moe_router_topk)[:-1].tobytes()).decode("ascii")
        elif fault == "no_routes":
            meta.pop("routed_experts", None)
        elif fault == "stale_version":
            meta["weight_version"] = f"stale-{meta['weight_version']}"
            for span in meta.get("weight_versions", []):
                span["version"] = f"stale-{span['version']}"
        elif fault == "abort":
            meta["finish_reason"] = {"type": "abort", "message": "injected abort"}
        elif fault == "malformed_json":
            text = json.dumps(payload)
            return web.Response(text=text[: len(text) // 2], content_type="application/json")
        return web.json_response(payload)


if __name__ == "__main__":
    code = serve(argument_parser().parse_args(), FaultInjectingServer)
    gc.freeze()  # as the stand-in's cli(): no final garbage collections at exit
    sys.exit(code)
