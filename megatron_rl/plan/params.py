"""Parameter counts of the Megatron model a ``ModelConfig`` builds: whole, active per token, and per rank.

Owns: the count of every parameter tensor ``megatron_rl.parallel.model.build_model`` creates
(Megatron's GPTModel with the local or the Transformer Engine spec: both hold the same
tensors, TE fuses the input norm into ``linear_qkv`` but keeps its weight), layer by layer,
split into what a tensor-parallel group replicates and what it splits, so that the count on
one rank of any TP/EP/ETP/PP layout follows. Checked against the real model built on CPU in
``tests/parallel/test_memory_plan_params.py``. Pure integer arithmetic over the config
sections: no torch, no Megatron.

Per layer (H hidden, V padded vocabulary, E experts, F expert width, K top-K):

- attention, grouped-query: ``linear_qkv`` ``[(heads + 2 groups) * head_dim, H]`` (+ ``heads *
  head_dim`` output-gate rows, Qwen3-Next; + its bias with ``add_qkv_bias`` / ``add_bias_linear``),
  ``linear_proj`` ``[H, heads * head_dim]`` and the sink logits ``[heads]`` (GPT-OSS), split over
  TP; the input norm ``[H]``, the q/k norms ``[head_dim]`` each and ``linear_proj``'s bias ``[H]``
  are replicated.
- a Gated DeltaNet (linear_attention layers): :func:`gated_delta_net_params`.
- attention, multi-latent: the down projections (``linear_q_down_proj``
  ``[q_lora_rank, H]``, ``linear_kv_down_proj`` ``[kv_lora_rank + rope_dim, H]``) and the latent
  norms are replicated (``parallel.families.replicated_mla_down_projections``; TE's spec
  duplicates them too); the up projections and ``linear_proj`` are split over TP.
- dense MLP: ``linear_fc1`` ``[2 F_dense, H]`` and ``linear_fc2`` ``[H, F_dense]`` split over TP.
- MoE: the router ``[E, H]`` (+ its bias ``[E]``; replicated; the expert bias is a buffer, not
  a parameter), the shared expert (split over TP like a dense MLP; its gate ``[1, H]``
  replicated), and E experts of ``3 H F`` each (+ ``2 F + H`` of biases, GPT-OSS), E/EP of them
  on a rank, each split over ETP.
- the embedding ``[V, H]`` on the first stage, the final norm ``[H]`` and the output layer
  ``[V, H]`` on the last stage (tied embeddings: the last stage holds the output weight only
  with PP > 1, where Megatron keeps a copy there).

Layers are split evenly over pipeline stages (Megatron's default, which the ``parallel``
section requires); dense first layers sit on the first stages.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_rl.sections import ModelConfig, ParallelConfig


@dataclass(frozen=True)
class Split:
    """Parameters of one module: those every TP rank holds whole, and those split over TP."""

    replicated: int = 0
    """Held whole by every TP rank (norms, routers, MLA down projections)."""
    split: int = 0
    """Split evenly over the TP ranks (the ``parallel`` section checks TP divides each)."""

    def __add__(self, other: "Split") -> "Split":
        return Split(self.replicated + other.replicated, self.split + other.split)

    def on_rank(self, tp: int) -> int:
        """Parameters one of ``tp`` ranks holds."""
        return self.replicated + self.split // tp

    @property
    def total(self) -> int:
        """Parameters of the whole module."""
        return self.replicated + self.split


def gated_delta_net_params(m: ModelConfig) -> Split:
    """One linear_attention layer's Gated DeltaNet, its input norm included: ``in_proj``
    ``[2 qk + 2 v + 2 Hv, H]``, the depthwise ``conv1d`` ``[2 qk + v, 1, K]``, ``A_log`` and
    ``dt_bias`` ``[Hv]`` and ``out_proj`` ``[H, v]`` split over TP (by heads); the input norm
    ``[H]`` and the output norm ``[Dv]`` (shared by the heads) replicated."""
    h = m.hidden_size
    qk = m.linear_num_key_heads * m.linear_key_head_dim
    v = m.linear_num_value_heads * m.linear_value_head_dim
    heads = m.linear_num_value_heads
    split = (2 * qk + 2 * v + 2 * heads) * h + (2 * qk + v) * m.linear_conv_kernel_dim + 2 * heads + h * v
    return Split(h + m.linear_value_head_dim, split)


def attention_params(m: ModelConfig, layer: int = 0) -> Split:
    """Layer ``layer``'s attention block (a Gated DeltaNet on linear_attention layers), its input
    norm included; the output gate's rows (Qwen3-Next), biases and sinks (GPT-OSS) counted."""
    if m.mixer_types[layer] == "linear_attention":
        return gated_delta_net_params(m)
    h = m.hidden_size
    if m.multi_latent_attention:
        heads = m.num_attention_heads
        qk = m.qk_nope_head_dim + m.qk_rope_head_dim
        replicated = h + (m.kv_lora_rank + m.qk_rope_head_dim) * h + m.kv_lora_rank
        if m.q_lora_rank is None:
            split = heads * qk * h
        else:
            replicated += m.q_lora_rank * h + m.q_lora_rank
            split = heads * qk * m.q_lora_rank
        split += heads * (m.qk_nope_head_dim + m.v_head_dim) * m.kv_lora_rank + h * heads * m.v_head_dim
        return Split(replicated, split)
    gate = m.num_attention_heads if m.attention_output_gate else 0
    qkv_rows = (m.num_attention_heads + gate + 2 * m.num_query_groups) * m.head_dim
    split = qkv_rows * h + h * m.num_attention_heads * m.head_dim
    split += (qkv_rows if m.add_qkv_bias or m.add_bias_linear else 0) + (m.num_attention_heads if m.attention_sinks else 0)
    # linear_proj's bias is added after the TP reduction: every rank holds it whole.
    replicated = h + (2 * m.head_dim if m.qk_layernorm else 0) + (h if m.add_bias_linear else 0)
    return Split(replicated, split)


