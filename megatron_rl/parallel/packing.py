"""Pack variable-length sequences into one THD model row per micro-batch, and cut it over
context-parallel ranks.

Shape legend: T packed tokens of a micro-batch (after padding), S sequences, T_cp = T / CP
tokens of one context-parallel rank.

A micro-batch of S sequences becomes a single row ``[1, T]`` plus Megatron's
``PackedSeqParams`` in the THD format: cumulative segment boundaries and the longest
segment. Attention runs per segment (Transformer Engine's fused THD attention on a GPU,
:mod:`megatron_rl.parallel.packed_attention` elsewhere), so no token attends across a
sequence boundary and no ``[T, T]`` mask exists. RoPE restarts at every segment, exactly as
each sequence would see it alone.

Padding is explicit and has one reason each: the row is padded at its end to a multiple of
``pad_multiple`` (the TP size under sequence parallelism: the row is split over TP ranks)
and, with the allgather token dispatcher, to one common length across data-parallel ranks
(``pad_to``: that dispatcher all-gathers equal-sized token blocks). The padding tail is a
segment of its own, so attention stays block-causal, and it is never a loss row, a routing
record row or a metric. A micro-batch may hold no sequence at all: ranks that must run the
same number of micro-batches (expert dispatch is a collective) run such a padding-only row.

Context parallelism (CP > 1) follows Megatron-Core's THD layout (``get_thd_batch_on_this_cp_rank``
with Transformer Engine's ``thd_get_partitioned_indices``): every sequence sits in a *slot*
padded to a multiple of 2 x CP (pad tokens after its last real token, where causal attention
keeps them out of every real token's view), the row to a multiple of 2 x CP and of CP x TP
(under SP each CP rank's share is split over TP), and each slot is cut into 2 x CP equal chunks
of which CP rank r holds chunks r and 2 x CP - 1 - r (the load-balanced zig-zag order: every
rank gets one early and one late chunk of each sequence, so causal attention costs the same on
all of them). ``PackedSeqParams`` then carry the slots as ``cu_seqlens_*_padded`` and the real
lengths as ``cu_seqlens_*``, for the whole row, on every CP rank. Every CP rank of a
data-parallel replica packs the same samples into the same rows and feeds the model its own
``T_cp`` rows (:attr:`PackedMicroBatch.local_rows`); per-token results come back in row order
through :attr:`PackedMicroBatch.cp_row_order`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Sequence

import torch

from megatron_rl.parallel.mcore_compat import PackedSeqParams
from megatron_rl.sections.parallel import thd_row_multiple, thd_slot_multiple


def slot_lengths(lengths: Sequence[int], cp_size: int) -> list[int]:
    """The slot each sequence of ``lengths`` tokens takes in a row under ``cp_size``."""
    multiple = thd_slot_multiple(cp_size)
    return [-(-n // multiple) * multiple for n in lengths]


def cp_partition_indices(cu_padded: torch.Tensor, total: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """``[total / cp_size]`` int64 row positions that CP rank ``cp_rank`` holds, in its local order.

    The pure-torch twin of Transformer Engine's ``thd_get_partitioned_indices`` (what
    Megatron-Core's ``get_thd_batch_on_this_cp_rank`` slices a THD batch with): segment after
    segment, chunk ``cp_rank`` then chunk ``2 x cp_size - 1 - cp_rank`` of the segment's
    2 x cp_size equal chunks (``mcore_compat.THD_CONTEXT_PARALLEL``).

    Args:
        cu_padded: ``[n + 1]`` boundaries of the row's n segments (slots and padding tail).
        total: the row length T (``cu_padded[-1]``).
        cp_size: CP.
        cp_rank: this rank inside the CP group.

    Raises:
        ValueError: a segment is not a multiple of 2 x cp_size, or the segments do not cover T.
    """
    cu = cu_padded.to(device="cpu", dtype=torch.int64)
    if cp_size == 1:
        return torch.arange(total)
    lengths = cu.diff()
    if int(cu[-1]) != total or bool((lengths % (2 * cp_size)).any()):
        raise ValueError(
            f"context parallelism {cp_size}: every segment must be a multiple of {2 * cp_size} and they must "
            f"cover the row of {total} tokens; segments {lengths.tolist()}"
        )
    chunk_n = lengths // (2 * cp_size)
    segment_L = torch.repeat_interleave(torch.arange(lengths.numel()), 2 * chunk_n)
    local_starts = torch.cumsum(2 * chunk_n, 0) - 2 * chunk_n
    within_L = torch.arange(total // cp_size) - local_starts[segment_L]
    chunk_L = chunk_n[segment_L]
    late_L = within_L >= chunk_L
    chunk_index_L = torch.where(late_L, 2 * cp_size - 1 - cp_rank, cp_rank)
    return cu[segment_L] + chunk_index_L * chunk_L + within_L - late_L * chunk_L


@dataclass
class PackedMicroBatch:
    """One packed model input row and its token bookkeeping."""

    tokens: torch.Tensor
    """Input ids ``[1, T]`` (int64), padding after each slot's sequence and at the end."""
    position_ids: torch.Tensor
    """Positions ``[1, T]``, restarting at 0 for every slot and for the padding tail."""
    cu_seqlens: torch.Tensor
    """``[S + 1]`` int64 cumulative lengths of the real sequences (their token counts, in row order)."""
    sample_ids: torch.Tensor
    """``[S]`` int64 index of each packed sequence in the caller's batch."""
    num_tokens: int
    """Real (non-padding) tokens T_real."""
    cu_slots: torch.Tensor | None = None
    """``[S + 1]`` int64 slot boundaries in the row (each slot: a sequence, then its padding);
    None means slots are the sequences themselves (``cu_seqlens``)."""
    cp_size: int = 1
    """Context-parallel ranks the row is cut over."""
    cp_rank: int = 0
    """The CP rank this copy of the row feeds to the model."""

    @property
    def padded_length(self) -> int:
        """Row length T including padding."""
        return int(self.tokens.shape[1])

    @property
    def num_sequences(self) -> int:
        """Real sequences S in the row (0 for a padding-only micro-batch)."""
        return int(self.sample_ids.numel())

    @property
    def slot_starts(self) -> torch.Tensor:
        """``[S + 1]`` int64 row offsets of the slots (the last one: where the padding tail starts)."""
        return self.cu_seqlens if self.cu_slots is None else self.cu_slots

    @functools.cached_property
    def real_rows(self) -> torch.Tensor:
        """``[T_real]`` int64 row positions of the real tokens, sequence after sequence."""
        if self.cu_slots is None:
            return torch.arange(self.num_tokens)
        lengths = self.cu_seqlens.diff()
        offsets = torch.repeat_interleave(self.cu_slots[:-1] - self.cu_seqlens[:-1], lengths)
        return torch.arange(self.num_tokens) + offsets

    @property
    def segment_cu_seqlens(self) -> torch.Tensor:
        """``[S + 1]`` or ``[S + 2]`` int32 attention segments: the slots, then the padding tail."""
        starts = self.slot_starts
        if int(starts[-1]) == self.padded_length:
            return starts.to(torch.int32)
        return torch.cat([starts, starts.new_tensor([self.padded_length])]).to(torch.int32)

    def packed_seq_params(self, device: torch.device | str = "cpu") -> PackedSeqParams:
        """Megatron's THD ``PackedSeqParams`` of the row's attention segments, on ``device``.

        Under CP the padded segments (``cu_seqlens_*_padded``: the slots, which RoPE and the CP
        split read) and the real lengths (``cu_seqlens_*``: what Transformer Engine attends
        over) are both given, for the whole row, as Megatron-Core's THD CP path expects.
        """
        padded_32 = self.segment_cu_seqlens
        longest = int(padded_32.diff().max())
        if self.cp_size == 1:
            cu_32 = padded_32.to(device)
            return PackedSeqParams(
                qkv_format="thd", cu_seqlens_q=cu_32, cu_seqlens_kv=cu_32, max_seqlen_q=longest, max_seqlen_kv=longest
            )
        real_lengths = padded_32.diff().to(torch.int64)
        real_lengths[: self.num_sequences] = self.cu_seqlens.diff()  # the padding tail counts whole
        real_32 = torch.zeros_like(padded_32)
        torch.cumsum(real_lengths, 0, out=real_32[1:])
        real_32, padded_32 = real_32.to(device), padded_32.to(device)
        return PackedSeqParams(
            qkv_format="thd", cu_seqlens_q=real_32, cu_seqlens_kv=real_32,
            cu_seqlens_q_padded=padded_32, cu_seqlens_kv_padded=padded_32,
            max_seqlen_q=longest, max_seqlen_kv=longest,
        )

    @functools.cached_property
    def local_rows(self) -> torch.Tensor:
        """``[T_cp]`` int64 row positions this CP rank feeds to the model, in its local order."""
        return cp_partition_indices(self.segment_cu_seqlens, self.padded_length, self.cp_size, self.cp_rank)

    @functools.cached_property
    def cp_row_order(self) -> torch.Tensor:
        """``[T]`` int64: where each row position sits in the CP ranks' concatenated local rows
        (rank order), so ``gathered[cp_row_order]`` is in row order."""
        every_rank = [
            cp_partition_indices(self.segment_cu_seqlens, self.padded_length, self.cp_size, r)
            for r in range(self.cp_size)
        ]
        return torch.argsort(torch.cat(every_rank))

    @functools.cached_property
    def local_position_of_row(self) -> torch.Tensor:
        """``[T]`` int64: the local position of each row position on this CP rank, -1 elsewhere."""
        out = torch.full((self.padded_length,), -1, dtype=torch.int64)
        out[self.local_rows] = torch.arange(self.local_rows.numel())
        return out

    def model_inputs(self, device: torch.device | str = "cpu") -> dict:
        """Keyword arguments of the model's forward for this CP rank's share of the row."""
        tokens, positions = self.tokens, self.position_ids
        if self.cp_size > 1:
            tokens, positions = tokens[:, self.local_rows], positions[:, self.local_rows]
        return {
            "input_ids": tokens.to(device),
            "position_ids": positions.to(device),
            # THD packing: attention reads the segment boundaries; there is no dense mask.
            "attention_mask": None,
            "packed_seq_params": self.packed_seq_params(device),
        }


