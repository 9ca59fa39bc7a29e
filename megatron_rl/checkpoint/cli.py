"""Command lines of the checkpoint tools (``tools/*.py`` and the console scripts call these).

Owns: argument parsing, size strings ("5GB"), prompt selection for the parity check, and
how a tool ends: exit code 0 success, 1 parity outside tolerance, 2 bad usage or an input
that does not fit (a missing, truncated or corrupt file, a layout that does not divide the
model, an output location that cannot be created), 3 an unexpected internal failure. A
failure is one line on stderr, ``<tool>: error: <message naming the file, tensor, key or
dimension>``, as ``megatron-rl-train`` does; the traceback only with ``--traceback`` or
``MEGATRON_RL_TRACEBACK=1``. Library warnings (Megatron's missing TE/Apex fallbacks) are
silenced in the tool and its ranks. Does not own any conversion logic.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import sys
import warnings
from pathlib import Path
from typing import Callable, Iterator, Sequence

from megatron_rl.checkpoint.errors import CheckpointMismatchError
from megatron_rl.checkpoint.local_world import one_line
from megatron_rl.config_loading import ConfigError
from megatron_rl.parallel.world import WorldError
from megatron_rl.sections import ParallelConfig

TRACEBACK_ENV = "MEGATRON_RL_TRACEBACK"
_QUIET = "ignore::UserWarning,ignore::FutureWarning,ignore::DeprecationWarning"

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(text: str) -> int:
    """Bytes in ``"50KB"``, ``"5GB"``, ``"2GiB"`` or a plain integer (HF's conventions)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]i?B|B)?\s*", text, flags=re.IGNORECASE)
    if match is None:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 50KB, 5GB, 2GiB)")
    return int(float(match.group(1)) * _UNITS[(match.group(2) or "").upper()])


def _layout_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size (sequence parallel when > 1)")
    parser.add_argument("--ep", type=int, default=1, help="expert-parallel size")
    parser.add_argument("--pp", type=int, default=1, help="pipeline-parallel size")
    parser.add_argument(
        "--world-size", type=int, default=None, help="processes (default: the fewest the layout needs)"
    )


def _layout(args: argparse.Namespace) -> ParallelConfig:
    return ParallelConfig(
        tensor_model_parallel_size=args.tp,
        expert_model_parallel_size=args.ep,
        pipeline_model_parallel_size=args.pp,
    )


def _parser(tool: str, description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=tool, description=description)
    parser.add_argument(
        "--traceback", action="store_true", help=f"show the traceback of a failure (or set {TRACEBACK_ENV}=1)"
    )
    return parser


@contextlib.contextmanager
def _quiet_warnings() -> Iterator[None]:
    """Library warnings off here and in spawned ranks (which read PYTHONWARNINGS); both restored."""
    before = os.environ.get("PYTHONWARNINGS")
    os.environ["PYTHONWARNINGS"] = _QUIET if before is None else f"{before},{_QUIET}"
    try:
        with warnings.catch_warnings():
            for category in (UserWarning, FutureWarning, DeprecationWarning):
                warnings.simplefilter("ignore", category)
            yield
    finally:
        if before is None:
            os.environ.pop("PYTHONWARNINGS", None)
        else:
            os.environ["PYTHONWARNINGS"] = before


def _world_failure(err: WorldError) -> str:
    """Each failed rank's last traceback line (``run_world`` puts the tracebacks in the message)."""
    text = str(err)
    parts = text.split("\n--- rank ")
    lines = [parts[0].splitlines()[0]] if parts[0].strip() else []
    for part in parts[1:]:
        rank = part.split(" ", 1)[0]
        last = [line for line in part.splitlines() if line.strip()][-1]
        lines.append(f"rank {rank}: {last.strip()}")
    return "; ".join(lines)


def _run(tool: str, args: argparse.Namespace, body: Callable[[], int]) -> int:
    """Run a tool body; a failure becomes one line on stderr and exit code 2 (input) or 3 (internal)."""
    show = args.traceback or os.environ.get(TRACEBACK_ENV, "") not in ("", "0")
    with _quiet_warnings():
        try:
            return body()
        except (CheckpointMismatchError, ConfigError, OSError) as err:
            if show:
                raise
            print(f"{tool}: error: {one_line(err)}", file=sys.stderr)
            return 2
        except Exception as err:  # noqa: BLE001 - the convention: one line, traceback on request
            if show:
                raise
            what = _world_failure(err) if isinstance(err, WorldError) else f"{type(err).__name__}: {one_line(err)}"
            print(f"{tool}: error: internal failure: {what} ({TRACEBACK_ENV}=1 shows the traceback)", file=sys.stderr)
            return 3


