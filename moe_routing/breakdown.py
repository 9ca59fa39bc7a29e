"""The train-vs-rollout log-prob gap split into its causes, per layer (pure torch).

Shape legend: T response tokens (sample order), L MoE layers, K experts per token, P passes.

The trainer's log-prob of a token and the rollout engine's differ by ``d_0 = lp_train -
lp_rollout``. Re-running the trainer's pass with the engine's routing replayed in stages
removes that gap cause by cause, in a fixed order:

(a) **expert choice**: the engine's expert ids replayed at layers 1..l (the trainer's own
    gate weights over them), for l = 1..L, one pass each;
(b) **gate weights**: the engine's ids at every layer and its gate weights at layers 1..l
    (R3w at layers 1..l), for l = 1..L; not measured when the engine returns no gates
    (SGLang 0.5.23 returns expert ids only), so its share stays inside (c);
(c) **other numerics**: what the last pass still leaves (attention kernels, dtype, reductions).

With ``G_p = mean_t |lp_p - lp_rollout|`` over the counted tokens of pass p (pass 0 the
trainer's own), the stage at layer l removes ``G_{p-1} - G_p``, and (c) is ``G_last``: the
parts telescope, so they sum to ``G_0`` exactly (a part is negative where replaying made the
gap wider). Shares are parts over ``G_0``. With ``per_layer`` off, (a) and (b) are one pass
each over all layers. Attribution follows the layer order: replaying layer l changes what
every later layer sees, and the later layers' parts are measured after it.

Per layer also: the **flip rate** (tokens whose engine and trainer top-K expert sets differ)
and the **router KL** ``KL(p_engine || p_trainer)`` over K + 1 bins, the engine's K experts
and one for the other E - K (a lower bound of the E-way KL that needs only each side's
probabilities at the engine's experts; engines without router probabilities: not measured).
Per token, the **cause** is the stage and layer whose pass removed most of its gap, or other
numerics when the last pass leaves more than any stage removed.

Sums are kept apart from the metrics (:func:`gap_sums`, :func:`routing_sums` then
:func:`breakdown_metrics`), so that a caller can add them over data-parallel ranks first.
No torch.distributed, Megatron or I/O here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

STAGES = ("expert_choice", "gate_weights", "other")
"""Metric names of stages (a), (b) and (c)."""


@dataclass
class StagePasses:
    """Log-probs ``[T]`` of every pass of a breakdown, with the tokens that count."""

    rollout_T: torch.Tensor
    """The engine's log-probs."""
    trainer_T: torch.Tensor
    """The trainer's own pass (its own routing)."""
    ids_passes: list[torch.Tensor]
    """Stage (a): engine ids at layers 1..l, l = 1..L (one pass over all layers without per_layer)."""
    gate_passes: list[torch.Tensor]
    """Stage (b): engine ids everywhere and gates at layers 1..l (empty: the engine gives no gates)."""
    mask_T: torch.Tensor
    """bool: tokens the policy generated (the ones a loss sees)."""

    def all_passes(self) -> list[torch.Tensor]:
        """Trainer, then stage (a), then stage (b) passes, in the order they remove the gap."""
        return [self.trainer_T, *self.ids_passes, *self.gate_passes]


def gap_sums(passes: StagePasses) -> torch.Tensor:
    """``[P + 1]`` fp64: sum of ``|lp_p - lp_rollout|`` over counted tokens per pass, then the count."""
    mask = passes.mask_T.bool()
    sums = [(p.double() - passes.rollout_T.double()).abs()[mask].sum() for p in passes.all_passes()]
    return torch.stack([*sums, mask.sum().double()])


def coarse_router_kl_TL(engine_probs_TLK: torch.Tensor, trainer_probs_TLK: torch.Tensor) -> torch.Tensor:
    """``[T, L]`` KL over the engine's K experts plus one bin for the rest of the E experts.

    Both inputs hold router probabilities (softmax over all E) at the engine's experts. Each
    side's last bin is ``1 - sum_k``; ``0 log 0 = 0``; the trainer's bins are floored at 1e-12.
    """
    pe = engine_probs_TLK.double().clamp(0.0, 1.0)
    pt = trainer_probs_TLK.double().clamp(1e-12, 1.0)
    rest_e = (1.0 - pe.sum(-1)).clamp_min(0.0)
    rest_t = (1.0 - pt.sum(-1)).clamp_min(1e-12)
    terms = torch.xlogy(pe, pe) - pe * pt.log()
    return (terms.sum(-1) + torch.xlogy(rest_e, rest_e) - rest_e * rest_t.log()).clamp_min(0.0)


def routing_sums(engine_ids_TLK: torch.Tensor, trainer_ids_TLK: torch.Tensor, mask_T: torch.Tensor,
                 engine_probs_TLK: torch.Tensor | None = None,
                 trainer_probs_TLK: torch.Tensor | None = None) -> torch.Tensor:
    """``[3, L]`` fp64 per layer: flipped tokens, router-KL sum (0 without probabilities), count.

    Rows are the positions that predict the counted tokens; ``trainer_probs_TLK`` are the
    trainer's router probabilities at the engine's experts.
    """
    mask = mask_T.bool()
    flips_TL = (engine_ids_TLK.long().sort(-1).values != trainer_ids_TLK.long().sort(-1).values).any(-1)
    kl_TL = torch.zeros(flips_TL.shape, dtype=torch.float64)
    if engine_probs_TLK is not None and trainer_probs_TLK is not None:
        kl_TL = coarse_router_kl_TL(engine_probs_TLK, trainer_probs_TLK)
    count_L = torch.full((flips_TL.shape[1],), float(mask.sum()), dtype=torch.float64)
    return torch.stack([flips_TL[mask].double().sum(0), kl_TL[mask].sum(0), count_L])


