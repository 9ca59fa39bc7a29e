"""Parallel smoke run: one checkpoint, several layouts, the same numbers.

Usage::

    megatron-rl-smoke [--config configs/tiny_moe.yaml] [key.path=value ...]

Builds the configured MoE model on one process, saves it as a Megatron distributed
checkpoint, reloads it into TP2+SP and EP2 layouts (2 gloo processes each, the CPU
platform patches on when there is no GPU), runs one forward + backward over the same
packed batch through Megatron's schedules, and prints how far the full-vocabulary logits
and the router / output-layer gradients are from the single-process run.

A bad override, or a model that one of those layouts cannot split, is reported before any
worker starts, in one line naming the key, with exit code 2 (``MEGATRON_RL_TRACEBACK=1``
shows the traceback).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
import time
import warnings
from pathlib import Path

# Without TE/apex megatron-core warns about its torch fallbacks at import; expected here.
warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")

from megatron_rl.config import RunConfig, load_config  # noqa: E402
from megatron_rl.config_loading import ConfigError  # noqa: E402
from megatron_rl.sections import ParallelConfig, validate_layout  # noqa: E402

LOGIT_TOL = 1e-5
GRAD_TOL = 1e-4
_DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "tiny_moe.yaml"


def _layouts(base: ParallelConfig) -> list[tuple[str, ParallelConfig, int]]:
    def with_(**kw) -> ParallelConfig:
        return dataclasses.replace(base, world_size=None, **kw)

    return [
        ("TP2+SP", with_(tensor_model_parallel_size=2), 2),
        ("EP2 alltoall", with_(expert_model_parallel_size=2), 2),
    ]


def smoke_config(path: str | None, overrides: list[str]) -> RunConfig:
    """The run config, checked against the single-process reference and every layout the
    smoke run reloads the checkpoint into.

    Raises:
        ConfigError: naming the key; for a layout, which one.
    """
    cfg = load_config(path, overrides, world_size=1)
    for name, parallel, world in _layouts(cfg.parallel):
        try:
            validate_layout(cfg.model, parallel, world)
        except ConfigError as err:
            raise ConfigError(f"{err} (in the smoke run's {name} layout, {world} processes)") from None
    return cfg


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--config",
        default=str(_DEFAULT_CONFIG) if _DEFAULT_CONFIG.exists() else None,
        help="YAML preset (default: configs/tiny_moe.yaml of the source tree)",
    )
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. model.num_experts=16")
    args = parser.parse_args(argv)
    # Without TE/apex megatron-core warns at import in every worker; the run says what matters.
    os.environ.setdefault("PYTHONWARNINGS", "ignore::UserWarning,ignore::FutureWarning")
    try:
        cfg = smoke_config(args.config, args.overrides)
    except ConfigError as err:
        if os.environ.get("MEGATRON_RL_TRACEBACK"):
            raise
        print(f"megatron-rl-smoke: error: {err}", file=sys.stderr, flush=True)
        return 2
    return _run(cfg)


def _run(cfg: RunConfig) -> int:
    """The smoke run of a checked config; 1 when a layout's numbers differ."""
    # Imported only now: Megatron-Core takes seconds to import, and a bad input is refused before.
    from megatron_rl.parallel.smoke_worker import (
        LayoutRun,
        compare,
        layout_worker,
        merge_rank_results,
        random_sequences,
    )
    from megatron_rl.parallel.world import run_world

    sequences = random_sequences(8, cfg.model.vocab_size, 5, 40, seed=cfg.seed)
    lengths = [int(s.numel()) for s in sequences]
    print(
        f"model: {cfg.model.num_layers} MoE layers, {cfg.model.num_experts} experts, "
        f"top-{cfg.model.moe_router_topk}, vocab {cfg.model.vocab_size}; "
        f"batch: {len(sequences)} sequences, lengths {lengths}"
    )
    failures = 0
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = str(Path(tmp) / "ckpt")
        reference_parallel = dataclasses.replace(cfg.parallel, world_size=None)
        start = time.perf_counter()
        reference = merge_rank_results(
            run_world(
                layout_worker,
                1,
                LayoutRun(
                    model=cfg.model,
                    parallel=reference_parallel,
                    checkpoint_dir=checkpoint,
                    sequences=sequences,
                    save_checkpoint=True,
                    seed=cfg.seed,
                ),
            )
        )
        print(f"[reference] 1 process: forward+backward, checkpoint saved ({time.perf_counter() - start:.1f}s)")
        for name, parallel, world in _layouts(cfg.parallel):
            start = time.perf_counter()
            result = merge_rank_results(
                run_world(
                    layout_worker,
                    world,
                    LayoutRun(
                        model=cfg.model, parallel=parallel, checkpoint_dir=checkpoint, sequences=sequences
                    ),
                )
            )
            report = compare(result, reference)
            worst_grad = max(v for k, v in report.items() if k.startswith("grad_rel_err"))
            ok = report["logits_max_abs_diff"] <= LOGIT_TOL and worst_grad <= GRAD_TOL
            failures += not ok
            print(
                f"[{name:>12}] {world} processes, checkpoint resharded on load: "
                f"logits max |diff| {report['logits_max_abs_diff']:.2e} (tol {LOGIT_TOL:.0e}), "
                f"router/output grads max rel err {worst_grad:.2e} (tol {GRAD_TOL:.0e}) "
                f"-> {'OK' if ok else 'MISMATCH'} ({time.perf_counter() - start:.1f}s)"
            )
    print("smoke run passed" if failures == 0 else f"smoke run FAILED in {failures} layout(s)")
    return 0 if failures == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
