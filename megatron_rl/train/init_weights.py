"""Fill a fresh policy stage from the run's starting checkpoint, in the run's own layout.

Owns: streaming an HF checkpoint into this rank's stage (each parameter is read, fused
and cut to this rank's tensor-parallel shard, one tensor at a time, so no rank ever holds
the whole model; experts are read only by the rank that owns them), with the check that
every HF tensor was consumed by some rank; and loading a Megatron distributed checkpoint
(resharded by Megatron's ``dist_checkpointing``), including the model part of a trainer
checkpoint. Does not own validating the source (``megatron_rl.checkpoint.init_source``,
done from the config before any process starts) or resuming a run.
"""

from __future__ import annotations

import torch

from megatron_rl.checkpoint.errors import CheckpointMismatchError, format_names
from megatron_rl.checkpoint.families import mtp_tensor_names
from megatron_rl.checkpoint.weight_rules import passthrough_names
from megatron_rl.checkpoint.hf_config import read_config
from megatron_rl.checkpoint.hf_io import HFCheckpoint
from megatron_rl.checkpoint.init_source import InitSource
from megatron_rl.checkpoint.megatron_io import fill_from_hf, load_megatron_model_into
from megatron_rl.parallel.comm import all_gather_objects
from megatron_rl.parallel.groups import ParallelGroups
from megatron_rl.sections import ModelConfig


def load_initial_weights(gpt: torch.nn.Module, source: InitSource, model: ModelConfig, groups: ParallelGroups) -> None:
    """Collective over the world: overwrite every parameter of ``gpt`` from ``source``.

    Args:
        gpt: this rank's bare ``GPTModel`` stage (built with the run's layout).
        source: the validated starting checkpoint.
        model: the run's model config (its dtype may differ from the checkpoint's: cast).
        groups: this rank's parallel groups.

    Raises:
        CheckpointMismatchError: a parameter has no HF tensor, or HF tensors were left
            unused by every rank (named).
    """
    if source.kind == "megatron":
        load_megatron_model_into(gpt, source.path)
        return
    checkpoint = HFCheckpoint(source.path)
    used = fill_from_hf(gpt, source.hf.arch, model, checkpoint, groups.tp_rank, groups.tp_size, cast=True)
    everyone = all_gather_objects(used, groups.world)
    # A checkpoint's multi-token-prediction layers are not part of the policy (noted when
    # the checkpoint was inspected).
    skipped = mtp_tensor_names(read_config(source.path), checkpoint.names())
    unused = set(checkpoint.names()) - set().union(*everyone) - set(skipped)
    unused -= set(passthrough_names(source.hf.arch, checkpoint.names()))
    if unused:
        raise CheckpointMismatchError(f"{source.path}: HF tensors no parameter consumed: {format_names(unused)}")
