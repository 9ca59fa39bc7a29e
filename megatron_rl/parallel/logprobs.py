"""Forward-only log-prob pass over packed prompt+response samples, with routing records.

Shape legend: S samples of this data-parallel rank, T_resp response tokens (sample
order, whatever micro-batch each sample was packed into), T_all prompt+response tokens, L MoE layers, K top-K.

``compute_logprobs`` packs the samples into micro-batches, runs them through Megatron's
forward-only pipeline schedule, computes on the last stage each response token's
log-probability and the entropy of the full next-token distribution from vocab-sharded
logits (never gathering the vocabulary), and broadcasts them to every pipeline stage, so
every rank of the model-parallel group returns the same tensors. With
``record_routing=True`` a :class:`~megatron_rl.parallel.routing_record.RouterRecorder` watches every MoE
router and the result carries one :class:`~moe_routing.types.RouterRecord` over all
prompt+response positions.

Data parallelism is the caller's: each DP rank passes its own samples. Under context
parallelism every CP rank of a replica passes the same samples, runs its share of each row,
and gets every result whole (log-probs and entropies summed over CP, records gathered over
CP), so every rank of the replica returns the same tensors. All DP ranks run
the same number of micro-batches (expert dispatch is a collective across them): they agree
on the count and a rank short of samples runs padding-only rows. With a token budget
(``micro_batch_tokens``) samples are packed into as few balanced micro-batches as fit, in
any order; every result comes back in sample order.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist

from megatron_rl.parallel.balance import plan_micro_batches
from megatron_rl.parallel.comm import all_reduce, broadcast
from megatron_rl.parallel.context_parallel import response_logprobs_entropy
from megatron_rl.parallel.groups import ParallelGroups
from megatron_rl.parallel.packing import (
    PackedMicroBatch,
    pack_sequences,
    padded_row_length,
    response_targets,
    slot_lengths,
)
from megatron_rl.parallel.routing_layout import assemble_record, gather_call_field, local_ids_per_call
from megatron_rl.parallel.routing_record import RouterRecorder
from megatron_rl.parallel.routing_replay import RoutingReplay, replay_ids_per_call
from megatron_rl.parallel.schedule import run_schedule, unwrap
from megatron_rl.parallel.vocab_topk import topk_logprobs
from megatron_rl.sections.parallel import thd_row_multiple
from moe_routing.shift import router_shift_TL, rspo_gamma_T
from moe_routing.stats import routing_metrics
from moe_routing.types import RouterRecord


@dataclass
class LogProbResult:
    """Per-response-token outputs of the pass, in sample order."""

    logprobs_T: torch.Tensor
    """``[T_resp]`` fp32 log-probability of each response token."""
    entropy_T: torch.Tensor
    """``[T_resp]`` fp32 entropy of the distribution that predicted each response token."""
    cu_seqlens_S1: torch.Tensor
    """``[S + 1]`` response-token boundaries of the samples."""
    record: RouterRecord | None
    """Routing of every prompt+response position (``[T_all, L, K]``), when recorded."""
    rspo_gamma_T: torch.Tensor | None = None
    """``[T_resp]`` unfloored RSPO router-shift weight of each response token (with ``old_record``)."""
    routing_metrics: dict[str, torch.Tensor] | None = None
    """Replay agreement, flip rate and router shift per layer (when routing was watched)."""
    router_shift_T: torch.Tensor | None = None
    """``[T_resp]`` mean over layers and the old record's experts of ``|log r_cur - log r_old|`` at
    the position that predicted each response token (what RSPO's gamma exponentiates; with ``old_record``)."""
    flip_T: torch.Tensor | None = None
    """``[T_resp]`` share of MoE layers whose natural top-K at the position that predicted each
    response token is not the experts of ``old_record`` (or ``query_ids_TLK``)."""
    query_probs_TLK: torch.Tensor | None = None
    """``[T_all, L, K]`` router probability of the queried experts at every position (with ``query_ids_TLK``)."""
    topk_ids_TK: torch.Tensor | None = None
    """``[T_resp, K]`` int64 the K most likely ids of each response token's distribution (``topk``)."""
    topk_logprobs_TK: torch.Tensor | None = None
    """``[T_resp, K]`` fp32 their log-probs."""


def validate_samples(
    sequences: Sequence[torch.Tensor],
    prompt_lengths: Sequence[int],
    vocab_size: int,
    max_length: int,
) -> None:
    """Reject malformed samples before any forward runs, naming the sample and position."""
    if len(sequences) == 0:
        raise ValueError("log-prob pass: no samples")
    if len(sequences) != len(prompt_lengths):
        raise ValueError(
            f"log-prob pass: {len(sequences)} sequences but {len(prompt_lengths)} prompt lengths"
        )
    for i, (seq, prompt) in enumerate(zip(sequences, prompt_lengths)):
        if seq.dim() != 1 or seq.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"sample {i}: expected a 1-D integer token tensor, got {seq.dtype} {tuple(seq.shape)}")
        if seq.numel() > max_length:
            raise ValueError(
                f"sample {i} has {seq.numel()} tokens, more than the model's maximum "
                f"{max_length} (model.max_position_embeddings)"
            )
        if not 1 <= prompt < seq.numel():
            raise ValueError(
                f"sample {i}: prompt length {prompt} must be in [1, {seq.numel() - 1}] so that "
                "at least one response token follows the prompt"
            )
        bad = (seq < 0) | (seq >= vocab_size)
        if bool(bad.any()):
            pos = int(torch.nonzero(bad)[0, 0])
            raise ValueError(
                f"sample {i} position {pos}: token id {int(seq[pos])} is outside the "
                f"vocabulary [0, {vocab_size})"
            )


