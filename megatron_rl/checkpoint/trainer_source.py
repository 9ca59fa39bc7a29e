"""Exporting a trainer checkpoint: the model its run config names, and which keys are the optimizer's.

A checkpoint written by :func:`megatron_rl.train.checkpoint.save_checkpoint` is a Megatron
distributed checkpoint holding the model *and* Megatron's optimizer state
(``chained_<i>.optimizer.state.exp_avg.<parameter>``, ...), next to ``trainer_state.json``
(step, data position, weight version and the run's full config) and an ``rng/`` folder.

Owns: recognizing such a directory, the precise rule for the optimizer's keys (skipped
only in trainer checkpoints: in a plain model checkpoint they would be unknown tensors),
the model config and HF architecture the run config names, and the check that an HF
config given for the export describes the model the trainer trained. Imports no
Megatron, like the rest of the validation code.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, fields
from pathlib import Path

from megatron_rl.checkpoint.errors import CheckpointMismatchError
from megatron_rl.checkpoint.mapping import ARCHITECTURES
from megatron_rl.config import ConfigError, ModelConfig, from_dict

TRAINER_STATE_NAME = "trainer_state.json"
DEFAULT_ARCHITECTURE = "qwen3_moe"
"""What the trainer's ``rollout.sglang.hf_architecture`` defaults to."""

# Megatron's optimizer state dict: ``optimizer.state.<name>.<param key>`` for one optimizer,
# prefixed ``chained_<i>.`` for each member of a ChainedOptimizer (dense + experts).
_OPTIMIZER_KEY = re.compile(r"^(chained_\d+\.)?optimizer\.")

# ModelConfig fields that only matter to training: they do not change the forward pass an
# exported HF model computes, and HF configs do not record them faithfully.
_TRAINING_ONLY = ("moe_aux_loss_coeff", "init_method_std")


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
    return _OPTIMIZER_KEY.match(key) is not None


def read_trainer_model(directory: str | Path) -> TrainerModel:
    """The architecture and model config of a trainer checkpoint's run.

    Raises:
        CheckpointMismatchError: ``trainer_state.json`` has no ``config.model``, names an
            unknown architecture, or its model section does not parse (key named).
    """
    path = Path(directory) / TRAINER_STATE_NAME
    body = json.loads(path.read_text())
    config = body.get("config")
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
