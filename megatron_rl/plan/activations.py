"""Bytes one training micro-batch keeps for its backward pass, layer by layer, and what a step
needs besides them for a moment (recomputed layers, logits, log-prob chunks, expert dispatch).

Owns the activation formulas of the planner. They count the tensors autograd saves in
Megatron-Core 0.16.1's *local* layer spec (what the CPU runs and what
``tools/bench_memory_plan.py`` measures), derived from what each op saves; the bytes each
decoder layer saves are compared with them exactly in ``tests/parallel/test_memory_plan_model.py``
(``torch.autograd.graph.saved_tensors_hooks``):

- RMSNorm (``torch.nn.RMSNorm``) on CPU, where torch runs it composite: an fp32 copy of its
  input (the input itself when it is fp32), the fp32 normalized input and an fp32 ``rstd`` per
  row: ``8 D + 4`` bytes per row of width D, whatever the parameter dtype. On a GPU target
  (``RankShape.fused_norm``) torch runs its fused kernel instead (``_fused_rms_norm``: a CUDA
  kernel in ``native_functions.yaml``, so autograd's own node, whose backward reads ``input``,
  ``result1`` = rstd and ``weight`` in ``derivatives.yaml``), as Transformer Engine's RMSNorm
  does: the input itself (the whole tensor it is a view of) and the fp32 ``rstd``, ``B D + 4``
  bytes per row. Zero-centred norms (``norm_zero_centered``) compute in fp32 around an
  un-weighted call and keep ``8 D + 4`` on both.
- A linear layer: its input (under sequence parallelism the local shard; the all-gather is
  redone in backward).
- Attention (:class:`~megatron_rl.parallel.packed_attention.PackedCoreAttention`): the
  gathered queries, keys and values expanded to the query heads, the output and an fp32
  log-sum-exp per head: a flash kernel's, linear in the tokens. q/k norms save the q copy
  and, in fp32, the whole fused ``qkv`` output that ``k`` is a view of. RoPE keeps cos and
  sin for q and k in the activation dtype.
- SwiGLU MLPs: ``fc1``'s output (2F), SiLU's output (F), the gated product (F), the
  probability-weighted product on experts (F) and ``fc2``'s input (F); a gated shared
  expert also keeps its output and its sigmoid gate.
- MoE: the router's input, its top-K ids (int64) and probabilities, the ``[E, N]`` routing
  map and probabilities, the permutation indices, and on the expert side the rows this rank
  receives (``N K`` of its N tokens when routing is balanced, times ETP).

Transformer Engine's fused kernels save less than this (a bf16 input and ``rstd`` per norm,
keys and values not expanded to the query heads), so on a TE GPU these figures are an upper
bound. Multi-latent attention is modelled with a flash kernel's memory (TE's); on the local
spec on CPU, PyTorch runs it through the math kernel, which is quadratic in the segment
length, so it is not among the CPU-validated configurations.

Recompute (``train.recompute``, Megatron's ``recompute_granularity``):
``selective`` checkpoints each MoE block (``recompute_modules=["moe"]``: router, dispatch,
experts, shared expert): it keeps only its input, and one block is recomputed at a time in backward;
``full`` checkpoints every layer (uniform, one layer per checkpoint): each keeps its input
only, and one layer's activations exist again while it is recomputed.

Shape legend: T tokens of one micro-batch row, T_s its sequence-parallel shard (T / TP),
H hidden, V padded vocabulary, E experts, K top-K, F expert width. Pure arithmetic.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from megatron_rl.parallel.optimizer_memory import DTYPE_BYTES
from megatron_rl.sections import ModelConfig

Recompute = Literal["none", "selective", "full"]


@dataclass(frozen=True)
class RankShape:
    """The sizes one rank's activation formulas read."""

    tokens: int
    """T: tokens of one micro-batch row (the token budget)."""
    tp: int
    """Tensor-parallel size (heads, vocabulary and dense MLPs split over it)."""
    sequence_parallel: bool
    """Whether norms, routers and residuals hold only T / TP rows."""
    etp: int
    """Expert tensor-parallel size."""
    dtype_bytes: int
    """Bytes per element of the parameters and activations."""
    fused_norm: bool = False
    """Norms keep only their input and rstd (torch's fused RMSNorm on CUDA, or Transformer
    Engine's: a GPU target); False: torch's composite RMSNorm (a CPU target)."""

    @property
    def shard_tokens(self) -> int:
        """T_s: rows of the residual stream on this rank."""
        return self.tokens // self.tp if self.sequence_parallel else self.tokens


