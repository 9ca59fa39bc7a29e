"""Record each MoE router's decisions during a forward pass (hooks on Megatron's routers).

Shape legend: N tokens seen by one router call (this rank's sequence-parallel shard of its
context-parallel share of one micro-batch), E experts, K experts per token, L MoE layers on this rank.

``RouterRecorder`` wraps ``TopKRouter.routing`` of every router in the given model chunks,
keyed by the router's global ``layer_number`` (never by construction order). Each call of
a router appends one :class:`LayerCall` (ids of the dispatched experts, their router
probabilities under the score function, their gate weights) to that layer's list. When the
caller supplies *query ids* for a layer (the experts an earlier pass used for the same
tokens), the call also returns the current router probabilities at those ids, which
is what RSPO's router-shift weight needs (returned as probabilities). Everything lives inside the context manager:
entering wraps the routers, leaving restores them, and nothing stays behind in any class
or module.

Sigmoid routing (DeepSeek-V3, GLM-4.5): the recorded *router probability* of an expert is
its own sigmoid score ``sigma(z_e)``, the quantity its gate is made of. The expert bias of
aux-loss-free balancing takes part in selection only (selection score ``sigma(z_e) + b_e``,
and with group-limited routing only the best groups' experts compete); it is a checkpoint
constant during RL, so the selection needs no record of its own. The *gate* is what
multiplied the expert's output: the K sigmoid scores normalized to sum 1, times the routed
scaling factor. Both are recorded. RSPO compares ``log sigma(z_e)`` at the old experts
(each depends on that expert's logit alone, unlike a softmax); diagnostics compare with
the router's own selection, bias and groups included (:func:`natural_topk`).

What it does not own: assembling calls from shards, micro-batches and stages into one
:class:`~moe_routing.types.RouterRecord` (``megatron_rl.parallel.routing_layout``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable

import torch

from megatron_rl.parallel.mcore_compat import override_routing
from moe_routing.scores import (
    dispatched_by_score,
    router_log_scores,
    same_expert_set,
    selection_topk,
)
from moe_routing.types import compact_id_dtype


@dataclass
class LayerCall:
    """What one router call decided for its N tokens."""

    expert_ids_NK: torch.Tensor
    """Dispatched experts, by descending router probability (compact integer dtype)."""
    probs_NK: torch.Tensor
    """Router probabilities of those experts under the score function."""
    gates_NK: torch.Tensor
    """Gate weights used to combine the experts' outputs."""
    natural_equals_dispatched_N: torch.Tensor | None = None
    """bool: the router's own top-K set equals the dispatched set (False where replay overrode it)."""
    query_probs_NK: torch.Tensor | None = None
    """Current router probabilities at the query ids, when queried (same dtype and rounding
    as ``probs_NK``, so unchanged weights reproduce a recorded probability bit for bit)."""
    natural_equals_query_N: torch.Tensor | None = None
    """bool: the router's own top-K set equals the query set (no flip), when queried."""


@dataclass
class _RouterEntry:
    router: torch.nn.Module
    undo: Callable[[], None] | None = None
    calls: list[LayerCall] = field(default_factory=list)
    queries: list[torch.Tensor] = field(default_factory=list)


def find_routers(model_chunks: Iterable[torch.nn.Module]) -> dict[int, torch.nn.Module]:
    """Megatron ``TopKRouter`` modules of the chunks, by global layer number.

    Raises:
        ValueError: the model has no MoE layers, or two routers share a layer number.
    """
    from megatron_rl.parallel.mcore_compat import TopKRouter

    routers: dict[int, torch.nn.Module] = {}
    for chunk in model_chunks:
        for name, module in chunk.named_modules():
            if isinstance(module, TopKRouter):
                if module.layer_number is None:
                    raise ValueError(f"router {name} has no layer number")
                if module.layer_number in routers:
                    raise ValueError(f"two routers claim layer number {module.layer_number}")
                routers[module.layer_number] = module
    return routers


