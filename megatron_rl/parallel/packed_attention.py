"""Block-causal core attention over THD-packed sequences, without a ``[T, T]`` mask.

Shape legend: T packed tokens of a micro-batch row, H query heads of this TP rank, G key/value
groups of this TP rank, D head dim (Dv for values), n segments of one length, Lseg that length.

The Transformer Engine layer spec hands Megatron's ``PackedSeqParams`` (THD) to TE's fused
attention. :class:`PackedCoreAttention` is the same contract for Megatron's local layer
spec (CPU, or a GPU without TE): it sits where the spec's ``core_attention`` sits, takes
the same constructor and forward arguments, and attends inside each segment of
``cu_seqlens_q`` only. Segments of equal length run as one batched causal
``scaled_dot_product_attention`` call, so the work is proportional to the sum of squared
segment lengths and memory to the largest batch of segments, never to ``T^2``. A segment's
output is a function of that segment's queries, keys and values alone: changing another
sequence of the row cannot change it.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from megatron.core.transformer import MegatronModule

from megatron_rl.parallel.mcore_compat import AttnMaskType


class PackedCoreAttention(MegatronModule):
    """Causal attention per THD segment; drop-in for the local spec's ``core_attention``.

    Constructor arguments are those Megatron passes to any core-attention submodule.
    """

    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        k_channels: int | None = None,
        v_channels: int | None = None,
        cp_comm_type: str | None = None,
        pg_collection=None,
    ) -> None:
        super().__init__(config=config)
        if attn_mask_type not in (AttnMaskType.causal, AttnMaskType.padding_causal):
            raise ValueError(f"PackedCoreAttention computes causal attention, not {attn_mask_type}")
        if config.context_parallel_size != 1:
            raise ValueError("PackedCoreAttention: context parallelism needs Transformer Engine's attention")
        if getattr(config, "window_size", None) is not None or getattr(config, "softmax_type", "vanilla") != "vanilla":
            raise ValueError("PackedCoreAttention: sliding windows and softmax offsets are not supported")
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout:
            raise ValueError(f"PackedCoreAttention: attention dropout {dropout} is not supported (RL uses 0)")
        # Megatron's DotProductAttention divides by the layer number for fp16 range and
        # multiplies back inside its softmax: the effective scale is this one.
        # MLA passes its own scale and its key/value widths (k_channels, v_channels); the
        # widths come with the tensors, so only the scale is kept.
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(config.kv_channels)
        self.layer_number = layer_number

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params=None,
    ) -> torch.Tensor:
        """Attention output ``[T, H * Dv]`` (THD) or ``[s, b, H * Dv]`` (one sequence per batch row).

        Args:
            query: ``[T, H, D]`` with THD params, else ``[s, b, H, D]``.
            key: ``[T, G, D]`` or ``[s, b, G, D]``.
            value: ``[T, G, Dv]`` or ``[s, b, G, Dv]``.
            attention_mask: ignored: causality and segments define what is attended.
            attn_mask_type: unused (always causal).
            attention_bias: must be None.
            packed_seq_params: Megatron ``PackedSeqParams`` with ``qkv_format='thd'``; None means
                every batch row is one whole sequence.
        """
        if attention_bias is not None:
            raise ValueError("PackedCoreAttention: attention_bias is not supported")
        if packed_seq_params is None:
            # [s, b, H, D] -> [b, H, s, D]: each batch row is one causal sequence.
            out_BHSD = _causal_attention(
                query.permute(1, 2, 0, 3), key.permute(1, 2, 0, 3), value.permute(1, 2, 0, 3), self.softmax_scale
            )
            s, b = query.shape[0], query.shape[1]
            return out_BHSD.permute(2, 0, 1, 3).reshape(s, b, -1)
        if packed_seq_params.qkv_format != "thd":
            raise ValueError(f"PackedCoreAttention: qkv_format {packed_seq_params.qkv_format!r} is not 'thd'")
        cu_q = packed_seq_params.cu_seqlens_q_padded
        cu_q = packed_seq_params.cu_seqlens_q if cu_q is None else cu_q
        cu_kv = packed_seq_params.cu_seqlens_kv_padded
        cu_kv = packed_seq_params.cu_seqlens_kv if cu_kv is None else cu_kv
        if cu_kv is not cu_q and not torch.equal(cu_kv, cu_q):
            raise ValueError("PackedCoreAttention: self-attention needs cu_seqlens_kv == cu_seqlens_q")
        total = query.shape[0]
        if int(cu_q[-1]) != total:
            raise ValueError(f"PackedCoreAttention: segments cover {int(cu_q[-1])} tokens, the row has {total}")
        out_THD = query.new_empty(total, query.shape[1], value.shape[2])
        starts = cu_q[:-1].to(torch.int64).cpu()
        lengths = cu_q.diff().to(torch.int64).cpu()
        for length in lengths.unique().tolist():
            if length == 0:
                continue
            # [n, Lseg] row indices of the n segments of this length.
            rows_NL = (starts[lengths == length][:, None] + torch.arange(length)[None]).to(query.device)
            q_NHLD = query[rows_NL].transpose(1, 2)
            k_NGLD = key[rows_NL].transpose(1, 2)
            v_NGLD = value[rows_NL].transpose(1, 2)
            out_NHLD = _causal_attention(q_NHLD, k_NGLD, v_NGLD, self.softmax_scale)
            out_THD[rows_NL.reshape(-1)] = out_NHLD.transpose(1, 2).reshape(-1, *out_THD.shape[1:])
        return out_THD.reshape(total, -1)


def _causal_attention(q_BHLD: torch.Tensor, k_BGLD: torch.Tensor, v_BGLD: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal SDPA with grouped-query heads expanded to the query heads (``[B, H, L, Dv]``)."""
    heads, groups = q_BHLD.shape[1], k_BGLD.shape[1]
    if heads != groups:
        k_BGLD = k_BGLD.repeat_interleave(heads // groups, dim=1)
        v_BGLD = v_BGLD.repeat_interleave(heads // groups, dim=1)
    return F.scaled_dot_product_attention(q_BHLD, k_BGLD, v_BGLD, is_causal=True, scale=scale)