def needs_common_length(model: torch.nn.Module, groups: ParallelGroups) -> bool:
    """Whether micro-batch rows must have one length across data-parallel ranks.

    Megatron's allgather token dispatcher all-gathers equal-sized token blocks over the
    expert-parallel group, whose ranks hold different samples; alltoall exchanges counts.
    """
    config = unwrap(model).config
    return config.moe_token_dispatcher_type == "allgather" and groups.ep_size > 1


def pack_for_rank(
    sequences: Sequence[torch.Tensor],
    groups: ParallelGroups,
    per_micro_batch: int,
    *,
    max_tokens: int | None = None,
    common_length: bool = False,
) -> list[PackedMicroBatch]:
    """This rank's samples packed into micro-batches; every DP rank runs the same number.

    Args:
        sequences: this DP rank's samples.
        groups: parallel groups.
        per_micro_batch: consecutive samples per micro-batch (when ``max_tokens`` is None).
        max_tokens: token budget of a micro-batch *per context-parallel rank*: samples are
            planned into as few rows of at most ``max_tokens x CP`` tokens (slots included) as
            fit, with balanced token counts (``megatron_rl.parallel.balance.plan_micro_batches``),
            in any order.
        common_length: pad every row to the longest row of any DP rank (see
            :func:`needs_common_length`).

    Ranks with fewer micro-batches than the most loaded DP rank get balanced extra ones or,
    when they run out of samples, padding-only rows: expert dispatch is a collective, so
    every DP rank must enter the same number of forwards. The CP ranks of a replica hold
    the same samples, so they plan the same rows and each feeds its own share of them.
    """
    split = groups.tp_size if groups.sequence_parallel else 1
    multiple = thd_row_multiple(split, groups.cp_size)
    slots = slot_lengths([int(s.numel()) for s in sequences], groups.cp_size)
    if max_tokens is None:
        chunks = [list(range(i, min(i + per_micro_batch, len(sequences)))) for i in range(0, len(sequences), per_micro_batch)]
    else:
        capacity = max_tokens * groups.cp_size
        if capacity % multiple:
            raise ValueError(
                f"micro-batch token budget {max_tokens} per CP rank (x CP {groups.cp_size}) is not a multiple of "
                f"{multiple}, what every row is padded to (CP slots of 2 x CP, TP shards under SP)"
            )
        for i, slot in enumerate(slots):
            if slot > capacity:
                raise ValueError(
                    f"sample {i} takes {slot} tokens of a row (its CP slot), more than a micro-batch row holds: "
                    f"{max_tokens} tokens per CP rank x CP {groups.cp_size}"
                )
        chunks = plan_micro_batches(slots, capacity)
    longest = max((padded_row_length(sum(slots[j] for j in c), multiple) for c in chunks), default=multiple)
    stats = torch.tensor([longest, len(chunks)], dtype=torch.int64)
    if groups.dp_size > 1:
        all_reduce(stats, groups.dp, op=dist.ReduceOp.MAX)
    count = int(stats[1])
    if len(chunks) < count:
        if max_tokens is not None:
            chunks = plan_micro_batches(slots, max_tokens * groups.cp_size, num_micro_batches=count)
        chunks = chunks + [[] for _ in range(count - len(chunks))]
    return [
        pack_sequences(
            [sequences[j] for j in chunk],
            sample_ids=chunk,
            pad_multiple=split,
            pad_to=int(stats[0]) if common_length else None,
            cp_size=groups.cp_size,
            cp_rank=groups.cp_rank,
        )
        for chunk in chunks
    ]


