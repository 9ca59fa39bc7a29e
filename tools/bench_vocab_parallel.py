"""Benchmark: vocab-parallel log-prob + entropy against gather-then-log-softmax, TP2 on CPU.

Both approaches start from this rank's bf16 vocabulary shard ``[T, V / 2]`` (the dtype real
training hands over) and compute, per token, the target's log-prob and the full entropy,
then backpropagate ``sum(w * logprobs)`` into the shard (the entropy is a detached metric,
as by default; ``--entropy-grad`` backpropagates ``sum(entropy)`` too):

- **vocab-parallel**: ``megatron_rl.parallel.vocab_parallel.vocab_parallel_logprobs_entropy``
  with ``--chunk-tokens`` tokens per chunk.
- **gather**: all-gather the shards into the full ``[T, V]`` bf16 logits (the local shard
  spliced in so autograd reaches it, as Megatron's gather does), then ``log_softmax`` in
  fp32, gather the targets, entropy ``-sum(exp(logp) * logp)``, backward. Buffers are
  released as soon as autograd no longer needs them, so the baseline is not inflated.

Memory method: every (approach, V, T) runs in a fresh 2-process gloo world. After the timed
runs, each rank runs the step once more while a thread samples the process's anonymous
resident memory (``RssAnon`` in ``/proc/self/status``, every millisecond); peak extra memory
= the largest sample - the value just before the step, with the inputs already allocated.
Anonymous memory is where every CPU tensor lives (torch's CPU allocator does not cache, and
glibc returns blocks this large to the OS on free, so a reused buffer cannot hide a peak); it
includes autograd's saved tensors, gloo's buffers and the shard's gradient. Unlike total RSS
(``VmHWM``) it does not move when the kernel evicts or faults in pages of the shared
libraries, which happens on a machine shared with other jobs. The peaks measured here last
far longer than a millisecond (they are GiB-sized buffers that are filled and read). Each
world first calibrates the method on a 1 GiB tensor that is allocated, filled and freed
while sampling; the output reports what it measured. Reported memory is the larger of the
two ranks.

Time: wall time and CPU time (``time.process_time``, all threads of the rank's process) of
one forward + backward, the slower rank, median of ``--repeats`` runs after one warm-up
(``--large-repeats`` for sizes with ``T * V`` of at least 1e9). On a machine shared with
other jobs the wall time includes waiting for a core (and for the other rank in each
collective); the CPU time is the work done and is the steadier comparison there.

The gather approach is skipped (and marked so) where its peak would not fit in the available
memory: extrapolated from the first measured size's bytes per logit of the full ``[T, V]``,
or, before any measurement, from ``PRIOR_GATHER_BYTES_PER_LOGIT``.

Usage (from the repository root)::

    PYTHONPATH=. python tools/bench_vocab_parallel.py   # writes the results next to itself
    PYTHONPATH=. python tools/bench_vocab_parallel.py --vocab 32768 --tokens 4096 --out /tmp/q.md
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import torch
import torch.distributed as dist

from megatron_rl.parallel.vocab_parallel import vocab_parallel_logprobs_entropy
from megatron_rl.parallel.world import run_world

REPO = Path(__file__).resolve().parents[1]
TP = 2
GIB = 2**30
CALIBRATION_BYTES = GIB
# Gather peak per logit of the full [T, V] before anything is measured (fp32 log-softmax kept
# for backward, plus its fp32 gradient and the scattered target gradient, or the entropy's
# two fp32 temporaries; bf16 copies on top). Measured: ~12.
PRIOR_GATHER_BYTES_PER_LOGIT = 14.0


@dataclass(frozen=True)
class Job:
    """One measurement: an approach at one size, run in its own world."""

    approach: str
    vocab: int
    tokens: int
    chunk_tokens: int
    repeats: int
    entropy_grad: bool


def rss_anon() -> int:
    """This process's anonymous resident memory in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return 1024 * int(line.split()[1])
    raise RuntimeError("RssAnon not in /proc/self/status")


