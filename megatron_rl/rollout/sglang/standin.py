"""The CPU SGLang stand-in: SGLang 0.5.23's HTTP protocol served by a local engine.

    python -m megatron_rl.rollout.sglang.standin --config configs/demo_cpu.yaml --port 30000 \\
        [--engine hf|megatron] [--weight-version default] [--max-batch N] [--token-latency-s S] [key=value ...]

SGLang cannot run on CPU machines; this stand-in lets the real client, weight sync and
launch path run there (CPU dry runs, ``configs/demo_sglang.yaml``, and the tests). It builds
the config's model in its own single-process gloo world (CPU platform, no parallelism)
and serves it through the same endpoints, request fields and response fields as SGLang
(:mod:`megatron_rl.rollout.sglang.wire` encodes them). The model it builds holds the
served weights; by default the HF engine (a transformers replica with its own numerics,
refreshed after every weight update's last bucket) generates, so clients see log-probs and
routes that differ from the trainer's as a real server's do; ``--engine megatron``
generates with the Megatron model itself (exact numerics). Endpoints: ``POST /generate``,
``GET /health``, ``GET /health_generate``, ``GET /model_info``, ``POST /flush_cache``,
``POST /update_weights_from_tensor`` (by-value payloads), ``POST /update_weight_version``,
and ``/init_weights_update_group``, ``/update_weights_from_distributed``,
``/destroy_weights_update_group`` over a gloo group (a ``nccl`` group is refused with
400). Weights may be named as a real SGLang server wants them (HF names of the Qwen3-MoE
conversion table, fused back here) or as
:func:`~megatron_rl.rollout.sglang.weight_sync.megatron_names` sends them.

Requests are batched by :mod:`~megatron_rl.rollout.sglang.standin_batching` (``--max-batch``,
``--token-latency-s``); every Megatron call runs on one dedicated thread, where the CPU
platform and the parallel state live. On stop it prints one line of what it did.
Owns the engine host, the endpoints and the command line; does not own the client, the
weight gathering or the batching.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from aiohttp import web

from megatron_rl.checkpoint.mapping import QWEN3_MOE, all_weights, fuse
from megatron_rl.parallel.comm import broadcast
from megatron_rl.rollout.engine import SamplingParams
from megatron_rl.rollout.sglang.standin_batching import ContinuousBatcher
from megatron_rl.rollout.sglang.wire import (
    SGLANG_VERSION,
    WireFormatError,
    deserialize_named_tensors,
    generate_response_payload,
)
from megatron_rl.sections import ModelConfig, ParallelConfig

_TOP_K_ALL = 1 << 30
"""SGLang's "no top-k" value (``-1`` on the wire is mapped to it)."""


