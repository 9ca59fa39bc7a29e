"""One parallel policy-update step: routing plan, RSPO weights, objective, backward, step.

Shape legend: S samples of this data-parallel rank, T_resp their response tokens (packed,
sample order), T_all prompt+response positions, L MoE layers, K top-K.

``forward_backward`` takes this DP rank's mini-batch, resolves the routing plan into the
experts every position is dispatched to (``none``: the router decides; ``R2``: the old
policy's recorded experts; ``R3``: the experts the rollout engine returned, SGLang layout),
validates them before any forward, optionally runs a forward-only *probe* under the same
plan (current router log-probabilities at the old experts give the RSPO weights; the same
pass yields replay agreement, flip rate and router shift; it also gives the current
log-probs and entropies the 80/20 and STAPO filters select on), and then runs forward and
backward through Megatron's schedule with the objective from ``megatron_rl.algos``.

The 80/20 and STAPO filters select over the global mini-batch, as the methods define them:
with more than one data-parallel rank, every DP rank's filter inputs are gathered over the
DP group (ranks in DP order, each rank's tokens in its own order), the pure
``build_loss_mask`` runs on the concatenation and each rank keeps its slice. The kept mask
and the ``mask/*`` metrics are therefore those of a single process holding the whole
mini-batch in that order; the order matters only for exact entropy ties at the 80/20 cut
(the earlier token is kept). Every DP rank receives, per token of the global mini-batch, one
byte of response mask and one value per float input the filters read (entropy; log-probs
and advantages for STAPO), 4 bytes each in float32.

Losses are normalized by the global kept-token (or sequence) count of the whole mini-batch
across data-parallel ranks, and Megatron's DDP sums gradients over DP, so micro-batching
and the layout do not change the gradient. Under context parallelism the CP ranks of a
replica hold the same samples: each gets the whole micro-batch's log-probs
(``context_parallel.response_logprobs_entropy``) and computes the same objective, whose
backward reaches only its own rows; DDP sums the parameter gradients over DP x CP, while the
counts, the filters' inputs and the step's loss are reduced over DP only, so nothing is
counted once per CP rank. The probe costs one extra forward; it runs
only when RSPO, routing diagnostics or the 80/20 / STAPO filters ask for it.
"""

from __future__ import annotations

import dataclasses
import functools
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Literal, Sequence

import torch

from megatron_rl.algos.aggregation import kept_counts
from megatron_rl.algos.batch import TokenBatch
from megatron_rl.algos.config import ObjectiveConfig
from megatron_rl.algos.distill import topk_reverse_kl_T
from megatron_rl.algos.loss import policy_loss
from megatron_rl.algos.masks import build_loss_mask
from megatron_rl.algos.segments import seq_ids_from_cu_seqlens
from megatron_rl.parallel.comm import (
    all_gather_cat,
    all_gather_varlen,
    all_reduce,
    broadcast,
    broadcast_object,
)
from megatron_rl.parallel.context_parallel import response_logprobs_entropy
from megatron_rl.parallel.families import moe_layer_numbers
from megatron_rl.parallel.groups import ParallelGroups
from megatron_rl.parallel.logprobs import (
    compute_logprobs,
    needs_common_length,
    pack_for_rank,
)
from megatron_rl.parallel.packing import PackedMicroBatch
from megatron_rl.parallel.routing_record import find_routers
from megatron_rl.parallel.routing_replay import RoutingReplay, replay_ids_per_call
from megatron_rl.parallel.schedule import run_schedule, unwrap
from megatron_rl.parallel.vocab_topk import response_logprobs_at
from moe_routing.stats import gamma_metrics
from moe_routing.types import RouterRecord
from moe_routing.validate import RoutingDataError, validate_expert_ids

RoutingMode = Literal["none", "R2", "R3"]