class AnonPeak:
    """Context manager: peak ``RssAnon`` above its value on entry, sampled by a thread."""

    def __init__(self, interval_s: float = 0.001):
        self.interval_s = interval_s
        self.baseline = self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.peak = max(self.peak, rss_anon())

    def __enter__(self) -> "AnonPeak":
        self.baseline = self.peak = rss_anon()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_anon())

    @property
    def extra(self) -> int:
        return self.peak - self.baseline


def calibrate() -> int:
    """Measured peak extra memory of a 1 GiB tensor allocated, filled and freed."""
    with AnonPeak() as peak:
        block = torch.ones(CALIBRATION_BYTES // 4, dtype=torch.float32)
        del block  # freed before the sampler stops: only the sampling can see it
    return peak.extra


def make_inputs(job: Job, rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This rank's bf16 shard [T, V/TP], global targets [T] and loss weights [T]."""
    v_local = job.vocab // TP
    gen = torch.Generator().manual_seed(100 + rank)
    shard_TV = torch.empty(job.tokens, v_local, dtype=torch.bfloat16)
    # Filled in row blocks so that no fp32 copy of the whole shard ever exists.
    for start in range(0, job.tokens, 256):
        rows = min(256, job.tokens - start)
        shard_TV[start : start + rows] = torch.randn(rows, v_local, generator=gen) * 2
    shared = torch.Generator().manual_seed(0)  # same targets and weights on every rank
    targets_T = torch.randint(0, job.vocab, (job.tokens,), generator=shared)
    weights_T = torch.randn(job.tokens, generator=shared)
    return shard_TV.requires_grad_(True), targets_T, weights_T


def vocab_parallel_step(shard_TV, targets_T, weights_T, group, job: Job) -> None:
    logprobs_T, entropy_T = vocab_parallel_logprobs_entropy(
        shard_TV,
        targets_T,
        group,
        chunk_tokens=job.chunk_tokens,
        entropy_requires_grad=job.entropy_grad,
    )
    loss = (weights_T * logprobs_T).sum()
    if job.entropy_grad:
        loss = loss + entropy_T.sum()
    loss.backward()


def gather_step(shard_TV, targets_T, weights_T, group, job: Job) -> None:
    rank = dist.get_rank(group)
    parts = [torch.empty_like(shard_TV, requires_grad=False) for _ in range(TP)]
    dist.all_gather(parts, shard_TV.detach(), group=group)
    parts[rank] = shard_TV  # backward of the concatenation hands this rank its slice
    full_TV = torch.cat(parts, dim=-1)
    del parts
    logp_TV = torch.log_softmax(full_TV.float(), dim=-1)
    del full_TV  # log_softmax keeps its output for backward, not its input
    logprobs_T = logp_TV.gather(1, targets_T[:, None]).squeeze(1)
    with torch.set_grad_enabled(job.entropy_grad):
        entropy_T = -(logp_TV.exp() * logp_TV).sum(dim=-1)
    loss = (weights_T * logprobs_T).sum()
    if job.entropy_grad:
        loss = loss + entropy_T.sum()
    del logp_TV
    loss.backward()


def bench_worker(job: Job) -> dict:
    """Runs on every rank: calibration, inputs, warm-up + timed runs, one sampled run."""
    rank, group = dist.get_rank(), dist.group.WORLD
    calibration = calibrate()
    shard_TV, targets_T, weights_T = make_inputs(job, rank)
    step = vocab_parallel_step if job.approach == "vocab_parallel" else gather_step
    wall, cpu = [], []
    for _ in range(job.repeats + 1):
        dist.barrier(group)
        wall_start, cpu_start = time.perf_counter(), time.process_time()
        step(shard_TV, targets_T, weights_T, group, job)
        wall.append(time.perf_counter() - wall_start)
        cpu.append(time.process_time() - cpu_start)
        shard_TV.grad = None
    dist.barrier(group)
    with AnonPeak() as peak:
        step(shard_TV, targets_T, weights_T, group, job)
    return {"wall": wall, "cpu": cpu, "peak_extra": peak.extra, "calibration": calibration}


def measure(job: Job) -> dict:
    """One fresh world; the slower rank's times per run (median) and the larger rank's peak."""
    ranks = run_world(bench_worker, TP, job, timeout_s=1800)
    timed = range(1, job.repeats + 1)  # run 0 is the warm-up
    return {
        "wall": statistics.median(max(r["wall"][i] for r in ranks) for i in timed),
        "cpu": statistics.median(max(r["cpu"][i] for r in ranks) for i in timed),
        "peak_extra": max(r["peak_extra"] for r in ranks),
        "calibration": min(r["calibration"] for r in ranks),
    }


def load_average() -> str:
    return f"{os.getloadavg()[0]:.2f}" if hasattr(os, "getloadavg") else "n/a"


def machine_info() -> str:
    names = [
        line.split(":", 1)[1].strip()
        for line in Path("/proc/cpuinfo").read_text().splitlines()
        if line.startswith("model name")
    ]
    cpu = f"{names[0]} x {len(names)}" if names else platform.processor()
    total = psutil.virtual_memory().total / GIB
    return (
        f"{cpu}, {total:.0f} GiB RAM; torch {torch.__version__}, "
        f"{max(1, (os.cpu_count() or 1) // TP)} thread(s) per rank; "
        f"Python {platform.python_version()}"
    )


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, nargs="+", default=[32768, 65536, 151936])
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096, 8192, 16384])
    parser.add_argument(
        "--chunk-tokens",
        type=int,
        default=128,
        help="tokens per chunk of the vocab-parallel pass; 128 keeps each fp32 [chunk, V/2] "
        "buffer at 16-39 MB, which on this CPU ran ~1.8x faster than the API default 1024",
    )
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per measurement")
    parser.add_argument(
        "--large-repeats", type=int, default=3, help="timed runs where T * V >= 1e9"
    )
    parser.add_argument("--entropy-grad", action="store_true", help="also backprop the entropy")
    parser.add_argument(
        "--memory-headroom",
        type=float,
        default=0.8,
        help="run the gather approach only if its extrapolated peak on all ranks fits in "
        "this fraction of the available memory",
    )
    parser.add_argument(
        "--out", type=Path, default=REPO / "tools" / "bench_vocab_parallel_results.md"
    )
    return parser.parse_args()


