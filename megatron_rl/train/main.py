"""Entry point of an RL run: ``megatron-rl-train --config configs/demo_cpu.yaml [key=value ...]``.

Under ``torchrun`` (or ``srun`` + torchrun) the process group comes from the launcher's
environment (NCCL on GPUs, gloo on CPU). Started plainly, it spawns a local gloo world of
``parallel.world_size`` processes itself, which is how the CPU demo runs. The config and
its files (starting checkpoint, tokenizer, prompt files, reward) are checked before any
process or model starts; a bad one is reported in one line naming the culprit, exit code 2
(``MEGATRON_RL_TRACEBACK=1`` shows the traceback).
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from pathlib import Path

warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from megatron_rl.config import ConfigError, RunConfig, from_dict, to_dict, validate  # noqa: E402
from megatron_rl.train.prepare import check_inputs, load_run_config  # noqa: E402

_DEFAULT_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "demo_cpu.yaml"


def run_rank(cfg_dict: dict) -> list[dict]:
    """Body of one rank: build groups, train, write plots and the summary on rank 0."""
    from megatron_rl.parallel.cpu_platform import cpu_platform
    from megatron_rl.parallel.groups import model_parallel
    from megatron_rl.train.metrics import plot_run, read_metrics, summary_table
    from megatron_rl.train.trainer import Trainer

    cfg = from_dict(RunConfig, cfg_dict)
    validate(cfg, world_size=dist.get_world_size())
    with cpu_platform(enable=cfg.parallel.use_cpu_platform is not False):
        with model_parallel(cfg.parallel, cfg.seed) as groups:
            history = Trainer(cfg, groups).run()
    if dist.get_rank() == 0:
        run_dir = Path(cfg.train.run_dir)
        plots = plot_run(run_dir)
        rows = read_metrics(run_dir / "metrics.jsonl")
        print(summary_table(rows, ["reward/mean", "rollout/accuracy", "eval/accuracy", "eval/accuracy_greedy",
                                   "routing/replay_agreement",
                                   "gamma/mean", "objective/clip/high_token_frac", "time/rollout", "time/update"]))
        print("plots: " + ", ".join(str(p) for p in plots))
        print(f"metrics: {run_dir / 'metrics.jsonl'} (TensorBoard: {run_dir / 'tensorboard'})")
    return history


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=str(_DEFAULT_CONFIG) if _DEFAULT_CONFIG.exists() else None)
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.steps=10")
    args = parser.parse_args(argv)
    launched = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    world_size = int(os.environ["WORLD_SIZE"]) if launched else None
    try:
        cfg = load_run_config(args.config, args.overrides, world_size=world_size)
        summary = check_inputs(cfg)
    except ConfigError as err:
        if os.environ.get("MEGATRON_RL_TRACEBACK"):
            raise
        print(f"megatron-rl-train: error: {err}", file=sys.stderr)
        return 2
    if not launched or int(os.environ["RANK"]) == 0:
        print(summary.describe(), flush=True)
    if launched:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend)
        try:
            run_rank(to_dict(cfg))
        finally:
            dist.destroy_process_group()
        return 0
    from megatron_rl.parallel.world import run_world

    os.environ.setdefault("PYTHONWARNINGS", "ignore::UserWarning,ignore::FutureWarning")
    nproc = cfg.parallel.world_size or 1
    validate(cfg, world_size=nproc)
    run_world(run_rank, nproc, to_dict(cfg), timeout_s=24 * 3600)
    return 0


if __name__ == "__main__":
    sys.exit(main())
