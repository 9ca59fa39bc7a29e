"""Move routing data between the global token axis and each rank's shards.

Shape legend: T tokens of this data-parallel rank's samples (sample order: sample 0's
tokens, then sample 1's, whatever micro-batch each sample was packed into),
T_pad padded tokens of one micro-batch row, N = T_pad / (CP x TP) tokens one router call
sees (TP under sequence parallelism), L MoE layers (L_local on this pipeline stage), K top-K.

Under context parallelism each CP rank runs its zig-zag share of the row (T_cp = T_pad / CP
positions, ``PackedMicroBatch.local_rows``); Megatron shards that share along the sequence
over the TP group (contiguous chunks, rank order) when sequence parallelism is on, and
pipeline stages hold contiguous blocks of layers (a stage of dense layers only holds no MoE
layer and adds no column). ``assemble_record`` reverses all three for
what a :class:`RouterRecorder` saw; ``local_ids_per_call`` cuts a global ``[T, L, K]`` id
tensor into exactly what each router call of this rank sees (the same cuts, in the same
order, as the tokens). Groups are passed in; this is the only routing module that runs
collectives.
"""

from __future__ import annotations

from typing import Sequence

import torch

from megatron_rl.parallel.comm import all_gather_cat, all_gather_varlen
from megatron_rl.parallel.context_parallel import whole_row
from megatron_rl.parallel.routing_record import LayerCall, RouterRecorder
from moe_routing.types import RouterRecord


def _call_per_micro_batch(recorder: RouterRecorder, num_micro_batches: int) -> dict[int, list[LayerCall]]:
    calls = {}
    for number in recorder.layer_numbers:
        layer_calls = recorder.calls(number)
        if len(layer_calls) != num_micro_batches:
            raise RuntimeError(
                f"layer {number}: recorded {len(layer_calls)} router calls for "
                f"{num_micro_batches} micro-batches (was activation recomputation on?)"
            )
        calls[number] = layer_calls
    return calls


def sample_cu_seqlens(micro_batches: Sequence) -> torch.Tensor:
    """``[S + 1]`` token offsets of the samples in sample order, from the micro-batches that hold them.

    Raises:
        ValueError: the micro-batches do not hold each of samples ``0..S-1`` exactly once.
    """
    ids = torch.cat([mb.sample_ids for mb in micro_batches])
    lengths = torch.cat([mb.cu_seqlens.diff() for mb in micro_batches])
    if not torch.equal(ids.sort().values, torch.arange(ids.numel())):
        raise ValueError("the micro-batches must hold samples 0..S-1 exactly once each")
    cu = torch.zeros(ids.numel() + 1, dtype=torch.int64)
    by_sample = torch.zeros(ids.numel(), dtype=torch.int64)
    by_sample[ids] = lengths
    torch.cumsum(by_sample, 0, out=cu[1:])
    return cu


def packed_rows(mb, cu_S1: torch.Tensor) -> torch.Tensor:
    """Sample-order token rows of one micro-batch's real tokens, in the micro-batch's order."""
    parts = [torch.arange(int(cu_S1[s]), int(cu_S1[s + 1])) for s in mb.sample_ids.tolist()]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)


def _gather_tokens(local_NLK: torch.Tensor, tp_group, tp_size: int) -> torch.Tensor:
    return local_NLK if tp_size == 1 else all_gather_cat(local_NLK, tp_group, dim=0)


def _gather_layers(local_TLK: torch.Tensor, pp_group, pp_size: int) -> torch.Tensor:
    if pp_size == 1:
        return local_TLK
    # Stages may hold different numbers of MoE layers (dense first layers sit on stage 0).
    layers_first = all_gather_varlen(local_TLK.transpose(0, 1).contiguous(), pp_group)
    return layers_first.transpose(0, 1).contiguous()


