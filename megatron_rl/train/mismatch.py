"""A step's train-vs-rollout log-prob gap broken down by cause; the rollouts saved for it.

Shape legend: S samples of this data-parallel rank, T_resp their response tokens, T_all their
prompt+response positions, L MoE layers, K top-K.

:func:`run_breakdown` re-runs the trainer's log-prob pass with the engine's routing replayed in
stages (``parallel.mismatch_passes``), sums what each stage removes over the data-parallel
ranks and turns it into ``mismatch/breakdown/*`` metrics (``moe_routing.breakdown``), with this
rank's worst tokens and their causes. The trainer runs it every step with
``train.mismatch.breakdown`` (:class:`StepMismatch`); ``megatron-rl-mismatch RUN_DIR`` runs the same function over the
rollouts a run saved with ``train.mismatch.save_rollouts`` (:meth:`StepMismatch.save`), on the
weights that generated them. :func:`report_lines` is the short report both print.

The rollout log-probs compared are the engine's; the trainer's side is scored at each sample's
temperature unless the run trains the T = 1 policy (``train.policy_temperature=one``), exactly
as the old-policy pass does.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from megatron_rl.parallel import comm
from megatron_rl.parallel.families import moe_layer_numbers
from megatron_rl.parallel.logprobs import (
    LogProbResult,
    compute_logprobs,
    response_cu_seqlens,
    response_positions,
)
from megatron_rl.parallel.mismatch_passes import staged_passes
from megatron_rl.parallel.rollout_routes import rollout_gates_TLK, rollout_ids_TLK
from megatron_rl.parallel.routing_record import find_routers
from megatron_rl.parallel.schedule import unwrap
from megatron_rl.rollout.engine import RolloutSample
from megatron_rl.train.phases import phase_timer
from moe_routing.breakdown import (
    StagePasses,
    breakdown_metrics,
    gap_sums,
    routing_sums,
    worst_tokens,
)

ROLLOUTS_DIR = "rollouts"
"""Where ``train.mismatch.save_rollouts`` writes, under the run directory."""


@dataclass
class BreakdownResult:
    """One breakdown: metrics (the same on every rank) and this DP rank's worst tokens."""

    metrics: dict[str, torch.Tensor]
    """``mismatch/breakdown/*`` (``moe_routing.breakdown.breakdown_metrics``)."""
    worst: list[dict]
    """This rank's worst tokens (``moe_routing.breakdown.worst_tokens``), sample indices its own."""
    layer_numbers: tuple[int, ...]
    """The MoE layers, in column order."""


def sample_temperatures(samples: Sequence[RolloutSample], policy_temperature: str) -> torch.Tensor | None:
    """``[T_resp]`` temperature of every response token the passes score at (None: T = 1)."""
    if policy_temperature == "one":
        return None
    return torch.cat([s.temperatures() for s in samples])


def _per_position(values: Sequence[torch.Tensor]) -> torch.Tensor:
    """Per-sample ``[n - 1, L, K]`` values as ``[T_all, L, K]`` (the last position takes the one before)."""
    return torch.cat([torch.cat([v.float(), v[-1:].float()]) for v in values])


