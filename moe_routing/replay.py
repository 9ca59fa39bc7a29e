"""Routing replay (R2 / R3) on top of Megatron-Core's ``RouterReplay``, scoped per pass.

Shape legend: N tokens one router call sees (this rank's sequence-parallel shard of one
micro-batch), K experts per token.

Megatron-Core 0.16.1 gives each ``TopKRouter`` a ``RouterReplay`` when the model is built
with ``moe_enable_routing_replay=True``. In replay mode the router dispatches the target
experts and gathers its *current* scores at them: for softmax routing the gate weights are
the softmax of the current logits restricted to the replayed experts, for sigmoid routing
the normalized sigmoid scores, so the router keeps receiving gradients.

``RoutingReplay`` drives those objects by layer number (never through Megatron's
class-level instance list, whose order is construction order): ``before_forward(m)``
hands each local router the ids of micro-batch ``m``; a forward under activation
recomputation replays the same ids again in the backward recompute (Megatron's
``REPLAY_BACKWARD`` queue, consumed in forward order, which is the order both the
no-pipelining and the 1F1B schedules run backwards in). Leaving the context clears every
router's targets and actions.
"""

from __future__ import annotations

from typing import Callable

import torch
from megatron.core.tensor_parallel.random import is_checkpointing
from megatron.core.transformer.moe.router_replay import RouterReplayAction

from moe_routing.record import find_routers


class RoutingReplay:
    """Context manager that makes the routers of a model dispatch given experts.

    Args:
        model_chunks: this rank's model chunk(s), built with ``moe_enable_routing_replay``.
        ids_per_call: for every local MoE layer number, one ``[N, K]`` id tensor per
            micro-batch (``moe_routing.layout.local_ids_per_call``).

    Raises:
        ValueError: a router has no ``RouterReplay``, or ids are missing for a local layer.
    """

    def __init__(self, model_chunks, ids_per_call: dict[int, list[torch.Tensor]]) -> None:
        self._routers = find_routers(model_chunks)
        for number, router in self._routers.items():
            if getattr(router, "router_replay", None) is None:
                raise ValueError(
                    f"layer {number}: router has no RouterReplay; build the model with "
                    "moe_enable_routing_replay=True"
                )
        missing = sorted(set(self._routers) - set(ids_per_call))
        if missing:
            raise ValueError(f"replay ids are missing for local MoE layer(s) {missing}")
        self._ids = ids_per_call
        self._saved: dict[int, Callable] = {}
        self.replayed_micro_batches = 0
        """Micro-batches whose experts were handed to the routers (evidence replay ran)."""

    def before_forward(self, micro_batch: int) -> None:
        """Queue micro-batch ``micro_batch``'s ids for the next forward of every router."""
        for number, router in self._routers.items():
            router.router_replay.set_target_indices(self._ids[number][micro_batch])
        self.replayed_micro_batches += 1

    def __enter__(self) -> "RoutingReplay":
        for number, router in self._routers.items():
            replay = router.router_replay
            replay.clear_indices()
            self._saved[number] = replay.get_replay_topk
            replay.get_replay_topk = self._choose_action(replay, self._saved[number])
        return self

    def __exit__(self, *exc_info) -> None:
        for number, router in self._routers.items():
            replay = router.router_replay
            if "get_replay_topk" in vars(replay):
                del replay.get_replay_topk
            replay.clear_indices()
            replay.clear_router_replay_action()
        self._saved.clear()

    @staticmethod
    def _choose_action(replay, original: Callable) -> Callable:
        def get_replay_topk(scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
            # The backward recompute of a checkpointed layer runs with grad enabled inside
            # Megatron's checkpoint; the first forward runs under no_grad (or outside it).
            recompute = is_checkpointing() and torch.is_grad_enabled()
            replay.set_router_replay_action(
                RouterReplayAction.REPLAY_BACKWARD if recompute else RouterReplayAction.REPLAY_FORWARD
            )
            if recompute:
                return original(scores, topk, num_groups, group_topk, default_compute_topk)
            # A forward that will not be recomputed never pops its ids again: drop them from
            # the recompute queue so it stays aligned with the forwards that will be.
            result = original(scores, topk, num_groups, group_topk, default_compute_topk)
            if not is_checkpointing() and replay.replay_backward_list:
                replay.replay_backward_list.pop(0)
            return result

        return get_replay_topk
