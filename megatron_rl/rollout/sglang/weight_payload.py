"""SGLang 0.5.23's weight-update requests: the JSON bodies and the flattened buckets they carry.

Owns the bodies of ``/begin_weight_update``, ``/end_weight_update``,
``/update_weights_from_tensor``, ``/init_weights_update_group``,
``/update_weights_from_distributed`` and ``/destroy_weights_update_group`` (the fields of
``srt/managers/io_struct.py:2002-2047``, ``:2126-2138``, ``:2197-2209``; the conformance tests
validate every body built here with those very definitions), and the form of the tensors:

* **One flattened bucket per request** (``load_format: "flattened_bucket"``, SGLang's own fast
  path): the bucket's tensors copied into one uint8 buffer, with a metadata list of ``name,
  shape, dtype, start_idx, end_idx, numel`` (bytes) per tensor. SGLang rebuilds each tensor as
  a view of the buffer (``srt/weight_sync/tensor_bucket.py:118-135``) and hands them to the
  model's loader in one call (``srt/model_executor/model_runner_components/weight_updater.py:
  354-358``, ``:383-411`` from a tensor payload; ``:275-278``, ``:300-310`` from one broadcast
  of the buffer, whose layout it derives from the announced names, dtypes and shapes,
  refusing a tensor at an offset its dtype cannot view, ``tensor_bucket.py:86-116``). So the
  tensors are laid out widest dtype first (every offset is then aligned), any dtype travels
  (float8 too: the buffer is bytes), one pickled storage or one broadcast per bucket instead
  of one per tensor. The metadata entries are ``types.SimpleNamespace`` (on SGLang's
  ``SafeUnpickler`` allow-list, ``srt/utils/common.py:3176``; SGLang reads their attributes
  only): the trainer needs no SGLang installed.
* **Tensor payloads** (``serialized_named_tensors``, entry ``tp_rank`` read by each server rank
  with ``MultiprocessingSerializer.deserialize`` under ``SafeUnpickler``,
  ``srt/managers/tp_worker.py:194-201``, ``srt/utils/common.py:3084-3099``, ``:3144-3370``),
  ``{"flattened_tensor": buffer, "metadata": [...]}`` pickled

  - **by reference** (CUDA buffers, a colocated server), as SGLang's own
    ``MultiprocessingSerializer`` pickles them (``ForkingPickler``, ``:3060-3082``): a CUDA IPC
    handle whose device is the GPU's UUID (``srt/utils/patch_torch.py:41-59``, ``:72-77``,
    ``:85-86``; the server maps it back to its own index, ``:80-99``), so trainer and server may
    see different ``CUDA_VISIBLE_DEVICES``. Serialized once per server TP rank
    (``srt/entrypoints/http_server_engine.py:107-117``): each copy carries its own IPC reference
    count. (A CPU buffer would pickle as a shared-memory descriptor handed over
    ``multiprocessing.resource_sharer``, which authenticates with the sending process's
    ``authkey``: a server that is not its child cannot open it, so CPU buffers go by value.)
  - **by value**: torch's own tensor pickling (``torch._utils._rebuild_tensor_v2`` over
    ``torch.storage._load_from_bytes``, both on the allow-list), one storage of exactly the
    bucket's bytes; the same entry serves every rank.

  Entries are base64 (``pybase64``, as SGLang encodes and decodes them, ``common.py:3080``,
  ``:3097``) and spliced into the JSON body as bytes: base64 needs no escaping, and passing a
  bucket-sized string through ``json.dumps`` costs more than the rest of the request.

Does not own HTTP (:mod:`~megatron_rl.rollout.sglang.weight_transport`) or which tensors go
together (:mod:`~megatron_rl.rollout.sglang.loader_rules`).
"""

from __future__ import annotations

import io
import json
import pickle
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Sequence

import pybase64
import torch

NamedTensors = Sequence[tuple[str, torch.Tensor]]
"""One bucket: ``[(server_name, tensor), ...]``."""

class WeightPayloadError(ValueError):
    """A bucket cannot travel in the requested form; the message names the setting that works."""


FLATTENED_BUCKET = "flattened_bucket"
"""The ``load_format`` of every update that carries tensors."""


@dataclass
class FlatBucket:
    """One bucket's tensors in one uint8 buffer, laid out as SGLang's ``FlattenedTensorBucket``."""

    flat: torch.Tensor
    """uint8 ``[bytes]``: every tensor's bytes, one after another in ``metadata`` order."""
    metadata: list[SimpleNamespace]
    """Per tensor: ``name, shape, dtype, start_idx, end_idx, numel`` (offsets and size in bytes)."""

    def announce(self) -> tuple[list[str], list[str], list[list[int]]]:
        """Names, dtypes and shapes in buffer order: from them a server derives the same layout."""
        return ([m.name for m in self.metadata], [str(m.dtype).removeprefix("torch.") for m in self.metadata],
                [list(m.shape) for m in self.metadata])


def flat_layout(named: NamedTensors) -> tuple[list[SimpleNamespace], int]:
    """The bucket's metadata (widest dtype first, so that every offset is aligned) and its bytes."""
    metadata, offset = [], 0
    for name, tensor in sorted(named, key=lambda item: -item[1].element_size()):
        size = tensor.numel() * tensor.element_size()
        metadata.append(SimpleNamespace(name=str(name), shape=torch.Size(tensor.shape), dtype=tensor.dtype,
                                        start_idx=offset, end_idx=offset + size, numel=size))
        offset += size
    return metadata, offset


