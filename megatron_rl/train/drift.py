"""Router drift against staleness: the behaviour routes RSPO measures against, and metrics per version lag.

Shape legend: T_resp response tokens (sample order), T_all prompt+response positions, L MoE
layers, K top-K.

With asynchronous rollouts (``rollout.max_staleness`` k > 0) a token generated under version
v - d is trained at v: d is its lag. Its routes (what R3 replays) are those of the engine
pass that produced it, under v - d; RSPO's router-shift weight is then measured at those
experts (:func:`shift_record`): the old-policy pass (the proximal policy, version v) queries
its router's probabilities there, and the update's probe compares the current router's with
them, so the weight down-weights a token whose producing experts the router has moved away
from. (SGLang returns no router probabilities, only the experts, so the reference
probabilities are the proximal policy's at those experts.) With k = 0 nothing changes: the
old policy's own top-K, as before.

Per lag d = 0 .. k (:class:`LagMeans`, over the tokens the loss sees, every data-parallel rank):

* ``drift/flip_rate/lag<d>``: share of (token, MoE layer) pairs whose experts under the
  proximal router are not the ones the token was produced with;
* ``drift/router_shift/lag<d>``, ``drift/gamma/lag<d>``: what RSPO uses, the mean over layers
  and the behaviour experts of ``|log r_cur - log r_prox|`` and its weight, over the updates;
* ``drift/train_rollout_abs_diff/lag<d>``: ``|log pi_prox - log pi_behaviour|`` per token.

A lag no token of the step has is not logged (its mean is undefined, not 0).

Owns the record and the reductions; not the passes (``parallel.logprobs``, ``parallel.train_step``).
"""

from __future__ import annotations

import torch

from megatron_rl.parallel.comm import all_reduce
from megatron_rl.parallel.families import moe_layer_numbers
from megatron_rl.parallel.groups import ParallelGroups
from megatron_rl.parallel.rollout_routes import rollout_ids_TLK
from megatron_rl.parallel.routing_record import find_routers
from megatron_rl.parallel.schedule import unwrap
from moe_routing.types import RouterRecord, compact_id_dtype


def behaviour_route_ids(model: torch.nn.Module, sequences: list[torch.Tensor],
                        rollout_routes: list[torch.Tensor]) -> tuple[torch.Tensor, tuple[int, ...]]:
    """``([T_all, L, K] experts each position was computed with by the rollout engine, the MoE
    layer number of each column)``."""
    config = unwrap(model).config
    layers = tuple(moe_layer_numbers(config))
    ids = rollout_ids_TLK(rollout_routes, sequences, num_experts=config.num_moe_experts,
                          topk=config.moe_router_topk, layer_numbers=layers,
                          local_layers=tuple(find_routers([model])), num_model_layers=config.num_layers)
    return ids, layers


def shift_record(ids_TLK: torch.Tensor, layers: tuple[int, ...], proximal_probs_TLK: torch.Tensor,
                 cu_seqlens_S1: torch.Tensor, num_experts: int) -> RouterRecord:
    """The record RSPO measures against: the behaviour experts, with the proximal policy's
    router probabilities at them (gates unused: zeros)."""
    return RouterRecord(expert_ids_TLK=ids_TLK.to(compact_id_dtype(num_experts)), probs_TLK=proximal_probs_TLK,
                        gates_TLK=torch.zeros_like(proximal_probs_TLK), layer_numbers=layers,
                        cu_seqlens_S1=cu_seqlens_S1, num_experts=num_experts)


class LagMeans:
    """Means of per-token values per version lag 0 .. ``max_lag`` of a step training version
    ``version`` (every rank adds the same names, so every rank reduces the same tensor)."""

    def __init__(self, max_lag: int, version: int) -> None:
        self.max_lag, self.version = max_lag, version
        self.sums: dict[str, torch.Tensor] = {}
        self.counts: dict[str, torch.Tensor] = {}

    def add(self, name: str, values_T: torch.Tensor, versions_T: torch.Tensor, mask_T: torch.Tensor) -> None:
        """Add ``values_T`` of the tokens where ``mask_T``, grouped by their lag ``version - versions_T``."""
        lag_T = self.version - versions_T
        lags = torch.arange(self.max_lag + 1)
        hit_DT = (lag_T[None, :] == lags[:, None]) & mask_T[None, :].bool()
        values = torch.nan_to_num(values_T.double(), nan=0.0)
        sums = (hit_DT.double() * values[None, :]).sum(dim=1)
        counts = hit_DT.double().sum(dim=1)
        self.sums[name] = self.sums.get(name, 0) + sums
        self.counts[name] = self.counts.get(name, 0) + counts

    def reduce(self, groups: ParallelGroups) -> dict[str, torch.Tensor]:
        """Collective over the data-parallel group: ``drift/<name>/lag<d>`` for each lag d that
        some token of ``name`` has on some rank; a lag without tokens logs nothing (a 0 there
        would read as a measured mean)."""
        names = sorted(self.sums)
        if not names:
            return {}
        stacked = torch.stack([torch.cat([self.sums[n], self.counts[n]]) for n in names])
        if groups.dp_size > 1:
            all_reduce(stacked, groups.dp)
        out = {}
        width = self.max_lag + 1
        for row, name in zip(stacked, names):
            counts = row[width:]
            means = row[:width] / counts.clamp_min(1.0)
            out.update({f"drift/{name}/lag{d}": means[d].float() for d in range(width) if counts[d] > 0})
        return out
