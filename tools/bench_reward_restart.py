"""Benchmark: how long a reward pool takes to start, and to be replaced after a worker died,
in a process that looks like a trainer rank.

A trainer rank's main module is the entry point, which imports torch and Megatron; spawned
and forkserver workers re-run their parent's main module unless the pool prevents it
(``megatron_rl/parallel/main_module.py``, ``parent_main_hidden``). This script is such a main
module: it imports the entry point at the top, then times a pool's start and ``--repeats``
replacements (the path a worker that died or hung takes), each until every worker has
imported the reward and reported ready.

    python tools/bench_reward_restart.py [--workers 2] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import time

import megatron_rl.train.main  # noqa: F401  what a trainer rank's main module imports


def main() -> None:
    from megatron_rl.rewards.config import RewardConfig
    from megatron_rl.rewards.pool import RewardScorer

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(f"{os.cpu_count()} CPU cores, load average before: {os.getloadavg()[0]:.1f}")
    start = time.perf_counter()
    scorer = RewardScorer(RewardConfig(function="math", num_workers=args.workers))
    print(f"pool start ({args.workers} workers, reward 'math'): {time.perf_counter() - start:.2f} s")
    replacements = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        scorer._replace_pool()
        replacements.append(time.perf_counter() - start)
    scorer.close()
    print("pool replacements: " + ", ".join(f"{s:.2f} s" for s in replacements))


if __name__ == "__main__":
    main()
