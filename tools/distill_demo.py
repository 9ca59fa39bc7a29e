"""On-policy distillation against RL alone on the CPU demo: held-out accuracy per step, same sample budget.

    python tools/distill_demo.py                      # 3 seeds x 2 arms
    python tools/distill_demo.py --seeds 1 2 3 4 5 --steps 20 --eval-every 2

Both arms start from the shipped tiny student and draw the same number of samples per step
(``configs/demo_distill.yaml``: 4 prompts x 2 responses a step for 50 steps, one sampling
round, no dynamic sampling): the *distill* arm is pure on-policy distillation from the
larger tiny teacher (``objective.rl_coef: 0``, ``distill_coef: 1``, the sampled-token
estimator), the *rl* arm is GRPO on the math reward (``distill_coef: 0``, ``rl_coef: 1``, no
teacher); the same optimizer (Adam, lr 1e-4: 5e-4 collapses both arms on this model). Every
run's config is checked as ``megatron-rl-train`` checks it, then all of them run one after
the other in one 2-process gloo world (one start-up for all: the CPU demo's start-up is most
of a short run's time). Held-out accuracy (``eval/accuracy``: 100 held-out prompts x 2
samples at temperature 1) is measured every ``--eval-every`` steps (5). Prints, per step,
each arm's accuracy per seed and its mean, and the wall time; writes ``<out>/summary.json``
and each run's ``metrics.jsonl`` under ``<out>/<arm>/seed<N>``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "demo_distill.yaml"
ARMS = {
    "distill": [],
    "rl": ["objective.distill_coef=0", "objective.rl_coef=1", "distill.teachers=[]"],
}
"""Overrides of each arm on top of the config."""


def run_all(cfg_dicts: list[dict]) -> list[list[dict]]:
    """Rank body: every config's run in turn; each run's rows (rank 0, else empty lists)."""
    import torch.distributed as dist

    from megatron_rl.config import RunConfig
    from megatron_rl.config_loading import from_dict
    from megatron_rl.parallel.cpu_platform import cpu_platform
    from megatron_rl.parallel.groups import model_parallel
    from megatron_rl.train.trainer import Trainer

    histories = []
    for data in cfg_dicts:
        cfg = from_dict(RunConfig, data)
        with cpu_platform(), model_parallel(cfg.parallel, cfg.seed) as groups:
            histories.append(Trainer(cfg, groups).run())
    return histories if dist.get_rank() == 0 else []


def accuracy_by_step(rows: list[dict]) -> dict[int, float]:
    """``eval/accuracy`` of each step that has one."""
    return {int(r["step"]): float(r["eval/accuracy"]) for r in rows if "eval/accuracy" in r}


def table(results: dict[str, dict[int, dict[int, float]]]) -> str:
    """Per step: each arm's accuracy per seed, and the mean over seeds."""
    arms = list(results)
    seeds = sorted(next(iter(results.values())))
    steps = sorted(next(iter(next(iter(results.values())).values())))
    header = ["step"] + [f"{arm} s{seed}" for arm in arms for seed in seeds] + [f"{arm} mean" for arm in arms]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for step in steps:
        cells = [str(step)]
        cells += [f"{results[arm][seed][step]:.3f}" for arm in arms for seed in seeds]
        cells += [f"{sum(results[arm][s][step] for s in seeds) / len(seeds):.3f}" for arm in arms]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--steps", type=int, default=None, help="RL steps per run (default: the config's)")
    parser.add_argument("--eval-every", type=int, default=5, help="held-out accuracy every N steps")
    parser.add_argument("--out", type=Path, default=Path("runs/distill_demo"))
    parser.add_argument("overrides", nargs="*", help="more dotted overrides for both arms")
    args = parser.parse_args(argv)

    from megatron_rl.config_loading import ConfigError, to_dict
    from megatron_rl.parallel.world import run_world
    from megatron_rl.config import load_config
    from megatron_rl.train.prepare import check_inputs

    started = time.time()
    runs = []
    for arm, overrides in ARMS.items():
        for seed in args.seeds:
            extra = [f"seed={seed}", f"train.run_dir={args.out / arm / f'seed{seed}'}", f"train.eval_every={args.eval_every}",
                     "train.resume=false", *([f"train.steps={args.steps}"] if args.steps else []), *args.overrides]
            try:
                cfg = load_config(CONFIG, [*overrides, *extra], world_size=2)
                if seed == args.seeds[0]:
                    print(f"{arm}: {check_inputs(cfg).describe()}", flush=True)
            except ConfigError as err:
                print(f"distill_demo: error: {err}", file=sys.stderr)
                return 2
            runs.append((arm, seed, cfg))
    histories = run_world(run_all, 2, [to_dict(cfg) for _, _, cfg in runs], timeout_s=3600)[0]
    results: dict[str, dict[int, dict[int, float]]] = {}
    for (arm, seed, _), rows in zip(runs, histories):
        results.setdefault(arm, {})[seed] = accuracy_by_step(rows)
    elapsed = time.time() - started
    print(table(results))
    print(f"{len(runs)} runs in {elapsed:.0f} s (checks, start-up and every run)")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "summary.json").write_text(json.dumps({"accuracy": results, "seconds": elapsed}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
