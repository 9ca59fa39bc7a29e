"""Gated DeltaNet layers (Qwen3-Next, Qwen3.5) over THD-packed rows, on any device.

Shape legend: T tokens of the (sequence-gathered) packed row, n segments of one length, L that
length, C convolution channels of this TP rank (q, k and v), Hk / Hv key / value heads of
this TP rank, Dk / Dv their channels.

:class:`PackedGatedDeltaNet` is Megatron-Core's ``GatedDeltaNet`` (its parameters, their
initialization and TP split, its sharded checkpoint with ``in_proj`` cut into q, k, v, z,
beta, alpha) with another forward. Megatron's own forward cannot run here: 0.16.1 raises for
packed sequences (``NotImplementedError("GDN does not support packed sequence")``) and both
0.16.1 and 0.19.2 reach FLA's Triton kernels for them (0.19.2's torch path asserts
``cu_seqlens is None``). This forward runs every segment of the packed row alone, as a
sequence of its own: the causal depthwise convolution with zero history, the L2-normalized
queries and keys, and Megatron's torch implementation of the chunked gated delta rule
(``torch_chunk_gated_delta_rule``) with a zero initial state; segments that fill as many of
its 64-token chunks run as one batch, each padded at its end. A segment's output is a function of that segment alone. Then the gated output
norm (RMSNorm times ``silu(z)``) and the output projection, as Megatron computes them.

Parallelism: TP splits the heads (each rank's ``in_proj`` shard is its q, k, v, z, beta and
alpha heads, which Megatron's sharded checkpoint and :func:`section_shard` lay out); under
sequence parallelism ``in_proj`` gathers the sequence and ``out_proj`` scatters it. Context
parallelism is refused before any process starts (``sections.parallel``). Does not own the
layer spec's placement of these layers (``parallel.model``) or the HF weight layout
(``checkpoint.families_qwen_next``).
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.transformer import ModuleSpec

from megatron_rl.parallel import mcore_layers as ml

CHUNK = 64
"""Chunk length of Megatron's ``torch_chunk_gated_delta_rule`` (its default)."""


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum x^2 + eps)`` over the last axis (FLA's and transformers' ``l2norm``)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def segment_starts_lengths(packed_seq_params, total: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(starts, lengths)`` of the packed row's segments (padded boundaries when given), on the CPU."""
    if packed_seq_params is None:
        return torch.zeros(1, dtype=torch.int64), torch.tensor([total])
    cu = packed_seq_params.cu_seqlens_q_padded
    cu = packed_seq_params.cu_seqlens_q if cu is None else cu
    cu = cu.to(device="cpu", dtype=torch.int64)
    if int(cu[-1]) != total:
        raise ValueError(f"PackedGatedDeltaNet: segments cover {int(cu[-1])} tokens, the row has {total}")
    return cu[:-1], cu.diff()


class PackedGatedDeltaNet(ml.GatedDeltaNet):
    """Megatron's ``GatedDeltaNet`` whose forward takes THD-packed rows (see the module docstring).

    Construction is Megatron's (with FLA's absence allowed: ``mcore_layers.
    gated_delta_net_without_fla``); keyword arguments its version does not take (0.19.2 adds
    ``name`` and ``cp_comm_type``) are dropped.
    """

    def __init__(self, config, submodules, layer_number: int | None = None, **kwargs) -> None:
        accepted = inspect.signature(ml.GatedDeltaNet.__init__).parameters
        kwargs = {k: v for k, v in kwargs.items() if k in accepted}
        with ml.gated_delta_net_without_fla():
            super().__init__(config, submodules, layer_number=layer_number, **kwargs)
        tp = config.tensor_model_parallel_size
        qk, v, heads = self.qk_dim, self.v_dim, self.num_value_heads
        # The whole tensors' sections, each split over TP (read by the weight-sync gather).
        self.in_proj.weight.tp_sections = (qk, qk, v, v, heads, heads)
        self.conv1d.weight.tp_sections = (qk, qk, v)
        self.local_sizes = (qk // tp, qk // tp, v // tp, v // tp, heads // tp, heads // tp)

    def _setup_variant_attrs(self) -> None:
        # 0.19.2 picks its kernel here and insists on one; FLA's is None without FLA.
        super()._setup_variant_attrs()
        self.gated_delta_rule = ml.torch_chunk_gated_delta_rule

    def forward(self, hidden_states: torch.Tensor, attention_mask=None, *args, packed_seq_params=None, **kwargs):
        """``(output [s, b, H], bias)`` of hidden states ``[s, b, H]`` (s local under SP).

        With ``packed_seq_params`` (THD) the batch is one row of segments; without, every
        batch row is one sequence.
        """
        if kwargs.get("inference_context") is not None or kwargs.get("inference_params") is not None:
            raise NotImplementedError("PackedGatedDeltaNet: Megatron inference contexts are not supported")
        mixed_TBD, _ = self.in_proj(hidden_states)
        if packed_seq_params is not None and mixed_TBD.shape[1] != 1:
            raise ValueError(f"PackedGatedDeltaNet: a THD row has batch 1, got {mixed_TBD.shape[1]}")
        rows = [mixed_TBD[:, b] for b in range(mixed_TBD.shape[1])]
        core = [self._mix_row(row, packed_seq_params) for row in rows]
        out_TBD = torch.stack(core, dim=1)
        return self.out_proj(out_TBD)

    def _mix_row(self, mixed_TD: torch.Tensor, packed_seq_params) -> torch.Tensor:
        """``[T, Hv * Dv]``: the gated-norm output of one packed row's projected inputs."""
        qk, _, v, _, heads, _ = self.local_sizes
        qkv_TC, z_TV, b_TH, a_TH = mixed_TD.split([2 * qk + v, v, heads, heads], dim=-1)
        total = mixed_TD.shape[0]
        out_THD = mixed_TD.new_empty(total, heads, self.value_head_dim)
        starts, lengths = segment_starts_lengths(packed_seq_params, total, mixed_TD.device)
        # Segments that fill the same number of the rule's chunks run as one batch, each padded at
        # its end to the longest: the rule pads to whole chunks anyway, and nothing is causal
        # backwards, so a segment's own positions see only themselves and what came before.
        chunks = (lengths + CHUNK - 1) // CHUNK
        for count in chunks[lengths > 0].unique().tolist():
            group = (chunks == count) & (lengths > 0)
            longest = int(lengths[group].max())
            positions_L = torch.arange(longest)
            real_NL = positions_L[None] < lengths[group][:, None]
            # Padding rows point at the segment's first token; their outputs are dropped.
            rows_NL = starts[group][:, None] + torch.where(real_NL, positions_L[None], 0)
            real_NL, rows_NL = real_NL.to(mixed_TD.device), rows_NL.to(mixed_TD.device)
            zero = real_NL[..., None].to(mixed_TD.dtype)
            out_NLHD = self._segments(qkv_TC[rows_NL] * zero, b_TH[rows_NL], a_TH[rows_NL])
            out_THD[rows_NL[real_NL]] = out_NLHD[real_NL]
        # Gated RMSNorm per value head: norm(x) * silu(z), as Megatron's _apply_gated_norm.
        normed = self.out_norm(out_THD.reshape(-1, self.value_head_dim))
        gate = z_TV.reshape(-1, self.value_head_dim)
        return (normed * self.act_fn(gate.float())).to(out_THD.dtype).reshape(total, -1)

    def _segments(self, qkv_NLC: torch.Tensor, b_NLH: torch.Tensor, a_NLH: torch.Tensor) -> torch.Tensor:
        """``[n, L, Hv, Dv]`` delta-rule outputs of n segments, each from its start, padded at its end to L."""
        qk, _, v, _, _, _ = self.local_sizes
        length = qkv_NLC.shape[1]
        # Causal depthwise convolution from a zero history (the module pads K - 1 both sides).
        conv_NCL = self.conv1d(qkv_NLC.transpose(1, 2))[..., :length]
        qkv_NLC = self.act_fn(conv_NCL).transpose(1, 2)
        q_NLC, k_NLC, v_NLC = qkv_NLC.split([qk, qk, v], dim=-1)
        n = qkv_NLC.shape[0]
        query = l2norm(q_NLC.reshape(n, length, -1, self.key_head_dim))
        key = l2norm(k_NLC.reshape(n, length, -1, self.key_head_dim))
        value = v_NLC.reshape(n, length, -1, self.value_head_dim)
        repeat = self.num_value_heads // self.num_key_heads
        if repeat > 1:
            query = query.repeat_interleave(repeat, dim=2)
            key = key.repeat_interleave(repeat, dim=2)
        g = -self.A_log.float().exp() * F.softplus(a_NLH.float() + self.dt_bias)
        beta = b_NLH.sigmoid()
        out, _ = ml.torch_chunk_gated_delta_rule(
            query.contiguous(), key.contiguous(), value.contiguous(), g=g, beta=beta,
            initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=False,
        )
        return out


def gated_delta_net_spec(out_norm: type) -> ModuleSpec:
    """The self-attention spec of a linear_attention layer: Megatron's local column- and
    row-parallel linears around :class:`PackedGatedDeltaNet`, ``out_norm`` a plain RMSNorm."""
    return ModuleSpec(
        module=PackedGatedDeltaNet,
        submodules=ml.GatedDeltaNetSubmodules(
            in_proj=tensor_parallel.ColumnParallelLinear,
            out_norm=out_norm,
            out_proj=tensor_parallel.RowParallelLinear,
        ),
    )
