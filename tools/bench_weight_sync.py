"""Benchmark weight sync on CPU: a synthetic Qwen3-30B-A3B-shaped MoE pushed from an EP2 trainer
to the SGLang stand-in, per stage, next to a plain memory copy of the same bytes.

    python tools/bench_weight_sync.py [--layers 1] [--bucket-mb 512] [--modes tensor distributed] \\
        [--repeats 3] [--out tools/results/bench_weight_sync]

The model has Qwen3-30B-A3B's shapes (``configs/qwen3_30b_a3b.yaml``: hidden 2048, 32 query heads
x 128 / 4 KV heads, 128 experts of 768, vocabulary 151936, untied output) with ``--layers`` layers
(one layer is 1.25 GB of bf16, the two embeddings another 1.24 GB) and random weights. The
trainer is a 2-process gloo world (EP2, one torch thread per rank, as ``run_world`` gives a
2-core machine); the server is the CPU stand-in (``python -m megatron_rl.sglang_standin.server
--engine megatron``), started as a subprocess as the e2e tests do, with SGLang 0.5.23's rules
(sessions, ``SafeUnpickler``, loader rules). Each mode pushes ``--repeats`` times through
:class:`~megatron_rl.rollout.sglang.weight_sync.WeightSync` (the median push is reported).

Stages, timed on trainer rank 0 by wrapping the push's own stage functions (they overlap when
the push streams, so they need not add up to the whole): **gather** (each parameter whole on
rank 0: the EP peer's experts arrive over gloo), **rename** (HF names and layouts), **bucket**,
**serialize** (tensor mode: the payload; distributed: the announce), **send** (the update
requests and the broadcast, less the server's own work) and, from the stand-in's session
report, the server's **deserialize** / **receive** and **load** (writing into its model).
GB/s is the model's bytes over the stage's seconds. The limit: ``torch`` copying the same
bytes (rank 0's parameters, the largest share) into preallocated buffers, with one thread
(the run's) and with every core. Writes ``<out>/results.json`` and ``<out>/results.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from collections import defaultdict
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
BASE = REPO / "configs" / "demo_task.yaml"
SHAPES = REPO / "configs" / "qwen3_30b_a3b.yaml"
MODES = {"tensor": ("tensor", None), "distributed": ("distributed", None)}
"""Benchmarked modes: (``WeightSyncConfig.mode``, ``by_reference``)."""
SESSION_LINE = re.compile(r"stand-in: weight-update session: (?P<fields>.*)$")


def model_overrides(layers: int) -> list[str]:
    """Qwen3-30B-A3B's model section with ``layers`` layers, bf16, as dotted overrides."""
    model = yaml.safe_load(SHAPES.read_text())["model"]
    model.update(num_layers=layers, params_dtype="bfloat16", max_position_embeddings=128)
    return [f"model.{key}={value}" for key, value in model.items()]


def start_server(overrides: list[str], log: Path):
    """The stand-in, serving on a socket bound here (no other process can take its port first)."""
    from megatron_rl.rollout.sglang.control import probe_servers
    from megatron_rl.rollout.sglang.server import SERVER_ENV, ManagedServer

    cmd = [sys.executable, "-m", "megatron_rl.sglang_standin.server", "--config", str(BASE), "--port", "0",
           "--engine", "megatron", "--threads", "1", *overrides]
    log.unlink(missing_ok=True)
    server = ManagedServer(cmd, "http://127.0.0.1:0", env={**SERVER_ENV, "PYTHONWARNINGS": "ignore"}, log_path=log,
                           listen="127.0.0.1").start()
    try:
        probe_servers([server.url], timeout_s=30, wait_s=900, poll_s=1.0)
    except Exception:
        server.stop()
        raise
    return server


