"""CPU platform: lets unmodified megatron-core (0.16.1 to 0.19.x) run on CPU with gloo.

Megatron-Core assumes CUDA in a handful of places (RNG trackers, ``device="cuda"``
literals, CUDA streams in the all-to-all dispatcher, ``torch.cuda.current_device()``, the
``torch.cuda.*Tensor`` type names its optimizers check, ``.cuda()`` in a checkpoint gather).
This module papers over exactly those places, each patch with a one-line reason, so that
tests and CI on CPU-only machines exercise Megatron's real TP/SP/EP/PP code paths.

What it owns: the patches and their scoping. What it does not own: anything a GPU run
needs. It is opt-in (``with cpu_platform():``), restores every patched attribute on exit,
and is a no-op when CUDA is available, so production GPU paths never depend on it.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
from torch.overrides import TorchFunctionMode

log = logging.getLogger(__name__)

_CPU = torch.device("cpu")


EAGER_WITHOUT_CUDA = {"TORCHDYNAMO_DISABLE": "1"}
"""Without CUDA the ranks and the SGLang stand-in run Megatron's fusions eager unless the
caller's environment says otherwise: Megatron wraps them in ``torch.compile`` as it is imported (``megatron/core/jit.py``),
which then hands each back as it is (``torch/_dynamo/eval_frame.py``: ``optimize``). Compiled,
GPT-OSS's ``quick_gelu`` cost each rank 4.7 CPU-s of tracing and Inductor on its first forward
and backward (Qwen3-Next's output gate alike). Read as Megatron is imported (forkserver, rank or stand-in)."""


def eager_fusions_environment() -> dict[str, str]:
    """What a process about to import Megatron-Core gets in its environment (where it lacks the
    key): :data:`EAGER_WITHOUT_CUDA` without CUDA, nothing with it."""
    return {} if torch.cuda.is_available() else EAGER_WITHOUT_CUDA


def _is_cuda_device(device: Any) -> bool:
    if isinstance(device, str):
        return device.startswith("cuda")
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return False


_CUDA_TYPE_NAMES = {
    "torch.FloatTensor": "torch.cuda.FloatTensor",
    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor",
    "torch.HalfTensor": "torch.cuda.HalfTensor",
}


class _CudaDeviceToCpu(TorchFunctionMode):
    """Rewrites ``device="cuda"`` in factory calls and ``Tensor.to`` to the CPU; ``Tensor.cuda()``
    returns the tensor; ``Tensor.type()`` answers the CUDA type name of a float tensor.

    Reasons: schedules.py, transformer/utils.py and the router hard-code ``device="cuda"``;
    ``rope_utils.get_pos_emb_on_this_cp_rank`` stages its index with ``pin_memory=True`` (0.16.1
    :62-64, 0.19.2 :63; reached under CP by the YaRN embedding GPT-OSS uses), which needs CUDA.
    Megatron's optimizers classify parameters by their type string and refuse
    ``torch.FloatTensor`` (0.16.1: ``distrib_optimizer.py:361,420,582``, the bf16 plain
    optimizer ``optimizer.py:671,690``); the distributed optimizer's fully-reshardable
    checkpoint moves its gather buffers with ``.cuda()`` (``distrib_optimizer.py:1089``).
    One mode for all of them: each torch call pays one Python dispatch, not several.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        if "device" in kwargs and _is_cuda_device(kwargs["device"]):
            kwargs = {**kwargs, "device": _CPU}
        if kwargs.get("pin_memory"):
            kwargs = {**kwargs, "pin_memory": False}
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], _CPU, *args[2:])
        out = func(*args, **kwargs)
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            return _CUDA_TYPE_NAMES.get(out, out)
        return out


class _InertStream:
    """Stand-in for ``torch.cuda.Stream``/``Event``: CPU work is already ordered."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, other: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> "_InertStream":
        return _InertStream()

    def record(self, stream: Any = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, other: Any) -> float:
        return 0.0


_SHARED_STREAM = _InertStream()


def _current_stream(device: Any = None) -> _InertStream:
    return _SHARED_STREAM


@contextlib.contextmanager
def _stream_context(stream: Any = None) -> Iterator[None]:
    yield


def _noop(*args: Any, **kwargs: Any) -> None:
    return None


def _cpu_current_device() -> torch.device:
    return _CPU


def _cpu_get_rng_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False):
    return torch.get_rng_state()


def _cpu_set_rng_state(new_state: torch.Tensor, device: Any = -1, graph_safe: bool = False):
    torch.set_rng_state(new_state)


def _split_sizes_as_ints(sizes: Any) -> list[int] | None:
    """gloo's all_to_all_single binding accepts only Python int lists as split sizes."""
    if sizes is None:
        return None
    if torch.is_tensor(sizes):
        return [int(s) for s in sizes.tolist()]
    return [int(s) for s in sizes]