@dataclass
class TrainBatch:
    """This data-parallel rank's mini-batch; per-token tensors follow the response axis."""

    sequences: list[torch.Tensor]
    """Prompt+response token ids per sample."""
    prompt_lengths: list[int]
    """Prompt tokens at the start of each sample."""
    old_logprobs_T: torch.Tensor
    """``[T_resp]`` old-policy log-probs."""
    advantages_T: torch.Tensor
    """``[T_resp]`` advantages."""
    loss_mask_T: torch.Tensor | None = None
    """``[T_resp]`` bool response mask (default: every response token)."""
    rollout_logprobs_T: torch.Tensor | None = None
    """``[T_resp]`` rollout-engine log-probs (mismatch corrections, metrics)."""
    ref_logprobs_T: torch.Tensor | None = None
    """``[T_resp]`` reference-policy log-probs (KL)."""
    truncated_S: torch.Tensor | None = None
    """``[S]`` bool, samples cut at the length limit (overlong filter)."""
    old_record: RouterRecord | None = None
    """Old-policy routing record of every position (R2 and RSPO)."""
    rollout_routes: list[torch.Tensor] | None = None
    """R3: per sample the rollout engine's experts ``[len_s - 1, L, K]`` (SGLang layout)."""
    versions_T: torch.Tensor | None = None
    """``[T_resp]`` int64 weight version that produced each response token (the behaviour policy's)."""
    shift_record: RouterRecord | None = None
    """The record RSPO's router shift is measured against: the experts each token was produced
    with (the rollout routes) and the old policy's router probabilities at them; None: the old
    policy's own top-K (``old_record``)."""
    teacher_logprobs_T: torch.Tensor | None = None
    """``[T_resp]`` distillation teachers' log-probs of the sampled tokens (``train.teachers``)."""
    teacher_topk_ids_TK: torch.Tensor | None = None
    """``[T_resp, K]`` the teachers' top-k ids per response position (the top-k estimator)."""
    teacher_topk_logprobs_TK: torch.Tensor | None = None
    """``[T_resp, K]`` their log-probs."""

    def select(self, indices: list[int]) -> "TrainBatch":
        """The mini-batch made of the given samples (per-token tensors follow)."""
        lengths = [int(self.sequences[i].numel()) - self.prompt_lengths[i] for i in range(len(self.sequences))]
        starts = [0]
        for n in lengths:
            starts.append(starts[-1] + n)
        rows = torch.cat([torch.arange(starts[i], starts[i + 1]) for i in indices])

        def tokens(t):
            return None if t is None else t[rows]

        return TrainBatch(
            sequences=[self.sequences[i] for i in indices],
            prompt_lengths=[self.prompt_lengths[i] for i in indices],
            old_logprobs_T=self.old_logprobs_T[rows],
            advantages_T=self.advantages_T[rows],
            loss_mask_T=tokens(self.loss_mask_T),
            rollout_logprobs_T=tokens(self.rollout_logprobs_T),
            ref_logprobs_T=tokens(self.ref_logprobs_T),
            truncated_S=None if self.truncated_S is None else self.truncated_S[indices],
            old_record=None if self.old_record is None else self.old_record.select_samples(indices),
            rollout_routes=None if self.rollout_routes is None else [self.rollout_routes[i] for i in indices],
            versions_T=tokens(self.versions_T),
            shift_record=None if self.shift_record is None else self.shift_record.select_samples(indices),
            teacher_logprobs_T=tokens(self.teacher_logprobs_T),
            teacher_topk_ids_TK=tokens(self.teacher_topk_ids_TK),
            teacher_topk_logprobs_TK=tokens(self.teacher_topk_logprobs_TK),
        )


@dataclass
class RoutingPlan:
    """How experts are chosen during the update."""

    mode: RoutingMode = "none"
    """none: the router decides; R2: replay the old record; R3: replay the rollout routes."""
    diagnostics: bool = True
    """Run the probe pass for routing metrics even when RSPO is off."""


@dataclass
class StepResult:
    """What one update step measured."""

    loss: torch.Tensor
    """0-dim global loss (sum over micro-batches and DP ranks of pre-normalized terms)."""
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)
    """0-dim metric tensors, identical on every rank."""
    kept_mask_T: torch.Tensor | None = None
    """``[T_resp]`` bool: this rank's tokens that entered the loss (response mask and filters)."""
    probe_T: dict[str, torch.Tensor] = field(default_factory=dict)
    """Per response token of the probe pass: ``router_shift`` (what gamma exponentiates),
    ``gamma`` and ``flip`` (layers whose current top-K is not the measured record's experts)."""