def run_breakdown(model, groups, samples: Sequence[RolloutSample], *, policy_temperature: str, per_layer: bool,
                  worst: int, micro_batch_sequences: int, micro_batch_tokens: int | None,
                  old: LogProbResult | None = None) -> BreakdownResult:
    """Collective (like ``compute_logprobs``): the breakdown of this DP rank's ``samples``.

    ``old`` is the trainer's own pass over them with routing recorded (computed here when None).
    """
    gpt = unwrap(model)
    layers = moe_layer_numbers(gpt.config)
    sequences = [s.tokens for s in samples]
    prompt_lengths = [len(s.prompt_ids) for s in samples]
    packing = {"micro_batch_sequences": micro_batch_sequences, "micro_batch_tokens": micro_batch_tokens}
    temperature_T = sample_temperatures(samples, policy_temperature)
    if old is None or old.record is None:
        old = compute_logprobs(model, groups, sequences, prompt_lengths, record_routing=True,
                               temperature_T=temperature_T, **packing)
    routes = [s.routed_experts for s in samples]
    engine_ids = rollout_ids_TLK(routes, sequences, num_experts=gpt.config.num_moe_experts,
                                 topk=gpt.config.moe_router_topk, layer_numbers=layers,
                                 local_layers=tuple(find_routers([model])), num_model_layers=gpt.config.num_layers)
    with_gates = all(s.routed_gates is not None for s in samples)
    engine_gates = rollout_gates_TLK([s.routed_gates for s in samples], routes, len(layers)) if with_gates else None
    staged = staged_passes(model, groups, sequences, prompt_lengths, engine_ids_TLK=engine_ids,
                           engine_gates_TLK=engine_gates, layer_numbers=layers, per_layer=per_layer,
                           temperature_T=temperature_T, **packing)
    mask_T = torch.cat([s.loss_mask() for s in samples])
    passes = StagePasses(rollout_T=torch.cat([s.output_logprobs.float() for s in samples]), trainer_T=old.logprobs_T,
                         ids_passes=staged.ids_passes, gate_passes=staged.gate_passes, mask_T=mask_T)
    rows = response_positions(old.record.cu_seqlens_S1, prompt_lengths)
    with_probs = all(s.routed_probs is not None for s in samples)
    engine_probs = _per_position([s.routed_probs for s in samples])[rows] if with_probs else None
    engine_rows, trainer_rows = engine_ids[rows], old.record.expert_ids_TLK[rows]
    sums = torch.cat([gap_sums(passes), routing_sums(
        engine_rows, trainer_rows, mask_T, engine_probs, staged.trainer_probs_at_engine_TLK[rows]).flatten()])
    if groups.dp_size > 1:
        comm.all_reduce(sums, groups.dp)
    num_passes = 1 + len(staged.ids_passes) + len(staged.gate_passes)
    metrics = breakdown_metrics(sums[: num_passes + 1], sums[num_passes + 1:].view(3, len(layers)), layers,
                                len(staged.ids_passes), len(staged.gate_passes), with_kl=with_probs)
    flips_TL = (engine_rows.long().sort(-1).values != trainer_rows.long().sort(-1).values).any(-1)
    return BreakdownResult(metrics, worst_tokens(passes, layers, old.cu_seqlens_S1, flips_TL, worst), layers)


def gathered_worst(result: BreakdownResult, groups, count: int) -> list[dict]:
    """Collective over DP: the ``count`` worst tokens of all DP ranks (each tagged with its ``dp_rank``)."""
    mine = [{**row, "dp_rank": groups.dp_rank} for row in result.worst]
    everyone = comm.all_gather_objects(mine, groups.dp) if groups.dp_size > 1 else [mine]
    rows = [row for part in everyone for row in part]
    return sorted(rows, key=lambda row: -row["gap"])[:count]


def report_lines(result: BreakdownResult, worst: list[dict], title: str) -> list[str]:
    """A short plain-text report: the gap, each stage's share, one line per layer, the worst tokens."""
    m = {k: float(v) for k, v in result.metrics.items()}
    key = "mismatch/breakdown/"
    lines = [f"{title}: mean |log-prob gap| {m[key + 'gap']:.3e} nats"]
    for stage in ("expert_choice", "gate_weights", "other"):
        if key + f"share/{stage}" in m:
            lines.append(f"  {stage:<13} {m[key + f'gap/{stage}']:.3e} nats  ({100 * m[key + f'share/{stage}']:.1f}%)")
    if key + "share/gate_weights" not in m:
        lines.append("  gate_weights  not measured: the engine returns expert ids only (inside 'other')")
    for n in result.layer_numbers:
        parts = [f"layer {n}:"]
        for stage in ("expert_choice", "gate_weights"):
            if key + f"layer{n}/{stage}" in m:
                parts.append(f"{stage} {100 * m[key + f'layer{n}/{stage}']:.1f}%")
        parts.append(f"flip rate {m[key + f'layer{n}/flip_rate']:.4f}")
        if key + f"layer{n}/router_kl" in m:
            parts.append(f"router KL {m[key + f'layer{n}/router_kl']:.2e}")
        lines.append("  " + ", ".join(parts))
    for row in worst:
        flips = f", routing flipped at layers {row['flipped_layers']}" if row["flipped_layers"] else ""
        lines.append(f"  worst: sample {row['sample']} (dp {row.get('dp_rank', 0)}) response token {row['position']}: "
                     f"gap {row['gap']:.3e}, cause {row['cause']}{flips}")
    return lines