def _norm(m: ModelConfig, s: RankShape, rows: int, width: int, kept: int | None = None) -> int:
    """An RMSNorm's saved bytes over ``rows`` rows of ``width``: composite, an fp32 input copy
    (the input itself in fp32: ``kept`` elements per row when it is a view of a wider tensor),
    the fp32 normalized input and the fp32 rstd; fused, its input (``kept`` per row) and the rstd."""
    kept = width if kept is None else kept
    if s.fused_norm and not m.norm_zero_centered:
        return rows * (s.dtype_bytes * kept + 4)
    return rows * (4 * (kept if s.dtype_bytes == 4 else width) + 4 * width + 4)


def _swiglu(rows: int, width: int, b: int, weighted: bool) -> int:
    """fc1 output (2F), SiLU output, gated product, [probability-weighted product], fc2 input."""
    return b * rows * width * (6 if weighted else 5)


def attention_bytes(m: ModelConfig, s: RankShape) -> int:
    """One layer's attention block (input norm included) for one micro-batch."""
    t, ts, b, h = s.tokens, s.shard_tokens, s.dtype_bytes, m.hidden_size
    heads = m.num_attention_heads // s.tp
    saved = _norm(m, s, ts, h)
    if m.multi_latent_attention:
        return saved + _mla_bytes(m, s, heads)
    groups, hd = m.num_query_groups // s.tp, m.head_dim
    saved += b * ts * h  # linear_qkv's input
    if m.qk_layernorm:
        # q is a copy; k a view of the fused qkv output, which an fp32 or fused norm keeps whole.
        qkv_per_group = (heads // groups + 2) * hd
        saved += _norm(m, s, t * heads, hd) + _norm(m, s, t * groups, hd, kept=qkv_per_group)
    saved += 4 * b * t * int(hd * m.rotary_percent)  # cos and sin for q and k, in the activation dtype
    return saved + core_attention_bytes(m, s) + b * t * heads * hd  # + linear_proj's input


def core_attention_bytes(m: ModelConfig, s: RankShape) -> int:
    """Core attention alone: q, keys and values expanded to the query heads, output, fp32
    log-sum-exp, and the int64 row index of the packed segments."""
    t, b = s.tokens, s.dtype_bytes
    heads = m.num_attention_heads // s.tp
    if m.multi_latent_attention:
        qk = m.qk_nope_head_dim + m.qk_rope_head_dim
        return b * t * heads * (2 * qk + 2 * m.v_head_dim) + 4 * t * heads
    return b * t * heads * m.head_dim * 4 + 4 * t * heads + 8 * t


def _mla_bytes(m: ModelConfig, s: RankShape, heads: int) -> int:
    """Multi-latent attention after the input norm: latent norms, projections' inputs, RoPE, core."""
    t, ts, b, h = s.tokens, s.shard_tokens, s.dtype_bytes, m.hidden_size
    saved = b * ts * h  # the down projections' input
    if m.q_lora_rank is not None:
        saved += _norm(m, s, t, m.q_lora_rank) + b * t * m.q_lora_rank
    # The latent is a view of the down projection's output, which an fp32 or fused norm keeps whole.
    saved += _norm(m, s, t, m.kv_lora_rank, kept=m.kv_lora_rank + m.qk_rope_head_dim) + b * t * m.kv_lora_rank
    saved += 4 * b * t * m.qk_rope_head_dim
    return saved + core_attention_bytes(m, s) + b * t * heads * m.v_head_dim


def dense_mlp_bytes(m: ModelConfig, s: RankShape) -> int:
    """One dense layer's MLP block (pre-MLP norm included)."""
    ts, b = s.shard_tokens, s.dtype_bytes
    return _norm(m, s, ts, m.hidden_size) + b * ts * m.hidden_size + _swiglu(s.tokens, m.ffn_hidden_size // s.tp, b, False)


def expert_rows(m: ModelConfig, s: RankShape) -> int:
    """Token rows this rank's experts receive under balanced routing: its N tokens times K,
    gathered over ETP (the busiest rank of an EP group gets a few percent more)."""
    return s.shard_tokens * m.moe_router_topk * s.etp


def moe_bytes(m: ModelConfig, s: RankShape, recompute_moe: bool = False) -> int:
    """One MoE layer's block (pre-MLP norm included)."""
    ts, b, h = s.shard_tokens, s.dtype_bytes, m.hidden_size
    saved = _norm(m, s, ts, h) + b * ts * h  # the norm, and its output (the router's and experts' input)
    if recompute_moe:
        return saved
    return saved + moe_block_bytes(m, s)


def moe_block_bytes(m: ModelConfig, s: RankShape) -> int:
    """What the MoE block keeps besides its input: router, permutation, experts, shared expert."""
    ts, b, h, e, k = s.shard_tokens, s.dtype_bytes, m.hidden_size, m.num_experts, m.moe_router_topk
    scores = 12 * k + (9 * e if m.moe_router_score_function == "sigmoid" else 0)
    saved = ts * scores + ts * (5 * e + 8 * k)  # router; routing map, probabilities, permutation
    rows = expert_rows(m, s)
    saved += b * rows * h + 4 * rows + _swiglu(rows, m.moe_ffn_hidden_size // s.etp, b, True)
    if m.moe_shared_expert_intermediate_size:
        saved += _swiglu(s.tokens, m.moe_shared_expert_intermediate_size // s.tp, b, False)
        if m.moe_shared_expert_gate:
            saved += b * ts * (h + 1)  # the shared expert's output and its sigmoid gate, multiplied
    return saved


def layer_bytes(m: ModelConfig, s: RankShape, layer: int, recompute: Recompute = "none") -> int:
    """Saved bytes of global layer ``layer`` (0-based) for one micro-batch under ``recompute``."""
    if recompute == "full":
        return s.dtype_bytes * s.shard_tokens * m.hidden_size  # the checkpointed layer's input
    saved = attention_bytes(m, s)
    if layer < m.num_dense_layers:
        return saved + dense_mlp_bytes(m, s)
    return saved + moe_bytes(m, s, recompute_moe=recompute == "selective")


def recompute_transient_bytes(m: ModelConfig, s: RankShape, layers: range, recompute: Recompute) -> int:
    """The most a recomputed piece adds back at once during backward (0 without recompute)."""
    if recompute == "none":
        return 0
    if recompute == "full":
        return max(layer_bytes(m, s, i) for i in layers)
    return moe_block_bytes(m, s) if any(i >= m.num_dense_layers for i in layers) else 0


def head_bytes(m: ModelConfig, s: RankShape) -> int:
    """The last stage's final norm and output layer input."""
    return _norm(m, s, s.shard_tokens, m.hidden_size) + s.dtype_bytes * s.shard_tokens * m.hidden_size


def logits_bytes(m: ModelConfig, s: RankShape, response_tokens: int) -> int:
    """The output layer's logits ``[T, V/TP]`` (or their gradient) and the copy of the response
    rows the log-prob function keeps, in the parameter dtype."""
    v_local = m.padded_vocab_size // s.tp
    return s.dtype_bytes * v_local * (s.tokens + response_tokens)


def logprob_chunk_bytes(m: ModelConfig, s: RankShape, chunk_tokens: int) -> int:
    """The vocab-parallel log-prob's two fp32 ``[C, V/TP]`` buffers
    (``megatron_rl.parallel.vocab_parallel``)."""
    return 2 * 4 * min(chunk_tokens, s.tokens) * (m.padded_vocab_size // s.tp)


def dispatch_bytes(m: ModelConfig, s: RankShape) -> int:
    """Expert dispatch buffers of one MoE layer in flight: the permuted rows sent and the rows
    received (all-to-all or all-gather), and the combined output on the way back."""
    rows = expert_rows(m, s)
    return s.dtype_bytes * m.hidden_size * (2 * rows + s.shard_tokens)
