"""Model weights in Megatron's distributed checkpoint format, resharded on load.

Owns: saving a model stage's sharded state dict and loading it into a model built with
any other TP/EP/PP layout (Megatron's ``dist_checkpointing`` reassembles shards by their
global offsets). Does not own optimizer state or trainer progress, which the trainer's
checkpoint layers on top.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing

from megatron_rl.parallel.mcore_compat import return_unexpected


def save_model(model: torch.nn.Module, directory: str | Path) -> None:
    """Collectively save ``model``'s sharded state dict into ``directory``.

    Every rank of the world must call this; the directory must not hold a checkpoint yet.
    """
    directory = Path(directory)
    if dist.get_rank() == 0:
        directory.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save(model.sharded_state_dict(), str(directory))
    dist.barrier()


def load_model(model: torch.nn.Module, directory: str | Path, strict: bool = True) -> None:
    """Collectively load a checkpoint written under any layout into ``model``.

    Raises:
        FileNotFoundError: ``directory`` holds no distributed checkpoint.
        RuntimeError: keys missing or unexpected (``strict``), naming them.
    """
    directory = Path(directory)
    if not dist_checkpointing.check_is_distributed_checkpoint(str(directory)):
        raise FileNotFoundError(f"{directory} is not a Megatron distributed checkpoint")
    state = load_sharded(model.sharded_state_dict(), directory)
    result = model.load_state_dict(state, strict=False)
    missing = [k for k in result.missing_keys if not k.endswith("_extra_state")]
    unexpected = [k for k in result.unexpected_keys if not k.endswith("_extra_state")]
    if strict and (missing or unexpected):
        raise RuntimeError(
            f"checkpoint {directory} does not match the model: "
            f"missing {missing[:10]}, unexpected {unexpected[:10]}"
        )


def load_sharded(sharded_state_dict: dict, directory: str | Path) -> dict:
    """Collective: ``dist_checkpointing.load`` that tolerates absent ``_extra_state`` objects.

    Transformer Engine modules carry an ``_extra_state`` (FP8 scaling metadata, empty
    without FP8) that Megatron's local modules do not have, so a TE-spec model asks for
    objects a local-spec checkpoint never wrote; those start fresh, as in a new TE model.
    Every tensor must still be in the checkpoint.

    Raises:
        RuntimeError: a requested tensor is not in the checkpoint (named).
    """
    # "Unexpected" in Megatron's terms: asked for, not in the checkpoint (left out of the load).
    state, _, absent = dist_checkpointing.load(sharded_state_dict, str(directory), strict=return_unexpected())
    absent = sorted(str(k) for k in absent if not str(k).endswith("_extra_state"))
    if absent:
        raise RuntimeError(f"checkpoint {directory} lacks {absent[:10]} ({len(absent)} in all)")
    return state
