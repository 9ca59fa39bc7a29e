"""Pack variable-length sequences into one THD model row per micro-batch.

Shape legend: T packed tokens of a micro-batch (after padding), S sequences.

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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from megatron_rl.parallel.mcore_compat import PackedSeqParams


@dataclass
class PackedMicroBatch:
    """One packed model input row and its token bookkeeping."""

    tokens: torch.Tensor
    """Input ids ``[1, T]`` (int64), padding at the end."""
    position_ids: torch.Tensor
    """Positions ``[1, T]``, restarting at 0 for every segment."""
    cu_seqlens: torch.Tensor
    """``[S + 1]`` int64 start offsets of the real sequences in the row."""
    sample_ids: torch.Tensor
    """``[S]`` int64 index of each packed sequence in the caller's batch."""
    num_tokens: int
    """Real (non-padding) tokens T_real; positions ``>= num_tokens`` are padding."""

    @property
    def padded_length(self) -> int:
        """Row length T including padding."""
        return int(self.tokens.shape[1])

    @property
    def num_sequences(self) -> int:
        """Real sequences S in the row (0 for a padding-only micro-batch)."""
        return int(self.sample_ids.numel())

    @property
    def segment_cu_seqlens(self) -> torch.Tensor:
        """``[S + 1]`` or ``[S + 2]`` int32 attention segments: the sequences, then the padding tail."""
        if self.num_tokens == self.padded_length:
            return self.cu_seqlens.to(torch.int32)
        return torch.cat([self.cu_seqlens, self.cu_seqlens.new_tensor([self.padded_length])]).to(torch.int32)

    def packed_seq_params(self, device: torch.device | str = "cpu") -> PackedSeqParams:
        """Megatron's THD ``PackedSeqParams`` of the row's attention segments, on ``device``."""
        cu_32 = self.segment_cu_seqlens
        longest = int(cu_32.diff().max())
        cu_32 = cu_32.to(device)
        return PackedSeqParams(
            qkv_format="thd",
            cu_seqlens_q=cu_32,
            cu_seqlens_kv=cu_32,
            max_seqlen_q=longest,
            max_seqlen_kv=longest,
        )


def padded_row_length(num_tokens: int, pad_multiple: int = 1, pad_to: int | None = None) -> int:
    """Row length for ``num_tokens`` real tokens: at least one token, ``pad_to``, a multiple."""
    length = max(num_tokens, pad_to or 0, 1)
    return -(-length // pad_multiple) * pad_multiple


def pack_sequences(
    sequences: Sequence[torch.Tensor],
    sample_ids: Sequence[int] | None = None,
    pad_multiple: int = 1,
    pad_to: int | None = None,
    pad_id: int = 0,
) -> PackedMicroBatch:
    """Pack 1-D token tensors into one padded THD row.

    Args:
        sequences: S token-id tensors of shape ``[len_s]`` (S may be 0: a padding-only row).
        sample_ids: batch index of each sequence (defaults to ``range(S)``).
        pad_multiple: pad the row length up to a multiple of this (TP size under SP).
        pad_to: pad the row to at least this length (the allgather dispatcher's common length).
        pad_id: token id written into padding positions.
    """
    for i, seq in enumerate(sequences):
        if seq.dim() != 1 or seq.numel() == 0:
            raise ValueError(f"pack_sequences: sequence {i} must be a non-empty 1-D tensor")
    lengths = torch.tensor([s.numel() for s in sequences], dtype=torch.int64)
    cu_seqlens = torch.zeros(len(sequences) + 1, dtype=torch.int64)
    torch.cumsum(lengths, 0, out=cu_seqlens[1:])
    num_tokens = int(cu_seqlens[-1])
    length = padded_row_length(num_tokens, pad_multiple, pad_to)
    tokens = torch.full((length,), pad_id, dtype=torch.int64)
    position_ids = torch.arange(length, dtype=torch.int64) - num_tokens  # the padding segment
    if sequences:
        tokens[:num_tokens] = torch.cat([s.to(torch.int64) for s in sequences])
        position_ids[:num_tokens] = torch.arange(num_tokens) - torch.repeat_interleave(cu_seqlens[:-1], lengths)
    if sample_ids is None:
        sample_ids = range(len(sequences))
    return PackedMicroBatch(
        tokens=tokens[None],
        position_ids=position_ids[None],
        cu_seqlens=cu_seqlens,
        sample_ids=torch.as_tensor(list(sample_ids), dtype=torch.int64),
        num_tokens=num_tokens,
    )


def next_token_targets(mb: PackedMicroBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Next-token targets and loss mask over the padded row.

    Returns:
        ``(targets_T, mask_T)``: the token following each position inside its own sequence,
        and a bool mask that is False on each sequence's last token and on padding.
    """
    length = mb.padded_length
    targets_T = torch.zeros(length, dtype=torch.int64)
    targets_T[:-1] = mb.tokens[0, 1:]
    mask_T = torch.zeros(length, dtype=torch.bool)
    mask_T[: mb.num_tokens] = True
    mask_T[mb.cu_seqlens[1:] - 1] = False
    targets_T[~mask_T] = 0
    return targets_T, mask_T


def response_rows(mb: PackedMicroBatch, prompt_lengths: Sequence[int]) -> torch.Tensor:
    """Row positions whose logits predict the response tokens of the micro-batch's samples.

    Response token t of a sample is predicted by the row of token t - 1, so a sample of
    prompt length P and length N contributes rows ``[start + P - 1, start + N - 1)``.
    """
    rows = [torch.zeros(0, dtype=torch.int64)]
    for i, sample in enumerate(mb.sample_ids.tolist()):
        start, end = int(mb.cu_seqlens[i]), int(mb.cu_seqlens[i + 1])
        rows.append(torch.arange(start + prompt_lengths[sample] - 1, end - 1))
    return torch.cat(rows)


def response_targets(
    mb: PackedMicroBatch, prompt_lengths: Sequence[int], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rows_R, targets_R)`` on ``device``: the rows predicting response tokens and those tokens.

    What every loss over response tokens (log-prob pass, RL objective, SFT) indexes the
    logits with: ``logits_1TV[0, rows_R]`` scored against ``targets_R``.
    """
    rows_R = response_rows(mb, prompt_lengths)
    # The target of row r is the token at r + 1 (rows never include a sequence's last token).
    targets_R = mb.tokens[0, rows_R + 1]
    return rows_R.to(device), targets_R.to(device=device, dtype=torch.int64)
