"""Validation of routing data before it drives a forward pass (pure torch).

Shape legend: T tokens, L MoE layers, K experts per token, E experts per layer.

Replay data that is wrong in any way (shape, dtype, id range, an expert repeated within a
token, a layer missing) must stop the step before any forward runs, with an error that
names the layer and the token; a silently wrong route trains on a different model.
"""

from __future__ import annotations

from typing import Sequence

import torch


class RoutingDataError(ValueError):
    """Replay or routing data does not fit the model."""


def validate_expert_ids(
    expert_ids_TLK: torch.Tensor,
    *,
    num_experts: int,
    topk: int,
    layer_numbers: Sequence[int],
    required_layers: Sequence[int],
    num_tokens: int,
    source: str,
) -> None:
    """Check ids ``[T, L, K]`` against the model; raise naming layer and token.

    Args:
        expert_ids_TLK: the ids to replay.
        num_experts: E.
        topk: K the routers use.
        layer_numbers: global layer number of each of the L columns.
        required_layers: MoE layer numbers of the model (all must be present).
        num_tokens: T the batch has.
        source: what the data is ("R2 record", "R3 routes of sample 3") for messages.
    """
    if expert_ids_TLK.is_floating_point() or expert_ids_TLK.is_complex() or expert_ids_TLK.dtype == torch.bool:
        raise RoutingDataError(f"{source}: expert ids must be integers, got {expert_ids_TLK.dtype}")
    if expert_ids_TLK.dim() != 3:
        raise RoutingDataError(f"{source}: expected [tokens, layers, top-K], got shape {tuple(expert_ids_TLK.shape)}")
    t, l, k = expert_ids_TLK.shape
    if t != num_tokens:
        raise RoutingDataError(f"{source}: covers {t} tokens but the batch has {num_tokens}")
    if k != topk:
        raise RoutingDataError(f"{source}: has top-{k} ids but the routers use top-{topk}")
    if len(layer_numbers) != l:
        raise RoutingDataError(f"{source}: {l} layer columns but {len(layer_numbers)} layer numbers")
    missing = sorted(set(required_layers) - set(layer_numbers))
    if missing:
        raise RoutingDataError(f"{source}: no routing for MoE layer(s) {missing}")
    ids = expert_ids_TLK.to(torch.int64)
    bad = (ids < 0) | (ids >= num_experts)
    if bool(bad.any()):
        token, col, slot = (int(v) for v in torch.nonzero(bad)[0])
        raise RoutingDataError(
            f"{source}: layer {layer_numbers[col]} token {token}: expert id {int(ids[token, col, slot])} "
            f"is outside [0, {num_experts})"
        )
    ordered = ids.sort(dim=-1).values
    dup = (ordered[..., 1:] == ordered[..., :-1]).any(dim=-1)
    if bool(dup.any()):
        token, col = (int(v) for v in torch.nonzero(dup)[0])
        raise RoutingDataError(
            f"{source}: layer {layer_numbers[col]} token {token}: expert repeated in "
            f"{ids[token, col].tolist()}"
        )