def gather_call_field(
    recorder: RouterRecorder, micro_batches: Sequence, groups, field: str
) -> torch.Tensor:
    """One per-call field of every local layer as ``[T, L, ...]`` over this DP rank's tokens.

    Tokens are gathered over the sequence-parallel shards (TP), then over the CP ranks (back
    in row order), and padding is dropped; layers are gathered over pipeline stages, in stage order.
    """
    calls = _call_per_micro_batch(recorder, len(micro_batches))
    numbers = recorder.layer_numbers
    tp_size = groups.tp_size if groups.sequence_parallel else 1
    cu_S1 = sample_cu_seqlens(micro_batches)
    if not numbers:
        # A stage of dense layers only: no columns of its own, but its part of the gather.
        trailing, dtype = recorder.field_layout(field)
        return _gather_layers(torch.empty(int(cu_S1[-1]), 0, *trailing, dtype=dtype), groups.pp, groups.pp_size)
    out = None
    for m, mb in enumerate(micro_batches):
        values = [getattr(calls[n][m], field) for n in numbers]
        if any(v is None for v in values):
            raise RuntimeError(f"router calls of micro-batch {m} did not record {field}")
        # Records live in host memory: move each call's rows off the accelerator once.
        local_NL = torch.stack(values, dim=1).cpu()
        row = whole_row(_gather_tokens(local_NL, groups.tp, tp_size), mb, groups.cp)
        real = row[mb.real_rows]  # padding dropped
        if out is None:
            out = real.new_empty(int(cu_S1[-1]), *real.shape[1:])
        out[packed_rows(mb, cu_S1)] = real
    return _gather_layers(out, groups.pp, groups.pp_size)


def gathered_layer_numbers(recorder: RouterRecorder, groups) -> tuple[int, ...]:
    """Global layer numbers of the L columns that ``gather_call_field`` returns."""
    numbers = torch.tensor(recorder.layer_numbers, dtype=torch.int64)[None, :]
    return tuple(int(n) for n in _gather_layers(numbers, groups.pp, groups.pp_size)[0])


def assemble_record(
    recorder: RouterRecorder,
    micro_batches: Sequence,
    groups,
    num_experts: int,
) -> RouterRecord:
    """One record for this data-parallel rank's samples, on every TP and PP rank.

    Args:
        recorder: the recorder that watched one forward of each micro-batch.
        micro_batches: the ``PackedMicroBatch`` list that was run, in order.
        groups: ``ParallelGroups`` of this rank (tp/pp groups and sizes, SP flag).
        num_experts: experts per layer.
    """
    cu = sample_cu_seqlens(micro_batches)
    return RouterRecord(
        expert_ids_TLK=gather_call_field(recorder, micro_batches, groups, "expert_ids_NK"),
        probs_TLK=gather_call_field(recorder, micro_batches, groups, "probs_NK"),
        gates_TLK=gather_call_field(recorder, micro_batches, groups, "gates_NK"),
        layer_numbers=gathered_layer_numbers(recorder, groups),
        cu_seqlens_S1=cu,
        num_experts=num_experts,
    )


def local_ids_per_call(
    expert_ids_TLK: torch.Tensor,
    layer_numbers: Sequence[int],
    local_layer_numbers: Sequence[int],
    micro_batches: Sequence,
    groups,
    pad_ids_K: torch.Tensor | None = None,
) -> dict[int, list[torch.Tensor]]:
    """Cut global ids ``[T, L, K]`` into each local router call's ``[N, K]`` ids.

    Args:
        expert_ids_TLK: ids for this DP rank's samples, rows in sample order.
        layer_numbers: global layer number of each of the L columns.
        local_layer_numbers: layers whose routers live on this rank.
        micro_batches: the micro-batches that will run, in order (they define padding).
        groups: ``ParallelGroups`` of this rank.
        pad_ids_K: ids used for padding positions (default ``0..K-1``).

    Returns:
        For each local layer number, one ``[N, K]`` int64 tensor per micro-batch.
    """
    column = {number: i for i, number in enumerate(layer_numbers)}
    missing = [n for n in local_layer_numbers if n not in column]
    if missing:
        raise ValueError(f"routing data has no entry for MoE layer(s) {missing}")
    k = expert_ids_TLK.shape[2]
    if pad_ids_K is None:
        pad_ids_K = torch.arange(k)
    tp_size = groups.tp_size if groups.sequence_parallel else 1
    out: dict[int, list[torch.Tensor]] = {n: [] for n in local_layer_numbers}
    cu_S1 = sample_cu_seqlens(micro_batches)
    offset = int(cu_S1[-1])
    if offset != expert_ids_TLK.shape[0]:
        raise ValueError(
            f"routing data covers {expert_ids_TLK.shape[0]} tokens but the micro-batches hold {offset}"
        )
    for mb in micro_batches:
        rows_TLK = expert_ids_TLK[packed_rows(mb, cu_S1)].to(torch.int64)
        padded_TLK = pad_ids_K.to(torch.int64).expand(mb.padded_length, len(layer_numbers), k).clone()
        padded_TLK[mb.real_rows] = rows_TLK
        if mb.cp_size > 1:
            padded_TLK = padded_TLK[mb.local_rows]
        shard = padded_TLK.shape[0] // tp_size
        start = (groups.tp_rank if tp_size > 1 else 0) * shard
        for number in local_layer_numbers:
            out[number].append(padded_TLK[start : start + shard, column[number]])
    return out
