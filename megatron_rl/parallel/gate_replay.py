"""Exact-weight routing replay (R3w): the engine's experts *and* the gate weights it used.

Shape legend: T tokens (packed, sample order), L MoE layers, N tokens one router call sees,
K experts per token, E experts per layer.

R3 (``parallel.routing_replay``) dispatches every token to the experts the rollout engine chose
but recomputes their gate weights from the trainer's own router logits, so the expert
outputs are still mixed with the trainer's weights, not the engine's. R3w also hands every
router the gate weight the engine combined each expert's output with (the hf and megatron
engines return them; SGLang 0.5.23 returns expert ids only). The forward value of each
replayed gate is the engine's, exactly: the router's gates enter as ``g_engine + (g - g.detach())``,
whose second term is an exact zero, so the value is the engine's bit for bit while the
gradient is the router's own (the router keeps learning, as under R3). Rows whose given gates
are NaN (padding positions, layers a breakdown stage does not replay) keep the router's gates.

With the megatron engine (the trainer's own pass) R3w reproduces the rollout log-probs bit
for bit; with any other engine what it leaves is what routing cannot explain (attention
kernels, dtype, reductions): stage (c) of ``moe_routing.breakdown``.

:class:`Replay` puts R3 (or R2) and the gate replay behind one ``before_forward`` for
Megatron's schedules; :func:`replay_for` builds it from global ``[T, L, K]`` tensors.
Under activation recomputation the gates of a checkpointed forward are replayed again in
its backward recompute, in forward order (as ``RoutingReplay`` does for the ids).
"""

from __future__ import annotations

from contextlib import ExitStack
from typing import Sequence

import torch

from megatron_rl.parallel import mcore_compat as mc
from megatron_rl.parallel.routing_layout import local_values_per_call
from megatron_rl.parallel.routing_record import find_routers
from megatron_rl.parallel.routing_replay import RoutingReplay, replay_ids_per_call


def exact_gates(probs_NE: torch.Tensor, map_NE: torch.Tensor, ids_NK: torch.Tensor,
                gates_NK: torch.Tensor) -> torch.Tensor:
    """The router's ``[N, E]`` gate weights with the given ones in their place.

    Args:
        probs_NE: the router's gate weights (zero outside the dispatched experts).
        map_NE: bool, the dispatched experts.
        ids_NK: the replayed experts (negative where the row routes itself).
        gates_NK: the gate weight of each replayed expert; NaN rows keep the router's gates.

    Raises:
        ValueError: a row with given gates was not dispatched to exactly the given experts.
    """
    given_NK = gates_NK.to(device=probs_NE.device, dtype=probs_NE.dtype)
    own_N = torch.isnan(given_NK).any(dim=-1)
    ids_NK = ids_NK.to(probs_NE.device).clamp_min(0)
    replayed_N = ~own_N
    if bool((~map_NE.gather(1, ids_NK).all(dim=-1) & replayed_N).any()):
        row = int((~map_NE.gather(1, ids_NK).all(dim=-1) & replayed_N).nonzero()[0, 0])
        raise ValueError(f"gate replay: row {row} was not dispatched to its replayed experts "
                         f"{ids_NK[row].tolist()} (R3w needs the engine's experts replayed too)")
    dense_NE = torch.zeros_like(probs_NE).scatter(1, ids_NK, given_NK.nan_to_num(0.0))
    # (probs - probs.detach()) is an exact zero: the value is the engine's, the gradient the router's.
    return torch.where(own_N[:, None], probs_NE, dense_NE + (probs_NE - probs_NE.detach()))