def dense_mlp_params(m: ModelConfig) -> Split:
    """One dense layer's MLP (SwiGLU of width ``ffn_hidden_size``), its pre-MLP norm included."""
    return Split(m.hidden_size, 3 * m.hidden_size * m.ffn_hidden_size)


def moe_dense_params(m: ModelConfig) -> Split:
    """What an MoE layer holds besides its routed experts: pre-MLP norm, router, shared expert."""
    h, shared = m.hidden_size, m.moe_shared_expert_intermediate_size
    replicated = h + m.num_experts * h + (h if m.moe_shared_expert_gate else 0)
    replicated += m.num_experts if m.add_bias_linear else 0  # the router's bias
    return Split(replicated, 3 * h * shared)


def expert_params(m: ModelConfig) -> int:
    """One routed expert (SwiGLU of width ``moe_ffn_hidden_size``, with GPT-OSS's biases)."""
    biases = 2 * m.moe_ffn_hidden_size + m.hidden_size if m.add_bias_linear else 0
    return 3 * m.hidden_size * m.moe_ffn_hidden_size + biases


def embedding_params(m: ModelConfig) -> Split:
    """The input embedding (padded vocabulary rows, split over TP)."""
    return Split(0, m.padded_vocab_size * m.hidden_size)


def head_params(m: ModelConfig, pp: int) -> Split:
    """The last stage's final norm and output layer."""
    holds_output = m.untie_embeddings_and_output_weights or pp > 1
    return Split(m.hidden_size, m.padded_vocab_size * m.hidden_size if holds_output else 0)


def stage_layers(m: ModelConfig, pp: int, stage: int) -> range:
    """Global 0-based indices of the layers pipeline stage ``stage`` holds."""
    per_stage = m.num_layers // pp
    return range(stage * per_stage, (stage + 1) * per_stage)


@dataclass(frozen=True)
class RankParams:
    """Parameters one rank holds, by the data-parallel group that shards their optimizer state."""

    dense: int
    """Reduced over the dense data-parallel group (everything but routed experts, and routed
    experts too when EP is 1: Megatron treats them as dense then)."""
    expert: int
    """Routed experts with EP > 1, reduced over the expert data-parallel group."""

    @property
    def total(self) -> int:
        """Everything this rank holds."""
        return self.dense + self.expert


def rank_params(m: ModelConfig, p: ParallelConfig, stage: int) -> RankParams:
    """Parameters of one rank of pipeline stage ``stage`` under layout ``p`` (equal on every rank of a stage)."""
    tp, pp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size
    ep, etp = p.expert_model_parallel_size, p.expert_tensor_parallel_size
    dense = Split()
    routed = 0
    for layer in stage_layers(m, pp, stage):
        dense = dense + attention_params(m, layer)
        if layer < m.num_dense_layers:
            dense = dense + dense_mlp_params(m)
        else:
            dense = dense + moe_dense_params(m)
            routed += (m.num_experts // ep) * expert_params(m) // etp
    if stage == 0:
        dense = dense + embedding_params(m)
    if stage == pp - 1:
        dense = dense + head_params(m, pp)
    # Megatron marks expert parameters allreduce=False only with EP > 1
    # (transformer/moe/experts.py:203-204); otherwise they join the dense buffers.
    if ep > 1:
        return RankParams(dense=dense.on_rank(tp), expert=routed)
    return RankParams(dense=dense.on_rank(tp) + routed, expert=0)


@dataclass(frozen=True)
class ModelParams:
    """Whole-model counts, as model cards quote them."""

    total: int
    """Every parameter (the model's size)."""
    active: int
    """Parameters one token passes through: all but the routed experts it is not sent to."""
    routed_experts: int
    """The routed experts' share of ``total``."""


def model_params(m: ModelConfig) -> ModelParams:
    """Total and active parameters of the whole model (one pipeline stage, no parallelism)."""
    one_stage = ParallelConfig()
    total = rank_params(m, one_stage, 0).total
    moe_layers = len(m.moe_layers)
    routed = moe_layers * m.num_experts * expert_params(m)
    idle = moe_layers * (m.num_experts - m.moe_router_topk) * expert_params(m)
    return ModelParams(total=total, active=total - idle, routed_experts=routed)
