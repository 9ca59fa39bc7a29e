"""Megatron-Core's distributed checkpoints: how a sharded state dict is stored, and how a
synchronous save hands back its write results.

The checkpoint half of :mod:`megatron_rl.parallel.mcore_compat` (same rule, same contract
tests in ``tests/unit/test_mcore_contract.py``); the format's constants that the input checks
read before Megatron is imported stay there. Each helper gives its reason in its docstring and
holds for 0.16.1 and 0.19.2. Importing this module imports no Megatron-Core.
"""

from __future__ import annotations

import dataclasses
import importlib
import queue
from typing import Any, Callable, Mapping

from megatron_rl.parallel import mcore_compat as mc

WRITER_MODULE = "megatron.core.dist_checkpointing.strategies.filesystem_async"
"""The module of the torch_dist writer whose results queue :func:`collect_write_results_here` sets."""


def collect_write_results_here() -> None:
    """Let a synchronous save hand its write results back through a queue of this process.

    The torch_dist writer passes each save's results through a module-global queue that it
    creates, at the first save, from a ``spawn``-ed ``multiprocessing.Manager``
    (``filesystem_async.py`` ``_get_write_results_queue``, 0.16.1 :48-56; 0.19.2
    ``get_write_results_queue`` :49-66): a fresh interpreter per rank and run, 3-4 CPU-s on a
    CPU, which only an *asynchronous* save needs (its writer runs in another process). Our saves
    are synchronous (``dist_checkpointing.save`` without ``async_sharded_save``): the results are
    put (``write_preloaded_data_multiproc``, run by ``AsyncRequest.execute_sync``) and taken
    (``retrieve_write_results``) by the calling process, so a plain queue carries them. Set only
    while no queue exists, so a queue Megatron made is never replaced.
    """
    writer = importlib.import_module(WRITER_MODULE)
    if writer._results_queue is None:
        writer._results_queue = queue.Queue()


@dataclasses.dataclass(frozen=True)
class StoredBox:
    """One box of a stored tensor: ``key`` at ``offsets`` with ``shape`` (prepended axes included)."""

    key: str
    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    dtype: Any


def stored_boxes(entry: Any) -> tuple[list[StoredBox], Callable[[list], Any]]:
    """The stored boxes that make one sharded-state-dict entry, and how to merge them back.

    A ``ShardedTensorFactory`` (e.g. fused gate/up weights) stores several parts; a
    ``ShardedTensor`` stores one box whose shape gains ``prepend_axis_num`` leading 1s.
    """
    if isinstance(entry, mc.__getattr__("ShardedTensorFactory")):
        parts = entry.build()
        parts = parts if isinstance(parts, list) else [parts]
        boxes = [stored_boxes(p)[0][0] for p in parts]

        def merge(tensors, parts=parts):
            return entry.merge_fn([t.reshape(p.local_shape) for t, p in zip(tensors, parts)])

        return boxes, merge
    shape = (1,) * entry.prepend_axis_num + tuple(entry.local_shape)
    box = StoredBox(entry.key, tuple(entry.global_offset), shape, entry.dtype)
    return [box], lambda tensors: tensors[0].reshape(entry.local_shape)


def stored_tensor_shapes(sharded_state_dict: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """Checkpoint key -> global shape of every tensor a sharded state dict stores."""
    factory, tensor = mc.__getattr__("ShardedTensorFactory"), mc.__getattr__("ShardedTensor")
    shapes = {}
    for entry in sharded_state_dict.values():
        parts = entry.build() if isinstance(entry, factory) else [entry]
        for part in parts if isinstance(parts, list) else [parts]:
            if isinstance(part, tensor):
                shapes[part.key] = tuple(part.global_shape)
    return shapes


def stored_object_keys(sharded_state_dict: Mapping[str, Any]) -> set[str]:
    """Keys of the ShardedObjects a sharded state dict stores."""
    sharded_object = mc.__getattr__("ShardedObject")
    return {e.key for e in sharded_state_dict.values() if isinstance(e, sharded_object)}


def object_base_key(stored_key: str) -> str:
    """The ShardedObject key of a stored object key (``<key>/shard_...`` -> ``<key>``)."""
    return stored_key.split(mc.SHARDED_OBJECT_SEPARATOR)[0]


def is_megatron_object(base_key: str) -> bool:
    """A stored object Megatron writes for itself (not one of the model's)."""
    return base_key == mc.COMMON_STATE_KEY


def return_unexpected() -> Any:
    """``dist_checkpointing.load(strict=...)`` value that returns the absent keys as a 3-tuple."""
    return mc.__getattr__("StrictHandling").RETURN_UNEXPECTED
