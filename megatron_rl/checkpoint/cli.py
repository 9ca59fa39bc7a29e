"""Command lines of the checkpoint tools (``tools/*.py`` and the console scripts call these).

Owns: argument parsing, size strings ("5GB"), prompt selection for the parity check and
exit codes: 0 success, 1 parity outside tolerance, 2 a checkpoint or config that does not
fit (the message names the tensor or key). Does not own any conversion logic.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Callable, Sequence

from megatron_rl.checkpoint.errors import CheckpointMismatchError
from megatron_rl.config import ConfigError, ParallelConfig

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


def _run(body: Callable[[], int]) -> int:
    """Run a tool body, turning expected failures into one line and exit code 2."""
    try:
        return body()
    except (CheckpointMismatchError, ConfigError, FileExistsError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


def hf_to_megatron_main(argv: Sequence[str] | None = None) -> int:
    """``convert_hf_to_megatron HF_DIR OUT_DIR [--tp N --ep N --pp N]``."""
    from megatron_rl.checkpoint.convert import convert_hf_to_megatron

    parser = argparse.ArgumentParser(description="HF safetensors -> Megatron distributed checkpoint")
    parser.add_argument("hf_dir", help="HF checkpoint directory (config.json + safetensors)")
    parser.add_argument("out_dir", help="new directory for the distributed checkpoint")
    _layout_args(parser)
    parser.add_argument("--no-progress", action="store_true", help="hide progress bars")
    args = parser.parse_args(argv)

    def body() -> int:
        path = convert_hf_to_megatron(
            args.hf_dir,
            args.out_dir,
            _layout(args),
            world_size=args.world_size,
            progress=not args.no_progress,
        )
        print(f"wrote {path}")
        return 0

    return _run(body)


def megatron_to_hf_main(argv: Sequence[str] | None = None) -> int:
    """``convert_megatron_to_hf MEGATRON_DIR OUT_DIR [--hf-config DIR] [--max-shard-size 5GB]``."""
    from megatron_rl.checkpoint.convert import convert_megatron_to_hf

    parser = argparse.ArgumentParser(description="Megatron distributed checkpoint -> HF safetensors")
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

    return _run(body)


def parity_main(argv: Sequence[str] | None = None) -> int:
    """``logprob_parity --hf DIR --megatron DIR [--prompts FILE | --random-prompts N]``."""
    from megatron_rl.checkpoint.convert import read_export_source
    from megatron_rl.checkpoint.parity import ParityTolerances, check_parity, load_prompts, random_prompts

    parser = argparse.ArgumentParser(description="Log-prob and routing parity: transformers vs Megatron")
    parser.add_argument("--hf", required=True, help="HF checkpoint directory")
    parser.add_argument("--megatron", required=True, help="distributed checkpoint (from the converter)")
    _layout_args(parser)
    parser.add_argument("--prompts", default=None, help="JSON list of prompts: token-id lists or strings")
    parser.add_argument("--random-prompts", type=int, default=8, help="random prompts without --prompts")
    parser.add_argument("--prompt-length", type=int, default=64, help="tokens per random prompt")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    defaults = ParityTolerances()
    parser.add_argument("--logprob-atol", type=float, default=defaults.logprob_max_abs)
    parser.add_argument("--min-topk-agreement", type=float, default=defaults.topk_agreement_min)
    parser.add_argument("--router-prob-atol", type=float, default=defaults.router_prob_max_abs)
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

    return _run(body)


def export_fp8_main(argv: Sequence[str] | None = None) -> int:
    """``export_fp8 HF_DIR OUT_DIR``: block-wise FP8 weights for rollout engines."""
    from megatron_rl.checkpoint.fp8 import export_fp8

    parser = argparse.ArgumentParser(description="HF checkpoint -> block-wise (128x128) FP8 e4m3 copy")
    parser.add_argument("hf_dir", help="HF checkpoint (e.g. the output of convert_megatron_to_hf)")
    parser.add_argument("out_dir", help="new directory for the FP8 checkpoint")
    parser.add_argument("--no-progress", action="store_true", help="hide progress bars")
    args = parser.parse_args(argv)

    def body() -> int:
        print(f"wrote {export_fp8(args.hf_dir, args.out_dir, progress=not args.no_progress)}")
        return 0

    return _run(body)