class EngineHost:
    """A local engine over a Megatron model in a world of one, driven from one dedicated thread.

    Args:
        model_cfg: architecture to build.
        seed: initial weights.
        micro_batch_sequences: sequences per forward micro-batch (megatron engine).
        engine: hf (a transformers replica generates; Qwen3-MoE) or megatron (the model itself).
    """

    def __init__(self, model_cfg: ModelConfig, seed: int, micro_batch_sequences: int = 64,
                 engine: str = "hf") -> None:
        if engine not in ("hf", "megatron"):
            raise ValueError(f"engine must be hf or megatron, got {engine!r}")
        self.model_cfg = model_cfg
        self.engine_kind = engine
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")
        self._stack = contextlib.ExitStack()
        self._executor.submit(self._start, seed, micro_batch_sequences).result()
        self.update_groups: dict[str, dist.ProcessGroup] = {}
        # HF tensor name -> (its weight in the conversion table, its part index), and the
        # fused Megatron parameters still waiting for some of their HF parts.
        self.hf_parts = {hf: (w, i) for w in all_weights(QWEN3_MOE, model_cfg) for i, hf in enumerate(w.hf)}
        self.pending: dict[str, dict[int, torch.Tensor]] = {}

    def _start(self, seed: int, micro_batch_sequences: int) -> None:
        from megatron_rl.parallel.cpu_platform import cpu_platform
        from megatron_rl.parallel.groups import model_parallel
        from megatron_rl.parallel.model import build_model
        from megatron_rl.parallel.world import world_of_one
        from megatron_rl.rollout.local.embedded import EmbeddedEngine

        # The CPU platform's device rewriting is a thread-local torch mode: it must be
        # entered on the thread that runs every forward.
        self._stack.enter_context(world_of_one())
        self._stack.enter_context(cpu_platform())
        groups = self._stack.enter_context(model_parallel(ParallelConfig(), seed))
        self.model = build_model(self.model_cfg, ParallelConfig(), moe_enable_routing_replay=True)
        self.model.eval()
        if self.engine_kind == "hf":
            from megatron_rl.rollout.local.hf_engine import HFEngine

            self.engine = HFEngine(self.model, groups, architecture=QWEN3_MOE.name, model_config=self.model_cfg)
        else:
            self.engine = EmbeddedEngine(self.model, groups, micro_batch_sequences)

    async def call(self, fn, *args):
        """Run ``fn(*args)`` on the engine thread."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def load(self, named: list[tuple[str, torch.Tensor]], *, last: bool) -> int:
        """Load tensors named as Megatron (layout-free) or HF (Qwen3-MoE table) parameters.

        HF parts of a fused parameter (Q/K/V, gate/up) may arrive in different buckets;
        each is kept until its siblings arrive and then fused by the conversion table.
        Names and shapes are checked before anything is copied.

        Args:
            named: the bucket.
            last: the update's last bucket; no fused parameter may still be incomplete.
        """
        from megatron_rl.checkpoint.megatron_io import named_weights

        params = named_weights(self.model)  # parameters and the routers' expert bias
        whole = []
        try:
            for name, tensor in named:
                if name in params:
                    whole.append((name, tensor))
                    continue
                if name not in self.hf_parts:
                    raise ValueError(f"unknown parameter {name!r} (neither a layout-free Megatron name nor an HF name)")
                weight, part = self.hf_parts[name]
                if tuple(tensor.shape) != weight.hf_shapes[part]:
                    raise ValueError(f"{name}: shape {tuple(tensor.shape)}, the model needs {weight.hf_shapes[part]}")
                parts = self.pending.setdefault(weight.megatron, {})
                parts[part] = tensor
                if len(parts) == len(weight.hf):
                    whole.append((weight.megatron, fuse(weight, [parts[i] for i in range(len(parts))], self.model_cfg)))
                    del self.pending[weight.megatron]
            for name, tensor in whole:
                if tuple(tensor.shape) != tuple(params[name].shape):
                    raise ValueError(f"{name}: shape {tuple(tensor.shape)}, "
                                     f"the model needs {tuple(params[name].shape)}")
            if last and self.pending:
                raise ValueError(f"update ended with fused parameters missing parts: {sorted(self.pending)[:5]}")
        except ValueError:
            self.pending.clear()
            raise
        with torch.no_grad():
            for name, tensor in whole:
                params[name].copy_(tensor)
        if last and self.engine_kind == "hf":
            # The replica follows the model once the whole update has landed.
            self.engine.update_weights(self.engine.weight_version + 1)
        return len(named)

    def receive(self, group_name: str, names: list[str], dtypes: list[str], shapes: list[list[int]], last: bool) -> int:
        """Receive a bucket broadcast by the trainer's rank 0 and load it."""
        group = self.update_groups.get(group_name)
        if group is None:
            raise ValueError(f"no weight update group {group_name!r}; call /init_weights_update_group first")
        named = []
        for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
            tensor = torch.empty(shape, dtype=getattr(torch, dtype))
            broadcast(tensor, 0, group)
            named.append((name, tensor))
        return self.load(named, last=last)

    def close(self) -> None:
        """Leave the world and stop the thread."""
        self._executor.submit(self._stack.close).result()
        self._executor.shutdown()