def replay_ids_for(
    batch: TrainBatch,
    plan: RoutingPlan,
    *,
    num_experts: int,
    topk: int,
    layer_numbers: Sequence[int],
    local_layers: Sequence[int],
    num_model_layers: int | None = None,
) -> torch.Tensor | None:
    """Validated ``[T_all, L, K]`` experts to dispatch, or None for ``mode='none'``.

    Args:
        batch: the mini-batch (old record for R2, rollout routes for R3).
        plan: the routing plan.
        num_experts: E.
        topk: K.
        layer_numbers: MoE layer numbers of the model (the columns of R3 routes).
        local_layers: MoE layer numbers on this rank (must all be covered).
        num_model_layers: decoder layers of the model; R3 routes with that many columns
            (SGLang's layout, dense layers included) are cut to the MoE layers' columns.
    """
    total = sum(int(s.numel()) for s in batch.sequences)
    if plan.mode == "none":
        return None
    if plan.mode == "R2":
        if batch.old_record is None:
            raise RoutingDataError("routing plan R2 needs the old-policy RouterRecord (batch.old_record)")
        ids = batch.old_record.expert_ids_TLK
        validate_expert_ids(ids, num_experts=num_experts, topk=topk, layer_numbers=batch.old_record.layer_numbers,
                            required_layers=local_layers, num_tokens=total, source="R2 record")
        return ids
    if plan.mode != "R3":
        raise ValueError(f"routing plan mode {plan.mode!r} is not one of none, R2, R3")
    if batch.rollout_routes is None or len(batch.rollout_routes) != len(batch.sequences):
        raise RoutingDataError("routing plan R3 needs one rollout route tensor per sample (batch.rollout_routes)")
    return rollout_route_ids(batch.sequences, batch.rollout_routes, num_experts=num_experts, topk=topk,
                             layer_numbers=layer_numbers, local_layers=local_layers, num_model_layers=num_model_layers)


def rollout_route_ids(
    sequences: Sequence[torch.Tensor],
    rollout_routes: Sequence[torch.Tensor],
    *,
    num_experts: int,
    topk: int,
    layer_numbers: Sequence[int],
    local_layers: Sequence[int],
    num_model_layers: int | None = None,
) -> torch.Tensor:
    """Validated ``[T_all, L, K]`` experts of the rollout engine's routes (SGLang layout
    ``[len_s - 1, L, K]`` per sample; dense layers' columns dropped): what R3 dispatches, and
    the experts each token was produced with (asynchronous RSPO, drift metrics)."""
    parts = []
    for i, (routes, seq) in enumerate(zip(rollout_routes, sequences)):
        n = int(seq.numel())
        if routes.dim() != 3 or routes.shape[0] != n - 1:
            raise RoutingDataError(
                f"R3 routes of sample {i}: expected [{n - 1}, L, K] (prompt+response minus the last "
                f"token), got {tuple(routes.shape)}"
            )
        if routes.dim() == 3 and routes.shape[1] == num_model_layers != len(layer_numbers):
            # SGLang returns a column per decoder layer; dense layers' columns route nothing.
            routes = routes[:, [n - 1 for n in layer_numbers]]
        validate_expert_ids(routes, num_experts=num_experts, topk=topk, layer_numbers=layer_numbers,
                            required_layers=local_layers, num_tokens=n - 1, source=f"R3 routes of sample {i}")
        # The last position is never forwarded by the rollout engine and feeds no loss;
        # dispatch it to the experts of the position before it.
        parts.append(torch.cat([routes.to(torch.int64), routes[-1:].to(torch.int64)]))
    return torch.cat(parts)