def truncation_metrics(samples: Sequence[RolloutSample], mask_T: torch.Tensor) -> dict[str, torch.Tensor]:
    """What scoring the whole T-scaled distribution leaves out when top-p / top-k truncate
    (engines that report it): ``rollout/truncation_logratio`` (mean over generated tokens of
    ``log pi_trunc(y) - log pi_T(y)``) and ``rollout/truncated_mass`` (mean mass cut); none otherwise."""
    if not samples or any(s.truncation_logratio is None for s in samples):
        return {}
    logratio_T = torch.cat([s.truncation_logratio.float() for s in samples])[mask_T]
    return {"rollout/truncation_logratio": logratio_T.mean(), "rollout/truncated_mass": (-torch.expm1(-logratio_T)).mean()}


class StepMismatch:
    """What the loop asks each step about the sampled policy and the gap (built with the run, so
    the loop imports none of it): the temperatures its passes score at, the truncation metrics,
    the saved rollouts and the breakdown."""

    def __init__(self, train_cfg, model, groups) -> None:
        self.cfg, self.model, self.groups = train_cfg, model, groups

    def temperatures(self, samples: Sequence[RolloutSample]) -> torch.Tensor | None:
        """``[T_resp]`` temperatures of ``samples``' response tokens (None: the T = 1 policy)."""
        return sample_temperatures(samples, self.cfg.policy_temperature)

    truncation = staticmethod(truncation_metrics)

    def save(self, step: int, samples: Sequence[RolloutSample]) -> None:
        """Collective over the world when ``train.mismatch.save_rollouts``: this DP rank's samples to
        ``<run_dir>/rollouts/step_NNNNNN/dp<rank>.pt`` (written whole, then renamed), by the first
        rank of its model-parallel group."""
        if not self.cfg.mismatch.save_rollouts:
            return
        directory = Path(self.cfg.run_dir) / ROLLOUTS_DIR / f"step_{step:06d}"
        if comm.rank(self.groups.mp) == 0:
            directory.mkdir(parents=True, exist_ok=True)
            path = directory / f"dp{self.groups.dp_rank:04d}.pt"
            torch.save([vars(s) for s in samples], path.with_suffix(".tmp"))
            os.replace(path.with_suffix(".tmp"), path)
        comm.barrier(self.groups.world)

    def breakdown(self, step: int, sample_groups: Sequence[Sequence[RolloutSample]], batch, metrics: dict) -> None:
        """Collective, with ``train.mismatch.breakdown`` (else nothing): the breakdown of the step's
        samples against its old-policy pass (``batch``: the step's ``TrainBatch``) into ``metrics``,
        timed as the phase ``mismatch_breakdown``; rank 0 writes the report to
        ``<run_dir>/mismatch/step_NNNNNN.txt``."""
        m, groups = self.cfg.mismatch, self.groups
        if not m.breakdown:
            return
        samples = [s for group in sample_groups for s in group]
        old = LogProbResult(logprobs_T=batch.old_logprobs_T, entropy_T=None, record=batch.old_record,
                            cu_seqlens_S1=response_cu_seqlens(batch.sequences, batch.prompt_lengths))
        with phase_timer(metrics, "mismatch_breakdown"):
            result = run_breakdown(self.model, groups, samples, policy_temperature=self.cfg.policy_temperature,
                                   per_layer=m.per_layer, worst=m.worst_tokens, old=old,
                                   micro_batch_sequences=self.cfg.micro_batch_sequences,
                                   micro_batch_tokens=self.cfg.micro_batch_tokens)
            worst = gathered_worst(result, groups, m.worst_tokens)
        if comm.rank(groups.world) == 0:
            out = Path(self.cfg.run_dir) / "mismatch" / f"step_{step:06d}.txt"
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text("\n".join(report_lines(result, worst, f"step {step}")) + "\n")
        metrics.update(result.metrics)


def load_rollouts(directory: Path) -> list[RolloutSample]:
    """Every DP rank's samples of one saved step, in DP order (:meth:`StepMismatch.save`)."""
    files = sorted(directory.glob("dp*.pt"))
    if not files:
        raise FileNotFoundError(f"{directory}: no saved rollouts (dp*.pt)")
    return [RolloutSample(**fields) for path in files for fields in torch.load(path, weights_only=True)]