@dataclass
class ServerCounters:
    """What a stand-in did, for its closing log line."""

    generate_requests: int = 0
    """``/generate`` requests received (refused ones included)."""
    weight_updates: int = 0
    """Weight update calls that loaded tensors."""


class ProtocolServer:
    """The HTTP application over an :class:`EngineHost`.

    A subclass may extend it: :meth:`app` returns the application before it starts (more
    routes or middlewares can be added), and each endpoint is a method.

    Args:
        host: the engine.
        weight_version: version reported before any update (SGLang's default is "default").
        batch_window_s: how long the first queued request waits for others to batch with.
        max_batch: most sequences per engine call (1: each request alone, so its sample depends
            on its own seed only, not on what it was batched with: reproducible runs).
        model_path: reported by ``/model_info``.
        token_latency_s: modelled GPU decode time per token
            (:class:`~megatron_rl.rollout.sglang.standin_batching.ContinuousBatcher`).
    """

    def __init__(self, host: EngineHost, *, weight_version: str = "default", batch_window_s: float = 0.01,
                 max_batch: int = 256, model_path: str = "", token_latency_s: float = 0.0) -> None:
        self.host, self.model_path, self.weight_version = host, model_path, weight_version
        self.counters = ServerCounters()
        self.batcher = ContinuousBatcher(self._engine_generate, window_s=batch_window_s, max_batch=max_batch,
                                         token_latency_s=token_latency_s)

    def app(self) -> web.Application:
        """The aiohttp application (the batcher runs while it serves)."""
        app = web.Application(client_max_size=1 << 31)
        app.add_routes([
            web.post("/generate", self.generate), web.put("/generate", self.generate),
            web.get("/health", self.health), web.get("/health_generate", self.health_generate),
            web.get("/model_info", self.model_info),
            web.get("/flush_cache", self.flush_cache), web.post("/flush_cache", self.flush_cache),
            web.post("/update_weights_from_tensor", self.update_from_tensor),
            web.post("/update_weight_version", self.update_version),
            web.post("/init_weights_update_group", self.init_group),
            web.post("/update_weights_from_distributed", self.update_from_distributed),
            web.post("/destroy_weights_update_group", self.destroy_group),
        ])
        app.cleanup_ctx.append(self.batcher.running)
        return app

    def closing_line(self) -> str:
        """What this server did, for the log when it stops."""
        c = self.counters
        return (f"protocol server stopped: {c.generate_requests} generate requests, {self.batcher.batches} "
                f"batches, {c.weight_updates} weight updates, weight version {self.weight_version}")

    # ------------------------------------------------------------------ generation

    async def _engine_generate(self, prompts: list[list[int]], params: SamplingParams, want_routes: bool,
                               seed: int) -> list:
        return await self.host.call(lambda: self.host.engine.generate(prompts, params,
                                                                      return_routed_experts=want_routes, seed=seed))

    def _parse(self, body: Any) -> tuple[str, list[int], SamplingParams, bool, int]:
        if not isinstance(body, dict) or not isinstance(body.get("input_ids"), list) or not body["input_ids"]:
            raise ValueError("the request needs a non-empty input_ids list (text prompts are not supported)")
        prompt = body["input_ids"]
        vocab, longest = self.host.model_cfg.vocab_size, self.host.model_cfg.max_position_embeddings
        if not all(isinstance(t, int) and 0 <= t < vocab for t in prompt):
            raise ValueError(f"input_ids must be token ids in [0, {vocab})")
        sp = body.get("sampling_params") or {}
        top_k = int(sp.get("top_k", -1))
        params = SamplingParams(
            temperature=float(sp.get("temperature", 1.0)), top_p=float(sp.get("top_p", 1.0)),
            top_k=0 if top_k in (-1, _TOP_K_ALL) else top_k, max_new_tokens=int(sp.get("max_new_tokens", 128)),
            stop_token_ids=tuple(sorted(int(t) for t in sp.get("stop_token_ids") or ())),
        )
        if params.temperature < 0 or not 0 < params.top_p <= 1 or params.top_k < 0 or params.max_new_tokens < 1:
            raise ValueError(f"bad sampling_params {sp}")
        if len(prompt) + params.max_new_tokens > longest:
            raise ValueError(f"prompt ({len(prompt)}) + max_new_tokens ({params.max_new_tokens}) exceeds {longest}")
        if body.get("stream"):
            raise ValueError("streaming is not supported by the protocol server")
        rid = str(body.get("rid") or f"req-{self.counters.generate_requests}")
        return rid, prompt, params, bool(body.get("return_routed_experts")), int(sp.get("sampling_seed") or 0)

    @staticmethod
    def _routes_start(body: dict, prompt: list[int]) -> int:
        """``routed_experts_start_len``; SGLang refuses one outside [0, prompt tokens] with a 400
        (``scheduler.py:3300-3318``)."""
        start = body.get("routed_experts_start_len", 0)
        if not isinstance(start, int) or isinstance(start, bool) or not 0 <= start <= len(prompt):
            raise ValueError(f"routed_experts_start_len {start!r} must be in [0, {len(prompt)}] (the prompt tokens)")
        return start

    async def generate(self, request: web.Request) -> web.Response:
        """``POST /generate`` (non-streaming, ``input_ids`` only)."""
        self.counters.generate_requests += 1
        started = time.monotonic()
        try:
            body = await request.json()
            rid, prompt, params, want_routes, seed = self._parse(body)
            start = self._routes_start(body, prompt)
        except ValueError as err:
            return _error(400, str(err))
        try:
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
            weight_version=self.weight_version,
        ))

    async def health(self, request: web.Request) -> web.Response:
        """``GET /health``: 200 once the engine is up (it is, once the server listens)."""
        return web.Response(status=200)

    async def health_generate(self, request: web.Request) -> web.Response:
        """``GET /health_generate``: a one-token greedy generation must succeed."""
        try:
            await self.batcher.submit([0], SamplingParams(temperature=0.0, max_new_tokens=1), False, 0)
        except Exception:  # noqa: BLE001 - any failure means unhealthy
            return web.Response(status=503)
        return web.Response(status=200)

    async def model_info(self, request: web.Request) -> web.Response:
        """``GET /model_info`` with SGLang's keys, plus the MoE sizes (extra keys)."""
        m = self.host.model_cfg
        return web.json_response({
            "model_path": self.model_path, "tokenizer_path": None, "is_generation": True,
            "weight_version": self.weight_version, "model_type": "megatron_rl_protocol_server",
            "architectures": ["MegatronGPTMoE"], "protocol_version": SGLANG_VERSION,
            "num_hidden_layers": m.num_layers, "num_experts_per_tok": m.moe_router_topk, "num_experts": m.num_experts,
        })

    async def flush_cache(self, request: web.Request) -> web.Response:
        """``/flush_cache``: there is no prefix cache to flush."""
        return web.Response(text="Cache flushed.\n")

    # ------------------------------------------------------------------ weights

    @staticmethod
    def _result(ok: bool, message: str) -> web.Response:
        return web.json_response({"success": ok, "message": message}, status=200 if ok else 400)

    def _updated(self, body: dict, count: int) -> web.Response:
        self.counters.weight_updates += 1
        if body.get("weight_version") is not None:
            self.weight_version = str(body["weight_version"])
        return self._result(True, f"Updated {count} tensors. Weight version: {self.weight_version}.")

    async def update_from_tensor(self, request: web.Request) -> web.Response:
        """``POST /update_weights_from_tensor`` (entry 0 of ``serialized_named_tensors``)."""
        body = await request.json()
        if body.get("load_format") not in (None, "direct"):
            return self._result(False, f"load_format {body.get('load_format')!r} is not supported here")
        entries = body.get("serialized_named_tensors")
        if not isinstance(entries, list) or not entries:
            return self._result(False, "serialized_named_tensors must be a non-empty list (one entry per TP rank)")
        try:
            count = await self.host.call(lambda: self.host.load(deserialize_named_tensors(entries[0]),
                                                                last=body.get("weight_version") is not None))
        except (WireFormatError, ValueError) as err:
            return self._result(False, str(err))
        return self._updated(body, count)

    async def update_version(self, request: web.Request) -> web.Response:
        """``POST /update_weight_version`` ``{new_version, abort_all_requests}``."""
        body = await request.json()
        self.weight_version = str(body["new_version"])
        return web.json_response({"success": True, "message": f"Weight version updated to {body['new_version']}",
                                  "new_version": body["new_version"]})

    async def init_group(self, request: web.Request) -> web.Response:
        """``POST /init_weights_update_group``: join the trainer's group (gloo only)."""
        from megatron_rl.rollout.sglang.weight_sync import init_custom_group

        b = await request.json()
        if b.get("backend", "nccl") != "gloo":
            return self._result(False, f"backend {b.get('backend', 'nccl')!r}: this CPU server only joins gloo groups")
        name = b.get("group_name", "weight_update_group")
        if name in self.host.update_groups:
            return self._result(False, f"weight update group {name!r} already exists")
        # Joining blocks until the trainer joins too, so it runs off the event loop and the engine thread.
        group = await asyncio.to_thread(init_custom_group, "gloo", b["master_address"], int(b["master_port"]),
                                        int(b["world_size"]), int(b["rank_offset"]), name, timedelta(seconds=120))
        self.host.update_groups[name] = group
        return self._result(True, f"joined {name} as rank {b['rank_offset']} of {b['world_size']}")

    async def update_from_distributed(self, request: web.Request) -> web.Response:
        """``POST /update_weights_from_distributed``: receive the announced bucket and load it."""
        b = await request.json()
        try:
            count = await self.host.call(self.host.receive, b.get("group_name", "weight_update_group"),
                                         b["names"], b["dtypes"], b["shapes"], b.get("weight_version") is not None)
        except (ValueError, KeyError) as err:
            return self._result(False, str(err))
        return self._updated(b, count)

    async def destroy_group(self, request: web.Request) -> web.Response:
        """``POST /destroy_weights_update_group``."""
        name = (await request.json()).get("group_name", "weight_update_group")
        group = self.host.update_groups.pop(name, None)
        if group is None:
            return self._result(False, f"no weight update group {name!r}")
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
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: leave torch's default)")
    parser.add_argument("--micro-batch-sequences", type=int, default=64)
    parser.add_argument("--engine", choices=("hf", "megatron"), default="hf",
                        help="hf: a transformers replica generates (real numerics); megatron: the model itself (exact)")
    parser.add_argument("--max-batch", type=int, default=256,
                        help="most requests per engine call (1: every sample depends on its own seed only)")
    parser.add_argument("--token-latency-s", type=float, default=0.0,
                        help="sleep this long per generated token of a batch (models a GPU's decode; benchmarks)")
    parser.add_argument("overrides", nargs="*", help="dotted config overrides, e.g. model.num_layers=2")
    return parser


def serve(args: argparse.Namespace, server_type: type[ProtocolServer] = ProtocolServer) -> int:
    """Build the engine that ``args`` ask for and serve it with ``server_type`` (a
    :class:`ProtocolServer` or a subclass) until SIGTERM/SIGINT; prints what it did on stop."""
    # As the run reads it: a config that starts from a checkpoint takes its model section from it.
    from megatron_rl.checkpoint.init_source import run_config_from_checkpoint

    cfg = run_config_from_checkpoint(args.config, args.overrides)
    if args.threads:
        torch.set_num_threads(args.threads)
    host = EngineHost(cfg.model, cfg.seed, args.micro_batch_sequences, args.engine)
    server = server_type(host, weight_version=args.weight_version, model_path=args.config,
                         max_batch=args.max_batch, token_latency_s=args.token_latency_s)
    try:
        print(f"protocol server (SGLang {SGLANG_VERSION} protocol) on http://{args.host}:{args.port}", flush=True)
        web.run_app(server.app(), host=args.host, port=args.port, print=None, handle_signals=True)
    finally:
        print(server.closing_line(), flush=True)
        host.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    return serve(argument_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