def to_sample_order(values_per_mb: Sequence[torch.Tensor], micro_batches: Sequence[PackedMicroBatch],
                    cu_S1: torch.Tensor) -> torch.Tensor:
    """Concatenate per-micro-batch response values into sample order.

    Args:
        values_per_mb: for each micro-batch, its samples' response values in its own order.
        micro_batches: the micro-batches, in the order the values come.
        cu_S1: ``[S + 1]`` response-token offsets of the samples in sample order.
    """
    out = values_per_mb[0].new_empty(int(cu_S1[-1]), *values_per_mb[0].shape[1:]) if values_per_mb else None
    for values, mb in zip(values_per_mb, micro_batches):
        rows = [torch.arange(int(cu_S1[s]), int(cu_S1[s + 1])) for s in mb.sample_ids.tolist()]
        if rows:
            out[torch.cat(rows).to(values.device)] = values
    return out


def response_positions(cu_seqlens_S1: torch.Tensor, prompt_lengths: Sequence[int]) -> torch.Tensor:
    """Positions on the packed all-token axis whose outputs predict the response tokens.

    Response token t of a sample is predicted by position t - 1, so the routing and the
    RSPO weight of a response token are those of the position before it.
    """
    rows = [
        torch.arange(int(cu_seqlens_S1[i]) + p - 1, int(cu_seqlens_S1[i + 1]) - 1)
        for i, p in enumerate(prompt_lengths)
    ]
    return torch.cat(rows)


def compute_logprobs(
    model: torch.nn.Module,
    groups: ParallelGroups,
    sequences: Sequence[torch.Tensor],
    prompt_lengths: Sequence[int],
    *,
    micro_batch_sequences: int = 4,
    micro_batch_tokens: int | None = None,
    record_routing: bool = False,
    probs_dtype: torch.dtype = torch.float32,
    chunk_tokens: int = 1024,
    replay_ids_TLK: torch.Tensor | None = None,
    replay_layer_numbers: Sequence[int] | None = None,
    old_record: RouterRecord | None = None,
    query_ids_TLK: torch.Tensor | None = None,
    query_layer_numbers: Sequence[int] | None = None,
    topk: int = 0,
) -> LogProbResult:
    """Response-token log-probs and entropies (and optionally routing) for this DP rank.

    Args:
        model: this rank's model stage (bare or DDP-wrapped).
        groups: this rank's parallel groups.
        sequences: prompt+response token ids per sample, ``[len_s]``.
        prompt_lengths: prompt tokens at the start of each sample.
        micro_batch_sequences: samples packed per micro-batch (without a token budget).
        micro_batch_tokens: token budget per micro-batch (balanced token-budget packing).
        record_routing: also return the routing record of every position.
        probs_dtype: dtype of recorded router probabilities and gates.
        chunk_tokens: tokens per chunk of the vocab-parallel log-softmax.
        replay_ids_TLK: experts to dispatch every position to (R2/R3), validated by the caller.
        replay_layer_numbers: layer number of each column of ``replay_ids_TLK``.
        old_record: the old policy's record of the same positions; the pass then measures
            the current router log-probs at its experts and returns RSPO weights.
        query_ids_TLK: experts (e.g. the rollout engine's routes) at which the pass reports
            every position's router probabilities and whether the router's own top-K is them
            (not with ``old_record``); ``query_layer_numbers``: the layer of each column.
        topk: also return each response token's K most likely ids and their log-probs
            (``parallel.vocab_topk``; without context parallelism).
    """
    gpt = unwrap(model)
    vocab = gpt.true_vocab_size
    validate_samples(sequences, prompt_lengths, vocab, gpt.max_sequence_length)
    if topk and groups.cp_size > 1:
        raise ValueError("log-prob pass: top-k log-probs are computed without context parallelism")
    micro_batches = pack_for_rank(sequences, groups, micro_batch_sequences, max_tokens=micro_batch_tokens,
                                  common_length=needs_common_length(model, groups))
    probing = replay_ids_TLK is not None or old_record is not None
    if old_record is not None and query_ids_TLK is not None:
        raise ValueError("compute_logprobs queries either the old record's experts or query_ids_TLK, not both")
    recorder = None
    if record_routing or probing or query_ids_TLK is not None:
        recorder = _recorder(model, groups, old_record, probs_dtype, diagnostics=probing or query_ids_TLK is not None)
    if old_record is not None:
        _queue_queries(recorder, old_record.expert_ids_TLK, old_record.layer_numbers, micro_batches, groups)
    if query_ids_TLK is not None:
        _queue_queries(recorder, query_ids_TLK, query_layer_numbers, micro_batches, groups)
    replay = None
    if replay_ids_TLK is not None:
        replay = RoutingReplay(
            [model],
            replay_ids_per_call(replay_ids_TLK, replay_layer_numbers, recorder.layer_numbers, micro_batches, groups),
        )
    with torch.no_grad(), recorder or nullcontext(), replay or nullcontext():
        outputs = run_schedule(
            model, micro_batches, _response_logprobs_fn(groups, prompt_lengths, chunk_tokens, vocab, topk),
            forward_only=True, before_forward=replay.before_forward if replay is not None else None,
        )
    result = _results_in_sample_order(outputs, micro_batches, groups, sequences, prompt_lengths, topk)
    if recorder is not None:
        record = assemble_record(recorder, micro_batches, groups, gpt.config.num_moe_experts)
        if record_routing:
            result.record = record
        if probing:
            _routing_outputs(result, recorder, record, micro_batches, groups, prompt_lengths, old_record)
        if query_ids_TLK is not None:
            _query_outputs(result, recorder, record, micro_batches, groups, prompt_lengths)
    return result


