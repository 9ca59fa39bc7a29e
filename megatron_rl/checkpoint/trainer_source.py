"""Exporting a trainer checkpoint: the model its run config names, and which keys are the optimizer's.

A checkpoint written by :func:`megatron_rl.train.checkpoint.save_checkpoint` is a Megatron
distributed checkpoint holding the model *and* Megatron's optimizer state
(``chained_<i>.optimizer.state.exp_avg.<parameter>``, ...), next to ``trainer_state.json``
(step, data position, weight version and the run's full config) and an ``rng/`` folder.

Owns: recognizing such a directory, the precise rule for the optimizer's keys (skipped
only in trainer checkpoints: in a plain model checkpoint they would be unknown tensors),
the model config and HF architecture the run config names, the check that every file of a
trainer checkpoint is whole before a run resumes from it, and the check that an HF
config given for the export describes the model the trainer trained. Imports no
Megatron, like the rest of the validation code.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path

import torch

from megatron_rl.checkpoint.errors import CheckpointMismatchError
from megatron_rl.checkpoint.inputs import (
    check_dist_checkpoint,
    load_torch_file,
    read_json,
)
from megatron_rl.checkpoint.mapping import ARCHITECTURES
from megatron_rl.config_loading import ConfigError, from_dict
from megatron_rl.parallel.mcore_compat import OPTIMIZER_KEY
from megatron_rl.sections import ModelConfig

TRAINER_STATE_NAME = "trainer_state.json"
TRAINER_STATE_KEYS = ("step", "data_position", "weight_version", "config")
"""Keys every ``trainer_state.json`` holds (``optimizer_state`` is newer and optional)."""
RNG_DIR = "rng"
DEFAULT_ARCHITECTURE = "qwen3_moe"
"""What the trainer's ``rollout.sglang.hf_architecture`` defaults to."""


# ModelConfig fields that do not change the forward pass an exported HF model computes and
# that HF configs do not record faithfully (or at all: the vocabulary padding is Megatron's).
_TRAINING_ONLY = ("moe_aux_loss_coeff", "init_method_std", "vocab_padding_multiple")


@dataclass(frozen=True)
class TrainerModel:
    """The model a trainer checkpoint holds, as its run config describes it."""

    architecture: str
    """HF model_type to export as (``rollout.sglang.hf_architecture``, default qwen3_moe)."""
    model: ModelConfig
    """The run's ``model`` section."""


def is_trainer_checkpoint(directory: str | Path) -> bool:
    """Whether ``directory`` was written by the trainer (it has ``trainer_state.json``)."""
    return (Path(directory) / TRAINER_STATE_NAME).is_file()


def is_optimizer_key(key: str) -> bool:
    """Whether a stored key (tensor, or byte object ``<key>/shard_...``) is the optimizer's."""
    # Megatron's optimizer state dict naming (mcore_compat.OPTIMIZER_KEY).
    return OPTIMIZER_KEY.match(key) is not None


def read_trainer_model(directory: str | Path) -> TrainerModel:
    """The architecture and model config of a trainer checkpoint's run.

    Raises:
        CheckpointMismatchError: ``trainer_state.json`` has no ``config.model``, names an
            unknown architecture, or its model section does not parse (key named).
    """
    path = Path(directory) / TRAINER_STATE_NAME
    config = read_json(path, required=("config",))["config"]
    if not isinstance(config, dict) or not isinstance(config.get("model"), dict):
        raise CheckpointMismatchError(f"{path}: key 'config.model' is missing")
    try:
        model = from_dict(ModelConfig, config["model"], prefix="config.model")
    except ConfigError as err:
        raise CheckpointMismatchError(f"{path}: {err}") from None
    sglang = (config.get("rollout") or {}).get("sglang") or {}
    architecture = sglang.get("hf_architecture", DEFAULT_ARCHITECTURE)
    if architecture not in ARCHITECTURES.names():
        raise CheckpointMismatchError(
            f"{path}: config.rollout.sglang.hf_architecture={architecture!r} is not one of "
            f"{sorted(ARCHITECTURES.names())}"
        )
    return TrainerModel(architecture=architecture, model=model)


def check_same_model(trained: ModelConfig, exported: ModelConfig, source: str | Path) -> None:
    """Refuse an export config that describes another model than the one trained.

    Raises:
        CheckpointMismatchError: naming every differing field with both values.
    """
    differ = [
        f"{f.name}: trainer {getattr(trained, f.name)!r}, {source} {getattr(exported, f.name)!r}"
        for f in fields(ModelConfig)
        if f.name not in _TRAINING_ONLY and getattr(trained, f.name) != getattr(exported, f.name)
    ]
    if differ:
        raise CheckpointMismatchError(
            f"the HF config from {source} does not describe the model the trainer trained: " + "; ".join(differ)
        )


def check_trainer_checkpoint(directory: str | Path) -> dict:
    """Check every file a resume reads, before any rank loads it; the ``trainer_state.json`` body.

    ``trainer_state.json`` must parse and hold :data:`TRAINER_STATE_KEYS`, every ``.distcp``
    shard be present and as long as ``.metadata`` says, and every ``rng/rank_*.pt`` load
    (weights only) to ``{"torch": <RNG state tensor>}``.

    Raises:
        CheckpointMismatchError: naming the first missing, truncated or corrupt file.
    """
    directory = Path(directory)
    body = read_json(directory / TRAINER_STATE_NAME, required=TRAINER_STATE_KEYS)
    check_dist_checkpoint(directory)
    for path in sorted((directory / RNG_DIR).glob("rank_*.pt")):
        state = load_torch_file(path)
        if not isinstance(state, dict) or not isinstance(state.get("torch"), torch.Tensor):
            raise CheckpointMismatchError(f"{path}: expected {{'torch': <RNG state tensor>}}")
    return body
