"""megatron-rl-mismatch: a run's train-vs-rollout log-prob gap, broken down by cause, from its saved rollouts.

Usage::

    megatron-rl-mismatch RUN_DIR [--steps N ...] [--whole-model] [--worst 8] [--threads N]

Reads the rollouts a run saved with ``train.mismatch.save_rollouts``
(``RUN_DIR/rollouts/step_NNNNNN``) and, for each step, the training checkpoint of the weight
version that generated them (``RUN_DIR/checkpoints/step_*/trainer_state.json``); rebuilds the
policy in this process alone (log-probs and routing do not depend on the layout: the layout
invariance tests) and runs the breakdown the trainer runs per step
(``megatron_rl.train.mismatch.run_breakdown``: the trainer's pass, then the engine's expert ids and
gate weights replayed stage by stage, layer by layer). Writes ``RUN_DIR/mismatch/report.txt`` (the
report printed here: the gap, each stage's share, one line per layer with its flip rate and router
KL, the worst tokens with their cause), ``RUN_DIR/mismatch/breakdown.jsonl`` (one row of
``mismatch/breakdown/*`` per step) and ``RUN_DIR/plots/mismatch_layers.png`` (per layer, the share
of the gap each stage removes, and the flip rate, averaged over the steps). A step whose weights
were not checkpointed (``train.save_every``) is skipped, named. Bad usage (no such run, nothing
saved, an unknown step): one line, exit code 2.
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path

warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")


def _checkpoints_by_version(run_dir: Path) -> tuple[dict[int, Path], dict | None]:
    """``{weight_version: checkpoint}`` of the run's complete checkpoints, and the newest one's config."""
    found, config = {}, None
    for path in sorted((run_dir / "checkpoints").glob("step_*")):
        state = path / "trainer_state.json"
        if state.exists():
            body = json.loads(state.read_text())
            found[int(body["weight_version"])] = path
            config = body.get("config", config)
    return found, config


def _usage_error(message: str) -> int:
    print(f"megatron-rl-mismatch: error: {message}", file=sys.stderr)
    return 2


def _plot(rows: list[dict], layers: tuple[int, ...], out: Path) -> Path:
    """Per layer: mean share of the gap each stage removed (bars) and the flip rate (line)."""
    from matplotlib.figure import Figure

    def mean(key: str) -> float:
        values = [row[key] for row in rows if key in row]
        return sum(values) / len(values) if values else 0.0

    fig = Figure(figsize=(7, 4), layout="constrained")
    ax = fig.subplots()
    x = list(range(len(layers)))
    bottom = [0.0] * len(layers)
    for stage in ("expert_choice", "gate_weights"):
        heights = [mean(f"mismatch/breakdown/layer{n}/{stage}") for n in layers]
        ax.bar(x, heights, bottom=bottom, label=f"share removed: {stage}")
        bottom = [b + h for b, h in zip(bottom, heights)]
    flips = ax.twinx()
    flips.plot(x, [mean(f"mismatch/breakdown/layer{n}/flip_rate") for n in layers], "k.-", label="flip rate")
    flips.set_ylabel("expert flip rate")
    ax.set_xticks(x, [f"layer {n}" for n in layers])
    ax.set_ylabel("share of the gap")
    ax.set_title(f"Train-vs-rollout gap removed per layer ({len(rows)} steps)")
    ax.legend(loc="upper left", fontsize="small")
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    return out


def _breakdowns(run_dir: Path, steps: list[Path], cfg, checkpoints: dict[int, Path], args) -> list[str]:
    """Every step's report lines; writes the metrics rows and the plot."""
    from megatron_rl.parallel.checkpoint import load_training_state
    from megatron_rl.parallel.cpu_platform import cpu_platform
    from megatron_rl.parallel.groups import model_parallel
    from megatron_rl.parallel.model import build_model
    from megatron_rl.parallel.world import world_of_one
    from megatron_rl.sections import ParallelConfig
    from megatron_rl.train.mismatch import gathered_worst, load_rollouts, report_lines, run_breakdown

    lines, rows, layers = [], [], ()
    alone = ParallelConfig()
    with world_of_one(), cpu_platform(), model_parallel(alone, cfg.seed) as groups:
        model = build_model(cfg.model, alone, moe_enable_routing_replay=True)
        for directory in steps:
            samples = load_rollouts(directory)
            versions = sorted({s.weight_version for s in samples})
            if len(versions) != 1 or versions[0] not in checkpoints:
                lines.append(f"{directory.name}: skipped, weight version(s) {versions} not in a checkpoint "
                             f"(checkpointed: {sorted(checkpoints)})")
                continue
            load_training_state(model, None, checkpoints[versions[0]], with_optimizer_state=False)
            result = run_breakdown(model, groups, samples, policy_temperature=cfg.train.policy_temperature,
                                   per_layer=not args.whole_model, worst=args.worst,
                                   micro_batch_sequences=cfg.train.micro_batch_sequences, micro_batch_tokens=None)
            layers = result.layer_numbers
            title = f"{directory.name} (weights {checkpoints[versions[0]].name}, {len(samples)} samples)"
            lines += report_lines(result, gathered_worst(result, groups, args.worst), title)
            rows.append({"step": int(directory.name.split("_")[-1]),
                         **{k: float(v) for k, v in result.metrics.items()}})
    out = run_dir / "mismatch"
    out.mkdir(parents=True, exist_ok=True)
    (out / "breakdown.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    if rows:
        lines.append(f"plot: {_plot(rows, layers, run_dir / 'plots' / 'mismatch_layers.png')}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="megatron-rl-mismatch", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", help="a run directory of megatron-rl-train")
    parser.add_argument("--steps", type=int, nargs="*", default=None, help="saved steps to break down (default: all)")
    parser.add_argument("--whole-model", action="store_true", help="replay every layer at once (2 passes per step)")
    parser.add_argument("--worst", type=int, default=8, help="worst tokens reported per step")
    parser.add_argument("--threads", type=int, default=None, help="torch threads")
    args = parser.parse_args(argv)
    run_dir = Path(args.run_dir)
    if not run_dir.is_dir():
        return _usage_error(f"{run_dir}: no such run directory")
    saved = {int(p.name.split("_")[-1]): p for p in sorted((run_dir / "rollouts").glob("step_*"))}
    if not saved:
        return _usage_error(f"{run_dir}/rollouts holds no saved rollouts (run with train.mismatch.save_rollouts=true)")
    unknown = sorted(set(args.steps or ()) - set(saved))
    if unknown:
        return _usage_error(f"--steps {unknown}: not saved (saved steps: {sorted(saved)})")
    if args.worst < 0:
        return _usage_error(f"--worst {args.worst}: must be >= 0")
    checkpoints, config = _checkpoints_by_version(run_dir)
    if config is None:
        return _usage_error(f"{run_dir}/checkpoints holds no complete checkpoint to take the weights from")
    import torch

    from megatron_rl.config import RunConfig
    from megatron_rl.config_loading import from_dict

    if args.threads:
        torch.set_num_threads(args.threads)
    steps = [saved[s] for s in sorted(args.steps or saved)]
    lines = _breakdowns(run_dir, steps, from_dict(RunConfig, config), checkpoints, args)
    (run_dir / "mismatch" / "report.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