def forward_backward(
    model: torch.nn.Module,
    groups: ParallelGroups,
    batch: TrainBatch,
    objective: ObjectiveConfig,
    plan: RoutingPlan,
    *,
    micro_batch_sequences: int = 4,
    micro_batch_tokens: int | None = None,
    chunk_tokens: int = 1024,
) -> StepResult:
    """Forward and backward of one mini-batch; gradients land reduced in ``main_grad``."""
    gpt = unwrap(model)
    topk = gpt.config.moe_router_topk
    layer_numbers = moe_layer_numbers(gpt.config)
    replay_ids = replay_ids_for(
        batch, plan, num_experts=gpt.config.num_moe_experts, topk=topk,
        layer_numbers=layer_numbers, local_layers=tuple(find_routers([model])),
        num_model_layers=gpt.config.num_layers,
    )
    replay_columns = batch.old_record.layer_numbers if plan.mode == "R2" else layer_numbers
    lengths = torch.tensor([int(s.numel()) - p for s, p in zip(batch.sequences, batch.prompt_lengths)])
    cu_S1 = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    torch.cumsum(lengths, 0, out=cu_S1[1:])
    seq_ids_T = seq_ids_from_cu_seqlens(cu_S1)
    num_seqs = len(batch.sequences)
    response_mask_T = (
        batch.loss_mask_T.bool() if batch.loss_mask_T is not None else torch.ones(int(cu_S1[-1]), dtype=torch.bool)
    )

    uses_rspo = objective.rspo_gamma_min is not None
    needs_filter_inputs = objective.entropy_top_rho is not None or objective.stapo_tau_p is not None
    metrics: dict[str, torch.Tensor] = {}
    gamma_T = probe = None
    # RSPO measures the router's shift at the experts each token was produced with when the
    # batch says which (shift_record), else at the old policy's own.
    measured = batch.shift_record if batch.shift_record is not None else batch.old_record
    if uses_rspo or plan.diagnostics or needs_filter_inputs:
        if uses_rspo and measured is None:
            raise RoutingDataError("the objective uses RSPO weights but the batch has no old_record")
        probe = compute_logprobs(
            model, groups, batch.sequences, batch.prompt_lengths,
            micro_batch_sequences=micro_batch_sequences, micro_batch_tokens=micro_batch_tokens,
            chunk_tokens=chunk_tokens,
            replay_ids_TLK=replay_ids, replay_layer_numbers=replay_columns, old_record=measured,
        )
        gamma_T = probe.rspo_gamma_T
        metrics.update(probe.routing_metrics or {})
        if gamma_T is not None:
            metrics.update(gamma_metrics(gamma_T, response_mask_T, objective.rspo_gamma_min))

    response = TokenBatch(
        loss_mask_T=response_mask_T, seq_ids_T=seq_ids_T, num_seqs=num_seqs,
        logprobs_T=probe.logprobs_T if probe else None, advantages_T=batch.advantages_T,
        entropy_T=probe.entropy_T if probe else None, truncated_S=batch.truncated_S,
    )
    kept_T, counts = _kept_mask_and_counts(objective, groups, response, lengths, metrics)

    micro_batches = pack_for_rank(batch.sequences, groups, micro_batch_sequences, max_tokens=micro_batch_tokens,
                                  common_length=needs_common_length(model, groups))
    loss_fn = _objective_loss_fn(
        batch, objective, groups, micro_batches, cu_S1, kept_T, gamma_T, counts, chunk_tokens,
        gpt.true_vocab_size,
    )
    replay = None
    if replay_ids is not None:
        local = replay_ids_per_call(replay_ids, replay_columns, tuple(find_routers([model])), micro_batches, groups)
        replay = RoutingReplay([model], local)
    with replay or nullcontext():
        outputs = run_schedule(
            model, micro_batches, loss_fn, forward_only=False,
            before_forward=replay.before_forward if replay is not None else None,
        )
    metrics["routing/replayed_micro_batches"] = torch.tensor(
        float(replay.replayed_micro_batches if replay is not None else 0)
    )
    probe_T = {} if probe is None else {name: value for name, value in (
        ("router_shift", probe.router_shift_T), ("gamma", probe.rspo_gamma_T), ("flip", probe.flip_T))
        if value is not None}
    return StepResult(*_reduce_step(outputs, groups, metrics), kept_mask_T=kept_T, probe_T=probe_T)