def _recorder(model, groups: ParallelGroups, old_record: RouterRecord | None, probs_dtype: torch.dtype, *,
              diagnostics: bool) -> RouterRecorder:
    gpt = unwrap(model)
    # Current probabilities are rounded like the old ones, so no-change gives gamma = 1.
    dtype = old_record.probs_TLK.dtype if old_record is not None else probs_dtype
    # Under PP a stage may hold dense layers only (records are per MoE layer, by number).
    return RouterRecorder([model], probs_dtype=dtype, diagnostics=diagnostics, allow_empty=groups.pp_size > 1,
                          topk=gpt.config.moe_router_topk, num_experts=gpt.config.num_moe_experts)


def _query_outputs(result: LogProbResult, recorder: RouterRecorder, record: RouterRecord, micro_batches, groups,
                   prompt_lengths: Sequence[int]) -> None:
    """The queried experts' router probabilities at every position, and per response token the
    share of layers whose own top-K is not them."""
    result.query_probs_TLK = gather_call_field(recorder, micro_batches, groups, "query_probs_NK")
    agree_TL = gather_call_field(recorder, micro_batches, groups, "natural_equals_query_N")
    result.flip_T = _per_response_token(1.0 - agree_TL.float().mean(dim=1), record, prompt_lengths)


def _per_response_token(values_T: torch.Tensor, record: RouterRecord, prompt_lengths: Sequence[int]) -> torch.Tensor:
    """Per-position values at the positions that predicted each response token, ``[T_resp]``."""
    return values_T[response_positions(record.cu_seqlens_S1, prompt_lengths)]


def _response_logprobs_fn(groups: ParallelGroups, prompt_lengths: Sequence[int], chunk_tokens: int, vocab: int,
                          topk: int):
    """The schedule's loss function: each micro-batch's response log-probs and entropies (no loss),
    and with ``topk`` their top-k ids and log-probs."""

    def loss_fn(mb: PackedMicroBatch, logits_1TV: torch.Tensor):
        logprobs, entropy = response_logprobs_entropy(
            mb, logits_1TV, prompt_lengths, groups, chunk_tokens=chunk_tokens, vocab_size=vocab
        )
        zero = logits_1TV.new_zeros(())
        out = {"lp": logprobs, "ent": entropy}
        if topk:
            rows_R, targets_R = response_targets(mb, prompt_lengths, logits_1TV.device)
            out["topk_ids"], out["topk_lp"] = topk_logprobs(logits_1TV[0, rows_R], targets_R, logprobs, topk,
                                                            groups.tp, vocab)
        return zero, torch.tensor(logprobs.numel(), dtype=torch.int), out

    return loss_fn


