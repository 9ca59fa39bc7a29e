"""The forward passes of a mismatch breakdown: the trainer's log-prob pass with the rollout
engine's routing replayed in stages (``moe_routing.breakdown`` says what they measure).

Shape legend: S samples of this data-parallel rank, T_resp their response tokens, T_all their
prompt+response positions, L MoE layers, K top-K.

Stage (a), expert choice: the engine's expert ids replayed at layers 1..l and the router's own
top-K at the others (``megatron_rl.parallel.routing_replay.NATURAL``), for l = 1..L (one pass over every layer
without ``per_layer``); the trainer's gate weights are recomputed over the replayed experts, as
under R3. Stage (b), gate weights: the engine's ids at every layer and its gate weights at
layers 1..l (``parallel.gate_replay``, NaN gates elsewhere), for l = 1..L; only when the engine
returned gate weights. Every pass is ``compute_logprobs`` with the caller's packing and the
samples' temperatures, so the only thing that differs between two passes is the routing.

The last stage-(a) pass also records the trainer's router probabilities at the engine's
experts (the pass dispatches to them), for the router KL. Collective like ``compute_logprobs``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from megatron_rl.parallel.logprobs import compute_logprobs
from megatron_rl.parallel.routing_replay import NATURAL


@dataclass
class StagedPasses:
    """Response-token log-probs of every stage pass, in sample order."""

    ids_passes: list[torch.Tensor]
    """Stage (a): ``[T_resp]`` per pass (engine ids at layers 1..l)."""
    gate_passes: list[torch.Tensor]
    """Stage (b): ``[T_resp]`` per pass (engine ids everywhere, its gates at layers 1..l); empty
    without gates."""
    trainer_probs_at_engine_TLK: torch.Tensor
    """``[T_all, L, K]`` the trainer's router probabilities at the engine's experts, in the
    engine's expert order (from the last stage-(a) pass)."""


def _aligned(probs_TLK: torch.Tensor, ids_TLK: torch.Tensor, wanted_TLK: torch.Tensor) -> torch.Tensor:
    """``probs_TLK`` (of experts ``ids_TLK``) reordered to the experts ``wanted_TLK`` (the same sets)."""
    match_TLKK = wanted_TLK.long()[..., :, None] == ids_TLK.long()[..., None, :]
    return (match_TLKK * probs_TLK.float()[..., None, :]).sum(-1)


def staged_passes(model, groups, sequences: Sequence[torch.Tensor], prompt_lengths: Sequence[int], *,
                  engine_ids_TLK: torch.Tensor, engine_gates_TLK: torch.Tensor | None,
                  layer_numbers: Sequence[int], per_layer: bool, temperature_T: torch.Tensor | None,
                  micro_batch_sequences: int, micro_batch_tokens: int | None) -> StagedPasses:
    """The stage passes of one breakdown (2 L forwards with ``per_layer``, else 2; half without gates).

    Args:
        model: this rank's model stage (built with ``moe_enable_routing_replay``).
        groups: this rank's parallel groups.
        sequences: this DP rank's prompt+response ids per sample.
        prompt_lengths: prompt tokens of each sample.
        engine_ids_TLK: the engine's experts of every position (``rollout_routes.rollout_ids_TLK``).
        engine_gates_TLK: their gate weights (``rollout_routes.rollout_gates_TLK``), or None.
        layer_numbers: the MoE layer number of each of the L columns, ascending.
        per_layer: one pass per layer and stage (else one per stage).
        temperature_T: ``[T_resp]`` sampling temperatures (None: 1).
        micro_batch_sequences: the trainer's packing (samples per micro-batch).
        micro_batch_tokens: the trainer's packing (token budget), or None.
    """
    ends = list(range(1, len(layer_numbers) + 1)) if per_layer else [len(layer_numbers)]

    def run(ids_TLK, gates_TLK=None, record=False):
        return compute_logprobs(model, groups, sequences, prompt_lengths, micro_batch_sequences=micro_batch_sequences,
                                micro_batch_tokens=micro_batch_tokens, temperature_T=temperature_T,
                                replay_ids_TLK=ids_TLK, replay_layer_numbers=layer_numbers,
                                replay_gates_TLK=gates_TLK, record_routing=record)

    ids_passes, probs = [], None
    for end in ends:
        ids_TLK = engine_ids_TLK.clone()
        ids_TLK[:, end:] = NATURAL
        result = run(ids_TLK, record=end == len(layer_numbers))
        ids_passes.append(result.logprobs_T)
        if result.record is not None:
            probs = _aligned(result.record.probs_TLK, result.record.expert_ids_TLK, engine_ids_TLK)
    gate_passes = []
    if engine_gates_TLK is not None:
        for end in ends:
            gates_TLK = engine_gates_TLK.clone()
            gates_TLK[:, end:] = float("nan")
            gate_passes.append(run(engine_ids_TLK, gates_TLK).logprobs_T)
    return StagedPasses(ids_passes=ids_passes, gate_passes=gate_passes, trainer_probs_at_engine_TLK=probs)
