"""SGLang 0.5.23's weight-update requests: the JSON bodies and the serialized tensors they carry.

Owns the bodies of ``/begin_weight_update``, ``/end_weight_update``,
``/update_weights_from_tensor``, ``/init_weights_update_group``,
``/update_weights_from_distributed`` and ``/destroy_weights_update_group`` (the fields of
``srt/managers/io_struct.py:2002-2047``, ``:2126-2138``, ``:2197-2209``; the conformance tests
validate every body built here with those very definitions), and the
``serialized_named_tensors`` entries, in the form SGLang's scheduler reads:
``MultiprocessingSerializer.deserialize`` of entry ``tp_rank`` under its ``SafeUnpickler``
(``srt/managers/tp_worker.py:194-201``, ``srt/utils/common.py:3084-3099``, ``:3144-3370``):

* **By value** (CPU tensors): ``base64(pickle.dumps([(name, tensor), ...]))`` with torch's own
  tensor pickling (``torch._utils._rebuild_tensor_v2`` over ``torch.storage._load_from_bytes``),
  both on SGLang's allow-list. A custom reducer's global is not, and SGLang raises inside its
  scheduler, which kills the server (``srt/managers/scheduler.py:6370-6376``). torch pickles
  the "new" dtypes (float8_*, uint16/32/64) through ``_rebuild_tensor_v3`` and an untyped
  storage, which the ``torch.load(weights_only=True)`` inside the allow-list refuses, so those
  are refused here, up front, naming the modes that carry them.
* **By reference** (CUDA tensors, a colocated server): torch's CUDA IPC reduction with the
  device index replaced by the GPU's UUID, as SGLang's ``monkey_patch_torch_reductions`` writes
  it (``srt/utils/patch_torch.py:41-59``, ``:72-77``, ``:85-86``); the server maps the UUID back
  to its own device index (``:80-99``), so trainer and server may see different
  ``CUDA_VISIBLE_DEVICES``. Serialized once per server TP rank
  (``srt/entrypoints/http_server_engine.py:107-117``): each rank's copy carries its own IPC
  reference count.

Does not own HTTP (:mod:`~megatron_rl.rollout.sglang.weight_transport`) or which tensors go
together (:mod:`~megatron_rl.rollout.sglang.loader_rules`).
"""

from __future__ import annotations

import base64
import io
import pickle
from typing import Sequence

import torch

NamedTensors = Sequence[tuple[str, torch.Tensor]]
"""One bucket: ``[(server_name, tensor), ...]``."""

BY_VALUE_DTYPES = frozenset({torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
                             torch.int16, torch.int8, torch.uint8, torch.bool})
"""Dtypes torch pickles through typed storages, which SGLang's ``SafeUnpickler`` reads back."""


class WeightPayloadError(ValueError):
    """A tensor cannot travel in the requested form; the message names it and the way that works."""


def check_by_value_dtype(name: str, dtype: torch.dtype) -> None:
    """Refuse a dtype SGLang cannot read from a CPU payload (see the module docstring)."""
    if dtype not in BY_VALUE_DTYPES:
        raise WeightPayloadError(
            f"weight sync: {name} is {str(dtype).removeprefix('torch.')}, which SGLang 0.5.23 cannot read from a "
            "CPU tensor payload of /update_weights_from_tensor (its SafeUnpickler's torch.load(weights_only=True) "
            "refuses torch's pickling of that dtype, srt/utils/common.py:3135-3141); use "
            "rollout.sglang.weight_sync=distributed, or CUDA tensors with a colocated server")


def _owning(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` on the CPU in a storage of exactly its own bytes (pickling writes the whole storage)."""
    tensor = tensor.detach().cpu()
    if not tensor.is_contiguous() or tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size():
        tensor = tensor.clone(memory_format=torch.contiguous_format)
    return tensor


def serialize_by_value(named: NamedTensors) -> str:
    """One ``serialized_named_tensors`` entry holding the tensors' bytes (any TP rank may read it)."""
    for name, tensor in named:
        check_by_value_dtype(name, tensor.dtype)
    items = [(str(name), _owning(tensor)) for name, tensor in named]
    return base64.b64encode(pickle.dumps(items, protocol=pickle.HIGHEST_PROTOCOL)).decode("ascii")


def serialize_by_reference(named: NamedTensors) -> str:
    """One entry of CUDA IPC handles, devices named by GPU UUID; make one per server TP rank."""
    from multiprocessing.reduction import ForkingPickler

    from torch.multiprocessing import reductions

    class UUIDPickler(ForkingPickler):
        def reducer_override(self, obj):
            if isinstance(obj, torch.Tensor) and obj.is_cuda:
                rebuild, args = reductions.reduce_tensor(obj)
                # Argument 6 of torch's rebuild_cuda_tensor is the device index (patch_torch.py:64-77).
                uuid = str(torch.cuda.get_device_properties(args[6]).uuid)
                return rebuild, (*args[:6], uuid, *args[7:])
            return NotImplemented

    for name, tensor in named:
        if not tensor.is_cuda:
            raise WeightPayloadError(f"weight sync: {name} is on {tensor.device}; by reference needs CUDA tensors "
                                     "(a CPU tensor would travel as a file descriptor the server cannot open)")
    buffer = io.BytesIO()
    UUIDPickler(buffer).dump([(str(name), tensor.detach()) for name, tensor in named])
    return base64.b64encode(buffer.getvalue()).decode("ascii")


# --------------------------------------------------------------------------- request bodies


def begin_weight_update_body() -> dict:
    """``POST /begin_weight_update`` (``selector`` defaults to "all", io_struct.py:2197-2200)."""
    return {}


def end_weight_update_body() -> dict:
    """``POST /end_weight_update`` (io_struct.py:2208-2209)."""
    return {}


def tensor_update_body(entries: list[str], *, version: str | None) -> dict:
    """``POST /update_weights_from_tensor``: one entry per server TP rank; ``version`` (the
    last bucket only) sets the served weight version and flushes the prefix cache."""
    return {"serialized_named_tensors": entries, "load_format": None, "flush_cache": version is not None,
            "abort_all_requests": False, "weight_version": version}


def distributed_update_body(named: NamedTensors, *, group_name: str, version: str | None) -> dict:
    """``POST /update_weights_from_distributed``: the bucket's names, dtypes and shapes, broadcast
    one tensor at a time in this order; an empty bucket has the server check its session and
    group and answer without joining any broadcast (weight_updater.py:192-197, :270-298)."""
    return {"names": [str(n) for n, _ in named], "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in named],
            "shapes": [list(t.shape) for _, t in named], "group_name": group_name,
            "flush_cache": version is not None, "abort_all_requests": False, "weight_version": version}


def init_group_body(*, address: str, port: int, rank_offset: int, world_size: int, group_name: str,
                    backend: str) -> dict:
    """``POST /init_weights_update_group``: server TP rank r joins as ``rank_offset + r``."""
    return {"master_address": address, "master_port": port, "rank_offset": rank_offset, "world_size": world_size,
            "group_name": group_name, "backend": backend}


def destroy_group_body(group_name: str) -> dict:
    """``POST /destroy_weights_update_group``."""
    return {"group_name": group_name}
