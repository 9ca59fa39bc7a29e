"""Bytes autograd saves for backward inside each decoder layer of a model, for the planner tests
(``tests/parallel/test_memory_plan_model.py``, ``tests/unit/test_memory_plan_fused_norm.py``)."""

from __future__ import annotations

from typing import Callable

import torch


def saved_per_layer(model: torch.nn.Module, run: Callable[[], object]) -> dict[int, int]:
    """Run ``run()`` (one update of ``model``) and return, per decoder layer (global 0-based index),
    the bytes of the unique storages saved for backward while that layer ran, parameters excluded."""
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    inside: list[int] = []

    def enter(layer, *_):
        inside.append(layer.layer_number - 1)

    def leave(*_):
        inside.pop()

    handles = [h for layer in model.decoder.layers
               for h in (layer.register_forward_pre_hook(enter), layer.register_forward_hook(leave))]
    seen, per_layer = set(), {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if inside and storage.data_ptr() not in parameters and storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            per_layer[inside[-1]] = per_layer.get(inside[-1], 0) + storage.nbytes()
        return tensor

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            run()
    finally:
        for handle in handles:
            handle.remove()
    return per_layer