def _kept_mask_and_counts(
    objective: ObjectiveConfig, groups: ParallelGroups, response: TokenBatch, lengths_S: torch.Tensor,
    metrics: dict[str, torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's ``[T_resp]`` kept mask (the mask metrics go into ``metrics``) and the ``[2]``
    kept-token and kept-sequence counts of the whole mini-batch, summed over DP."""
    kept_T = response.loss_mask_T
    if objective.entropy_top_rho is not None or objective.stapo_tau_p is not None or objective.overlong_filter:
        kept_T, mask_metrics = _global_loss_mask(objective, groups, response, lengths_S=lengths_S)
        metrics.update(mask_metrics)
    num_tokens, num_kept_seqs = kept_counts(dataclasses.replace(response, loss_mask_T=kept_T))
    counts = torch.stack([num_tokens.double(), num_kept_seqs.double()])
    if groups.dp_size > 1:
        all_reduce(counts, groups.dp)
    return kept_T, counts


def _global_loss_mask(
    objective: ObjectiveConfig, groups: ParallelGroups, response: TokenBatch, *, lengths_S: torch.Tensor
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """This rank's ``[T_resp]`` kept mask and the mask metrics of the global mini-batch.

    With DP > 1 the inputs ``build_loss_mask`` reads are gathered over the DP group only
    (TP and PP peers hold the same samples, and ``compute_logprobs`` returns the probe's
    log-probs and entropies on every model-parallel rank), the unchanged pure function runs on
    the concatenation, and this rank keeps its rows. Sequence ids of the concatenation come
    from the gathered response lengths ``lengths_S``, so they stay unique across ranks.
    """
    if groups.dp_size == 1:
        return build_loss_mask(objective, response)
    response.require(objective, loss=False, filters=True)
    # Only what the configured masks read travels; float inputs share one gather in their
    # promoted dtype (exact: promotion only widens).
    floats = {}
    if objective.entropy_top_rho is not None or objective.stapo_tau_p is not None:
        floats["entropy_T"] = response.entropy_T
    if objective.stapo_tau_p is not None:
        floats.update(logprobs_T=response.logprobs_T, advantages_T=response.advantages_T)
    num_tokens = int(response.loss_mask_T.numel())
    sizes_R2 = all_gather_cat(torch.tensor([[num_tokens, response.num_seqs]], dtype=torch.int64), groups.dp)
    token_sizes, seq_sizes = sizes_R2[:, 0].tolist(), sizes_R2[:, 1].tolist()
    token_inputs = {"loss_mask_T": all_gather_varlen(response.loss_mask_T.bool(), groups.dp, sizes=token_sizes)}
    if floats:
        dtype = functools.reduce(torch.promote_types, (t.dtype for t in floats.values()))
        columns = torch.stack([t.detach().to(dtype) for t in floats.values()], dim=1)
        gathered = all_gather_varlen(columns, groups.dp, sizes=token_sizes)
        for i, (name, t) in enumerate(floats.items()):
            token_inputs[name] = gathered[:, i].to(t.dtype)
    per_seq = [lengths_S.to(torch.int64)]
    if objective.overlong_filter:
        per_seq.append(response.truncated_S.to(torch.int64))
    seq_columns = all_gather_varlen(torch.stack(per_seq, dim=1), groups.dp, sizes=seq_sizes)
    cu_S1 = torch.zeros(seq_columns.shape[0] + 1, dtype=torch.int64)
    torch.cumsum(seq_columns[:, 0], 0, out=cu_S1[1:])
    everyone = TokenBatch(
        seq_ids_T=seq_ids_from_cu_seqlens(cu_S1), num_seqs=seq_columns.shape[0],
        truncated_S=seq_columns[:, 1].bool() if objective.overlong_filter else None, **token_inputs,
    )
    kept_T, metrics = build_loss_mask(objective, everyone)
    start = sum(token_sizes[: groups.dp_rank])
    return kept_T[start : start + num_tokens], metrics


def _objective_loss_fn(batch, objective, groups, micro_batches, cu_S1, kept_T, gamma_T, counts, chunk_tokens,
                       vocab_size):
    """Per-micro-batch loss: vocab-parallel log-probs over the true vocabulary, then the objective.

    A micro-batch may hold any samples in any order (token-budget packing): its per-token
    inputs are gathered from the sample-order tensors by the rows of its samples.
    """

    def loss_fn(mb: PackedMicroBatch, logits_1TV: torch.Tensor):
        samples = mb.sample_ids
        device = logits_1TV.device
        # Under CP every CP rank gets the whole micro-batch's log-probs and computes the same
        # objective (context_parallel.response_logprobs_entropy says why that is exact).
        logprobs_T, entropy_T = response_logprobs_entropy(
            mb, logits_1TV, batch.prompt_lengths, groups, chunk_tokens=chunk_tokens,
            entropy_requires_grad=objective.entropy_coef > 0, vocab_size=vocab_size,
        )
        lengths = (cu_S1[samples + 1] - cu_S1[samples]) if samples.numel() else samples
        token_rows = torch.cat([torch.zeros(0, dtype=torch.int64)]
                               + [torch.arange(int(cu_S1[i]), int(cu_S1[i + 1])) for i in samples.tolist()])
        local_cu = torch.zeros(samples.numel() + 1, dtype=torch.int64)
        torch.cumsum(lengths, 0, out=local_cu[1:])

        def part(t):
            return None if t is None else t[token_rows].to(device)

        if samples.numel() == 0:
            # A padding-only row: no token enters the loss, but the backward must still
            # reach every parameter its forward used (gradients are collective under DDP).
            loss = logits_1TV.sum() * 0.0
            return loss, torch.tensor(0, dtype=torch.int), {"loss": loss.detach()}
        distill_T = None
        if objective.distill_coef > 0 and objective.distill_estimator == "topk":
            student_TK = response_logprobs_at(mb, logits_1TV, batch.prompt_lengths, groups,
                                              part(batch.teacher_topk_ids_TK), logprobs_T)
            distill_T = topk_reverse_kl_T(student_TK, part(batch.teacher_topk_logprobs_TK))
        tokens = TokenBatch(
            logprobs_T=logprobs_T,
            old_logprobs_T=part(batch.old_logprobs_T),
            advantages_T=part(batch.advantages_T),
            loss_mask_T=part(kept_T),
            seq_ids_T=seq_ids_from_cu_seqlens(local_cu).to(device),
            num_seqs=len(samples),
            rollout_logprobs_T=part(batch.rollout_logprobs_T),
            ref_logprobs_T=part(batch.ref_logprobs_T),
            entropy_T=entropy_T,
            rspo_gamma_T=part(gamma_T),
            truncated_S=None if batch.truncated_S is None else batch.truncated_S[samples].to(device),
            teacher_logprobs_T=part(batch.teacher_logprobs_T),
            distill_T=distill_T,
        )
        loss, metrics = policy_loss(
            objective, tokens, global_num_tokens=counts[0].to(device), global_num_seqs=counts[1].to(device),
            apply_filters=False,
        )
        metrics = {**metrics, "loss": loss.detach(), "micro_batch": torch.tensor(1)}
        # Count 0: the objective already divided by the global count; Megatron must not again.
        return loss, torch.tensor(0, dtype=torch.int), metrics

    return loss_fn


def _reduce_step(outputs: list[dict], groups: ParallelGroups, metrics: dict) -> tuple[torch.Tensor, dict]:
    """Global loss and step metrics, identical on every rank.

    Objective metrics are averaged over micro-batches and data-parallel ranks (each
    micro-batch's fractions are over its own kept tokens).
    """
    names = sorted({k for o in outputs for k in o if k not in ("loss", "micro_batch")})
    if groups.pp_size > 1:
        # Only the last stage ran the loss; the others learn the metric names from it.
        names = broadcast_object(names, groups.pp_size - 1, groups.pp)
    local = torch.zeros(2 + len(names), dtype=torch.float64)
    if groups.is_last_stage and outputs:
        local[0] = sum(o["loss"].double() for o in outputs)
        local[1] = sum(1 for o in outputs if "micro_batch" in o)  # padding-only rows have no metrics
        for i, name in enumerate(names):
            local[2 + i] = sum(o[name].double() for o in outputs if name in o)
    if groups.pp_size > 1:
        broadcast(local, groups.pp_size - 1, groups.pp)
    if groups.dp_size > 1:
        all_reduce(local, groups.dp)
    count = local[1].clamp_min(1)
    step_metrics = {f"objective/{n}": (local[2 + i] / count).float() for i, n in enumerate(names)}
    step_metrics.update(metrics)
    step_metrics["loss"] = local[0].float()
    return local[0].float(), step_metrics
