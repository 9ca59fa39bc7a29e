"""Benchmark every objective preset: loss + backward on ~1M packed tokens in ~4k sequences.

Times ``megatron_rl.algos.policy_loss`` (input checks on, as shipped) plus ``backward()``
for each preset, and compares it with the plainly written per-sequence loop reference that
the unit tests check it against (``tests/unit/test_algos_reference.py``). The reference
loops over sequences in Python, so it is timed on the first ``--ref-seqs`` sequences and
extrapolated linearly to the whole batch (its cost is linear in the number of sequences);
the output says so. Medians over ``--repeats`` runs after one warm-up run.

Usage (from the repository root; needs the test file, so run it from a checkout)::

    PYTHONPATH=. python tools/bench_objectives.py   # writes tools/bench_objectives_results.md
    PYTHONPATH=. python tools/bench_objectives.py --seqs 512 --out /tmp/quick.md
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from megatron_rl.algos import OBJECTIVE_PRESETS, TokenBatch, get_preset, policy_loss

REPO = Path(__file__).resolve().parents[1]
REFERENCE_FILE = REPO / "tests" / "unit" / "test_algos_reference.py"


def load_reference():
    """Imports the test module that holds ``make_batch`` and ``reference_loss``."""
    spec = importlib.util.spec_from_file_location("algos_reference", REFERENCE_FILE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def time_loss_and_backward(loss_fn, batch: dict, repeats: int) -> tuple[float, float]:
    """Median wall and process-CPU seconds of ``loss_fn(batch).backward()`` (after a warm-up).

    CPU time is what to compare on a shared machine: other processes stretch the wall
    clock, not the CPU time a single-threaded run spends.
    """
    wall, cpu = [], []
    for _ in range(repeats + 1):
        logprobs = batch["logprobs_T"].detach().clone().requires_grad_(True)
        start_wall, start_cpu = time.perf_counter(), time.process_time()
        loss_fn({**batch, "logprobs_T": logprobs}).backward()
        wall.append(time.perf_counter() - start_wall)
        cpu.append(time.process_time() - start_cpu)
    return statistics.median(wall[1:]), statistics.median(cpu[1:])


def head_of_batch(batch: dict, num_seqs: int) -> dict:
    """The first ``num_seqs`` sequences of a packed batch (tokens are in packed order)."""
    tokens = batch["seq_ids_T"] < num_seqs
    head = {k: v[tokens] for k, v in batch.items() if k.endswith("_T")}
    head.update(num_seqs=num_seqs, truncated_S=batch["truncated_S"][:num_seqs])
    return head


def load_average() -> str:
    """The 1-minute load average, to tell a quiet run from a contended one."""
    return f"{os.getloadavg()[0]:.2f}" if hasattr(os, "getloadavg") else "n/a"


def machine_info() -> str:
    cpu = platform.processor() or "unknown CPU"
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        lines = cpuinfo.read_text().splitlines()
        names = [line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")]
        cpu = f"{names[0]} x {len(names)}" if names else cpu
    threads = torch.get_num_threads()
    return (
        f"{cpu}; torch {torch.__version__}, {threads} threads; Python {platform.python_version()}"
    )


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, default=4096, help="sequences in the batch")
    parser.add_argument("--max-len", type=int, default=512, help="lengths uniform in [1, max-len]")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per measurement")
    parser.add_argument(
        "--ref-seqs", type=int, default=256, help="sequences to time the reference on"
    )
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch default)")
    parser.add_argument("--out", type=Path, default=REPO / "tools" / "bench_objectives_results.md")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    load_before = load_average()
    reference = load_reference()
    batch = reference.make_batch(0, num_seqs=args.seqs, max_len=args.max_len, dtype=torch.float32)
    ref_batch = head_of_batch(batch, min(args.ref_seqs, args.seqs))
    num_tokens, ref_tokens = batch["logprobs_T"].numel(), ref_batch["logprobs_T"].numel()
    print(
        f"{num_tokens} tokens in {args.seqs} sequences (float32); the reference is timed on "
        f"{ref_tokens} tokens in {ref_batch['num_seqs']} sequences and extrapolated linearly",
        flush=True,
    )
    rows = []
    names = OBJECTIVE_PRESETS.names()
    scale = num_tokens / ref_tokens
    for index, name in enumerate(names, 1):
        cfg = get_preset(name)
        lib_wall, lib_cpu = time_loss_and_backward(
            lambda b, cfg=cfg: policy_loss(cfg, TokenBatch(**b))[0], batch, args.repeats
        )
        ref_wall, ref_cpu = time_loss_and_backward(
            lambda b, cfg=cfg: reference.reference_loss(cfg, b),
            ref_batch,
            max(1, args.repeats // 2),
        )
        row = (name, lib_wall, lib_cpu, ref_wall * scale, ref_cpu * scale)
        rows.append(row)
        print(
            f"[{index:2d}/{len(names)}] {name:13s} wall {1e3 * lib_wall:7.1f} ms "
            f"({num_tokens / lib_wall / 1e6:5.2f} M tok/s), cpu {1e3 * lib_cpu:7.1f} ms | "
            f"reference wall {1e3 * row[3]:6.0f} ms, cpu {1e3 * row[4]:6.0f} ms | "
            f"speed-up wall {row[3] / lib_wall:5.1f}x, cpu {row[4] / lib_cpu:5.1f}x",
            flush=True,
        )
    write_table(args, rows, num_tokens, ref_batch, f"{load_before} before, {load_average()} after")


def write_table(
    args: argparse.Namespace, rows: list, num_tokens: int, ref_batch: dict, load: str
) -> None:
    """Writes the markdown results table (copied into the README by hand)."""
    ref_tokens = ref_batch["logprobs_T"].numel()
    lines = [
        "# Objective library benchmark (`tools/bench_objectives.py`)",
        "",
        f"Loss + backward of every preset on {num_tokens:,} packed tokens in {args.seqs:,} "
        f"sequences (lengths uniform in [1, {args.max_len}], float32, input checks on), "
        f"median of {args.repeats} runs after a warm-up. The per-sequence loop reference of "
        f"the unit tests was timed on the first {ref_batch['num_seqs']} sequences "
        f"({ref_tokens:,} tokens) and **extrapolated linearly** to the whole batch. Wall "
        "clock and process CPU time are both reported; on a machine shared with other jobs "
        "the CPU time of a single-threaded run is the stable one.",
        "",
        f"Machine: {machine_info()}; 1-minute load average {load} the run.",
        "",
        "| preset | wall (ms) | tokens/s (wall) | CPU (ms) | reference wall / CPU (ms) "
        "| speed-up wall | speed-up CPU |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, lib_wall, lib_cpu, ref_wall, ref_cpu in rows:
        lines.append(
            f"| {name} | {1e3 * lib_wall:.1f} | {num_tokens / lib_wall / 1e6:.2f} M "
            f"| {1e3 * lib_cpu:.1f} | {1e3 * ref_wall:.0f} / {1e3 * ref_cpu:.0f} "
            f"| {ref_wall / lib_wall:.1f}x | {ref_cpu / lib_cpu:.1f}x |"
        )
    args.out.write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    sys.exit(main())
