"""The CPU stand-in's weight updates, by SGLang 0.5.23's rules.

Every rule here is SGLang's, next to the line it comes from (paths under ``sglang/srt/``):

* **Sessions.** ``update_weights_from_tensor`` and ``update_weights_from_distributed`` are
  refused (400) outside ``begin_weight_update`` / ``end_weight_update``, before anything is
  decoded or received (``managers/scheduler_components/weight_updater.py:192-197``,
  ``:234-239``); ``begin`` is refused while a session is open (``:311-316``), ``end`` when none
  is (``:325-329``); ``init_weights_update_group`` needs none (``:165-176``).
* **Payloads.** Entry ``tp_rank`` of ``serialized_named_tensors`` (a list shorter than the TP
  size raises in the scheduler, ``managers/tp_worker.py:194-201``) is base64-decoded strictly
  (``utils/common.py:3109-3113``) and unpickled by :class:`SafeUnpickler`'s rule (``:3144-3370``):
  only allow-listed globals, and ``torch.storage._load_from_bytes`` replaced by
  ``torch.load(weights_only=True)`` (``:3135-3141``, ``:3362-3364``). With ``load_format:
  "flattened_bucket"`` the payload is one buffer and its metadata, each tensor a view of it
  (``model_executor/model_runner_components/weight_updater.py:354-358``, ``:383-411``;
  ``weight_sync/tensor_bucket.py:118-135``); a distributed update in that format is one
  broadcast of a buffer laid out from the announced names, dtypes and shapes, refused before
  the broadcast when a tensor's offset does not suit its dtype, a dimension is negative, or
  nothing is announced (``tensor_bucket.py:86-116``; model runner's ``weight_updater.py:
  275-278``, ``:300-310``).
* **Loading.** One request is one ``load_weights`` call over HF names: stacked parts (q/k/v,
  gate/up) are written shard by shard into their fused parameter, in any request
  (``models/qwen3_moe.py:1160-1167``); an architecture's load groups are loaded only when
  complete within the request and dropped silently otherwise, and unknown names are skipped or
  raise ``KeyError`` (:mod:`~megatron_rl.rollout.sglang.loader_rules`).
* **Crashes.** An exception on the tensor path (a blocked global, a short entry list, a
  ``KeyError``) is not caught: the scheduler dies and takes the server with it
  (``managers/scheduler.py:6370-6376``); the distributed path answers 400 with the error
  (``weight_updater.py:201-211``).

Not modelled: ``load_format`` other than None and ``flattened_bucket`` (refused with 400),
``selector``, pausing.
What SGLang does not do, the stand-in adds only as a report: at the end of each session it
names the served tensors that session did not update (and the group halves it dropped), so
a push that silently left weights behind is visible in its log and to its callers.
Owns decoding, the session and loading into the Megatron model; does not own HTTP.
"""

from __future__ import annotations

import io
import pickle
import time
from dataclasses import dataclass, field

import pybase64
import torch

from megatron_rl.checkpoint.mapping import ARCHITECTURES, all_weights, write_part
from megatron_rl.rollout.sglang.loader_rules import (
    load_group,
    loader_rules,
    unknown_name_outcome,
)
from megatron_rl.rollout.sglang.weight_payload import FLATTENED_BUCKET
from megatron_rl.sections import ModelConfig

NO_SESSION = "{call} must run between begin_weight_update() and end_weight_update()"
"""weight_updater.py:192-197 (distributed), :234-239 (tensor)."""
SESSION_OPEN = "a weight-update session is already open; call end_weight_update() first"
"""weight_updater.py:311-316."""
NOTHING_TO_END = "no weight-update session is open; call begin_weight_update() first"
"""weight_updater.py:325-329."""

_TORCH_TYPES = {("torch", n) for n in ("Size", "device", "dtype", "float32", "float64", "float16", "bfloat16", "int64",
                                       "int32", "int16", "int8", "uint8", "bool", "float8_e4m3fn", "float8_e5m2",
                                       "uint16", "uint32", "uint64")}
ALLOWED_GLOBALS = frozenset({
    ("torch._utils", "_rebuild_tensor_v2"), ("torch._utils", "_rebuild_tensor_v3"),
    ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"), ("torch", "Tensor"),
    ("torch._tensor", "_rebuild_from_type_v2"), ("torch.storage", "UntypedStorage"),
    # A CUDA IPC handle names the storage's class: torch's reduce_tensor pickles a TypedStorage.
    ("torch.storage", "TypedStorage"), ("torch.storage", "_UntypedStorage"), ("torch", "UntypedStorage"),
    ("collections", "OrderedDict"), ("builtins", "list"), ("builtins", "tuple"), ("builtins", "dict"),
    ("types", "SimpleNamespace"), *_TORCH_TYPES,
})
"""The part of ``SafeUnpickler.ALLOWED_GLOBALS`` (utils/common.py:3148-3359) that torch's pickling of
CPU tensors and of CUDA IPC handles names, and a flattened bucket's metadata; every entry is SGLang's
(tests/unit/test_sglang_conformance.py reads its set)."""