class StageClock:
    """Seconds spent in each stage, accumulated by wrapping the functions that do them."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)

    def wrap(self, stage: str, fn):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[stage] += time.perf_counter() - start
        return timed

    def wrap_iterator(self, stage: str, make_iterator):
        def timed(*args, **kwargs):
            iterator = iter(make_iterator(*args, **kwargs))
            while True:
                start = time.perf_counter()
                try:
                    item = next(iterator)
                except StopIteration:
                    self.seconds[stage] += time.perf_counter() - start
                    return
                self.seconds[stage] += time.perf_counter() - start
                yield item
        return timed


def instrument(sync, clock: StageClock) -> None:
    """Wrap the push's stage functions (rank 0 does every stage; gather is a collective)."""
    from megatron_rl.rollout.sglang import weight_sync, weight_transport

    weight_sync.gather_full_params = clock.wrap_iterator("gather", ORIGINAL["gather_full_params"])
    sync.name_map = clock.wrap("rename", ORIGINAL_NAME_MAP[id(sync)])

    class TimedBucketer(ORIGINAL["Bucketer"]):
        add = clock.wrap("bucket", ORIGINAL["Bucketer"].add)
        finish = clock.wrap("bucket", ORIGINAL["Bucketer"].finish)

    weight_sync.Bucketer = TimedBucketer
    weight_transport.flatten = clock.wrap("bucket", ORIGINAL["flatten"])
    transport = sync.transport
    if transport is None:
        return
    bound = {name: getattr(type(transport), name).__get__(transport) for name in ("entries", "post", "send")
             if hasattr(type(transport), name)}
    if "post" in bound:  # tensor mode: send is serialize then post
        transport.entries = clock.wrap("serialize", bound["entries"])
        transport.post = clock.wrap("send", bound["post"])
    else:
        transport.send = clock.wrap("send", bound["send"])


ORIGINAL: dict = {}
ORIGINAL_NAME_MAP: dict = {}


def server_report(log: Path, after: int) -> dict[str, float]:
    """The stand-in's last session report written after byte ``after`` of its log."""
    with log.open() as f:
        f.seek(after)
        lines = [m for line in f if (m := SESSION_LINE.search(line.strip()))]
    if not lines:
        raise SystemExit(f"no session report in {log}")
    return {k: float(v) for k, v in (item.split("=") for item in lines[-1]["fields"].split())}