class GateReplay:
    """Context manager: every local router's gates are replaced by given ones, per micro-batch.

    Args:
        model_chunks: this rank's model chunk(s).
        ids_per_call: per local MoE layer number, the replayed ``[N, K]`` ids of each micro-batch.
        gates_per_call: the same cut of the gate weights (NaN rows: the router's own).
    """

    def __init__(self, model_chunks, ids_per_call: dict[int, list[torch.Tensor]],
                 gates_per_call: dict[int, list[torch.Tensor]]) -> None:
        self._routers = find_routers(model_chunks)
        missing = sorted(set(self._routers) - set(gates_per_call))
        if missing:
            raise ValueError(f"replay gates are missing for local MoE layer(s) {missing}")
        self._ids, self._gates = ids_per_call, gates_per_call
        self._current: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._in_backward: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {n: [] for n in self._routers}
        self._undo: list = []

    def before_forward(self, micro_batch: int) -> None:
        """The gates of micro-batch ``micro_batch`` serve the next forward of every router."""
        for number in self._routers:
            self._current[number] = (self._ids[number][micro_batch], self._gates[number][micro_batch])

    def __enter__(self) -> "GateReplay":
        for number, router in self._routers.items():
            self._undo.append(mc.override_routing(router, self._wrap(number, router.routing)))
        return self

    def __exit__(self, *exc_info) -> None:
        while self._undo:
            self._undo.pop()()
        self._current.clear()
        for queue in self._in_backward.values():
            queue.clear()

    def _wrap(self, number: int, original):
        def routing(logits, *args, **kwargs):
            probs_NE, map_NE = original(logits, *args, **kwargs)
            # As RoutingReplay: a checkpointed forward is run again, with grad, in backward.
            if mc.is_checkpointing() and torch.is_grad_enabled():
                ids_NK, gates_NK = self._in_backward[number].pop(0)
            else:
                ids_NK, gates_NK = self._current[number]
                if mc.is_checkpointing():
                    self._in_backward[number].append((ids_NK, gates_NK))
            return exact_gates(probs_NE, map_NE, ids_NK, gates_NK), map_NE

        return routing


class Replay:
    """Routing replay of ids (R2 / R3) and, optionally, of gates (R3w), as one context."""

    def __init__(self, routing: RoutingReplay, gates: GateReplay | None = None) -> None:
        self.routing, self.gates = routing, gates

    @property
    def replayed_micro_batches(self) -> int:
        """Micro-batches whose experts were handed to the routers."""
        return self.routing.replayed_micro_batches

    def before_forward(self, micro_batch: int) -> None:
        """Queue micro-batch ``micro_batch``'s ids (and gates) for the next forward."""
        self.routing.before_forward(micro_batch)
        if self.gates is not None:
            self.gates.before_forward(micro_batch)

    def __enter__(self) -> "Replay":
        self._stack = ExitStack()
        self._stack.enter_context(self.routing)
        if self.gates is not None:
            self._stack.enter_context(self.gates)
        return self

    def __exit__(self, *exc_info) -> None:
        self._stack.close()


def replay_for(model, groups, micro_batches: Sequence, ids_TLK: torch.Tensor, layer_numbers: Sequence[int],
               local_layer_numbers: Sequence[int], gates_TLK: torch.Tensor | None = None) -> Replay:
    """The replay of global ``[T, L, K]`` ids (and gates, R3w) over these micro-batches.

    Args:
        model: this rank's model stage.
        groups: ``ParallelGroups`` of this rank.
        micro_batches: the micro-batches that will run, in order.
        ids_TLK: experts to dispatch each position to (negative: the router's own top-K).
        layer_numbers: global layer number of each of the L columns.
        local_layer_numbers: the MoE layers on this rank.
        gates_TLK: gate weights of those experts (NaN: the router's own), or None (R2 / R3).
    """
    ids = replay_ids_per_call(ids_TLK, layer_numbers, local_layer_numbers, micro_batches, groups)
    gates = None
    if gates_TLK is not None:
        if gates_TLK.shape != ids_TLK.shape:
            raise ValueError(f"replay gates have shape {tuple(gates_TLK.shape)}, the ids {tuple(ids_TLK.shape)}")
        nan_K = torch.full((ids_TLK.shape[2],), float("nan"))
        per_call = local_values_per_call(gates_TLK.float(), layer_numbers, local_layer_numbers, micro_batches, groups,
                                         nan_K)
        gates = GateReplay([model], ids, per_call)
    return Replay(RoutingReplay([model], ids), gates)
