"""Benchmark of the reward scorer: wall time of one batch at several pool sizes.

Scores a batch of responses with three rewards: the built-in ``math`` (math-verify), a
verifier that sleeps 20 ms per call (I/O-bound, like a call to a sandbox) and one that
computes for about 20 ms (CPU-bound, pure Python), at each ``num_workers``; prints wall
time and speed-up over in-process scoring (``num_workers=0``). Pool start-up is timed
separately and not included; each figure is the best of a few batches on a warm scorer.
CPU-bound speed-up is capped by the machine's free cores.

    python tools/bench_rewards.py [--responses 256] [--workers 0 1 2 4] [--repeats 3]

The two synthetic verifiers live in this file, which workers import as ``bench_rewards``
(the script's folder is on ``sys.path``), so it must stay free of heavy imports.
"""

from __future__ import annotations

import argparse
import os
import random
import time

SLEEP_S = 0.02
CPU_TARGET_S = 0.02


def sleep_verifier(prompt, response, ground_truth, metadata) -> float:
    time.sleep(SLEEP_S)
    return 1.0 if response == ground_truth else 0.0


def cpu_verifier(prompt, response, ground_truth, metadata) -> float:
    total = 0
    for i in range(metadata["cpu_iterations"]):
        total += (i * i) % 7
    return float(total % 2)


def _calibrate_cpu_iterations() -> int:
    iterations = 100_000
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        cpu_verifier("", "", "", {"cpu_iterations": iterations})
        best = min(best, time.perf_counter() - start)
    return max(1, int(iterations * CPU_TARGET_S / best))


def _math_item(index: int, rng: random.Random):
    from megatron_rl.rewards.core import RewardInput

    a, b = rng.randint(1, 99), rng.randint(2, 99)
    styles = [
        (f"We add them: {a} + {b} = {a + b}. So the answer is \\boxed{{{a + b}}}.", str(a + b)),
        (f"Dividing gives \\boxed{{\\frac{{{a}}}{{{b}}}}}", f"{a}/{b}"),
        (f"The result is {a * b - 1}.", str(a * b)),
        (f"Hence x = \\boxed{{{a}x^2 + {b}}}", f"{b} + {a}x^2"),
        ("I could not solve this one.", str(a)),
    ]
    response, truth = styles[index % len(styles)]
    return RewardInput(
        sample_id=str(index), prompt="", response=response, ground_truth=truth, metadata={}
    )


def _batch(kind: str, count: int, cpu_iterations: int):
    from megatron_rl.rewards.core import RewardInput

    rng = random.Random(0)
    if kind == "math":
        return [_math_item(i, rng) for i in range(count)]
    return [
        RewardInput(
            sample_id=str(i), prompt="", response=str(i % 3), ground_truth="0",
            metadata={"cpu_iterations": cpu_iterations},
        )
        for i in range(count)
    ]


def _run(function: str, items, workers: int, repeats: int) -> tuple[float, float]:
    """Best wall time of ``repeats`` batches on one warm scorer, and its pool start-up time."""
    from megatron_rl.rewards.config import RewardConfig
    from megatron_rl.rewards.pool import RewardScorer

    start = time.perf_counter()
    cfg = RewardConfig(function=function, num_workers=workers, timeout_s=30.0)
    with RewardScorer(cfg) as scorer:
        startup = time.perf_counter() - start
        scorer.score(items[: max(1, workers)])  # first call per worker pays lazy caches
        walls = []
        for _ in range(repeats):
            begin = time.perf_counter()
            results = scorer.score(items)
            walls.append(time.perf_counter() - begin)
            assert not any(r.error for r in results), [r.error for r in results if r.error][:3]
    return min(walls), startup


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--responses", type=int, default=256)
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 1, 2, 4])
    parser.add_argument("--repeats", type=int, default=3, help="best of this many batches")
    args = parser.parse_args()

    cpu_iterations = _calibrate_cpu_iterations()
    benchmarks = [
        ("math (math-verify)", "math", "math"),
        (f"sleep {SLEEP_S * 1e3:.0f} ms (I/O-bound)", "bench_rewards:sleep_verifier", "sleep"),
        (f"CPU ~{CPU_TARGET_S * 1e3:.0f} ms (pure Python)", "bench_rewards:cpu_verifier", "cpu"),
    ]
    print(f"{args.responses} responses per batch, best of {args.repeats}, {os.cpu_count()} CPU "
          f"cores, CPU verifier = {cpu_iterations} loop iterations, "
          f"load average before: {os.getloadavg()[0]:.1f}\n")
    print("| reward | num_workers | pool start s | wall s | responses/s | speed-up |")
    print("|---|---:|---:|---:|---:|---:|")
    for label, function, kind in benchmarks:
        items = _batch(kind, args.responses, cpu_iterations)
        baseline = None
        for workers in args.workers:
            wall, startup = _run(function, items, workers, args.repeats)
            baseline = baseline or wall
            print(f"| {label} | {workers} | {startup:.2f} | {wall:.2f} | "
                  f"{args.responses / wall:.0f} | {baseline / wall:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
