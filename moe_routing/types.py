"""The routing record: per token and MoE layer, the top-K experts and their probabilities.

Shape legend: T tokens (packed, sample order), L MoE layers, K experts per token,
E experts per layer, S samples.

Pure data (no torch.distributed, no Megatron, no I/O). Expert ids use the narrowest integer
type that holds E (uint8 up to 256 experts): a 48-layer top-8 record costs 384 bytes per
token instead of the 1,536 of SGLang's int32 wire format.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def compact_id_dtype(num_experts: int) -> torch.dtype:
    """Narrowest integer dtype that holds expert ids ``0 .. num_experts - 1``."""
    if num_experts <= 0:
        raise ValueError(f"num_experts must be positive, got {num_experts}")
    if num_experts <= 256:
        return torch.uint8
    if num_experts <= 2**15:
        return torch.int16
    return torch.int32


@dataclass
class RouterRecord:
    """Top-K routing of every token at every MoE layer, aligned with the packed token axis.

    Row t describes the forward position t of the packed input (prompt and response tokens
    of every sample, in sample order): the experts its hidden state was dispatched to at
    each MoE layer.
    """

    expert_ids_TLK: torch.Tensor
    """Dispatched expert ids ``[T, L, K]``, ordered by descending router probability."""
    probs_TLK: torch.Tensor
    """Router probability of those experts under the score function: softmax over all E
    experts, or the expert's own sigmoid score (without the selection-only expert bias)."""
    gates_TLK: torch.Tensor
    """Gate weights that combined the experts' outputs (normalized top-K weights, times the
    routed scaling factor where the model has one)."""
    layer_numbers: tuple[int, ...]
    """Global (1-based) Megatron layer number of each of the L MoE layers."""
    cu_seqlens_S1: torch.Tensor
    """``[S + 1]`` sample boundaries on the token axis."""
    num_experts: int
    """Experts per layer E (bounds the ids)."""

    def __post_init__(self) -> None:
        t, l, k = self.expert_ids_TLK.shape
        for name in ("probs_TLK", "gates_TLK"):
            if getattr(self, name).shape != (t, l, k):
                raise ValueError(
                    f"RouterRecord.{name} has shape {tuple(getattr(self, name).shape)}, "
                    f"expected {(t, l, k)} like expert_ids_TLK"
                )
        if len(self.layer_numbers) != l:
            raise ValueError(
                f"RouterRecord.layer_numbers lists {len(self.layer_numbers)} layers for L={l}"
            )
        if int(self.cu_seqlens_S1[-1]) != t:
            raise ValueError(
                f"RouterRecord.cu_seqlens_S1 ends at {int(self.cu_seqlens_S1[-1])}, expected T={t}"
            )

    @property
    def num_tokens(self) -> int:
        """T."""
        return int(self.expert_ids_TLK.shape[0])

    @property
    def topk(self) -> int:
        """K."""
        return int(self.expert_ids_TLK.shape[2])

    def bytes_per_token(self) -> int:
        """Bytes one token's ids and probabilities take (gates excluded)."""
        _, l, k = self.expert_ids_TLK.shape
        return l * k * (self.expert_ids_TLK.element_size() + self.probs_TLK.element_size())

    def sample(self, index: int) -> "RouterRecord":
        """The record of one sample (its own token axis)."""
        start, end = int(self.cu_seqlens_S1[index]), int(self.cu_seqlens_S1[index + 1])
        return RouterRecord(
            expert_ids_TLK=self.expert_ids_TLK[start:end],
            probs_TLK=self.probs_TLK[start:end],
            gates_TLK=self.gates_TLK[start:end],
            layer_numbers=self.layer_numbers,
            cu_seqlens_S1=torch.tensor([0, end - start], dtype=torch.int64),
            num_experts=self.num_experts,
        )

    def select_samples(self, indices: list[int]) -> "RouterRecord":
        """The record of the given samples, in the given order."""
        spans = [(int(self.cu_seqlens_S1[i]), int(self.cu_seqlens_S1[i + 1])) for i in indices]
        rows = torch.cat([torch.arange(a, b) for a, b in spans])
        lengths = torch.tensor([b - a for a, b in spans], dtype=torch.int64)
        cu = torch.zeros(len(indices) + 1, dtype=torch.int64)
        torch.cumsum(lengths, 0, out=cu[1:])
        return RouterRecord(
            expert_ids_TLK=self.expert_ids_TLK[rows],
            probs_TLK=self.probs_TLK[rows],
            gates_TLK=self.gates_TLK[rows],
            layer_numbers=self.layer_numbers,
            cu_seqlens_S1=cu,
            num_experts=self.num_experts,
        )
