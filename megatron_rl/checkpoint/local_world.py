"""The local worlds the checkpoint tools run in, and the layouts they accept.

Owns: the fewest processes a layout needs; the check that a TP/EP/PP layout divides the
model, naming the dimension and the sizes that would work (before any process starts);
and running a body on every rank of a local gloo world (in this process for a world of
one) so that an input problem met inside a rank (a :class:`CheckpointMismatchError`,
:class:`ConfigError` or OSError) reaches the caller once, as that rank's one-line
message, instead of every rank's traceback. Does not own what the ranks do.

The vocabulary: a tensor-parallel size must divide Megatron's padded vocabulary
(``ModelConfig.padded_vocab_size``: V rounded up to ``model.vocab_padding_multiple``, 1
unless the conversion was asked to pad). When it does not, the message says which
multiple pads V to a size it divides. Padding never changes a log-prob: the padded rows
are masked out of every softmax (``megatron_rl.parallel.vocab_parallel``).
"""

from __future__ import annotations

import math
import shutil
import tempfile
from pathlib import Path

import torch.distributed as dist

from megatron_rl.checkpoint.errors import CheckpointMismatchError
from megatron_rl.checkpoint.inputs import describe_os_error
from megatron_rl.config_loading import ConfigError
from megatron_rl.parallel import comm
from megatron_rl.parallel.world import WorldError, run_world, world_of_one
from megatron_rl.sections import (
    ModelConfig,
    ParallelConfig,
    validate_layout,
    vocab_padding_hint,
)

_INPUT_ERRORS = (CheckpointMismatchError, ConfigError, OSError)


def minimal_world_size(parallel: ParallelConfig) -> int:
    """Fewest processes that hold the layout (TP x PP dense, ETP x EP x PP experts)."""
    tp, pp = parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size
    experts = parallel.expert_tensor_parallel_size * parallel.expert_model_parallel_size * pp
    return math.lcm(tp * pp * parallel.context_parallel_size, experts)


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def check_layout(model: ModelConfig, parallel: ParallelConfig, world_size: int) -> None:
    """Refuse a layout that does not divide the model, naming the dimension and the sizes that work.

    Raises:
        ConfigError: TP does not divide the heads, query groups or padded vocabulary; EP the
            experts; PP the layers; expert-TP is not 1; or ``validate_layout`` objects.
    """
    p = parallel
    if p.expert_tensor_parallel_size != 1:
        raise ConfigError(
            "parallel.expert_tensor_parallel_size: conversion splits experts over EP only (ETP=1); "
            "the checkpoint it writes loads into any ETP"
        )
    tp, ep, pp = p.tensor_model_parallel_size, p.expert_model_parallel_size, p.pipeline_model_parallel_size
    for name, size in (("--tp", tp), ("--ep", ep), ("--pp", pp)):
        if size < 1:
            raise ConfigError(f"{name} {size}: must be >= 1")
    tp_dims = {
        "num_attention_heads": model.num_attention_heads,
        "num_query_groups": model.num_query_groups,
        "padded_vocab_size": model.padded_vocab_size,
    }
    for dim, value in tp_dims.items():
        if value % tp:
            working = _divisors(math.gcd(*tp_dims.values()))
            what = f"model.{dim}={value}"
            hint = ""
            if dim == "padded_vocab_size":
                what = (f"the vocabulary (model.vocab_size={model.vocab_size} rounded up to "
                        f"model.vocab_padding_multiple={model.vocab_padding_multiple}: {value})")
                hint = f"; {vocab_padding_hint(model, tp)}, converting with --vocab-padding-multiple"
            raise ConfigError(
                f"--tp {tp} (tensor_model_parallel_size) does not divide {what}; TP sizes that divide "
                f"{', '.join(f'{k}={v}' for k, v in tp_dims.items())}: {working}{hint}"
            )
    if model.num_experts % ep:
        raise ConfigError(
            f"--ep {ep} (expert_model_parallel_size) does not divide model.num_experts={model.num_experts}; "
            f"EP sizes that work: {_divisors(model.num_experts)}"
        )
    if model.num_layers % pp:
        raise ConfigError(
            f"--pp {pp} (pipeline_model_parallel_size) does not divide model.num_layers={model.num_layers}; "
            f"PP sizes that work: {_divisors(model.num_layers)}"
        )
    validate_layout(model, parallel, world_size)


def one_line(err: BaseException) -> str:
    """The message of an input error, on one line (an OSError names its file)."""
    text = describe_os_error(err) if isinstance(err, OSError) else str(err)
    return " ".join(text.split())


def _reporting_rank(report_dir: str, entry, *args):
    """A rank's body: an input error leaves its one-line message for the caller, then raises."""
    try:
        return entry(*args)
    except _INPUT_ERRORS as err:
        rank = comm.rank(dist.group.WORLD)
        (Path(report_dir) / f"rank_{rank:05d}.txt").write_text(f"{type(err).__name__}\n{one_line(err)}")
        raise


def run_local(entry, world_size: int, *args, timeout_s: float) -> list:
    """``entry(*args)`` on every rank of a new local gloo world; results by rank.

    A world of one runs in this process (no spawn: Megatron is imported once, and a
    failure raises its own exception); larger worlds are spawned by ``run_world``.

    Raises:
        CheckpointMismatchError: a rank met an input problem; the message is the lowest
            such rank's, prefixed with its number (the other ranks' follow-on failures,
            peers left waiting in a collective, are not repeated).
        WorldError: a rank failed in any other way (its traceback).
    """
    if world_size > 1:
        report_dir = tempfile.mkdtemp(prefix="megatron-rl-ranks-")
        try:
            return run_world(_reporting_rank, world_size, report_dir, entry, *args, timeout_s=timeout_s)
        except WorldError:
            reports = sorted(Path(report_dir).glob("rank_*.txt"))
            if not reports:
                raise
            kind, message = reports[0].read_text().split("\n", 1)
            rank = int(reports[0].stem.split("_")[1])
            error = ConfigError if kind == "ConfigError" else CheckpointMismatchError
            raise error(f"rank {rank}: {message}") from None
        finally:
            shutil.rmtree(report_dir, ignore_errors=True)
    with world_of_one():
        return [entry(*args)]
