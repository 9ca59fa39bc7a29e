"""Entry point of an RL run: ``megatron-rl-train --config configs/demo_cpu.yaml [key=value ...]``.

``--print-config`` prints the resolved config (every default filled in, each value's source)
and exits; ``--help`` lists every config section and key with its doc.

Under ``torchrun`` (or ``srun`` + torchrun) the process group comes from the launcher's
environment (NCCL on GPUs, gloo on CPU). Started plainly, it spawns a local gloo world of
``parallel.world_size`` processes itself, which is how the CPU demo runs. The config and
its files (starting checkpoint, tokenizer, prompt files, reward) are checked before any
process or model starts; a bad one is reported in one line naming the culprit, exit code 2
(``MEGATRON_RL_TRACEBACK=1`` shows the traceback). So is a run directory that another live
run owns (``train/run_lock.py``). SIGTERM or SIGINT ends every rank and its children and
exits with ``128 + signal`` after one line; checkpoints are published atomically, so the
run resumes from the last complete one.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import signal
import sys
import warnings
from pathlib import Path

warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")

import torch.distributed as dist  # noqa: E402

from megatron_rl.config import RunConfig, load_config, validate  # noqa: E402
from megatron_rl.config_loading import ConfigError, from_dict, to_dict  # noqa: E402
from megatron_rl.parallel import comm  # noqa: E402
from megatron_rl.parallel.world import (  # noqa: E402
    Stopped,
    WorldError,
    exit_with_parent,
    gone_on_this_host,
    joined_world,
    raise_on_stop_signals,
    rank_processes,
    run_world,
)
from megatron_rl.train.checkpoint import latest_checkpoint  # noqa: E402
from megatron_rl.train.config_report import demo_sized_warning  # noqa: E402
from megatron_rl.train.prepare import RunPrompts, check_inputs  # noqa: E402
from megatron_rl.train.run_lock import RunDirBusy, RunDirLock  # noqa: E402

_DEFAULT_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "demo_cpu.yaml"


def run_rank(cfg_dict: dict, prompts: RunPrompts | None = None) -> list[dict]:
    """Body of one rank: build groups, train, write plots and the summary on rank 0, which
    also feeds the run's W&B and MLflow runs (``logging``). ``prompts``: the tokenizer and
    prompts the input check loaded; None reads them again."""
    from megatron_rl.parallel.cpu_platform import cpu_platform
    from megatron_rl.parallel.groups import model_parallel
    from megatron_rl.train.sinks import Trackers
    from megatron_rl.train.trainer import Trainer

    cfg = from_dict(RunConfig, cfg_dict)
    world = dist.group.WORLD
    validate(cfg, world_size=comm.size(world))
    rank0 = comm.rank(world) == 0
    with cpu_platform(enable=cfg.parallel.use_cpu_platform is not False):
        with model_parallel(cfg.parallel, cfg.seed) as groups:
            trainer = Trainer(cfg, groups, prompts)
            with Trackers(cfg, enabled=rank0, resumed=trainer.checkpoints.resumed_step is not None) as trackers:
                history = trainer.run(trackers)
                if rank0:
                    trackers.log_plots(_report(Path(cfg.train.run_dir), agentic=cfg.rollout.env.name is not None))
    return history


def _report(run_dir: Path, agentic: bool) -> list[Path]:
    """Draws the plots and prints the summary and phase tables; returns the plot files.
    ``agentic``: the run had an environment (turns, tool calls and tool use in the summary)."""
    from megatron_rl.train.metrics import plot_run, read_metrics, summary_table
    from megatron_rl.train.phases import phase_table

    plots = plot_run(run_dir)
    rows = read_metrics(run_dir / "metrics.jsonl")
    columns = ["reward/mean", "rollout/accuracy", "eval/accuracy", "eval/accuracy_greedy",
               *(["env/turns", "env/tool_calls", "eval/correct_tool_use"] if agentic else []),
               "routing/replay_agreement", "gamma/mean", "objective/clip/high_token_frac", "time/rollout",
               "time/update", "time/step"]
    also = ["eval/accuracy_greedy", "eval/correct_tool_use", "eval/tool_calls"] if agentic else []
    print(summary_table(rows, columns, also=also))
    print("time and peak memory per phase (mean over the steps; nested phases apart):")
    print(phase_table(rows))
    print("plots: " + ", ".join(str(p) for p in plots))
    print(f"metrics: {run_dir / 'metrics.jsonl'} (TensorBoard: {run_dir / 'tensorboard'})")
    return plots


class _Parser(argparse.ArgumentParser):
    """Lists the config's sections and keys under ``--help`` (read from their docstrings only then)."""

    def format_help(self) -> str:
        from megatron_rl.train.config_report import config_help

        self.epilog = config_help()
        return super().format_help()


def main(argv: list[str] | None = None) -> int:
    parser = _Parser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(_DEFAULT_CONFIG) if _DEFAULT_CONFIG.exists() else None)
    parser.add_argument("--print-config", action="store_true",
                        help="print the resolved config as YAML, each value's source in a comment, and exit")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.steps=10")
    args = parser.parse_args(argv)
    launched = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if args.print_config:
        return _print_config(args, int(os.environ["WORLD_SIZE"]) if launched else None)
    # Under torchrun the agent stops the workers (SIGTERM to each one's process group); the
    # default action ends a worker at once, even inside a collective, which a Python
    # handler could not.
    if launched:
        return _main(args, launched)
    try:
        with raise_on_stop_signals():
            return _main(args, launched)
    except Stopped as stop:
        print(f"megatron-rl-train: stopped by {signal.Signals(stop.signum).name} before the run started",
              file=sys.stderr, flush=True)
        return 128 + stop.signum


