"""Model weights and optimizer state in Megatron's distributed checkpoint format, resharded on load.

Owns: saving a model stage's sharded state dict and loading it into a model built with
any other TP/EP/PP layout (Megatron's ``dist_checkpointing`` reassembles shards by their
global offsets), and the sharded state of model + optimizer that the trainer's checkpoint
saves and loads (:func:`training_state`, :func:`load_training_state`). A distributed
optimizer's state is written in the format its metadata names (``fully_reshardable``:
model space, any TP/PP/DP/EP>1 at load; ``dp_reshardable``: buffer space, DP only), and
the metadata is the checkpoint's content metadata, so a load reads the format it was
written in. Does not own trainer progress, which the trainer's checkpoint layers on top.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing

from megatron_rl.parallel import mcore_compat as mc
from megatron_rl.parallel.mcore_checkpoint import collect_write_results_here, return_unexpected
from megatron_rl.parallel.mcore_optimizer import (
    adam_step_fix,
    distributed_optimizer_metadata,
    fill_adam_state,
    uses_distributed_optimizer,
)
from megatron_rl.parallel.optim import gather_updated_weights
from megatron_rl.parallel.schedule import unwrap


def save_model(model: torch.nn.Module, directory: str | Path) -> None:
    """Collectively save ``model``'s sharded state dict into ``directory``.

    Every rank of the world must call this; the directory must not hold a checkpoint yet.
    """
    directory = Path(directory)
    if dist.get_rank() == 0:
        directory.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    collect_write_results_here()
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


def optimizer_sharding(model: torch.nn.Module, sharding: str) -> str | None:
    """The distributed optimizer's checkpoint format for a DDP-wrapped ``model`` (None: the
    plain optimizer, whose model-space format needs no metadata)."""
    return sharding if uses_distributed_optimizer(model) else None


def has_optimizer_state(optimizer) -> bool:
    """Whether the optimizer holds per-parameter state (it has stepped)."""
    return optimizer is not None and any(param_state for _, param_state in optimizer.state.items())


def save_training_state(model, optimizer, directory: str | Path, sharding: str | None) -> None:
    """Collective (every rank): save model and optimizer into ``directory``.

    ``sharding`` (from :func:`optimizer_sharding`) is the distributed optimizer's format,
    saved as the checkpoint's content metadata; None for the plain optimizer. A distributed
    optimizer that has not stepped is saved with the state a first step creates (step 0,
    zero moments), which updates exactly like none; a plain one without state saves its
    param groups only.
    """
    gather_updated_weights(model)
    metadata = distributed_optimizer_metadata(sharding) if sharding is not None else None
    if sharding is not None:
        fill_adam_state(optimizer)
    model_sd = unwrap(model).sharded_state_dict()
    state = {"model": model_sd}
    if optimizer is not None:
        state["optimizer"] = optimizer.sharded_state_dict(model_sd, is_loading=False, metadata=metadata)
    writer_log = logging.getLogger(mc.ASYNC_WRITER_LOGGER)
    if not any(isinstance(f, _RaisedAnyway) for f in writer_log.filters):
        writer_log.addFilter(_RaisedAnyway())
    collect_write_results_here()
    dist_checkpointing.save(state, str(directory), content_metadata=metadata)


class _RaisedAnyway(logging.Filter):
    """Drops Megatron's line for a write worker's failure ("Local process N encountered an
    error: [enforce fail at inline_container.cc ...]"): the save raises that error, and the
    run reports it once, in one line naming the path and the cause (a full disk)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Local process ")


def load_training_state(model, optimizer, directory: str | Path, with_optimizer_state: bool) -> None:
    """Collective (every rank): load a checkpoint of :func:`save_training_state`, written
    under any layout its format reshards to, into ``model`` and ``optimizer``.

    Raises:
        RuntimeError: the checkpoint's optimizer (plain or distributed) is not this one's.
    """
    metadata = dist_checkpointing.load_content_metadata(str(directory))
    saved = (metadata or {}).get("distrib_optim_sharding_type")
    live = optimizer is not None and uses_distributed_optimizer(model)
    if optimizer is not None and (saved is not None) != live:
        raise RuntimeError(
            f"checkpoint {directory} holds the {'distributed' if saved else 'plain'} optimizer's state, "
            f"but this run uses the {'distributed' if live else 'plain'} optimizer (optim.distributed)")
    model_sd = unwrap(model).sharded_state_dict()
    state = {"model": model_sd}
    if optimizer is not None and saved is not None:
        # The load template is built from the live state (fresh optimizers have none yet), in
        # the format the checkpoint was written in (its content metadata, as Megatron-LM loads).
        fill_adam_state(optimizer)
        state["optimizer"] = optimizer.sharded_state_dict(model_sd, is_loading=True, metadata=metadata)
    elif optimizer is not None:
        # Megatron's ``is_loading`` creates the plain optimizer's state (zeros) so that a load
        # can fill it in; a checkpoint saved before the first step has none to fill it with.
        state["optimizer"] = optimizer.sharded_state_dict(model_sd, is_loading=with_optimizer_state)
    loaded = dist_checkpointing.load(state, str(directory))
    # With the distributed optimizer the parameters are views into DDP's buffer: this fills it.
    unwrap(model).load_state_dict(loaded["model"], strict=False)
    if optimizer is None:
        return
    # no_grad: with fp32 weights the distributed optimizer's main weights are views of the
    # parameters, and its dp_reshardable load copies into them with autograd on (0.16.1
    # distrib_optimizer.py:1772; the fully_reshardable load is already under no_grad).
    with torch.no_grad(), adam_step_fix(optimizer):
        optimizer.load_state_dict(loaded["optimizer"])