class SchedulerCrash(RuntimeError):
    """What kills a SGLang server: an exception on the tensor update path."""


def _safe_load_torch_storage(data: bytes):
    """utils/common.py:3135-3141: the nested storage bytes load with ``weights_only=True``."""
    storage = torch.load(io.BytesIO(data), weights_only=True)
    if not isinstance(storage, (torch.storage.TypedStorage, torch.UntypedStorage)):
        raise pickle.UnpicklingError(f"Expected a Torch storage, got {type(storage).__name__}")
    return storage


def _rebuild_cuda_tensor(*args):
    """torch's ``rebuild_cuda_tensor`` as SGLang's ``monkey_patch_torch_reductions`` makes it
    (utils/patch_torch.py): argument 6, the device, may name the GPU by UUID, and becomes this
    process's index of that GPU (trainer and server may see different ``CUDA_VISIBLE_DEVICES``)."""
    from torch.multiprocessing import reductions

    device = args[6]
    if isinstance(device, str):
        found = [i for i in range(torch.cuda.device_count()) if str(torch.cuda.get_device_properties(i).uuid) == device]
        if not found:
            raise Exception("Invalid device_uuid=" + device)  # noqa: TRY002 - SGLang's own exception
        device = found[0]
    return reductions.rebuild_cuda_tensor(*args[:6], device, *args[7:])


class SafeUnpickler(pickle.Unpickler):
    """SGLang's allow-list unpickler (utils/common.py:3361-3370), over :data:`ALLOWED_GLOBALS`; a CUDA
    IPC handle is rebuilt as on a SGLang server, whose torch reductions are patched."""

    def find_class(self, module: str, name: str):
        if (module, name) == ("torch.storage", "_load_from_bytes"):
            return _safe_load_torch_storage
        if (module, name) == ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"):
            return _rebuild_cuda_tensor
        if (module, name) in ALLOWED_GLOBALS:
            return super().find_class(module, name)
        raise RuntimeError(f"Blocked unsafe global ({module}.{name}) during pickle deserialization")


def decode_entries(entries: list, tp_size: int, load_format: str | None) -> list[tuple[str, torch.Tensor]]:
    """The named tensors of ``serialized_named_tensors``: every server rank r decodes entry r,
    as SGLang's ranks do; the stand-in loads rank 0's.

    Raises:
        SchedulerCrash: what SGLang raises there uncaught (too few entries, bad base64, a
            blocked global, a storage ``torch.load(weights_only=True)`` refuses, a flattened
            bucket without its keys or with metadata it cannot view).
    """
    if len(entries) < tp_size:
        raise SchedulerCrash(f"IndexError: {len(entries)} serialized_named_tensors entries for tp_size {tp_size}")
    try:
        decoded = [SafeUnpickler(io.BytesIO(pybase64.b64decode(entry, validate=True))).load()
                   for entry in entries[:tp_size]]
        if load_format != FLATTENED_BUCKET:
            return decoded[0]
        # weight_updater.py:383-409 and tensor_bucket.py:118-135: views of the one buffer.
        flat = decoded[0]["flattened_tensor"]
        return [(m.name, flat[m.start_idx:m.end_idx].view(m.dtype).reshape(m.shape)) for m in decoded[0]["metadata"]]
    except Exception as err:  # noqa: BLE001 - any of them kills SGLang's scheduler
        raise SchedulerCrash(f"{type(err).__name__}: {err}") from None


def flat_receive_layout(names: list[str], dtypes: list[str], shapes: list[list[int]]) -> list[tuple]:
    """``(name, dtype, shape, start, end)`` of an announced flattened bucket, checked as SGLang
    checks it before it receives (``FlattenedTensorBucket.empty``, tensor_bucket.py:86-116).

    Raises:
        ValueError: SGLang's words: a negative dimension, an offset the dtype cannot view, no tensor.
    """
    layout, offset = [], 0
    for name, dtype_name, shape in zip(names, dtypes, shapes, strict=True):
        dtype, shape = getattr(torch, dtype_name), torch.Size(shape)
        if any(dim < 0 for dim in shape):
            raise ValueError(f"Negative dimension in received tensor {name}: {shape}")
        if offset % dtype.itemsize:
            raise ValueError(f"Unaligned received tensor {name}: byte offset {offset}, dtype {dtype}")
        size = shape.numel() * dtype.itemsize
        layout.append((name, dtype, shape, offset, offset + size))
        offset += size
    if not layout:
        raise ValueError("Cannot create empty tensor bucket")
    return layout


