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
    state = dist_checkpointing.load(model.sharded_state_dict(), str(directory))
    result = model.load_state_dict(state, strict=False)
    missing = [k for k in result.missing_keys if not k.endswith("_extra_state")]
    unexpected = [k for k in result.unexpected_keys if not k.endswith("_extra_state")]
    if strict and (missing or unexpected):
        raise RuntimeError(
            f"checkpoint {directory} does not match the model: "
            f"missing {missing[:10]}, unexpected {unexpected[:10]}"
        )