def hf_to_megatron_main(argv: Sequence[str] | None = None) -> int:
    """``convert_hf_to_megatron HF_DIR OUT_DIR [--tp N --ep N --pp N] [--vocab-padding-multiple N]``."""
    from megatron_rl.checkpoint.convert import convert_hf_to_megatron

    parser = _parser("megatron-rl-convert-hf-to-megatron", "HF safetensors -> Megatron distributed checkpoint")
    parser.add_argument("hf_dir", help="HF checkpoint directory (config.json + safetensors)")
    parser.add_argument("out_dir", help="new directory for the distributed checkpoint")
    _layout_args(parser)
    parser.add_argument(
        "--vocab-padding-multiple", type=int, default=1,
        help="pad the vocabulary to a multiple of this (model.vocab_padding_multiple; e.g. 128 when TP "
        "does not divide it); the padding is masked and dropped again on export",
    )
    parser.add_argument("--no-progress", action="store_true", help="hide progress bars")
    args = parser.parse_args(argv)

    def body() -> int:
        path = convert_hf_to_megatron(
            args.hf_dir,
            args.out_dir,
            _layout(args),
            world_size=args.world_size,
            progress=not args.no_progress,
            vocab_padding_multiple=args.vocab_padding_multiple,
        )
        print(f"wrote {path}")
        return 0

    return _run("megatron-rl-convert-hf-to-megatron", args, body)


def megatron_to_hf_main(argv: Sequence[str] | None = None) -> int:
    """``convert_megatron_to_hf MEGATRON_DIR OUT_DIR [--hf-config DIR] [--max-shard-size 5GB]``."""
    from megatron_rl.checkpoint.convert import convert_megatron_to_hf

    parser = _parser("megatron-rl-convert-megatron-to-hf", "Megatron distributed checkpoint -> HF safetensors")
    parser.add_argument("megatron_dir", help="distributed checkpoint")
    parser.add_argument("out_dir", help="new directory for the HF checkpoint")
    parser.add_argument(
        "--hf-config", default=None,
        help="HF checkpoint (or converted Megatron checkpoint) giving config, side files and shard layout",
    )
    parser.add_argument("--max-shard-size", type=parse_size, default=None, help="re-shard by size, e.g. 5GB")
    parser.add_argument("--no-progress", action="store_true", help="hide progress bars")
    args = parser.parse_args(argv)

    def body() -> int:
        path = convert_megatron_to_hf(
            args.megatron_dir, args.out_dir, hf_config=args.hf_config,
            max_shard_bytes=args.max_shard_size, progress=not args.no_progress,
        )
        print(f"wrote {path}")
        return 0

    return _run("megatron-rl-convert-megatron-to-hf", args, body)


def parity_main(argv: Sequence[str] | None = None) -> int:
    """``logprob_parity --hf DIR --megatron DIR [--prompts FILE | --random-prompts N]``."""
    from megatron_rl.checkpoint.convert import read_export_source
    from megatron_rl.checkpoint.parity import (
        ParityTolerances,
        check_parity,
        load_prompts,
        random_prompts,
    )

    parser = _parser("megatron-rl-logprob-parity", "Log-prob and routing parity: transformers vs Megatron")
    parser.add_argument("--hf", required=True, help="HF checkpoint directory")
    parser.add_argument("--megatron", required=True, help="distributed checkpoint (from the converter)")
    _layout_args(parser)
    parser.add_argument("--prompts", default=None, help="JSON list of prompts: token-id lists or strings")
    parser.add_argument("--random-prompts", type=int, default=8, help="random prompts without --prompts")
    parser.add_argument("--prompt-length", type=int, default=64, help="tokens per random prompt")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    defaults = ParityTolerances()
    parser.add_argument("--logprob-atol", type=float, default=defaults.logprob_max_abs,
                        help="largest per-token log-prob difference allowed (default %(default)g)")
    parser.add_argument("--min-topk-agreement", type=float, default=defaults.topk_agreement_min,
                        help="smallest share of positions, per layer, with the same top-K experts (default %(default)g)")
    parser.add_argument("--router-prob-atol", type=float, default=defaults.router_prob_max_abs,
                        help="largest router-probability difference at Megatron's experts (default %(default)g)")
    parser.add_argument("--json", default=None, help="also write the report here")
    args = parser.parse_args(argv)

    def body() -> int:
        if args.prompts:
            prompts = load_prompts(args.prompts, args.hf)
        else:
            vocab = read_export_source(args.megatron).model.vocab_size
            prompts = random_prompts(args.random_prompts, args.prompt_length, vocab, args.seed)
        report = check_parity(args.hf, args.megatron, prompts, _layout(args), args.world_size)
        tolerances = ParityTolerances(
            logprob_max_abs=args.logprob_atol,
            topk_agreement_min=args.min_topk_agreement,
            router_prob_max_abs=args.router_prob_atol,
        )
        violations = report.violations(tolerances)
        text = json.dumps({**report.to_dict(), "violations": violations}, indent=1)
        print(text)
        if args.json:
            Path(args.json).write_text(text + "\n")
        return 1 if violations else 0

    return _run("megatron-rl-logprob-parity", args, body)


def export_fp8_main(argv: Sequence[str] | None = None) -> int:
    """``export_fp8 HF_DIR OUT_DIR``: block-wise FP8 weights for rollout engines."""
    from megatron_rl.checkpoint.fp8 import export_fp8

    parser = _parser("megatron-rl-export-fp8", "HF checkpoint -> block-wise (128x128) FP8 e4m3 copy")
    parser.add_argument("hf_dir", help="HF checkpoint (e.g. the output of convert_megatron_to_hf)")
    parser.add_argument("out_dir", help="new directory for the FP8 checkpoint")
    parser.add_argument("--no-progress", action="store_true", help="hide progress bars")
    args = parser.parse_args(argv)

    def body() -> int:
        print(f"wrote {export_fp8(args.hf_dir, args.out_dir, progress=not args.no_progress)}")
        return 0

    return _run("megatron-rl-export-fp8", args, body)