class RouterRecorder:
    """Context manager that records every router call of the given model chunks.

    Args:
        model_chunks: this rank's model chunk(s) (any wrappers; routers are found inside).
        probs_dtype: dtype for recorded probabilities and gates.
        allow_empty: do not raise when this pipeline stage holds no MoE layer (dense first
            layers can fill a stage); it then records nothing and contributes no layer columns.
        diagnostics: also compare each token's natural top-K with what was dispatched (and
            with the query ids); off for plain recording, which then costs less.
        topk: K of the model, for a stage without routers (the routers' own otherwise).
        num_experts: E of the model, likewise.

    Raises:
        ValueError: no MoE layer in the model (unless ``allow_empty``).
    """

    def __init__(
        self,
        model_chunks: Iterable[torch.nn.Module],
        probs_dtype: torch.dtype = torch.float32,
        allow_empty: bool = False,
        diagnostics: bool = False,
        topk: int | None = None,
        num_experts: int | None = None,
    ) -> None:
        routers = find_routers(model_chunks)
        if not routers and not allow_empty:
            raise ValueError("cannot record routing: the model has no MoE layers (no TopKRouter)")
        self.probs_dtype = probs_dtype
        self.diagnostics = diagnostics
        any_router = next(iter(routers.values()), None)
        self._topk = any_router.topk if any_router is not None else topk
        self._num_experts = any_router.config.num_moe_experts if any_router is not None else num_experts
        self._entries = {
            number: _RouterEntry(router=router)
            for number, router in sorted(routers.items())
        }
        self._active = False

    @property
    def layer_numbers(self) -> tuple[int, ...]:
        """Global layer numbers of the recorded routers, ascending."""
        return tuple(self._entries)

    def calls(self, layer_number: int) -> list[LayerCall]:
        """Calls recorded so far for one layer, in call order."""
        return self._entries[layer_number].calls

    def field_layout(self, field: str) -> tuple[tuple[int, ...], torch.dtype]:
        """Shape after N and dtype of a :class:`LayerCall` field, known without any call, so a
        stage that holds no router can contribute an empty ``[N, 0, ...]`` of it.

        Raises:
            ValueError: the stage has no router and the recorder was not given K and E.
        """
        if self._topk is None or self._num_experts is None:
            raise ValueError("a recorder without routers needs topk and num_experts to describe its (empty) calls")
        if field.startswith("natural_equals"):
            return (), torch.bool
        if field == "expert_ids_NK":
            return (self._topk,), compact_id_dtype(self._num_experts)
        return (self._topk,), self.probs_dtype

    def set_queries(self, layer_number: int, expert_ids_per_call: list[torch.Tensor]) -> None:
        """Experts ``[N, K]`` at which each coming call of a layer reports log-probabilities.

        The i-th coming call of the layer consumes the i-th tensor; its N must match.
        """
        self._entries[layer_number].queries = list(expert_ids_per_call)

    def clear(self) -> None:
        """Drop recorded calls and pending queries (between passes)."""
        for entry in self._entries.values():
            entry.calls.clear()
            entry.queries.clear()

    def __enter__(self) -> "RouterRecorder":
        if self._active:
            raise RuntimeError("RouterRecorder is already active")
        for number, entry in self._entries.items():
            entry.undo = override_routing(entry.router, self._wrap(number, entry, entry.router.routing))
        self._active = True
        return self

    def __exit__(self, *exc_info) -> None:
        for entry in self._entries.values():
            if entry.undo is not None:
                entry.undo()
                entry.undo = None
        self._active = False

    def _wrap(self, layer_number: int, entry: _RouterEntry, original: Callable) -> Callable:
        router = entry.router

        def routing(logits, *args, **kwargs):
            probs_NE, routing_map_NE = original(logits, *args, **kwargs)
            entry.calls.append(
                self._describe(layer_number, entry, router, logits, probs_NE, routing_map_NE)
            )
            return probs_NE, routing_map_NE

        return routing

    def _describe(self, layer_number, entry, router, logits, probs_NE, routing_map_NE) -> LayerCall:
        with torch.no_grad():
            logits_NE = logits.reshape(-1, router.config.num_moe_experts)
            # Full-row log scores: softmax needs every expert's logit for its normalizer, and
            # queries / diagnostics read experts outside the dispatched set.
            log_scores_NE = router_log_scores(logits_NE, router.score_function)
            ids_NK, log_scores_NK = dispatched_by_score(log_scores_NE, routing_map_NE, router.topk)
            natural_NK = natural_topk(router, logits_NE) if self.diagnostics else None
            query = natural_equals_query = None
            if entry.queries:
                query_ids_NK = entry.queries.pop(0).to(device=ids_NK.device, dtype=torch.int64)
                if query_ids_NK.shape != ids_NK.shape:
                    raise ValueError(
                        f"layer {layer_number}: query ids have shape {tuple(query_ids_NK.shape)}"
                        f" but the router saw {tuple(ids_NK.shape)} (tokens x top-K)"
                    )
                query = log_scores_NE.gather(1, query_ids_NK).exp().to(self.probs_dtype)
                if natural_NK is not None:
                    natural_equals_query = same_expert_set(natural_NK, query_ids_NK)
            return LayerCall(
                expert_ids_NK=ids_NK.to(compact_id_dtype(router.config.num_moe_experts)),
                # The sorted values are the gathered log scores themselves (bit for bit).
                probs_NK=log_scores_NK.exp().to(self.probs_dtype),
                # Gather before converting: K values per token instead of E, same result (the
                # fp32 step stays so rounding to probs_dtype is unchanged).
                gates_NK=probs_NE.gather(1, ids_NK).float().to(self.probs_dtype),
                natural_equals_dispatched_N=(
                    same_expert_set(natural_NK, ids_NK) if natural_NK is not None else None
                ),
                query_probs_NK=query,
                natural_equals_query_N=natural_equals_query,
            )


def natural_topk(router: torch.nn.Module, logits_NE: torch.Tensor) -> torch.Tensor:
    """Ids ``[N, K]`` a Megatron ``TopKRouter`` selects from ``logits_NE`` without replay
    (its expert bias and group limit included, as its own top-K does)."""
    config = router.config
    return selection_topk(
        logits_NE,
        router.score_function,
        router.topk,
        expert_bias_E=router.expert_bias,
        num_groups=config.moe_router_num_groups or 0,
        group_topk=config.moe_router_group_topk or 0,
    )