@dataclass
class SessionReport:
    """What one weight-update session did (the stand-in's own report; SGLang keeps none)."""

    loaded: set[str] = field(default_factory=set)
    """HF names written."""
    dropped: list[str] = field(default_factory=list)
    """Load-group members that arrived without their partner in the same request."""
    skipped: list[str] = field(default_factory=list)
    """Unknown names skipped."""
    not_updated: list[str] = field(default_factory=list)
    """Served names the session did not write (filled at its end)."""
    requests: int = 0
    """Update requests that loaded tensors."""
    bytes: int = 0
    """Bytes of the tensors they carried."""
    decode_s: float = 0.0
    """Seconds spent decoding tensor payloads (base64 and unpickling)."""
    receive_s: float = 0.0
    """Seconds spent receiving broadcasts."""
    load_s: float = 0.0
    """Seconds spent writing received tensors into the model."""

    def timings(self) -> str:
        """One line of what the session moved and where its time went."""
        return (f"requests={self.requests} bytes={self.bytes} decode_s={self.decode_s:.3f} "
                f"receive_s={self.receive_s:.3f} load_s={self.load_s:.3f}")


class ServedWeights:
    """The served model's weights, written by HF name as an SGLang server of ``architecture`` would.

    Args:
        params: the Megatron model's weights by layout-free name (they are written in place).
        model_cfg: its config.
        architecture: the HF ``model_type`` served.
    """

    def __init__(self, params: dict[str, torch.Tensor], model_cfg: ModelConfig, architecture: str) -> None:
        self.params, self.model_cfg = params, model_cfg
        self.rules = loader_rules(architecture)
        self.parts: dict[str, list[tuple]] = {}
        """HF name -> the (weight, part) pairs it writes (a stacked tensor: one per expert)."""
        for w in all_weights(ARCHITECTURES.get(architecture), model_cfg):
            for i, hf in enumerate(w.hf):
                self.parts.setdefault(hf, []).append((w, i))
        self.session: SessionReport | None = None
        self.last_session: SessionReport | None = None
        """The report of the last session that ended."""

    def begin(self) -> tuple[bool, str]:
        if self.session is not None:
            return False, SESSION_OPEN
        self.session = SessionReport()
        return True, "Success"

    def end(self) -> tuple[bool, str]:
        if self.session is None:
            return False, NOTHING_TO_END
        self.session.not_updated = sorted(set(self.parts) - self.session.loaded)
        self.last_session, self.session = self.session, None
        return True, "Success"

    def load(self, named: list[tuple[str, torch.Tensor]]) -> int:
        """One ``load_weights`` call; returns the tensors written.

        Raises:
            KeyError: an unknown name the architecture's loader raises on.
            ValueError: a tensor whose shape is not the served one (SGLang's loaders assert it).
        """
        started = time.perf_counter()
        writes, pending = [], {}
        for name, tensor in named:
            if name not in self.parts:
                if unknown_name_outcome(self.rules, name) == "KeyError":
                    raise KeyError(name)
                self.session.skipped.append(name)
                continue
            weight, part = self.parts[name][0]
            if tuple(tensor.shape) != weight.hf_shapes[part]:
                raise ValueError(f"{name}: shape {tuple(tensor.shape)}, the model has {weight.hf_shapes[part]}")
            group = load_group(self.rules, self.model_cfg, name)
            if group is None:
                writes.append((name, tensor))
                continue
            members = pending.setdefault(group, {})
            members[name] = tensor
            if len(members) == 2:
                writes.extend(pending.pop(group).items())
        self.session.dropped.extend(n for members in pending.values() for n in members)
        with torch.no_grad():
            for name, tensor in writes:
                self._write(name, tensor)
        self.session.loaded.update(n for n, _ in writes)
        self.session.requests += 1
        self.session.bytes += sum(t.numel() * t.element_size() for _, t in named)
        self.session.load_s += time.perf_counter() - started
        return len(writes)

    def _write(self, name: str, tensor: torch.Tensor) -> None:
        """Write one HF tensor into its part of the Megatron parameter (shard by shard)."""
        for weight, part in self.parts[name]:
            write_part(weight, self.params[weight.megatron], part, tensor, self.model_cfg)