def _results_in_sample_order(outputs: list[dict], micro_batches: list[PackedMicroBatch], groups: ParallelGroups,
                             sequences: Sequence[torch.Tensor], prompt_lengths: Sequence[int],
                             topk: int = 0) -> LogProbResult:
    """The last stage's per-micro-batch outputs in sample order, on every pipeline stage (no record yet)."""
    response_lengths = torch.tensor([int(s.numel()) - p for s, p in zip(sequences, prompt_lengths)])
    total = int(response_lengths.sum())
    cu = torch.zeros(len(sequences) + 1, dtype=torch.int64)
    torch.cumsum(response_lengths, 0, out=cu[1:])
    packed = torch.empty(2, total, dtype=torch.float32)
    if groups.is_last_stage:
        per_mb = [torch.stack([o["lp"].float(), o["ent"].float()], dim=1).cpu() for o in outputs]
        packed.copy_(to_sample_order(per_mb, micro_batches, cu).T)
    if groups.pp_size > 1:
        broadcast(packed, groups.pp_size - 1, groups.pp)
    result = LogProbResult(logprobs_T=packed[0], entropy_T=packed[1], cu_seqlens_S1=cu, record=None)
    if topk:
        # ids travel as exact small integers in the float buffer (ids < 2^24).
        top = torch.empty(total, 2 * topk, dtype=torch.float32)
        if groups.is_last_stage:
            per_mb = [torch.cat([o["topk_ids"].float(), o["topk_lp"].float()], dim=1).cpu() for o in outputs]
            top.copy_(to_sample_order(per_mb, micro_batches, cu))
        if groups.pp_size > 1:
            broadcast(top, groups.pp_size - 1, groups.pp)
        result.topk_ids_TK, result.topk_logprobs_TK = top[:, :topk].long(), top[:, topk:]
    return result


def _queue_queries(recorder: RouterRecorder, expert_ids_TLK: torch.Tensor, layer_numbers: Sequence[int],
                   micro_batches, groups) -> None:
    per_call = local_ids_per_call(expert_ids_TLK, layer_numbers, recorder.layer_numbers, micro_batches, groups)
    for number, ids in per_call.items():
        recorder.set_queries(number, ids)


def _routing_outputs(result, recorder, record, micro_batches, groups, prompt_lengths, old_record) -> None:
    """RSPO weights and routing metrics from what the recorder saw."""
    all_cu = record.cu_seqlens_S1
    valid_T = torch.ones(record.num_tokens, dtype=torch.bool)
    valid_T[all_cu[1:] - 1] = False  # a sample's last position feeds no prediction
    agree_TL = gather_call_field(recorder, micro_batches, groups, "natural_equals_dispatched_N")
    kwargs = {}
    if old_record is not None:
        if tuple(old_record.layer_numbers) != record.layer_numbers:
            raise ValueError(
                f"old record covers layers {old_record.layer_numbers}, the model has {record.layer_numbers}"
            )
        current_TLK = gather_call_field(recorder, micro_batches, groups, "query_probs_NK")
        shift_TL = router_shift_TL(current_TLK, old_record.probs_TLK)
        kwargs["shift_TL"] = shift_TL
        kwargs["natural_equals_old_TL"] = gather_call_field(
            recorder, micro_batches, groups, "natural_equals_query_N"
        )
        gamma_all_T = rspo_gamma_T(shift_TL.sum(dim=1), len(record.layer_numbers))
        result.rspo_gamma_T = gamma_all_T[response_positions(all_cu, prompt_lengths)]
        result.router_shift_T = _per_response_token(shift_TL.mean(dim=1).float(), record, prompt_lengths)
        result.flip_T = _per_response_token(1.0 - kwargs["natural_equals_old_TL"].float().mean(dim=1), record,
                                            prompt_lengths)
    result.routing_metrics = routing_metrics(
        record.layer_numbers, natural_equals_dispatched_TL=agree_TL, valid_T=valid_T, **kwargs
    )