def padded_row_length(num_tokens: int, pad_multiple: int = 1, pad_to: int | None = None) -> int:
    """Row length for ``num_tokens`` tokens of slots: at least one token, ``pad_to``, a multiple."""
    length = max(num_tokens, pad_to or 0, 1)
    return -(-length // pad_multiple) * pad_multiple


def pack_sequences(
    sequences: Sequence[torch.Tensor],
    sample_ids: Sequence[int] | None = None,
    pad_multiple: int = 1,
    pad_to: int | None = None,
    pad_id: int = 0,
    cp_size: int = 1,
    cp_rank: int = 0,
) -> PackedMicroBatch:
    """Pack 1-D token tensors into one padded THD row.

    Args:
        sequences: S token-id tensors of shape ``[len_s]`` (S may be 0: a padding-only row).
        sample_ids: batch index of each sequence (defaults to ``range(S)``).
        pad_multiple: each CP rank's share of the row is padded to a multiple of this (TP
            size under SP); the row length is a multiple of ``sections.parallel.thd_row_multiple``.
        pad_to: pad the row to at least this length (the allgather dispatcher's common length).
        pad_id: token id written into padding positions.
        cp_size: context-parallel ranks the row is cut over (slots of 2 x CP tokens).
        cp_rank: the CP rank this copy of the row is for.
    """
    for i, seq in enumerate(sequences):
        if seq.dim() != 1 or seq.numel() == 0:
            raise ValueError(f"pack_sequences: sequence {i} must be a non-empty 1-D tensor")
    lengths = torch.tensor([s.numel() for s in sequences], dtype=torch.int64)
    cu_seqlens = torch.zeros(len(sequences) + 1, dtype=torch.int64)
    torch.cumsum(lengths, 0, out=cu_seqlens[1:])
    slots = torch.tensor(slot_lengths(lengths.tolist(), cp_size), dtype=torch.int64)
    cu_slots = torch.zeros_like(cu_seqlens)
    torch.cumsum(slots, 0, out=cu_slots[1:])
    slotted = int(cu_slots[-1])
    length = padded_row_length(slotted, thd_row_multiple(pad_multiple, cp_size), pad_to)
    tokens = torch.full((length,), pad_id, dtype=torch.int64)
    position_ids = torch.arange(length, dtype=torch.int64) - slotted  # the padding tail
    if sequences:
        position_ids[:slotted] = torch.arange(slotted) - torch.repeat_interleave(cu_slots[:-1], slots)
    mb = PackedMicroBatch(
        tokens=tokens[None],
        position_ids=position_ids[None],
        cu_seqlens=cu_seqlens,
        sample_ids=torch.as_tensor(list(range(len(sequences)) if sample_ids is None else sample_ids),
                                   dtype=torch.int64),
        num_tokens=int(cu_seqlens[-1]),
        cu_slots=None if torch.equal(slots, lengths) else cu_slots,
        cp_size=cp_size,
        cp_rank=cp_rank,
    )
    if sequences:
        tokens[mb.real_rows] = torch.cat([s.to(torch.int64) for s in sequences])
    return mb


def next_token_targets(mb: PackedMicroBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Next-token targets and loss mask over the padded row (the whole row, under CP too).

    Returns:
        ``(targets_T, mask_T)``: the token following each position inside its own sequence,
        and a bool mask that is False on each sequence's last token and on padding.
    """
    length = mb.padded_length
    targets_T = torch.zeros(length, dtype=torch.int64)
    targets_T[:-1] = mb.tokens[0, 1:]
    mask_T = torch.zeros(length, dtype=torch.bool)
    mask_T[mb.real_rows] = True
    mask_T[mb.slot_starts[:-1] + mb.cu_seqlens.diff() - 1] = False
    targets_T[~mask_T] = 0
    return targets_T, mask_T


def response_rows(mb: PackedMicroBatch, prompt_lengths: Sequence[int]) -> torch.Tensor:
    """Row positions whose logits predict the response tokens of the micro-batch's samples.

    Response token t of a sample is predicted by the row of token t - 1, so a sample of
    prompt length P and length N in a slot starting at ``start`` contributes rows
    ``[start + P - 1, start + N - 1)``.
    """
    rows = [torch.zeros(0, dtype=torch.int64)]
    lengths = mb.cu_seqlens.diff().tolist()
    for i, sample in enumerate(mb.sample_ids.tolist()):
        start = int(mb.slot_starts[i])
        rows.append(torch.arange(start + prompt_lengths[sample] - 1, start + lengths[i] - 1))
    return torch.cat(rows)


def response_targets(
    mb: PackedMicroBatch, prompt_lengths: Sequence[int], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rows_R, targets_R)`` on ``device``: the rows predicting response tokens and those tokens.

    Rows are positions of the whole row: without CP, what every loss over response tokens
    indexes the logits with (``logits_1TV[0, rows_R]`` scored against ``targets_R``); under CP
    the labels come from the whole row before the row is cut, as Megatron-LM's RL does.
    """
    rows_R = response_rows(mb, prompt_lengths)
    # The target of row r is the token at r + 1 (rows never include a sequence's last token).
    targets_R = mb.tokens[0, rows_R + 1]
    return rows_R.to(device), targets_R.to(device=device, dtype=torch.int64)
