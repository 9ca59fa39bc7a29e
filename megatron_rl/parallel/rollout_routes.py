"""A rollout engine's per-sample routes (and gate weights) as one replayable ``[T_all, L, K]``.

Shape legend: S samples, T_all their prompt+response positions (sample order), L MoE layers,
K top-K, E experts.

Engines return, per sample of ``n`` tokens, the routes of the ``n - 1`` positions they
forwarded (SGLang's layout): the last token is never forwarded and feeds no loss, so its
position is dispatched to the experts of the position before it. Routes with a column per
decoder layer (SGLang's, dense layers included) are cut to the MoE layers' columns. Everything
is validated (shape, id range, repeats, the layers this rank holds; gates finite and
non-negative) before any forward, naming the sample. Used by R3 / R3w
(``parallel.train_step``) and the mismatch breakdown (``parallel.mismatch_passes``).
"""

from __future__ import annotations

from typing import Sequence

import torch

from moe_routing.validate import RoutingDataError, validate_expert_ids


def rollout_ids_TLK(routes: Sequence[torch.Tensor], sequences: Sequence[torch.Tensor], *, num_experts: int,
                    topk: int, layer_numbers: Sequence[int], local_layers: Sequence[int],
                    num_model_layers: int | None = None) -> torch.Tensor:
    """``[T_all, L, K]`` int64 experts from each sample's ``[n - 1, L(+dense), K]`` routes.

    Args:
        routes: per sample, the engine's routes.
        sequences: per sample, the prompt+response ids (``n`` tokens).
        num_experts: E.
        topk: K.
        layer_numbers: MoE layer numbers of the model (the columns kept).
        local_layers: MoE layer numbers on this rank (must all be covered).
        num_model_layers: decoder layers of the model; routes with that many columns are cut.
    """
    parts = []
    for i, (sample_routes, seq) in enumerate(zip(routes, sequences)):
        n = int(seq.numel())
        if sample_routes.dim() != 3 or sample_routes.shape[0] != n - 1:
            raise RoutingDataError(
                f"R3 routes of sample {i}: expected [{n - 1}, L, K] (prompt+response minus the last "
                f"token), got {tuple(sample_routes.shape)}"
            )
        if sample_routes.shape[1] == num_model_layers != len(layer_numbers):
            # SGLang returns a column per decoder layer; dense layers' columns route nothing.
            sample_routes = sample_routes[:, [number - 1 for number in layer_numbers]]
        validate_expert_ids(sample_routes, num_experts=num_experts, topk=topk, layer_numbers=layer_numbers,
                            required_layers=local_layers, num_tokens=n - 1, source=f"R3 routes of sample {i}")
        parts.append(torch.cat([sample_routes.to(torch.int64), sample_routes[-1:].to(torch.int64)]))
    return torch.cat(parts)


def rollout_gates_TLK(gates: Sequence[torch.Tensor] | None, routes: Sequence[torch.Tensor],
                      num_columns: int) -> torch.Tensor:
    """``[T_all, L, K]`` fp32 gate weights beside :func:`rollout_ids_TLK`'s experts.

    Each sample's ``[n - 1, L, K]`` gates must match its routes, be finite and non-negative.
    """
    if gates is None or len(gates) != len(routes):
        raise RoutingDataError("R3w needs the engine's gate weights per sample (the hf and megatron engines "
                               "return them, SGLang 0.5.23 does not)")
    parts = []
    for i, (sample_gates, sample_routes) in enumerate(zip(gates, routes)):
        if sample_gates is None or sample_gates.shape[0] != sample_routes.shape[0] \
                or sample_gates.shape[2:] != sample_routes.shape[2:]:
            shape = None if sample_gates is None else tuple(sample_gates.shape)
            raise RoutingDataError(f"R3w gates of sample {i}: shape {shape} does not match its routes "
                                   f"{tuple(sample_routes.shape)}")
        if not bool((torch.isfinite(sample_gates) & (sample_gates >= 0)).all()):
            raise RoutingDataError(f"R3w gates of sample {i}: a gate weight is negative or not finite")
        parts.append(torch.cat([sample_gates.float(), sample_gates[-1:].float()]))
    gates_TLK = torch.cat(parts)
    if gates_TLK.shape[1] != num_columns:
        raise RoutingDataError(f"R3w gates cover {gates_TLK.shape[1]} layers, the routes {num_columns}")
    return gates_TLK
