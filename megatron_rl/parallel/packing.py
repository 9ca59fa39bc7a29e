"""Pack variable-length sequences into one model row per micro-batch.

Shape legend: T packed tokens of a micro-batch (after padding), S sequences.

A micro-batch of S sequences becomes a single row ``[1, T]`` with a block-diagonal causal
attention mask, so no token attends across a sequence boundary and nothing is padded to
``[S, max_len]``. RoPE depends only on the distance between query and key, and the mask
only admits pairs inside one sequence, so a packed sequence computes exactly what it would
alone. The row is padded at its end to a multiple of ``pad_multiple`` (the TP size under
sequence parallelism); padding forms its own masked block and carries no loss.

The block mask is the local (CPU) attention path; a Transformer Engine run would hand the
same boundaries to TE as ``PackedSeqParams`` instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch


@dataclass
class PackedMicroBatch:
    """One packed model input row and its token bookkeeping."""

    tokens: torch.Tensor
    """Input ids ``[1, T]`` (int64), padding at the end."""
    position_ids: torch.Tensor
    """Positions ``[1, T]``, restarting at 0 for every sequence."""
    attention_mask: torch.Tensor
    """``[1, 1, T, T]`` bool, True where attention is *blocked* (Megatron's convention)."""
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


def block_causal_mask(cu_seqlens: torch.Tensor, length: int) -> torch.Tensor:
    """``[T, T]`` bool, True where query t may NOT attend key u (different block or u > t).

    Positions at or beyond ``cu_seqlens[-1]`` form one extra (padding) block.
    """
    boundaries = torch.cat([cu_seqlens, cu_seqlens.new_tensor([length])]).unique_consecutive()
    block_id_T = torch.bucketize(torch.arange(length), boundaries[1:], right=True)
    same_block = block_id_T[:, None] == block_id_T[None, :]
    causal = torch.ones(length, length, dtype=torch.bool).tril_()
    return ~(same_block & causal)


def pack_sequences(
    sequences: Sequence[torch.Tensor],
    sample_ids: Sequence[int] | None = None,
    pad_multiple: int = 1,
    pad_to: int | None = None,
    pad_id: int = 0,
) -> PackedMicroBatch:
    """Pack 1-D token tensors into one padded row with a block-diagonal causal mask.

    Args:
        sequences: S token-id tensors of shape ``[len_s]``.
        sample_ids: batch index of each sequence (defaults to ``range(S)``).
        pad_multiple: pad the row length up to a multiple of this (TP size under SP).
        pad_to: pad the row to at least this length (aligns micro-batches across ranks).
        pad_id: token id written into padding positions.
    """
    if len(sequences) == 0:
        raise ValueError("pack_sequences: got no sequences")
    for i, seq in enumerate(sequences):
        if seq.dim() != 1 or seq.numel() == 0:
            raise ValueError(f"pack_sequences: sequence {i} must be a non-empty 1-D tensor")
    lengths = torch.tensor([s.numel() for s in sequences], dtype=torch.int64)
    cu_seqlens = torch.zeros(len(sequences) + 1, dtype=torch.int64)
    torch.cumsum(lengths, 0, out=cu_seqlens[1:])
    num_tokens = int(cu_seqlens[-1])
    length = -(-max(num_tokens, pad_to or 0) // pad_multiple) * pad_multiple
    tokens = torch.full((length,), pad_id, dtype=torch.int64)
    tokens[:num_tokens] = torch.cat([s.to(torch.int64) for s in sequences])
    starts_T = torch.repeat_interleave(cu_seqlens[:-1], lengths)
    position_ids = torch.zeros(length, dtype=torch.int64)
    position_ids[:num_tokens] = torch.arange(num_tokens) - starts_T
    position_ids[num_tokens:] = torch.arange(length - num_tokens)
    if sample_ids is None:
        sample_ids = range(len(sequences))
    return PackedMicroBatch(
        tokens=tokens[None],
        position_ids=position_ids[None],
        attention_mask=block_causal_mask(cu_seqlens, length)[None, None],
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
    rows = []
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

