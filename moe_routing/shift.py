"""RSPO router-shift weights (pure torch).

Shape legend: T tokens, L MoE layers, K experts per token.

For each token, ``gamma = exp(-mean_l mean_k |log r_cur^l(e_old) - log r_old^l(e_old)|)``
over the experts ``e_old`` the old policy routed it to. The floor ``gamma_min`` is applied
exactly once, by the objective library (``megatron_rl.algos``); these functions return
the unfloored, stop-gradient weight.
"""

from __future__ import annotations

import torch


def router_shift_TL(current_probs_TLK: torch.Tensor, old_probs_TLK: torch.Tensor) -> torch.Tensor:
    """Mean over the old top-K of ``|log r_cur - log r_old|`` per token and layer, ``[T, L]``.

    Both probabilities should come in the record's dtype (the recorder rounds current
    probabilities the same way), so unchanged router weights give a shift of exactly 0.
    """
    tiny = torch.finfo(torch.float64).tiny
    current_log = current_probs_TLK.double().clamp_min(tiny).log()
    old_log = old_probs_TLK.double().clamp_min(tiny).log()
    return (current_log - old_log).abs().mean(dim=-1)


def rspo_gamma_T(shift_sum_T: torch.Tensor, num_layers: int) -> torch.Tensor:
    """``exp(-(sum over layers of the shift) / L)``, detached, fp32.

    Takes the per-token *sum* over layers so that pipeline stages can add their layers'
    contributions with one all-reduce before the mean.
    """
    if num_layers <= 0:
        raise ValueError(f"num_layers must be positive, got {num_layers}")
    return torch.exp(-shift_sum_T.detach().double() / num_layers).float()