def _print_config(args: argparse.Namespace, world_size: int | None) -> int:
    from megatron_rl.train.config_report import resolved_config_yaml

    try:
        text = resolved_config_yaml(args.config, args.overrides, world_size)
    except ConfigError as err:
        if os.environ.get("MEGATRON_RL_TRACEBACK"):
            raise
        print(f"megatron-rl-train: error: {err}", file=sys.stderr)
        return 2
    print(text, end="")
    return 0


def _main(args: argparse.Namespace, launched: bool) -> int:
    world_size = int(os.environ["WORLD_SIZE"]) if launched else None
    rank0 = not launched or int(os.environ["RANK"]) == 0
    lock, busy = None, None
    try:
        cfg = load_config(args.config, args.overrides, world_size=world_size)
        if rank0 and (warning := demo_sized_warning(args.config, args.overrides, cfg, launched)):
            print(warning, file=sys.stderr, flush=True)
        # A busy directory is refused before the input checks (minutes for a large dataset);
        # one that does not exist yet is created only once they pass.
        if rank0 and Path(cfg.train.run_dir).is_dir():
            lock = RunDirLock(cfg.train.run_dir).acquire()
        summary = check_inputs(cfg)
        if rank0 and lock is None:
            lock = RunDirLock(cfg.train.run_dir).acquire()
    except RunDirBusy as err:
        if not launched:
            print(f"megatron-rl-train: error: {err}", file=sys.stderr)
            return 2
        busy = err  # the other ranks learn it once the group exists
    except ConfigError as err:
        if lock is not None:
            lock.release()
        if os.environ.get("MEGATRON_RL_TRACEBACK"):
            raise
        print(f"megatron-rl-train: error: {err}", file=sys.stderr)
        return 2
    with lock if lock is not None else contextlib.nullcontext():
        if rank0 and busy is None:
            print(summary.describe(), flush=True)
        if launched:
            return _run_launched(cfg, busy, summary.prompts if busy is None else None)
        os.environ.setdefault("PYTHONWARNINGS", "ignore::UserWarning,ignore::FutureWarning")
        nproc = cfg.parallel.world_size or 1
        validate(cfg, world_size=nproc)
        try:
            # The ranks take the checked prompts along (pickled): one read and tokenization per run.
            run_world(run_rank, nproc, to_dict(cfg), summary.prompts, timeout_s=24 * 3600,
                      preload=_rank_preload(cfg))
        except WorldError as err:
            if os.environ.get("MEGATRON_RL_TRACEBACK"):
                raise
            print(f"megatron-rl-train: error: {err.cause()} "
                  "(MEGATRON_RL_TRACEBACK=1 prints every rank's traceback)", file=sys.stderr, flush=True)
            return 1
        except Stopped as stop:
            latest = latest_checkpoint(cfg.train.run_dir)
            where = f"resume from {latest} with the same command" if latest else "no checkpoint was published"
            print(f"megatron-rl-train: stopped by {signal.Signals(stop.signum).name}: every rank ended; {where}",
                  file=sys.stderr, flush=True)
            return 128 + stop.signum
        return 0


def _rank_preload(cfg: RunConfig) -> tuple[str, ...]:
    """What every rank of this run imports besides torch and Megatron-Core (about a second
    each: the trainer; with prompt files, the HF tokenizer (``datasets`` not: the ranks get the
    prompts read); with the hf engine, transformers' model classes), for the ranks' forkserver
    to import once."""
    files = ("transformers.models.auto.tokenization_auto",) if cfg.data.source == "files" else ()
    hf_engine = ("transformers.models.auto.modeling_auto",) if cfg.rollout.engine == "hf" else ()
    return ("megatron_rl.train.trainer", *files, *hf_engine)


def _run_launched(cfg: RunConfig, busy: RunDirBusy | None, prompts: RunPrompts | None) -> int:
    """One torchrun worker; global rank 0 holds the run directory and tells the others
    whether it got it, so that a refused run exits 2 on every rank."""
    # Workers lead their own sessions under torchrun: if the agent dies, nothing else
    # would stop them (or their reward workers).
    exit_with_parent(os.getppid())
    with joined_world() as world:
        try:
            comm.raise_first_failure(busy, world, "claiming the run directory")
        except RunDirBusy as err:
            print(f"megatron-rl-train: error: {err}", file=sys.stderr, flush=True)
            return 2
        except comm.RankFailed:
            return 2
        processes = rank_processes(world)
        try:
            run_rank(to_dict(cfg), prompts)
        except Exception:
            gone = gone_on_this_host(processes)
            if gone:
                # This rank's own error is only the broken connection; the agent reports how the peer ended.
                print(f"megatron-rl-train: error: rank {comm.rank(world)}: peer rank(s) {gone} on this node "
                      "ended without reporting (the torchrun agent's report says how)", file=sys.stderr, flush=True)
            raise
    return 0


def cli() -> int:
    """``megatron-rl-train``: :func:`main`, then the interpreter's exit without its final garbage
    collections. They walk every object torch, Megatron, transformers and the run made (~3 of a
    tiny run's ~35 CPU-s, more under torchrun, where every rank is such a process); the objects
    are still released and every open file flushed, only no cycle is looked for."""
    code = main()
    gc.freeze()
    return code


if __name__ == "__main__":
    sys.exit(cli())
