"""Routing diagnostics from per-token, per-layer flags and shifts (pure torch).

Shape legend: T tokens, L MoE layers.

- replay agreement: share of token-layer pairs whose natural top-K set (what the current
  router would pick) equals the set that was dispatched (replayed);
- flip rate per layer: share of tokens whose natural top-K set differs from the old
  policy's;
- router shift per layer: mean ``|log r_cur - log r_old|`` over the old top-K.
"""

from __future__ import annotations

from typing import Sequence

import torch


def routing_metrics(
    layer_numbers: Sequence[int],
    *,
    natural_equals_dispatched_TL: torch.Tensor,
    valid_T: torch.Tensor,
    natural_equals_old_TL: torch.Tensor | None = None,
    shift_TL: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """Per-step routing metrics as 0-dim tensors, over the tokens where ``valid_T``.

    Args:
        layer_numbers: global layer number of each column.
        natural_equals_dispatched_TL: bool, natural top-K set == dispatched set.
        valid_T: bool, tokens that count (real tokens with routing data).
        natural_equals_old_TL: bool, natural top-K set == the old policy's set.
        shift_TL: mean |delta log r| over the old top-K.
    """
    weight_T = valid_T.double()
    count = weight_T.sum().clamp_min(1.0)

    def per_layer_mean(values_TL: torch.Tensor) -> torch.Tensor:
        return (values_TL.double() * weight_T[:, None]).sum(0) / count

    metrics = {"routing/replay_agreement": per_layer_mean(natural_equals_dispatched_TL).mean()}
    if natural_equals_old_TL is not None:
        flips_L = 1.0 - per_layer_mean(natural_equals_old_TL)
        metrics["routing/flip_rate"] = flips_L.mean()
        for number, value in zip(layer_numbers, flips_L):
            metrics[f"routing/flip_rate/layer{number}"] = value
    if shift_TL is not None:
        shift_L = per_layer_mean(shift_TL)
        metrics["routing/abs_dlogr"] = shift_L.mean()
        for number, value in zip(layer_numbers, shift_L):
            metrics[f"routing/abs_dlogr/layer{number}"] = value
    return {k: v.float() for k, v in metrics.items()}


def gamma_metrics(gamma_T: torch.Tensor, valid_T: torch.Tensor, gamma_min: float | None) -> dict[str, torch.Tensor]:
    """min / mean / fraction floored of the (unfloored) RSPO weights over valid tokens."""
    values = gamma_T[valid_T].double()
    if values.numel() == 0:
        return {}
    out = {"gamma/min": values.min(), "gamma/mean": values.mean()}
    if gamma_min is not None:
        out["gamma/floored_frac"] = (values < gamma_min).double().mean()
    return {k: v.float() for k, v in out.items()}
