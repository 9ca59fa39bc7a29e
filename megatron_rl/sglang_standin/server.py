"""The CPU SGLang stand-in: SGLang 0.5.23's HTTP protocol and rules, served by a local engine.

    python -m megatron_rl.sglang_standin.server --config configs/demo_cpu.yaml --port 30000 \\
        [--engine auto|hf|megatron] [--tp-size N] [--enable-deterministic-inference] [--max-batch N] \\
        [--weight-version V] [--token-latency-s S] [--long-tail SHARE] [--enable-memory-saver] [key=value ...]

SGLang cannot run on CPU machines; this stand-in lets the real client, weight sync and
launch path run there (CPU dry runs, ``configs/demo_sglang.yaml``, and the tests). It builds
the config's model (:mod:`~megatron_rl.sglang_standin.engine`) and serves it through
SGLang's endpoints, request and response fields (:mod:`~megatron_rl.rollout.sglang.wire`),
and rules, each next to its SGLang line (``sglang/srt/...``):

* weight updates only inside a ``begin_weight_update`` / ``end_weight_update`` session,
  payloads decoded by ``SafeUnpickler``'s rule, HF names loaded by the served architecture's
  loader rules, a crash where SGLang's scheduler would die
  (:mod:`~megatron_rl.sglang_standin.weights`);
* prompt scoring (``max_new_tokens`` 0 with ``return_logprob``: a distillation teacher's
  prompt log-probs and top-k, :mod:`~megatron_rl.sglang_standin.scoring`), weights served from
  the config's ``init_checkpoint`` from the start;
* log-probs ``log_softmax(logits / T)`` for sampled requests unless
  ``SGLANG_RETURN_ORIGINAL_LOGPROB`` is true in its environment, read once at start
  (``layers/sampler.py:82``, ``:186-196``, ``:273-323``; ``utils/common.py:1424-1442`` reads it);
* ``sampling_seed`` honoured only with ``--enable-deterministic-inference``, a request without
  one then seeded 42 (``sampling/sampling_batch_info.py:128``, ``:157-172``); without the flag
  every batch draws from a fresh seed;
* ``/health`` (= ``/health_generate``) a one-token generation, answered 200 once the engine
  has answered anything since the probe started, checked every second up to
  ``SGLANG_HEALTH_CHECK_TIMEOUT`` (20 s) and 503 after (``entrypoints/http_server.py:218``,
  ``:721-799``); ``/ping`` and ``/ready`` a flag check (``:714-718``, ``:2190-2199``);
* ``/server_info`` with the launch settings (``tp_size``, ``dp_size``,
  ``enable_deterministic_inference``, ``enable_memory_saver``, ...; ``:863-894``), answered
  by the scheduler (here the engine thread) between two batches (``managers/scheduler.py:
  2026-2036``), so a hung scheduler leaves it unanswered while ``/ping`` answers,
  ``/model_info`` with SGLang's keys (``:812-850``);
* memory release and resume with ``--enable-memory-saver`` (:mod:`~megatron_rl.sglang_standin.
  memory`); pauses in the three modes, the model-update lock, ``flush_cache`` refused while
  requests run, per-token weight versions (:mod:`~megatron_rl.sglang_standin.pausing`).

Requests are batched by :mod:`~megatron_rl.sglang_standin.batching`. On stop it prints one line
of what it did. Owns the endpoints and the command line.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import random
import sys
import time
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist
from aiohttp import web

from megatron_rl.rollout.engine import SamplingParams
from megatron_rl.rollout.sglang.sockets import inherited_socket
from megatron_rl.sglang_standin.batching import ContinuousBatcher
from megatron_rl.sglang_standin.body import json_body
from megatron_rl.sglang_standin.engine import EngineHost
from megatron_rl.sglang_standin.memory import MemoryOccupation, MemoryRoutes
from megatron_rl.sglang_standin.pausing import FLUSH_REFUSED, PauseRoutes, UpdateLock
from megatron_rl.sglang_standin.requests import bool_env, parse_generate
from megatron_rl.sglang_standin.scoring import answer_scoring, is_scoring
from megatron_rl.sglang_standin.weights import NO_SESSION, SchedulerCrash, decode_entries
from megatron_rl.rollout.sglang.weight_payload import FLATTENED_BUCKET
from megatron_rl.rollout.sglang.wire import SGLANG_VERSION, generate_response_payload


@dataclass
class ServerCounters:
    """What a stand-in did, for its closing log line."""

    generate_requests: int = 0
    """``/generate`` requests received (refused ones included)."""
    weight_updates: int = 0
    """Weight update calls that loaded tensors."""
    sessions: int = 0
    """Weight-update sessions ended."""


class ProtocolServer(MemoryRoutes, PauseRoutes):
    """The HTTP application over an :class:`~megatron_rl.sglang_standin.engine.EngineHost`.

    A subclass may extend it: :meth:`app` returns the application before it starts (more
    routes or middlewares can be added), and each endpoint is a method.

    Args:
        host: the engine.
        weight_version: version reported before any update (SGLang's default is "default").
        tp_size: the TP size it reports, and the entries a tensor update must carry.
        deterministic: ``--enable-deterministic-inference``: each request is generated alone,
            seeded by its ``sampling_seed`` (42 without one).
        batch_window_s: how long the first queued request waits for others to batch with.
        max_batch: most sequences per engine call.
        model_path: reported by ``/model_info``.
        token_latency_s: modelled GPU decode time per token
            (:class:`~megatron_rl.sglang_standin.batching.ContinuousBatcher`).
        memory: its memory occupation (``--enable-memory-saver``, ``--enable-weights-cpu-backup``).
        long_tail: share of requests that ignore their stop tokens (a long-tailed task, benchmarks).
    """

    def __init__(self, host: EngineHost, *, weight_version: str = "default", tp_size: int = 1,
                 deterministic: bool = False, batch_window_s: float = 0.01, max_batch: int = 256,
                 model_path: str = "", token_latency_s: float = 0.0, memory: MemoryOccupation | None = None,
                 long_tail: float = 0.0) -> None:
        self.host, self.model_path, self.weight_version, self.long_tail = host, model_path, weight_version, long_tail
        self.launch_version, self.tp_size, self.deterministic = weight_version, tp_size, deterministic
        self.counters = ServerCounters()
        self.startup_time = {"load_weight": 0.0, "kv_cache_allocation": 0.0, "scheduler_e2e": 0.0, "cuda_graph": {}}
        """``/server_info``'s ``startup_time`` (http_server.py:886): the scheduler's startup durations in
        seconds, SGLang's keys (observability/startup_time.py:11-28), set by :func:`serve`; a server
        started again reports new ones, which is how a client tells a restart."""
        self.batcher = ContinuousBatcher(self._engine_generate, window_s=batch_window_s, max_batch=max_batch,
                                         token_latency_s=token_latency_s, alone=deterministic,
                                         keeps_kv=(hf := getattr(host, "engine_kind", None) == "hf"), stops=hf)
        self.engine_version = weight_version
        """The version of the weights the engine computes with (set on the engine thread when a
        session ends: the HF replica follows the model only then)."""
        self.update_lock = UpdateLock()
        self.health_timeout_s = float(os.environ.get("SGLANG_HEALTH_CHECK_TIMEOUT", 20))
        self._seeds = random.Random()
        self.memory = memory or MemoryOccupation()
        self.running = asyncio.Event()
        """Set unless generation is paused."""
        self.running.set()

    def app(self) -> web.Application:
        """The aiohttp application (the batcher runs while it serves)."""
        app = web.Application(client_max_size=1 << 31)
        app.add_routes([
            web.post("/generate", self.generate), web.put("/generate", self.generate),
            web.get("/health", self.health), web.get("/health_generate", self.health),
            web.get("/ping", self.ping), web.get("/ready", self.ping),
            web.get("/model_info", self.model_info), web.get("/server_info", self.server_info),
            web.get("/flush_cache", self.flush_cache), web.post("/flush_cache", self.flush_cache),
            web.post("/begin_weight_update", self.begin_update), web.post("/end_weight_update", self.end_update),
            web.post("/update_weights_from_tensor", self.update_from_tensor),
            web.post("/update_weight_version", self.update_version),
            web.post("/init_weights_update_group", self.init_group),
            web.post("/update_weights_from_distributed", self.update_from_distributed),
            web.post("/destroy_weights_update_group", self.destroy_group),
            *self.memory_routes(), *self.pause_routes(),
        ])
        app.cleanup_ctx.append(self.batcher.running)
        return app

    def closing_line(self) -> str:
        """What this server did, for the log when it stops."""
        c = self.counters
        return (f"protocol server stopped: {c.generate_requests} generate requests, {self.batcher.batches} "
                f"batches, {c.weight_updates} weight updates, weight version {self.weight_version} "
                f"({c.sessions} weight-update sessions)")

    # ------------------------------------------------------------------ generation

    async def _engine_generate(self, prompts: list[list[int]], params: SamplingParams, want_routes: bool,
                               seed: int, kv, control) -> tuple[str, list]:
        def run() -> tuple[str, list]:  # on the engine thread, where the served version changes
            extra = {} if kv is None else {"kv": kv, "control": control}  # hf: keeps KV, stops between steps
            return self.engine_version, self.host.engine.generate(prompts, params, return_routed_experts=want_routes,
                                                                  seed=seed, **extra)

        return await self.host.call(run)

    def scheduler_idle(self) -> bool:
        """No request in the scheduler (queued ones ignored while paused: ``scheduler.py:5520``)."""
        return self.batcher.running_requests == 0 and (self.paused or self.batcher.queued == 0)

    @staticmethod
    def _routes_start(body: dict, prompt: list[int]) -> int:
        """``routed_experts_start_len``; SGLang refuses one outside [0, prompt tokens] with a 400
        (``scheduler.py:3300-3318``)."""
        start = body.get("routed_experts_start_len", 0)
        if not isinstance(start, int) or isinstance(start, bool) or not 0 <= start <= len(prompt):
            raise ValueError(f"routed_experts_start_len {start!r} must be in [0, {len(prompt)}] (the prompt tokens)")
        return start

    async def generate(self, request: web.Request) -> web.Response:
        """``POST /generate`` (non-streaming, ``input_ids`` only; ``max_new_tokens`` 0: prompt scoring)."""
        self.counters.generate_requests += 1
        started = time.monotonic()
        try:
            body = await json_body(request)
            if is_scoring(body):
                return await answer_scoring(self.host, body, self.weight_version, started)
            rid, prompt, params, want_routes, seed = parse_generate(
                body, self.host.model_cfg, deterministic=self.deterministic, seeds=self._seeds,
                default_rid=f"req-{self.counters.generate_requests}", long_tail=self.long_tail)
            start = self._routes_start(body, prompt)
        except ValueError as err:
            return _error(400, str(err))
        await self.running.wait()  # tokenizer_manager.py:938-939
        fault = self.memory.fault(("weights", "kv_cache", "cuda_graph"))
        if fault is not None:
            self._crash(SchedulerCrash(fault))
        try:
            async with self.update_lock.reading():  # tokenizer_manager.py:941
                sample = await self.batcher.submit(prompt, params, want_routes, seed)
        except Exception as err:  # noqa: BLE001 - reported like SGLang's internal errors
            return _error(500, f"{type(err).__name__}: {err}")
        routes = sample.routed_experts if sample.routed_experts is None else sample.routed_experts[start:]
        if routes is not None and self.host.model_cfg.num_dense_layers:
            # SGLang sends a column per decoder layer; it never writes the dense layers' (zeros).
            full = routes.new_zeros(routes.shape[0], self.host.model_cfg.num_layers, routes.shape[2])
            full[:, list(self.host.model_cfg.moe_layers)] = routes
            routes = full
        return web.json_response(generate_response_payload(
            rid=rid, prompt_len=len(prompt), output_ids=sample.output_ids, output_logprobs=sample.output_logprobs,
            finish_reason=sample.finish_reason, routed_experts=routes, e2e_latency=time.monotonic() - started,
            weight_version=self.weight_version, version_spans=sample.spans() or [(self.weight_version, 0, 0)],
            num_retractions=sample.retractions,
        ))

    async def health(self, request: web.Request) -> web.Response:
        """``GET /health`` and ``/health_generate``: a one-token generation (see the module docstring)."""
        tic = time.monotonic()
        probe = asyncio.ensure_future(self.batcher.submit([0], SamplingParams(temperature=0.0, max_new_tokens=1),
                                                          False, 0))
        try:
            while time.monotonic() < tic + self.health_timeout_s:
                await asyncio.sleep(1)
                if self.batcher.last_answer > tic:
                    return web.Response(status=200)
            return web.Response(status=503)
        finally:
            probe.cancel()

    async def ping(self, request: web.Request) -> web.Response:
        """``GET /ping`` and ``/ready``: the server is up (it is, once it listens)."""
        return web.Response(status=200)

    async def model_info(self, request: web.Request) -> web.Response:
        """``GET /model_info`` with SGLang's keys (http_server.py:812-850)."""
        return web.json_response({
            "model_path": self.model_path, "served_model_name": self.model_path, "tokenizer_path": None,
            "is_generation": True, "preferred_sampling_params": None, "weight_version": self.weight_version,
            "load_format": "auto", "reasoning_parser": None, "tool_call_parser": None, "disaggregation_mode": "null",
            "has_image_understanding": False, "has_audio_understanding": False,
            "model_type": self.host.architecture, "architectures": [f"megatron_rl stand-in ({self.host.architecture})"],
        })

    async def server_info(self, request: web.Request) -> web.Response:
        """``GET /server_info``: the launch settings SGLang reports there (http_server.py:863-894),
        with the scheduler's internal state, which SGLang asks the scheduler for
        (tokenizer_control_mixin.py:967-974) and the scheduler answers between two batches
        (scheduler.py:2026-2036, :1909): here the engine thread, between two engine calls. A
        hung engine thread leaves it unanswered while ``/ping`` still answers, as in SGLang."""
        internal_state = await self.host.call(dict)
        return web.json_response({
            "model_path": self.model_path, "tp_size": self.tp_size, "dp_size": 1,
            "enable_deterministic_inference": self.deterministic, "enable_return_routed_experts": True,
            "enable_memory_saver": self.memory.memory_saver,
            "enable_weights_cpu_backup": self.memory.weights_cpu_backup,
            "skip_tokenizer_init": True, "weight_version": self.launch_version, "version": SGLANG_VERSION,
            "startup_time": self.startup_time, "internal_states": [internal_state],
        })

    async def flush_cache(self, request: web.Request) -> web.Response:
        """``/flush_cache``: nothing to flush, refused while requests run (http_server.py:1027-1040)."""
        if not self.cache_flushable():
            return web.Response(text="Flush cache failed.\n", status=400)
        return web.Response(text="Cache flushed.\n")

    # ------------------------------------------------------------------ weights

    @staticmethod
    def _result(ok: bool, message: str) -> web.Response:
        return web.json_response({"success": ok, "message": message}, status=200 if ok else 400)

    def _updated(self, body: dict, message: str) -> tuple[bool, str]:
        """After a load: the version it sets, and the cache flush it asks for (SGLang's default),
        which fails the call while requests run (weight_updater.py:120-133)."""
        self.counters.weight_updates += 1
        if body.get("weight_version") is not None:
            self.weight_version = str(body["weight_version"])
        if body.get("flush_cache", True) and not self.cache_flushable():
            return False, FLUSH_REFUSED
        return True, message

    def _crash(self, err: BaseException) -> None:
        """SGLang's scheduler died: the whole server goes (scheduler.py:6370-6376)."""
        print(f"Scheduler hit an exception: {type(err).__name__}: {err}", flush=True)
        os._exit(1)

    async def begin_update(self, request: web.Request) -> web.Response:
        """``POST /begin_weight_update``."""
        async with self.updating():
            return self._result(*await self.host.call(self.host.weights.begin))

    async def end_update(self, request: web.Request) -> web.Response:
        """``POST /end_weight_update``; the stand-in logs what the session left unwritten."""
        async with self.updating():
            return await self._end_update()

    def _refresh(self) -> None:
        """On the engine thread: the engine follows the loaded weights, and computes as their version."""
        self.host.refresh()
        self.engine_version = self.weight_version

    async def _end_update(self) -> web.Response:
        ok, message = await self.host.call(self.host.weights.end)
        if ok:
            self.counters.sessions += 1
            await self.host.call(self._refresh)
            report = self.host.weights.last_session
            print(f"stand-in: weight-update session: {report.timings()}", flush=True)
            if report.not_updated or report.dropped:
                print(f"stand-in: weight-update session left {len(report.not_updated)} served tensors unwritten "
                      f"({report.not_updated[:3]}) and dropped {report.dropped[:3]}", flush=True)
        return self._result(ok, message)

    async def update_from_tensor(self, request: web.Request) -> web.Response:
        """``POST /update_weights_from_tensor``: session, then decode entry 0, then load (the
        body, a bucket's size, parsed off the event loop that answers every other request)."""
        async with self.updating():
            return await self._update_from_tensor(request)

    async def _update_from_tensor(self, request: web.Request) -> web.Response:
        body = await json_body(request)
        entries, load_format = body.get("serialized_named_tensors"), body.get("load_format")
        if not isinstance(entries, list) or not all(isinstance(e, str) for e in entries):
            return _error(400, "serialized_named_tensors must be a list of base64 strings")
        if load_format not in (None, FLATTENED_BUCKET):
            return self._result(False, f"load_format {load_format!r} is not supported by the stand-in")

        self._weights_mapped()

        def update() -> tuple[bool, str]:
            if self.host.weights.session is None:
                return False, NO_SESSION.format(call="update_weights_from_tensor")
            started = time.perf_counter()
            named = decode_entries(entries, self.tp_size, load_format)
            self.host.weights.session.decode_s += time.perf_counter() - started
            count = self.host.weights.load(named)
            return True, f"Success ({count} tensors)"

        try:
            ok, message = await self.host.call(update)
        except (SchedulerCrash, KeyError, ValueError) as err:
            self._crash(err)
        if ok:
            ok, message = self._updated(body, message)
        return self._result(ok, message)

    async def update_version(self, request: web.Request) -> web.Response:
        """``POST /update_weight_version`` ``{new_version, abort_all_requests}``."""
        body = await request.json()
        self.weight_version = str(body["new_version"])
        await self.host.call(setattr, self, "engine_version", self.weight_version)
        return web.json_response({"success": True, "message": f"Weight version updated to {body['new_version']}",
                                  "new_version": body["new_version"]})

    async def init_group(self, request: web.Request) -> web.Response:
        """``POST /init_weights_update_group``: join the trainer's group (gloo, one rank)."""
        from megatron_rl.rollout.sglang.weight_transport import init_custom_group

        b = await request.json()
        if b.get("backend", "nccl") != "gloo":
            return self._result(False, f"backend {b.get('backend', 'nccl')!r}: this CPU server only joins gloo groups")
        if self.tp_size != 1:
            return self._result(False, "the CPU stand-in joins a weight-update group with one rank: use --tp-size 1")
        name = b.get("group_name", "weight_update_group")
        # Joining blocks until the trainer joins too, so it runs off the event loop and the engine thread.
        group = await asyncio.to_thread(init_custom_group, "gloo", b["master_address"], int(b["master_port"]),
                                        int(b["world_size"]), int(b["rank_offset"]), name, timedelta(seconds=120))
        self.host.update_groups[name] = group
        return self._result(True, f"joined {name} as rank {b['rank_offset']} of {b['world_size']}")

    async def update_from_distributed(self, request: web.Request) -> web.Response:
        """``POST /update_weights_from_distributed``: session and group checked before the broadcast."""
        async with self.updating():
            return await self._update_from_distributed(request)

    async def _update_from_distributed(self, request: web.Request) -> web.Response:
        b = await request.json()
        name = b.get("group_name", "weight_update_group")
        self._weights_mapped()

        def update() -> tuple[bool, str]:
            if self.host.weights.session is None:
                return False, NO_SESSION.format(call="update_weights_from_distributed")
            group = self.host.update_groups.get(name)
            if group is None:
                return False, (f"Failed to receive weights: Group {name} not in {list(self.host.update_groups)}. "
                               "Please call `init_weights_update_group` first.")
            started = time.perf_counter()
            try:
                named = self.host.receive(group, b["names"], b["dtypes"], b["shapes"], b.get("load_format"))
            except ValueError as err:  # weight_updater.py:201-211: refused before any broadcast is joined
                return False, f"Failed to receive weights: {err}"
            self.host.weights.session.receive_s += time.perf_counter() - started
            try:
                count = self.host.weights.load(named)
            except (KeyError, ValueError) as err:
                return False, f"Failed to update parameter online: {err}. Please discard the whole weights."
            return True, f"Succeeded to update parameter online ({count} tensors)."

        ok, message = await self.host.call(update)
        if ok:
            ok, message = self._updated(b, message)
        return self._result(ok, message)

    async def destroy_group(self, request: web.Request) -> web.Response:
        """``POST /destroy_weights_update_group``."""
        name = (await request.json()).get("group_name", "weight_update_group")
        group = self.host.update_groups.pop(name, None)
        if group is None:
            return self._result(False, "The group to be destroyed does not exist.")
        dist.destroy_process_group(group)
        return self._result(True, f"destroyed {name}")


def _error(status: int, message: str) -> web.Response:
    """An error body as SGLang's HTTP server writes it."""
    return web.json_response({"object": "error", "message": message, "code": status}, status=status)


def argument_parser() -> argparse.ArgumentParser:
    """The stand-in's command line (``--config`` and ``--port`` required)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="run config whose model section is served")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--weight-version", default="default", help="version reported before any update")
    parser.add_argument("--tp-size", type=int, default=1, help="TP size reported in /server_info")
    parser.add_argument("--enable-deterministic-inference", action="store_true",
                        help="honour sampling_seed (each request generated alone), as SGLang's flag")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: leave torch's default)")
    parser.add_argument("--micro-batch-sequences", type=int, default=64)
    parser.add_argument("--engine", choices=("auto", "hf", "megatron"), default="auto",
                        help="hf: a transformers replica generates (real numerics); megatron: the model itself "
                             "(exact); auto: hf when it can serve the architecture")
    parser.add_argument("--max-batch", type=int, default=256, help="most requests per engine call")
    parser.add_argument("--token-latency-s", type=float, default=0.0,
                        help="model a GPU's decode: a response's tokens come one per this many seconds (benchmarks)")
    parser.add_argument("--long-tail", type=float, default=0.0, help="this share of requests ignore their stop "
                        "tokens and run to max_new_tokens (a long-tailed task; benchmarks)")
    parser.add_argument("--enable-memory-saver", action="store_true",
                        help="release and resume memory for real (else only the tags change), as SGLang's flag")
    parser.add_argument("--enable-weights-cpu-backup", action="store_true",
                        help="released weights come back as they were (else NaN until pushed again)")
    parser.add_argument("overrides", nargs="*", help="dotted config overrides, e.g. model.num_layers=2")
    return parser


def serve(args: argparse.Namespace, server_type: type[ProtocolServer] = ProtocolServer) -> int:
    """Build the engine that ``args`` ask for and serve it with ``server_type`` (a
    :class:`ProtocolServer` or a subclass) until SIGTERM/SIGINT; prints what it did on stop."""
    import torch

    from megatron_rl.parallel.cpu_platform import eager_fusions_environment

    for key, value in eager_fusions_environment().items():  # before Megatron is imported, as in the ranks
        os.environ.setdefault(key, value)
    # As the run reads it: a config that starts from a checkpoint takes its model section from it.
    # The trainer's rule on rollout.sglang.hf_architecture is the trainer's: a stand-in started
    # from a checkpoint serves that checkpoint's architecture.
    from megatron_rl.checkpoint.init_source import inspect_init_checkpoint
    from megatron_rl.config import load_config

    cfg = load_config(args.config, args.overrides, check_pushes=False)
    architecture = (inspect_init_checkpoint(cfg.init_checkpoint).hf.architecture if cfg.init_checkpoint
                    else cfg.rollout.sglang.hf_architecture)
    if args.threads:
        torch.set_num_threads(args.threads)
    original = bool_env("SGLANG_RETURN_ORIGINAL_LOGPROB")  # layers/sampler.py:82, read once
    began = time.perf_counter()
    host = EngineHost(cfg.model, architecture, cfg.seed, args.micro_batch_sequences, args.engine,
                      logprobs_after_temperature=not original, checkpoint=cfg.init_checkpoint)
    built = time.perf_counter()
    server = server_type(host, weight_version=args.weight_version, model_path=args.config, tp_size=args.tp_size,
                         deterministic=args.enable_deterministic_inference, max_batch=args.max_batch,
                         token_latency_s=args.token_latency_s, long_tail=args.long_tail,
                         memory=MemoryOccupation(args.enable_memory_saver, args.enable_weights_cpu_backup))
    server.startup_time.update(load_weight=built - began, scheduler_e2e=time.perf_counter() - began)
    sock = inherited_socket()  # bound by whoever started us (server.ManagedServer): --port is its port
    port = sock.getsockname()[1] if sock is not None else args.port
    try:
        print(f"protocol server (SGLang {SGLANG_VERSION} protocol) on http://{args.host}:{port}: {architecture}, "
              f"{host.engine_kind} engine, {'raw' if original else 'temperature-scaled'} log-probs", flush=True)
        where = {"sock": sock} if sock is not None else {"host": args.host, "port": args.port}
        web.run_app(server.app(), **where, print=None, handle_signals=True)
    finally:
        print(server.closing_line(), flush=True)
        host.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    """The command line: :func:`serve`, then no final garbage collections at exit (a 2.3 s stop -> 0.3 s)."""
    code = serve(argument_parser().parse_args(argv))
    gc.freeze()
    return code


if __name__ == "__main__":
    sys.exit(main())
