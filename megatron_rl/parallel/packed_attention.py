"""Block-causal core attention over THD-packed sequences, without a ``[T, T]`` mask.

Shape legend: T packed tokens of a micro-batch row, H query heads of this TP rank, G key/value
groups of this TP rank, D head dim (Dv for values), n segments of one length, Lseg that length.

The Transformer Engine layer spec hands Megatron's ``PackedSeqParams`` (THD) to TE's fused
attention. :class:`PackedCoreAttention` is the same contract for Megatron's local layer
spec (CPU, or a GPU without TE): it sits where the spec's ``core_attention`` sits, takes
the same constructor and forward arguments, and attends inside each segment of
``cu_seqlens_q`` only. Segments of equal length run as one batched causal
``scaled_dot_product_attention`` call, so the work is proportional to the sum of squared
segment lengths and memory to the largest batch of segments, never to ``T^2``. A layer with a
sliding window (Megatron's ``window_size`` and ``window_attn_skip_freq``: GPT-OSS) sees only
the keys it covers, and learnable softmax offsets (``softmax_type='learnable'``: GPT-OSS's
sinks, a parameter ``softmax_offset`` per head, split over TP) add a logit per head that takes
probability but no value; both run an explicit fp32 softmax, in the CP path too. A segment's
output is a function of that segment's queries, keys and values alone: changing another
sequence of the row cannot change it.

Under context parallelism (CP > 1) each rank holds the queries, keys and values of its
zig-zag share of the row (:func:`megatron_rl.parallel.packing.cp_partition_indices`) and the
segments are the padded slots. Keys and values are all-gathered over the CP group (their
gradients summed back to the rank that owns them: every rank's queries used them) and put in
row order; each local query then attends to the keys of its own slot at positions up to its
own. This is the all-gather flavour of CP attention (Transformer Engine's ``p2p`` ring
computes the same on a GPU), exact by construction, and the only way to test every CP layout
on gloo. It runs one chunk of a slot length at a time, in query blocks whose causal mask holds
at most :data:`MASK_ELEMENTS` entries, each block recomputed in the backward instead of kept
(``torch.utils.checkpoint``), so its memory is the gathered keys and values plus one block,
never ``[T_cp, T]``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from megatron.core import parallel_state, tensor_parallel
from megatron.core.transformer import MegatronModule
from torch.utils.checkpoint import checkpoint

from megatron_rl.parallel import mcore_compat as mc
from megatron_rl.parallel import mcore_layers as ml
from megatron_rl.parallel.mcore_compat import AttnMaskType, core_attention_cp_group
from megatron_rl.parallel.packing import cp_partition_indices

MASK_ELEMENTS = 1 << 20
"""Most causal-mask entries (segments x queries x keys) one CP attention block builds (4 MiB in
fp32: small next to a long row's activations; CPU SDPA is no slower per query in small blocks)."""


class PackedCoreAttention(MegatronModule):
    """Causal attention per THD segment; drop-in for the local spec's ``core_attention``.

    Constructor arguments are those Megatron passes to any core-attention submodule; under CP
    the CP group is ``pg_collection.cp`` and ``cp_comm_type`` (which only Transformer Engine's
    ring choice reads) is ignored.
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
        self.cp_group = None
        if config.context_parallel_size > 1:
            self.cp_group = core_attention_cp_group(pg_collection)
            if self.cp_group is None:
                raise ValueError("PackedCoreAttention: context parallelism needs the CP group (pg_collection.cp)")
        self.window = None
        window = getattr(config, "window_size", None)
        if window and ml.is_layer_window_attention(window, getattr(config, "window_attn_skip_freq", None), layer_number):
            if window[1] != 0:
                raise ValueError(f"PackedCoreAttention: causal attention has no right window, got {window}")
            self.window = int(window[0])
        softmax_type = getattr(config, "softmax_type", "vanilla")
        if softmax_type not in ("vanilla", "learnable"):
            raise ValueError(f"PackedCoreAttention: softmax_type {softmax_type!r} is not supported")
        if softmax_type == "learnable":
            # One sink logit per local head (GPT-OSS), split over TP with the heads.
            self.tp_group = pg_collection.tp if pg_collection is not None else parallel_state.get_tensor_model_parallel_group()
            heads = config.num_attention_heads // self.tp_group.size()
            self.softmax_offset = torch.nn.Parameter(torch.empty(heads, dtype=config.params_dtype))
            for name, value in (("tensor_model_parallel", True), ("partition_dim", 0), ("partition_stride", 1)):
                setattr(self.softmax_offset, name, value)
            if config.perform_initialization:
                config.init_method(self.softmax_offset)
        else:
            self.softmax_offset = None
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout:
            raise ValueError(f"PackedCoreAttention: attention dropout {dropout} is not supported (RL uses 0)")
        # Megatron's DotProductAttention divides by the layer number for fp16 range and
        # multiplies back inside its softmax: the effective scale is this one.
        # MLA passes its own scale and its key/value widths (k_channels, v_channels); the
        # widths come with the tensors, so only the scale is kept.
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(config.kv_channels)
        self.layer_number = layer_number

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        """Megatron's own sharded state dict of the sink logits (``DotProductAttention``'s: split
        over TP on axis 0); nothing without them."""
        if self.softmax_offset is None:
            return super().sharded_state_dict(prefix, sharded_offsets, metadata)
        return mc.DotProductAttention.sharded_state_dict(self, prefix, sharded_offsets, metadata)

    def _attend(self, q_NHLD: torch.Tensor, k_NGSD: torch.Tensor, v_NGSD: torch.Tensor,
                positions_L: torch.Tensor | None = None) -> torch.Tensor:
        """``[N, H, L, Dv]``: queries at ``positions_L`` (default ``0..L-1``) over keys ``0..S-1``."""
        if self.window is None and self.softmax_offset is None and positions_L is None:
            return _causal_attention(q_NHLD, k_NGSD, v_NGSD, self.softmax_scale)
        return _windowed_attention(q_NHLD, k_NGSD, v_NGSD, self.softmax_scale, positions_L, self.window,
                                   self.softmax_offset)

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
            if self.cp_group is not None:
                raise ValueError("PackedCoreAttention: context parallelism needs THD packed_seq_params")
            # [s, b, H, D] -> [b, H, s, D]: each batch row is one causal sequence.
            out_BHSD = self._attend(query.permute(1, 2, 0, 3), key.permute(1, 2, 0, 3), value.permute(1, 2, 0, 3))
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
        if self.cp_group is not None:
            return self._context_parallel(query, key, value, cu_q.to(device="cpu", dtype=torch.int64))
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
            out_NHLD = self._attend(q_NHLD, k_NGLD, v_NGLD)
            out_THD[rows_NL.reshape(-1)] = out_NHLD.transpose(1, 2).reshape(-1, *out_THD.shape[1:])
        return out_THD.reshape(total, -1)


    def _context_parallel(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_padded: torch.Tensor
    ) -> torch.Tensor:
        """``[T_cp, H * Dv]`` attention of this CP rank's queries over the whole row's keys.

        ``query``/``key``/``value``: ``[T_cp, H|G, D|Dv]`` in the rank's local (zig-zag) order;
        ``cu_padded``: the row's padded segment boundaries (global).
        """
        cp_size, cp_rank = self.cp_group.size(), self.cp_group.rank()
        total, local = int(cu_padded[-1]), query.shape[0]
        if local * cp_size != total:
            raise ValueError(
                f"PackedCoreAttention: {local} local rows x CP {cp_size} != the row's {total} tokens "
                "(was the row not cut over the CP ranks?)"
            )
        every_rank = [cp_partition_indices(cu_padded, total, cp_size, r) for r in range(cp_size)]
        row_order = torch.argsort(torch.cat(every_rank)).to(query.device)
        key_T, value_T = (
            tensor_parallel.gather_from_sequence_parallel_region(
                t, tensor_parallel_output_grad=True, group=self.cp_group
            )[row_order]
            for t in (key, value)
        )
        out_THD = query.new_empty(local, query.shape[1], value.shape[2])
        starts, lengths = cu_padded[:-1], cu_padded.diff()
        for length in lengths.unique().tolist():
            chunk = length // (2 * cp_size)
            if chunk == 0:
                continue
            seg_starts = starts[lengths == length]
            # Segment s occupies local rows [cu[s] / CP, cu[s] / CP + 2 chunk): its chunk
            # cp_rank, then its chunk 2 CP - 1 - cp_rank.
            for half, chunk_index in ((0, cp_rank), (1, 2 * cp_size - 1 - cp_rank)):
                first_local_N = seg_starts // cp_size + half * chunk
                first_position = chunk_index * chunk
                block = max(1, min(chunk, MASK_ELEMENTS // (seg_starts.numel() * (first_position + chunk))))
                for offset in range(0, chunk, block):
                    width = min(block, chunk - offset)
                    rows_NB = (first_local_N[:, None] + offset + torch.arange(width)).to(query.device)
                    out_NBHD = checkpoint(
                        _attend_to_prefix, self, query, key_T, value_T, rows_NB, tuple(seg_starts.tolist()),
                        first_position + offset, use_reentrant=False,
                    )
                    out_THD[rows_NB.reshape(-1)] = out_NBHD.reshape(-1, *out_THD.shape[1:])
        return out_THD.reshape(local, -1)


def _attend_to_prefix(
    attention: PackedCoreAttention, query_THD: torch.Tensor, key_TGD: torch.Tensor, value_TGD: torch.Tensor,
    rows_NB: torch.Tensor, seg_starts: tuple[int, ...], first_position: int,
) -> torch.Tensor:
    """``[N, B, H, Dv]``: local queries ``rows_NB`` (at positions ``first_position ...`` of their
    segment) over the keys of their segment (starting at row ``seg_starts[n]``) up to their own
    position.

    Reads the shared ``[T_cp]`` queries and ``[T]`` keys and values here (a slice, no copy, for
    one segment), so that the checkpoint around it keeps no per-block copy alive.
    """
    device = query_THD.device
    visible = first_position + rows_NB.shape[1]
    positions_B = torch.arange(first_position, visible, device=device)
    scale = attention.softmax_scale
    # An additive mask in the query dtype keeps SDPA on its flash kernel (a bool mask is
    # converted on every call, ~3x slower on CPU); 0 and -inf mask exactly as a bool mask.
    hidden_BL = torch.arange(visible, device=device)[None, :] > positions_B[:, None]
    mask_BL = torch.zeros(hidden_BL.shape, dtype=query_THD.dtype, device=device).masked_fill_(hidden_BL, float("-inf"))
    if len(seg_starts) == 1:
        k_NLGD = key_TGD[seg_starts[0] : seg_starts[0] + visible][None]
        v_NLGD = value_TGD[seg_starts[0] : seg_starts[0] + visible][None]
    else:
        keys_NL = torch.tensor(seg_starts, device=device)[:, None] + torch.arange(visible, device=device)
        k_NLGD, v_NLGD = key_TGD[keys_NL], value_TGD[keys_NL]
    q_NHBD = query_THD[rows_NB].transpose(1, 2)
    if attention.window is not None or attention.softmax_offset is not None:
        out_NHBD = attention._attend(q_NHBD, k_NLGD.transpose(1, 2), v_NLGD.transpose(1, 2), positions_B)
        return out_NHBD.transpose(1, 2)
    out_NHBD = F.scaled_dot_product_attention(
        q_NHBD, k_NLGD.transpose(1, 2), v_NLGD.transpose(1, 2), attn_mask=mask_BL, scale=scale,
        enable_gqa=q_NHBD.shape[1] != k_NLGD.shape[2],  # grouped keys without a per-head copy
    )
    return out_NHBD.transpose(1, 2)


def _causal_attention(q_BHLD: torch.Tensor, k_BGLD: torch.Tensor, v_BGLD: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal SDPA with grouped-query heads expanded to the query heads (``[B, H, L, Dv]``)."""
    heads, groups = q_BHLD.shape[1], k_BGLD.shape[1]
    if heads != groups:
        k_BGLD = k_BGLD.repeat_interleave(heads // groups, dim=1)
        v_BGLD = v_BGLD.repeat_interleave(heads // groups, dim=1)
    return F.scaled_dot_product_attention(q_BHLD, k_BGLD, v_BGLD, is_causal=True, scale=scale)


def _windowed_attention(
    q_NHLD: torch.Tensor, k_NGSD: torch.Tensor, v_NGSD: torch.Tensor, scale: float,
    positions_L: torch.Tensor | None, window: int | None, sinks_H: torch.Tensor | None,
) -> torch.Tensor:
    """``[N, H, L, Dv]`` causal attention of queries at ``positions_L`` (default ``0..L-1``) over
    keys ``0..S-1``, each query seeing the ``window`` keys left of it (None: all) and a sink
    logit per head in its softmax that takes probability but adds no value (GPT-OSS's sinks,
    Megatron's learnable softmax offset), in fp32 at least, as transformers' eager GPT-OSS attention."""
    heads, groups = q_NHLD.shape[1], k_NGSD.shape[1]
    if heads != groups:
        k_NGSD = k_NGSD.repeat_interleave(heads // groups, dim=1)
        v_NGSD = v_NGSD.repeat_interleave(heads // groups, dim=1)
    device, length, keys = q_NHLD.device, q_NHLD.shape[2], k_NGSD.shape[2]
    positions_L = torch.arange(length, device=device) if positions_L is None else positions_L
    offset_LS = positions_L[:, None] - torch.arange(keys, device=device)[None, :]
    hidden_LS = offset_LS < 0
    if window is not None:
        hidden_LS |= offset_LS > window
    wide = torch.promote_types(q_NHLD.dtype, torch.float32)
    scores = (q_NHLD.to(wide) @ k_NGSD.to(wide).transpose(-1, -2)) * scale
    scores = scores.masked_fill(hidden_LS, float("-inf"))
    if sinks_H is not None:
        sink = sinks_H.to(wide)[None, :, None, None].expand(*scores.shape[:-1], 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    return (probs @ v_NGSD.to(wide)).to(q_NHLD.dtype)