def gather_fits(predicted_extra: float, vocab: int, tokens: int, headroom: float) -> bool:
    """Whether all ranks' inputs plus the extrapolated gather peak fit in available memory."""
    inputs = 2 * tokens * (vocab // TP)  # the bf16 shard
    return TP * (predicted_extra + inputs) <= headroom * psutil.virtual_memory().available


def main() -> None:
    args = parse_args()
    load_before = load_average()
    sizes = sorted(((v, t) for v in args.vocab for t in args.tokens), key=lambda s: s[0] * s[1])
    gather_bytes_per_logit, measured_any = PRIOR_GATHER_BYTES_PER_LOGIT, False
    rows, calibrations = [], []
    wall_start = time.perf_counter()
    for index, (vocab, tokens) in enumerate(sizes, 1):
        repeats = args.large_repeats if vocab * tokens >= 1e9 else args.repeats
        job = Job("vocab_parallel", vocab, tokens, args.chunk_tokens, repeats, args.entropy_grad)
        vp = measure(job)
        calibrations.append(vp["calibration"])
        gather, predicted = None, gather_bytes_per_logit * tokens * vocab
        if gather_fits(predicted, vocab, tokens, args.memory_headroom):
            gather = measure(
                Job("gather", vocab, tokens, args.chunk_tokens, repeats, args.entropy_grad)
            )
            calibrations.append(gather["calibration"])
            if not measured_any:
                gather_bytes_per_logit = gather["peak_extra"] / (tokens * vocab)
                measured_any = True
        rows.append((vocab, tokens, repeats, vp, gather, predicted))
        print(format_row(rows[-1], args.chunk_tokens), f"  [{index}/{len(sizes)}]", flush=True)
    elapsed = time.perf_counter() - wall_start
    load = f"{load_before} before, {load_average()} after"
    write_table(args, rows, calibrations, load, elapsed)


def chunk_bytes(vocab: int, chunk_tokens: int, tokens: int) -> int:
    """One fp32 [chunk, V_local] temporary."""
    return 4 * min(chunk_tokens, tokens) * (vocab // TP)


def format_row(row: tuple, chunk_tokens: int) -> str:
    vocab, tokens, repeats, vp, gather, predicted = row
    one_chunk = chunk_bytes(vocab, chunk_tokens, tokens)
    cells = [f"{vocab:,}", f"{tokens:,}", str(repeats)]
    if gather is None:
        cells += [
            f"{vp['wall']:.2f} / not run",
            "n/a",
            f"{vp['cpu']:.2f} / not run",
            "n/a",
            f"{vp['peak_extra'] / GIB:.2f}",
            f"~{predicted / GIB:.1f} (extrapolated)",
            f"~{predicted / vp['peak_extra']:.1f}x",
            f"{(predicted / TP + one_chunk) / GIB:.2f}",
            "yes (vs extrapolated)" if vp["peak_extra"] <= predicted / TP + one_chunk else "NO",
        ]
    else:
        bound = gather["peak_extra"] / TP + one_chunk
        cells += [
            f"{vp['wall']:.2f} / {gather['wall']:.2f}",
            f"{gather['wall'] / vp['wall']:.1f}x",
            f"{vp['cpu']:.2f} / {gather['cpu']:.2f}",
            f"{gather['cpu'] / vp['cpu']:.1f}x",
            f"{vp['peak_extra'] / GIB:.2f}",
            f"{gather['peak_extra'] / GIB:.2f}",
            f"{gather['peak_extra'] / vp['peak_extra']:.1f}x",
            f"{bound / GIB:.2f}",
            "yes" if vp["peak_extra"] <= bound else "NO",
        ]
    return "| " + " | ".join(cells) + " |"


def write_table(args, rows: list, calibrations: list, load: str, elapsed: float) -> None:
    """Writes the markdown results (the lead copies them into the README)."""
    grad = "sum(w * logprobs) + sum(entropy)" if args.entropy_grad else "sum(w * logprobs)"
    cal_lo, cal_hi = min(calibrations) / GIB, max(calibrations) / GIB
    lines = [
        "# Vocab-parallel log-prob + entropy benchmark (`tools/bench_vocab_parallel.py`)",
        "",
        f"TP={TP} on CPU (2-process gloo world). Input: each rank's **bf16** vocabulary shard "
        f"[T, V/{TP}]. One step = per-token target log-prob and full entropy, then backward of "
        f"{grad} into the shard. vocab-parallel (VP): `vocab_parallel_logprobs_entropy` with "
        f"chunk_tokens={args.chunk_tokens}; gather: all-gather to [T, V] bf16, fp32 "
        "`log_softmax`, gather targets, entropy from the softmax, backward.",
        "",
        "Time: the slower rank's wall and CPU time of one step (vocab-parallel / gather), "
        "median of the stated number of runs after one warm-up; speed-up = gather / "
        "vocab-parallel. Memory: peak extra anonymous resident memory (`RssAnon`, sampled "
        "every ms during one more step) above the inputs (shard, targets), the larger of the "
        "two ranks, each size and approach in a fresh world; it includes the shard's bf16 "
        f"gradient. Calibration: a 1 GiB tensor measured {cal_lo:.3f}-{cal_hi:.3f} GiB in "
        "every world.",
        "",
        "Target: vocab-parallel peak <= gather peak / TP + one fp32 [chunk, V/TP] temporary "
        "(`bound` column); time no worse (speed-up >= 1).",
        "",
        f"Machine: {machine_info()}. 1-minute load average {load} the run (other jobs share "
        f"the machine); total {elapsed / 60:.1f} min.",
        "",
        "| V | T | runs | wall s (VP / gather) | wall speed-up | CPU s (VP / gather) "
        "| CPU speed-up | VP peak (GiB) | gather peak (GiB) | memory ratio | bound (GiB) "
        "| within bound |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    table = [format_row(row, args.chunk_tokens) for row in rows]
    lines += table
    skipped = [row for row in rows if row[4] is None]
    if skipped:
        lines += [
            "",
            "\"not run\": the gather approach's peak, extrapolated linearly in T * V from the "
            "first measured size, would not fit in this machine's available memory "
            f"(both ranks, {args.memory_headroom:.0%} headroom); the vocab-parallel pass ran "
            "at every size.",
        ]
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(table))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    sys.exit(main())
