"""The trainer's device memory, moved out and back while a colocated rollout engine generates.

Owns :class:`TrainerOffload`: every storage the training state lives in, found by walking what
exists rather than one optimizer's fields: Megatron DDP's gradient and parameter buffers
(dense and expert-parallel), the model's parameters, and each optimizer's parameters (the
fp32 main weights, or the model's own in fp32 training; with the distributed optimizer this
rank's shards) and state (Adam's moments and step), through ``mcore_compat``. A storage that
several of these view (``param.main_grad`` in a gradient buffer, ``param.data`` in the
distributed optimizer's parameter buffer, fp32 main weights that are the parameters) is moved
once. They come in two parts, moved at different times of the colocated step (see
``megatron_rl.train.colocate`` and ``docs/memory.md``): the *state* (gradient buffers, main
weights, optimizer state) before the weight push, the *weights* (model parameters, frozen
models such as the KL reference) after it.

The mechanism is :class:`StorageSet`, the same on CPU and GPU: the bytes of each storage are
copied to host memory (pinned on CUDA, a separate buffer on CPU), the device storage is
freed with ``untyped_storage().resize_(0)`` (every view of it, such as ``param.main_grad``
or a DDP bucket's slice, stays bound to the storage object), and on CUDA the freed memory
goes back to the driver (``torch.cuda.empty_cache``), where another process can take it.
Restoring re-allocates each storage at its size and copies the bytes back: every byte comes
back as it left. Gradient buffers are the exception: between an optimizer step and the next
backward their contents are dead (the schedule zeroes them before every backward,
``schedule.run_schedule``), so they are freed without a copy and come back zeroed, as
Megatron's own ``restore_grad_buffers`` does; the memory planner counts them freed, not moved.

Not moved: the model's buffers (rotary tables, router biases; small) and anything a
collective library holds (NCCL's buffers). torch_memory_saver is not used: it pauses
memory by the region it was allocated in, and Megatron allocates the distributed
optimizer's parameter buffer in the same constructor as the gradient buffers (and Adam's
state lazily at the first step), so it could not free the state before the push and the
weights after it, which is the order the planner fits (``docs/memory.md``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch

from megatron_rl.parallel.mcore_optimizer import ddp_buffers, optimizer_members


def _byte_view(storage: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over the whole storage."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


@dataclass
class _Stored:
    """One storage of a :class:`StorageSet`."""

    storage: torch.UntypedStorage
    """The device storage (freed while offloaded)."""
    nbytes: int
    """Its size when resident."""
    keep: bool
    """Its bytes come back (else it comes back zeroed)."""
    host: torch.Tensor | None = None
    """The host copy while offloaded."""


class StorageSet:
    """Device storages freed and re-allocated together.

    Args:
        tensors: ``(tensor, keep)`` pairs; each storage is taken once, by its first tensor
            (empty ones are skipped); ``keep``: its bytes are copied out and back, else it
            comes back zeroed.
    """

    def __init__(self, tensors: Iterable[tuple[torch.Tensor, bool]]) -> None:
        self.items: list[_Stored] = []
        seen: set[tuple[str, int]] = set()
        for tensor, keep in tensors:
            storage = tensor.untyped_storage()
            key = (str(storage.device), storage.data_ptr())
            if storage.nbytes() == 0 or key in seen:
                continue
            seen.add(key)
            self.items.append(_Stored(storage, storage.nbytes(), keep))

    @property
    def nbytes(self) -> int:
        """Device bytes the set holds when resident."""
        return sum(s.nbytes for s in self.items)

    @property
    def host_bytes(self) -> int:
        """Host bytes its copies take while offloaded."""
        return sum(s.nbytes for s in self.items if s.keep)

    def offload(self) -> None:
        """Copy the kept storages to host memory, then free every storage."""
        for s in self.items:
            if s.keep:
                pinned = s.storage.device.type == "cuda"
                s.host = torch.empty(s.nbytes, dtype=torch.uint8, pin_memory=pinned)
                s.host.copy_(_byte_view(s.storage), non_blocking=pinned)
        _synchronize(self.items)
        for s in self.items:
            s.storage.resize_(0)

    def restore(self) -> None:
        """Re-allocate every storage at its size, with its bytes (or zeros)."""
        for s in self.items:
            s.storage.resize_(s.nbytes)
            view = _byte_view(s.storage)
            if s.host is not None:
                view.copy_(s.host, non_blocking=True)
            else:
                view.zero_()
        _synchronize(self.items)
        for s in self.items:
            s.host = None


def _synchronize(items: list[_Stored]) -> None:
    """Wait for the copies (non-blocking on CUDA) before a storage is freed or a host copy dropped."""
    if any(s.storage.device.type == "cuda" for s in items):
        torch.cuda.synchronize()


class TrainerOffload:
    """The training state of this rank, offloaded in two parts and restored together.

    Args:
        ddp: the DDP-wrapped model stage (``schedule.wrap_for_training``).
        optimizer: its Megatron optimizer, plain or distributed, chained or not.
        frozen: further modules whose parameters go with the weights (the KL reference).
    """

    def __init__(self, ddp: torch.nn.Module, optimizer, frozen: Iterable[torch.nn.Module] = ()) -> None:
        self.ddp, self.optimizer, self.frozen = ddp, optimizer, list(frozen)
        self.device = next(ddp.parameters()).device
        self.parts: dict[str, StorageSet] = {}
        """The parts offloaded now, by name (``state``, ``weights``)."""

    def _on_device(self, tensor: torch.Tensor) -> bool:
        return torch.is_tensor(tensor) and tensor.device == self.device

    def weight_tensors(self) -> list[torch.Tensor]:
        """The model's parameters (and the distributed optimizer's buffer they view), and the frozen modules'."""
        tensors = [params for _, params in ddp_buffers(self.ddp) if params is not None]
        tensors += [p for module in (self.ddp, *self.frozen) for p in module.parameters()]
        return [t for t in tensors if self._on_device(t)]

    def state_tensors(self) -> list[tuple[torch.Tensor, bool]]:
        """``(tensor, keep)``: gradient buffers (not kept), then each optimizer's main weights,
        their ``.grad`` (views of the gradient buffers, or dead copies) and their state."""
        pairs = [(grads, False) for grads, _ in ddp_buffers(self.ddp)]
        for member in optimizer_members(self.optimizer):
            for group in member.param_groups:
                for main in group["params"]:
                    pairs.append((main, True))
                    if main.grad is not None:
                        pairs.append((main.grad, False))
                    pairs += [(value, True) for value in member.state.get(main, {}).values()]
        return [(t, keep) for t, keep in pairs if self._on_device(t)]

    def offload(self, part: str) -> StorageSet:
        """Move ``part`` (``state`` or ``weights``) out of device memory; returns what moved.

        A storage that is also one of the weights moves with the weights (fp32 training:
        the main weights are the parameters).
        """
        if part in self.parts:
            raise RuntimeError(f"TrainerOffload: the {part} part is offloaded already")
        weights = [(t, True) for t in self.weight_tensors()]
        if part == "weights":
            moved = StorageSet(weights)
        elif part == "state":
            resident_weights = {(str(s.storage.device), s.storage.data_ptr()) for s in StorageSet(weights).items}
            moved = StorageSet((t, keep) for t, keep in self.state_tensors()
                               if (str(t.device), t.untyped_storage().data_ptr()) not in resident_weights)
        else:
            raise ValueError(f"TrainerOffload: unknown part {part!r} (state or weights)")
        moved.offload()
        self.parts[part] = moved
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        return moved

    def restore(self) -> None:
        """Bring every offloaded part back (weights first: nothing else depends on the order)."""
        for part in ("weights", "state"):
            if part in self.parts:
                self.parts.pop(part).restore()