def flatten(named: NamedTensors, buffer: torch.Tensor | None = None, device: torch.device | None = None) -> FlatBucket:
    """Copy the bucket's tensors into ``buffer`` (uint8, at least the bucket's size; a new buffer
    of exactly that size on ``device`` when None): the bucket's one copy."""
    metadata, total = flat_layout(named)
    if buffer is None:
        buffer = torch.empty(total, dtype=torch.uint8, device=device)
    elif buffer.numel() < total:
        raise ValueError(f"a bucket of {total} bytes does not fit a buffer of {buffer.numel()}")
    flat = buffer[:total]
    tensors = dict(named)
    for meta in metadata:
        flat[meta.start_idx:meta.end_idx].view(meta.dtype).view(meta.shape).copy_(tensors[meta.name])
    return FlatBucket(flat, metadata)


def _payload(bucket: FlatBucket) -> dict:
    return {"flattened_tensor": bucket.flat, "metadata": bucket.metadata}


class _Pieces:
    """A pickle's output as the pieces it was written in (a bucket's storage is one, not copied)."""

    def __init__(self) -> None:
        self.pieces: list = []

    def write(self, data) -> int:
        self.pieces.append(data)
        return len(data)


def _base64(pieces: list) -> bytes:
    """base64 of the pieces' concatenation, encoded piece by piece (3-byte aligned) and joined once."""
    out, carry = [], b""
    for piece in pieces:
        view = memoryview(piece).cast("B")
        if carry:
            take = min(3 - len(carry), len(view))
            carry, view = carry + bytes(view[:take]), view[take:]
            if len(carry) < 3:
                continue
            out.append(pybase64.b64encode(carry))
            carry = b""
        whole = len(view) - len(view) % 3
        out.append(pybase64.b64encode(view[:whole]))
        carry = bytes(view[whole:])
    if carry:
        out.append(pybase64.b64encode(carry))
    return b"".join(out)


def serialize_by_value(bucket: FlatBucket) -> bytes:
    """One base64 entry holding the bucket's bytes (any TP rank may read it)."""
    flat = bucket.flat.detach().cpu()
    if flat.untyped_storage().nbytes() != flat.numel() or flat.storage_offset() != 0:
        # Pickling writes the tensor's whole storage: only the bucket's own bytes may be in it.
        flat = flat.clone()
    writer = _Pieces()
    pickle.Pickler(writer, protocol=pickle.HIGHEST_PROTOCOL).dump(_payload(FlatBucket(flat, bucket.metadata)))
    return _base64(writer.pieces)


def serialize_by_reference(bucket: FlatBucket) -> bytes:
    """One base64 entry of a CUDA IPC handle to the bucket's buffer (device by GPU UUID); make
    one per server TP rank.

    Raises:
        WeightPayloadError: the buffer is not on CUDA (see the module docstring).
    """
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

    if not bucket.flat.is_cuda:
        raise WeightPayloadError(f"weight sync: a bucket on {bucket.flat.device} cannot go by reference (a CPU "
                                 "buffer would travel as a file descriptor a server that is not the trainer's child "
                                 "cannot open); leave WeightSyncConfig.by_reference None or set it False")
    buffer = io.BytesIO()
    UUIDPickler(buffer, pickle.HIGHEST_PROTOCOL).dump(_payload(bucket))
    return pybase64.b64encode(buffer.getvalue())


# --------------------------------------------------------------------------- request bodies


def begin_weight_update_body() -> dict:
    """``POST /begin_weight_update`` (``selector`` defaults to "all", io_struct.py:2197-2200)."""
    return {}


def end_weight_update_body() -> dict:
    """``POST /end_weight_update`` (io_struct.py:2208-2209)."""
    return {}


def tensor_update_body(entries: Sequence[bytes], *, version: str | None, flush_cache: bool = True) -> list[bytes]:
    """``POST /update_weights_from_tensor`` as encoded JSON, in pieces (the entries, base64
    ASCII, are not copied): one entry per server TP rank, a flattened bucket each; ``version``
    (the last bucket only) sets the served weight version and, with ``flush_cache``, flushes
    the prefix cache (which fails the update while requests run: ``weight_updater.py:120-133``)."""
    rest = json.dumps({"load_format": FLATTENED_BUCKET, "flush_cache": flush_cache and version is not None,
                       "abort_all_requests": False, "weight_version": version}).encode()
    pieces: list[bytes] = [b'{"serialized_named_tensors": [']
    for i, entry in enumerate(entries):
        pieces += [b', "' if i else b'"', entry, b'"']
    return [*pieces, b"], ", rest[1:]]


def distributed_update_body(bucket: FlatBucket | None, *, group_name: str, version: str | None,
                            flush_cache: bool = True) -> dict:
    """``POST /update_weights_from_distributed``: the bucket's names, dtypes and shapes in buffer
    order, received as one broadcast of the buffer; ``None`` announces nothing (per-tensor
    format: a flattened bucket may not be empty, tensor_bucket.py:107-108), and the server
    checks its session and group and answers without joining a broadcast
    (weight_updater.py:192-197, model runner's :270-298)."""
    names, dtypes, shapes = bucket.announce() if bucket is not None else ([], [], [])
    return {"names": names, "dtypes": dtypes, "shapes": shapes, "group_name": group_name,
            "load_format": FLATTENED_BUCKET if bucket is not None else None,
            "flush_cache": flush_cache and version is not None, "abort_all_requests": False,
            "weight_version": version}


def init_group_body(*, address: str, port: int, rank_offset: int, world_size: int, group_name: str,
                    backend: str) -> dict:
    """``POST /init_weights_update_group``: server TP rank r joins as ``rank_offset + r``."""
    return {"master_address": address, "master_port": port, "rank_offset": rank_offset, "world_size": world_size,
            "group_name": group_name, "backend": backend}


def destroy_group_body(group_name: str) -> dict:
    """``POST /destroy_weights_update_group``."""
    return {"group_name": group_name}