def _clip_grad_by_total_norm_cpu(parameters, max_norm, total_norm, use_decoupled_grad=False):
    """Megatron's clip-by-total-norm without its ``torch.cuda.FloatTensor`` assertion."""
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    attr = "decoupled_grad" if use_decoupled_grad else "grad"
    grads = [getattr(p, attr).detach() for p in parameters if getattr(p, attr, None) is not None]
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if grads and clip_coeff < 1.0:
        torch._foreach_mul_(grads, clip_coeff)


@dataclass
class _Patcher:
    """Records (owner, name, old value) so every patch is undone in reverse order."""

    applied: list[tuple[Any, str, Any, bool]] = field(default_factory=list)

    def set(self, owner: Any, name: str, value: Any) -> None:
        existed = hasattr(owner, name)
        self.applied.append((owner, name, getattr(owner, name, None), existed))
        setattr(owner, name, value)

    def restore(self) -> None:
        for owner, name, old, existed in reversed(self.applied):
            if existed:
                setattr(owner, name, old)
            else:
                delattr(owner, name)
        self.applied.clear()


def _patch_torch_cuda(p: _Patcher) -> None:
    # Megatron passes torch.cuda.current_device() as a device everywhere; make it the CPU.
    p.set(torch.cuda, "current_device", _cpu_current_device)
    # The alltoall dispatcher creates a device-to-host copy stream and events at init.
    p.set(torch.cuda, "Stream", _InertStream)
    p.set(torch.cuda, "Event", _InertStream)
    p.set(torch.cuda, "current_stream", _current_stream)
    p.set(torch.cuda, "stream", _stream_context)
    # p2p communication and parallel_state barriers call synchronize after sends.
    p.set(torch.cuda, "synchronize", _noop)
    # The RNG tracker snapshots and seeds the "CUDA" generator: route it to the CPU one.
    p.set(torch.cuda, "get_rng_state", _cpu_get_rng_state)
    p.set(torch.cuda, "set_rng_state", _cpu_set_rng_state)
    p.set(torch.cuda, "manual_seed", torch.manual_seed)
    # Freeing the cache is meaningless on CPU and raises without CUDA.
    p.set(torch.cuda, "empty_cache", _noop)


def _patch_megatron(p: _Patcher) -> None:
    random = importlib.import_module("megatron.core.tensor_parallel.random")
    # Tracker fork/restore uses these module-level helpers, which go through CUDA generators.
    p.set(random, "_get_cuda_rng_state", _cpu_get_rng_state)
    p.set(random, "_set_cuda_rng_state", _cpu_set_rng_state)

    moe_utils = importlib.import_module("megatron.core.transformer.moe.moe_utils")
    # Router gating references te_general_gemm, which is undefined (NameError) without TE.
    if not hasattr(moe_utils, "te_general_gemm"):
        p.set(moe_utils, "te_general_gemm", None)

    dispatcher = importlib.import_module("megatron.core.transformer.moe.token_dispatcher")
    original_all_to_all: Callable = dispatcher.all_to_all

    def all_to_all_with_int_splits(group, input_, output_split_sizes=None, input_split_sizes=None, **kwargs):
        # gloo rejects tensor/ndarray split sizes, which the alltoall dispatcher passes.
        # (0.19 adds a use_nccl_stream keyword, passed on as given.)
        return original_all_to_all(
            group,
            input_,
            _split_sizes_as_ints(output_split_sizes),
            _split_sizes_as_ints(input_split_sizes),
            **kwargs,
        )

    p.set(dispatcher, "all_to_all", all_to_all_with_int_splits)

    # Gradient clipping asserts CUDA fp32 grads (type string 'torch.cuda.FloatTensor').
    clip_grads = importlib.import_module("megatron.core.optimizer.clip_grads")
    optimizer = importlib.import_module("megatron.core.optimizer.optimizer")
    p.set(clip_grads, "clip_grad_by_total_norm_fp32", _clip_grad_by_total_norm_cpu)
    p.set(optimizer, "clip_grad_by_total_norm_fp32", _clip_grad_by_total_norm_cpu)


_ACTIVE: list[bool] = []


def cpu_platform_active() -> bool:
    """True while a ``cpu_platform()`` context is open in this process."""
    return bool(_ACTIVE)


@contextlib.contextmanager
def cpu_platform(enable: bool = True) -> Iterator[bool]:
    """Patch Megatron-Core's CUDA assumptions for the duration of the context.

    Args:
        enable: explicit opt-in; ``False`` makes the context a no-op.

    Yields:
        Whether the patches are active (``False`` when disabled or when CUDA is available).
    """
    if not enable or torch.cuda.is_available():
        if enable:
            log.info("cpu_platform: CUDA is available, leaving Megatron-Core unpatched")
        yield False
        return
    if _ACTIVE:
        # Re-entrant: an inner context reuses the outer patches.
        yield True
        return
    patcher = _Patcher()
    mode = _CudaDeviceToCpu()
    try:
        _patch_torch_cuda(patcher)
        _patch_megatron(patcher)
        _ACTIVE.append(True)
        with mode:
            yield True
    finally:
        _ACTIVE.clear()
        patcher.restore()