def stage_of_pass(num_ids: int, num_gates: int, layer_numbers: Sequence[int]) -> list[tuple[str, str]]:
    """``(stage, layer)`` each pass after the first removes: ``layer<n>``, or ``all`` for a pass over every layer."""
    out = []
    for stage, count in (("expert_choice", num_ids), ("gate_weights", num_gates)):
        names = [f"layer{n}" for n in layer_numbers] if count == len(layer_numbers) and count > 1 else ["all"] * count
        out += [(stage, name) for name in names]
    return out


def breakdown_metrics(gaps: torch.Tensor, routing: torch.Tensor, layer_numbers: Sequence[int], num_ids: int,
                      num_gates: int, with_kl: bool) -> dict[str, torch.Tensor]:
    """``mismatch/breakdown/*`` from summed :func:`gap_sums` and :func:`routing_sums`.

    ``gap`` (nats, mean over counted tokens), ``gap/<stage>`` (what each stage removed; they sum
    to ``gap``), ``share/<stage>`` (over ``gap``), per layer ``layer<n>/<stage>`` shares,
    ``layer<n>/flip_rate`` and (``with_kl``) ``layer<n>/router_kl``.
    """
    count = gaps[-1].clamp_min(1.0)
    means = gaps[:-1] / count
    total = means[0]
    removed = means[:-1] - means[1:]
    parts = {stage: torch.zeros((), dtype=torch.float64) for stage in STAGES}
    out: dict[str, torch.Tensor] = {"mismatch/breakdown/gap": total}
    for (stage, layer), value in zip(stage_of_pass(num_ids, num_gates, layer_numbers), removed):
        parts[stage] = parts[stage] + value
        if layer != "all":
            out[f"mismatch/breakdown/{layer}/{stage}"] = value / total.clamp_min(1e-30)
    parts["other"] = means[-1]
    for stage, value in parts.items():
        if stage == "gate_weights" and num_gates == 0:
            continue  # not measured: the engine gave no gate weights, so it is inside "other"
        out[f"mismatch/breakdown/gap/{stage}"] = value
        out[f"mismatch/breakdown/share/{stage}"] = value / total.clamp_min(1e-30)
    flips_L, kl_L, rows_L = routing
    for i, number in enumerate(layer_numbers):
        out[f"mismatch/breakdown/layer{number}/flip_rate"] = flips_L[i] / rows_L[i].clamp_min(1.0)
        if with_kl:
            out[f"mismatch/breakdown/layer{number}/router_kl"] = kl_L[i] / rows_L[i].clamp_min(1.0)
    return {k: v.float() for k, v in out.items()}


def token_causes(passes: StagePasses, layer_numbers: Sequence[int]) -> list[str]:
    """``[T]`` cause of each token's gap: ``"<stage> at <layer>"`` of the pass that removed the most
    of it, or ``"other"`` when the last pass leaves more than any pass removed."""
    gaps_PT = torch.stack([(p.double() - passes.rollout_T.double()).abs() for p in passes.all_passes()])
    removed_PT = gaps_PT[:-1] - gaps_PT[1:]
    stages = stage_of_pass(len(passes.ids_passes), len(passes.gate_passes), layer_numbers)
    causes = []
    for t in range(gaps_PT.shape[1]):
        best = int(removed_PT[:, t].argmax()) if removed_PT.shape[0] else -1
        if best < 0 or gaps_PT[-1, t] >= removed_PT[best, t]:
            causes.append("other")
        else:
            stage, layer = stages[best]
            causes.append(f"{stage} at {layer}")
    return causes


def worst_tokens(passes: StagePasses, layer_numbers: Sequence[int], cu_seqlens_S1: torch.Tensor,
                 flips_TL: torch.Tensor, count: int) -> list[dict]:
    """The ``count`` counted tokens with the largest ``|d_0|``: sample, position in the response,
    gap, cause, and the layers whose routing flipped at the position predicting it."""
    gap_T = (passes.trainer_T.double() - passes.rollout_T.double()).abs().masked_fill(~passes.mask_T.bool(), -1.0)
    order = gap_T.argsort(descending=True)[: min(count, int(passes.mask_T.sum()))]
    causes = token_causes(passes, layer_numbers)
    sample_T = torch.bucketize(torch.arange(gap_T.numel()), cu_seqlens_S1[1:], right=True)
    rows = []
    for t in order.tolist():
        s = int(sample_T[t])
        rows.append({"sample": s, "position": t - int(cu_seqlens_S1[s]), "gap": float(gap_T[t]),
                     "cause": causes[t],
                     "flipped_layers": [n for n, f in zip(layer_numbers, flips_TL[t].tolist()) if f]})
    return rows