def copy_gbps(tensors: list, threads: int, repeats: int = 3) -> float:
    """torch copying ``tensors`` into preallocated buffers (best of ``repeats``), GB/s."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    targets = [torch.empty_like(t) for t in tensors]
    total = sum(t.numel() * t.element_size() for t in tensors)
    best = float("inf")
    for _ in range(repeats + 1):  # the first pass touches the pages
        start = time.perf_counter()
        for dst, src in zip(targets, tensors):
            dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    torch.set_num_threads(before)
    return total / best / 1e9


def _rank(cfg_dict: dict, url: str, args: dict, log: str) -> dict:
    import torch
    import torch.distributed as dist

    from megatron_rl.config import RunConfig
    from megatron_rl.config_loading import from_dict
    from megatron_rl.parallel.cpu_platform import cpu_platform
    from megatron_rl.parallel.groups import model_parallel
    from megatron_rl.parallel.model import build_model
    from megatron_rl.rollout.sglang import weight_sync, weight_transport
    from megatron_rl.sections import ParallelConfig

    ORIGINAL.update(gather_full_params=weight_sync.gather_full_params, Bucketer=weight_sync.Bucketer,
                    flatten=weight_transport.flatten)
    cfg = from_dict(RunConfig, cfg_dict)
    parallel = from_dict(ParallelConfig, {"expert_model_parallel_size": 2})
    rank0 = dist.get_rank() == 0
    out: dict = {"threads": torch.get_num_threads()}
    with cpu_platform(), model_parallel(parallel, seed=1) as groups, torch.no_grad():
        model = build_model(cfg.model, parallel)
        plan = weight_sync.plan_gather(model, groups)
        out["model_bytes"] = sum(torch.Size(s).numel() * d.itemsize for s, d in plan.meta.values())
        if rank0:
            local = [p.detach() for p in model.parameters()]
            out["copy_bytes"] = sum(t.numel() * t.element_size() for t in local)
            out["copy_gbps_1"] = copy_gbps(local, 1)
            out["copy_gbps_all"] = copy_gbps(local, os.cpu_count() or 1)
            del local
        version = 0
        for mode in args["modes"]:
            sync_cfg = weight_sync.WeightSyncConfig(mode=MODES[mode][0], by_reference=MODES[mode][1], backend="gloo",
                                                    master_address="127.0.0.1", bucket_bytes=args["bucket_mb"] << 20,
                                                    timeout_s=1800)
            sync = weight_sync.WeightSync(model, groups, [url], sync_cfg, architecture="qwen3_moe",
                                          model_config=cfg.model)
            ORIGINAL_NAME_MAP[id(sync)] = sync.name_map
            pushes = []
            for _ in range(args["repeats"]):
                version += 1
                clock = StageClock()
                instrument(sync, clock)
                log_at = Path(log).stat().st_size if rank0 else 0
                dist.barrier()
                start = time.perf_counter()
                sync.sync(version)
                seconds = time.perf_counter() - start
                dist.barrier()
                if rank0:
                    pushes.append({"seconds": seconds, "stages": dict(clock.seconds),
                                   "server": server_report(Path(log), log_at)})
            sync.close()
            out[mode] = pushes
    return out


def stage_rows(push: dict, mode: str) -> list[tuple[str, float]]:
    """(stage, seconds) in push order; send is the client's wait less the server's own work."""
    stages, server = push["stages"], push["server"]
    serialize = stages.get("serialize", 0.0)
    server_work = server.get("decode_s", 0.0) + server.get("load_s", 0.0)
    rows = [("gather", stages.get("gather", 0.0)), ("rename", stages.get("rename", 0.0)),
            ("bucket", stages.get("bucket", 0.0)), ("serialize", serialize)]
    if MODES[mode][0] == "tensor":
        rows += [("send", stages.get("send", 0.0) - server_work),
                 ("deserialize (server)", server.get("decode_s", 0.0))]
    else:
        rows += [("send (broadcast)", stages.get("send", 0.0) - server.get("load_s", 0.0))]
    rows.append(("load (server)", server.get("load_s", 0.0)))
    return rows


def report(result: dict, args) -> str:
    gb = result["model_bytes"] / 1e9
    copy1, copy_all = result["copy_gbps_1"], result["copy_gbps_all"]
    lines = [
        f"Command: `python tools/bench_weight_sync.py --layers {args.layers} --bucket-mb {args.bucket_mb} "
        f"--modes {' '.join(args.modes)} --repeats {args.repeats}`",
        f"Machine: {os.cpu_count()} CPU cores, load average {result.get('load_start', float('nan')):.1f} at the start, "
        f"{result.get('load_end', float('nan')):.1f} at the end (1-minute), "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; model {gb:.2f} GB of bf16 "
        f"({args.layers} layer(s)); trainer ranks with {result['threads']} torch thread(s).",
        f"Limit: torch copy of {result['copy_bytes'] / 1e9:.2f} GB into preallocated buffers: "
        f"{copy1:.2f} GB/s with 1 thread, {copy_all:.2f} GB/s with {os.cpu_count()}.",
        "",
    ]
    for mode in args.modes:
        push = sorted(result[mode], key=lambda p: p["seconds"])[(len(result[mode]) - 1) // 2]
        whole = gb / push["seconds"]
        lines += [f"**{mode}** (the median push of {len(result[mode])}: "
                  + ", ".join(f"{p['seconds']:.2f}" for p in result[mode]) + " s)", "",
                  "| stage | s | GB/s | % of 1-thread copy |", "|---|---|---|---|"]
        for stage, seconds in stage_rows(push, mode):
            rate = gb / seconds if seconds > 0 else float("inf")
            lines.append(f"| {stage} | {seconds:.2f} | {rate:.2f} | {100 * rate / copy1:.0f}% |")
        lines += [f"| **whole push** | {push['seconds']:.2f} | {whole:.2f} | {100 * whole / copy1:.0f}% |", ""]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=1, help="decoder layers (1: 2.49 GB of bf16)")
    parser.add_argument("--bucket-mb", type=int, default=512, help="weight_sync_bucket_mb")
    parser.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    parser.add_argument("--repeats", type=int, default=3, help="pushes per mode (the median is reported)")
    parser.add_argument("--out", default=str(REPO / "tools" / "results" / "bench_weight_sync"))
    args = parser.parse_args(argv)
    if args.layers < 1 or args.repeats < 1 or args.bucket_mb < 1:
        parser.error("--layers, --repeats and --bucket-mb: at least 1")
    from megatron_rl.config import load_config
    from megatron_rl.config_loading import to_dict
    from megatron_rl.parallel.world import run_world

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    overrides = model_overrides(args.layers)
    cfg = load_config(BASE, overrides)
    log = out / "server.log"
    load_start = os.getloadavg()[0]
    server = start_server(overrides, log)
    try:
        result = run_world(_rank, 2, to_dict(cfg), server.url, vars(args), str(log), timeout_s=7200)[0]
    finally:
        server.stop()
    result.update(load_start=load_start, load_end=os.getloadavg()[0])
    (out / "results.json").write_text(json.dumps(result, indent=1))
    text = report(result, args)
    (out / "results.md").write_text(text)
    print(text, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
