"""Routing replay (R2 / R3) on top of Megatron-Core's ``RouterReplay``, scoped per pass.

Shape legend: N tokens one router call sees (this rank's sequence-parallel shard of its
context-parallel share of one micro-batch), K experts per token.

Megatron-Core (0.16.1 to 0.19.x) gives each ``TopKRouter`` a ``RouterReplay`` when the model is built
with ``moe_enable_routing_replay=True``. In replay mode the router dispatches the target
experts and gathers its *current* scores at them: for softmax routing the gate weights are
the softmax of the current logits restricted to the replayed experts, for sigmoid routing
the normalized sigmoid scores, so the router keeps receiving gradients.

With sigmoid routing the replayed experts are dispatched whatever their selection scores:
neither the expert bias nor the group limit applies to them (a replayed set may span
groups the current router would not pick), and their gates are the current sigmoid
scores normalized over the replayed K, times the routed scaling factor.

``RoutingReplay`` drives those objects by layer number (never through Megatron's
class-level instance list, whose order is construction order): ``before_forward(m)``
hands each local router the ids of micro-batch ``m``; a forward under activation
recomputation replays the same ids again in the backward recompute (Megatron's
``REPLAY_BACKWARD`` queue, consumed in forward order, which is the order both the
no-pipelining and the 1F1B schedules run backwards in). Leaving the context clears every
router's targets and actions.

Replaying a pass's own routing reproduces that pass bit for bit (R2 with unchanged
weights): rows that no record covers (a micro-batch row's padding) are routed by the
router's own top-K as in a pass without replay, so every expert's GEMM sees the same
tokens, and the replayed scores go to the gate function in top-K's descending order.

Every Megatron internal used here goes through ``megatron_rl.parallel.mcore_compat``. A
router whose config makes replay silently wrong (fused router, quantile or Sinkhorn
balancing, MTP, virtual pipeline stages, token dropping: ``mcore_compat.replay_hazards``)
or that belongs to an MTP layer is refused when the context is created.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from megatron_rl.parallel import mcore_compat as mc
from megatron_rl.parallel.routing_layout import local_ids_per_call
from megatron_rl.parallel.routing_record import find_routers

NATURAL = -1
"""Expert id that marks a row with nothing to replay: the router routes it by its own top-K."""


def replay_ids_per_call(
    expert_ids_TLK: torch.Tensor,
    layer_numbers: Sequence[int],
    local_layer_numbers: Sequence[int],
    micro_batches: Sequence,
    groups,
) -> dict[int, list[torch.Tensor]]:
    """``local_ids_per_call`` for :class:`RoutingReplay`, padding rows marked ``NATURAL``.

    Padding routed anywhere else changes how many tokens each expert's GEMM gets, and CPU
    GEMM kernels pick their blocking (hence rounding) by shape, so real tokens would come
    out a few ulps different from a pass without replay.
    """
    pad_ids_K = torch.full((expert_ids_TLK.shape[2],), NATURAL, dtype=torch.int64)
    return local_ids_per_call(
        expert_ids_TLK, layer_numbers, local_layer_numbers, micro_batches, groups, pad_ids_K=pad_ids_K
    )


class RoutingReplay:
    """Context manager that makes the routers of a model dispatch given experts.

    Args:
        model_chunks: this rank's model chunk(s), built with ``moe_enable_routing_replay``.
        ids_per_call: for every local MoE layer number, one ``[N, K]`` id tensor per
            micro-batch (``megatron_rl.parallel.routing_layout.local_ids_per_call``).

    Raises:
        ValueError: a router has no ``RouterReplay``, or ids are missing for a local layer.
    """

    def __init__(self, model_chunks, ids_per_call: dict[int, list[torch.Tensor]]) -> None:
        self._routers = find_routers(model_chunks)
        for number, router in self._routers.items():
            if mc.router_replay(router) is None:
                raise ValueError(
                    f"layer {number}: router has no RouterReplay; build the model with "
                    "moe_enable_routing_replay=True"
                )
            hazards = mc.replay_hazards(router.config)
            if mc.is_mtp_router(router):
                hazards.append("the router belongs to an MTP layer, which must not replay backbone routes")
            if hazards:
                raise ValueError(f"layer {number}: routing replay would be silently wrong: " + "; ".join(hazards))
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
            mc.router_replay(router).set_target_indices(self._ids[number][micro_batch])
        self.replayed_micro_batches += 1

    def __enter__(self) -> "RoutingReplay":
        for number, router in self._routers.items():
            replay = mc.router_replay(router)
            replay.clear_indices()
            self._saved[number] = mc.override_replay_topk(replay, lambda original: self._choose_action(replay, original))
        return self

    def __exit__(self, *exc_info) -> None:
        for router in self._routers.values():
            mc.reset_replay(mc.router_replay(router))
        self._saved.clear()

    @staticmethod
    def _choose_action(replay, original: Callable) -> Callable:
        def replay_topk(scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
            # The backward recompute of a checkpointed layer runs with grad enabled inside
            # Megatron's checkpoint; the first forward runs under no_grad (or outside it).
            recompute = mc.is_checkpointing() and torch.is_grad_enabled()
            mc.set_replay_action(replay, recompute)
            _route_natural_rows(replay, recompute, scores, lambda: default_compute_topk(
                scores, topk, num_groups=num_groups, group_topk=group_topk))
            if recompute:
                return _descending(*original(scores, topk, num_groups, group_topk, default_compute_topk))
            # A forward that will not be recomputed never pops its ids again: drop them from
            # the recompute queue so it stays aligned with the forwards that will be.
            result = original(scores, topk, num_groups, group_topk, default_compute_topk)
            if not mc.is_checkpointing():
                mc.drop_recompute_ids(replay)
            return _descending(*result)

        return replay_topk


def _route_natural_rows(replay, recompute: bool, scores: torch.Tensor, natural_topk: Callable) -> None:
    """Give the ``NATURAL`` rows of the ids Megatron is about to gather the router's own top-K.

    ``natural_topk`` is the very call a pass without replay makes on these scores (all rows:
    group-limited top-K reshapes by the full token count), so those rows route identically.
    """
    queued_NK = mc.queued_replay_ids(replay, recompute)
    # Ids stay on the host until Megatron moves them, so this test never waits for the device.
    natural_N = queued_NK[:, 0] == NATURAL
    if not bool(natural_N.any()):
        return
    filled_NK = torch.where(
        natural_N.to(scores.device)[:, None], natural_topk()[1], queued_NK.to(scores.device)
    )
    mc.set_queued_replay_ids(replay, recompute, filled_NK)


def _descending(scores_NK: torch.Tensor, ids_NK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Replayed scores sorted as ``torch.topk`` returns them, ids alongside.

    The gate function (softmax over the K scores, or the sigmoid normalization) sums over K
    in memory order; a record's order (by rounded log-probability, ties by id) can differ
    from top-K's near ties, and for K > 2 the sum's rounding with it. Sorted, a replayed
    set equal to the natural one gives the gate function the same K scores in the same order.
    """
    sorted_NK, order_NK = scores_NK.sort(dim=-1, descending=True, stable=True)
    return sorted_NK, ids_NK.gather(1, order_NK)
