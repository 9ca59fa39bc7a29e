"""``megatron-rl-plan``: what a run needs per GPU and per node, before launch.

    megatron-rl-plan --config configs/qwen3_30b_a3b_1node.yaml --gpus 8 --gpu-memory 80GiB \\
        --host-memory 2TiB [--search] [key=value ...]

Prints, for each phase of an RL step (generation, weight push, log-prob pass, policy
update; per pipeline stage), every memory term, the phase's peak, the biggest term, host
memory per node, and FITS or DOES NOT FIT with the margin. ``--search`` lists the layouts
that fit, best first (``megatron_rl.plan.search``). Exit status: 0 fits, 1 does not fit,
2 a bad config or argument.

The config is read as ``megatron-rl-train`` reads it (``init_checkpoint``'s config.json
supplies the model), except for the checks of this machine's files and packages: the plan is
for the target machine, so a checkpoint that is not here leaves the preset's ``model``
section, and FP8 plans without Transformer Engine installed here. An entry point: the
planner itself (:mod:`megatron_rl.plan`) is arithmetic below the config layer.
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from megatron_rl.config import RunConfig, load_config
from megatron_rl.config_loading import ConfigError
from megatron_rl.plan.machine import Machine, parse_bytes
from megatron_rl.plan.report import format_plan, layout_from_config, make_plan
from megatron_rl.plan.search import format_search, search


def load_plan_config(path: str | None, overrides: Sequence[str]) -> RunConfig:
    """The run config as the trainer reads it, for the target machine (not this one's files and packages)."""
    return load_config(path, list(overrides), this_machine=False)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megatron-rl-plan", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", help="run config (YAML); key=value overrides follow")
    parser.add_argument("--gpus", type=int, help="GPUs in all (default: the config's world size plus "
                                                 "its SGLang servers' GPUs)")
    parser.add_argument("--gpu-memory", required=True, help="memory per GPU, e.g. 80GiB")
    parser.add_argument("--host-memory", help="host memory per node, e.g. 2TiB (default: not checked)")
    parser.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node (default 8)")
    parser.add_argument("--cpu", action="store_true", help="plan a CPU run (processes; no CUDA or NCCL reserve)")
    parser.add_argument("--search", action="store_true", help="list the layouts that fit, best first")
    parser.add_argument("--top", type=int, default=15, help="with --search: how many to list (default 15)")
    parser.add_argument("overrides", nargs="*", help="key.path=value overrides of the run config")
    return parser


def machine_from_args(args: argparse.Namespace, cfg: RunConfig) -> Machine:
    """The machine the command line describes (GPU count defaulting to the config's layout)."""
    gpu_memory = parse_bytes(args.gpu_memory, "--gpu-memory")
    host = parse_bytes(args.host_memory, "--host-memory") if args.host_memory else None
    if args.gpus is not None and args.gpus < 1:
        raise ConfigError(f"--gpus: must be >= 1, got {args.gpus}")
    gpus = args.gpus
    if gpus is None:
        if cfg.parallel.world_size is None:
            raise ConfigError("--gpus: the config has no parallel.world_size; say how many GPUs to plan for")
        layout = layout_from_config(cfg, Machine(gpus=cfg.parallel.world_size, gpu_memory=gpu_memory))
        gpus = layout.world + layout.server_gpus
    return Machine(gpus=gpus, gpu_memory=gpu_memory, host_memory=host, gpus_per_node=args.gpus_per_node, cpu=args.cpu)


def main(argv: Sequence[str] | None = None) -> int:
    """Print the plan (or the search); 0 fits, 1 does not fit, 2 bad input."""
    args = _parser().parse_args(argv)
    try:
        cfg = load_plan_config(args.config, args.overrides)
        machine = machine_from_args(args, cfg)
        plan = make_plan(cfg, machine)
    except ConfigError as err:
        print(f"megatron-rl-plan: error: {err}", file=sys.stderr)
        return 2
    if args.search:
        fitting = search(plan)
        print(format_search(fitting, args.top))
        return 0 if fitting else 1
    print(format_plan(plan))
    return 0 if plan.fits else 1


if __name__ == "__main__":
    sys.exit(main())
