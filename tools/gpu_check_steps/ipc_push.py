"""Step ``ipc``: a CUDA-IPC weight push from the trainer's process to the SGLang stand-in in
another process on the same GPU, against a device-to-device copy of the same bytes.

The stand-in (``python -m megatron_rl.sglang_standin.server --engine megatron``: SGLang 0.5.23's
endpoints and rules, its model on the GPU) serves Qwen3-30B-A3B's shapes with 2 layers
(``configs/qwen3_30b_a3b.yaml``'s model section, as ``tools/bench_weight_sync.py`` builds it:
3.74 GB of bf16). The trainer builds the same model on the GPU and pushes it with
``WeightSync`` in tensor mode by reference: one weight-update session, buckets of 512 MiB
flattened on the GPU, each request carrying a CUDA IPC handle that names the GPU by UUID; the
stand-in opens the handle as a SGLang server does and loads the tensors into its model by
SGLang's loader rules; the push ends when ``/model_info`` reports the new version. One push warms
up, three are timed (median). The limit: ``torch`` copying the trainer's parameters into
preallocated buffers on the GPU (median of 5), the same bytes counted once.

Pass: the push reaches >= 50% of the copy's GB/s, and every push left no served tensor unwritten
(the stand-in's session report). The stand-in serves on a socket bound here and handed to it (no
other process can take its port first), and is known by a launch weight version made for this run
(``/server_info``).
"""

from __future__ import annotations

import os
import secrets
import statistics
import sys
from pathlib import Path

import torch

from gpu_check_steps.common import (
    MADE_MODELS,
    REPO,
    Context,
    Outcome,
    copy_gbps,
    device_world,
    gib,
    timed,
    verdict,
)

LAYERS, BUCKET_MB, PUSHES, TARGET = 2, 512, 3, 0.5
BASE = REPO / "configs" / "demo_task.yaml"


def model_overrides(ctx: Context) -> list[str]:
    """The served model as the stand-in's dotted overrides (the dry run: the tiny made model)."""
    from bench_weight_sync import model_overrides as qwen3_30b_a3b_shapes

    if not ctx.dry:
        return qwen3_30b_a3b_shapes(LAYERS)
    return [f"model.{k}={v}" for k, v in {**MADE_MODELS["tiny"], "params_dtype": "bfloat16"}.items()]


def standin_command(ctx: Context, port: int, version: str, overrides: list[str]) -> list[str]:
    return [sys.executable, "-m", "megatron_rl.sglang_standin.server", "--config", str(BASE), "--port", str(port),
            "--engine", "megatron", "--weight-version", version, *overrides]


def start_standin(ctx: Context, overrides: list[str], log: Path):
    """A healthy stand-in serving on a socket bound here (no other process can take its port first);
    returns the ``ManagedServer``.

    Raises:
        RuntimeError: it did not become healthy, or what answers is not the server started here.
    """
    from megatron_rl.rollout.sglang.control import request_json
    from megatron_rl.rollout.sglang.server import SERVER_ENV, ManagedServer

    version = f"gpu-check-{os.getpid()}-{secrets.token_hex(4)}"
    server = ManagedServer(standin_command(ctx, 0, version, overrides), "http://127.0.0.1:0",
                           env=SERVER_ENV, log_path=log, listen="127.0.0.1")
    try:
        server.start().wait_healthy(timeout_s=300)
        status, info = request_json("GET", server.url + "/server_info", timeout_s=10)
        if status == 200 and isinstance(info, dict) and info.get("weight_version") == version:
            return server
        raise RuntimeError(f"the stand-in did not start: {server.url} answers as another server")
    except BaseException:
        server.stop()
        raise


def unwritten_reports(log: Path) -> list[str]:
    """The stand-in's lines saying a session left served tensors unwritten."""
    return [line for line in log.read_text().splitlines() if "left" in line and "unwritten" in line]


def _trainer_config(overrides: list[str]):
    from megatron_rl.config import load_config

    return load_config(BASE, [*overrides, "parallel.expert_model_parallel_size=1", "parallel.world_size=1"],
                       world_size=1)


def run(ctx: Context) -> Outcome:
    from megatron_rl.parallel.model import build_model
    from megatron_rl.sglang_standin.server import argument_parser
    from megatron_rl.rollout.sglang.weight_sync import WeightSync, WeightSyncConfig, plan_gather
    from megatron_rl.sections import ParallelConfig

    overrides = model_overrides(ctx)
    argument_parser().parse_args(standin_command(ctx, 1, "v", overrides)[3:])  # the stand-in takes these flags
    cfg = _trainer_config(overrides)
    sync_cfg = WeightSyncConfig(mode="tensor", by_reference=True, bucket_bytes=BUCKET_MB << 20, timeout_s=120)
    log = ctx.scratch / "standin.log"
    server = None if ctx.dry else start_standin(ctx, overrides, log)
    try:
        with device_world(ctx) as groups, torch.no_grad():
            model = build_model(cfg.model, ParallelConfig())
            url = server.url if server else "http://127.0.0.1:1"
            sync = WeightSync(model, groups, [url], sync_cfg, architecture="qwen3_moe", model_config=cfg.model)
            push = sync.plan(plan_gather(model, groups))
            params = [p.detach() for p in model.parameters()]
            nbytes = sum(p.numel() * p.element_size() for p in params)
            copy = copy_gbps(ctx, params)
            if ctx.dry:
                return Outcome("dry", f"{push.buckets} bucket(s) planned for {nbytes} bytes; stand-in flags parsed; "
                               f"copy {copy:.1f} GB/s", {"buckets": push.buckets, "bytes": nbytes})
            seconds = [timed(ctx, lambda v=v: sync.sync(v))[0] for v in range(1, PUSHES + 2)][1:]
            sync.close()
    except BaseException:
        # The stand-in's side of a failed push is only in its own log: keep it in the check's.
        if log.exists():
            print("stand-in log, last lines:\n" + "\n".join(log.read_text().splitlines()[-40:]), flush=True)
        raise
    finally:
        if server is not None:
            server.stop()
    push_s = statistics.median(seconds)
    rate = nbytes / push_s / 1e9
    unwritten = unwritten_reports(log)
    figures = {"bytes": nbytes, "buckets": push.buckets, "push_s": seconds, "push_gbs": round(rate, 2),
               "copy_gbs": round(copy, 1), "share_of_copy": round(rate / copy, 4), "unwritten_reports": unwritten}
    ok = rate >= TARGET * copy and not unwritten
    headline = (f"{gib(nbytes)} GiB in {push.buckets} buckets by CUDA IPC: median push {push_s * 1e3:.1f} ms = "
                f"{rate:.1f} GB/s, {100 * rate / copy:.1f}% of a device copy ({copy:.0f} GB/s; target "
                f"{100 * TARGET:.0f}%); unwritten tensors reported: {len(unwritten)}")
    return Outcome(verdict(ctx, ok), headline, figures)
