"""The ``model`` section: the MoE decoder's architecture, and its own consistency rules.

A leaf: imports nothing of ours but the config mechanics, so every owner (parallel model
building, checkpoint tables, rollout replicas) can import it without reaching the run's
composition (``megatron_rl.config``). Layout rules (what TP or PP must divide) live with the
``parallel`` section. :func:`check_family_fields` holds the rules of the fields that
DeepSeek-V3, GLM-4.5 and Qwen2-MoE add (MLA, YaRN, dense first layers, shared experts,
expert bias, group-limited routing, partial rotary, QKV biases), :func:`check_mixer_fields`
those GPT-OSS and Qwen3-Next / Qwen3.5 add (layer types, sliding windows, sinks, biases, the
clamped GLU, output gates, zero-centred norms, Gated DeltaNet sizes).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from megatron_rl.config_loading import require


@dataclass(kw_only=True)
class ModelConfig:
    """A MoE decoder: RMSNorm, RoPE, SwiGLU experts; by default Qwen3-MoE-style (GQA with
    QK-norm, softmax router, every layer MoE, no biases). The fields past ``qk_layernorm``
    add what DeepSeek-V3, GLM-4.5, Qwen2-MoE, GPT-OSS and Qwen3-Next / Qwen3.5 need; each maps
    onto Megatron-Core's own ``TransformerConfig`` field or layer spec (``megatron_rl.parallel.model``)."""

    vocab_size: int = 256
    """Vocabulary size V (the HF config's): token ids in [0, V); padding rows are never ids."""
    vocab_padding_multiple: int = 1
    """Megatron's vocabulary is V rounded up to a multiple of this (1: no padding); TP must divide it."""
    hidden_size: int = 64
    """Model width H."""
    num_layers: int = 4
    """Number of transformer layers (MoE layers, after the first ``num_dense_layers``)."""
    num_attention_heads: int = 4
    """Query heads."""
    num_query_groups: int = 2
    """Key/value heads (grouped-query attention)."""
    head_dim: int = 16
    """Channels per attention head (kv_channels in Megatron)."""
    num_experts: int = 8
    """Routed experts E per MoE layer."""
    moe_router_topk: int = 2
    """Experts K each token is routed to."""
    moe_ffn_hidden_size: int = 32
    """Hidden size of one expert's SwiGLU MLP."""
    moe_router_score_function: Literal["softmax", "sigmoid"] = "softmax"
    """Score function over all experts (Qwen3/Mixtral: softmax; DeepSeek-V3: sigmoid)."""
    moe_router_pre_softmax: bool = False
    """Softmax over all experts before top-K (un-normalized gates); False renormalizes top-K."""
    moe_aux_loss_coeff: float = 0.0
    """Load-balancing auxiliary loss coefficient (0 disables it, usual for RL)."""
    max_position_embeddings: int = 512
    """Longest sequence the model accepts."""
    rotary_base: float = 1_000_000.0
    """RoPE base frequency."""
    norm_epsilon: float = 1e-6
    """RMSNorm epsilon."""
    init_method_std: float = 0.02
    """Standard deviation of the normal weight initialization."""
    params_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Parameter dtype."""
    untie_embeddings_and_output_weights: bool = True
    """Separate output layer (Qwen3-MoE) instead of reusing the input embedding."""
    qk_layernorm: bool = True
    """Per-head RMSNorm on queries and keys before RoPE (Qwen3-MoE: true; Mixtral: false)."""
    add_qkv_bias: bool = False
    """Biases on the Q, K and V projections (Qwen2-MoE, GLM-4.5); the output projection has none."""
    rotary_percent: float = 1.0
    """Fraction of each head's channels that RoPE rotates (GLM-4.5: 0.5, the rest pass through)."""
    multi_latent_attention: bool = False
    """DeepSeek-V3 multi-latent attention (MLA) instead of grouped-query attention."""
    q_lora_rank: int | None = None
    """MLA: rank of the query down-projection (None: queries are projected directly)."""
    kv_lora_rank: int = 0
    """MLA: rank of the compressed key/value latent."""
    qk_nope_head_dim: int = 0
    """MLA: per-head query/key channels without RoPE."""
    qk_rope_head_dim: int = 0
    """MLA: per-head query/key channels with RoPE (the key part is shared by all heads)."""
    v_head_dim: int = 0
    """MLA: per-head value channels."""
    rope_scaling: Literal["none", "yarn"] = "none"
    """RoPE frequency scaling: none, or YaRN (MLA only, DeepSeek-V3's long-context RoPE)."""
    yarn_factor: float = 1.0
    """YaRN: context extension factor."""
    yarn_original_max_position_embeddings: int = 4096
    """YaRN: context length the model was pre-trained with before extension."""
    yarn_beta_fast: float = 32.0
    """YaRN: high-frequency boundary of the ramp (rotations per context)."""
    yarn_beta_slow: float = 1.0
    """YaRN: low-frequency boundary of the ramp."""
    yarn_mscale: float = 1.0
    """YaRN: magnitude-scale coefficient of cos/sin."""
    yarn_mscale_all_dim: float = 0.0
    """YaRN: magnitude-scale coefficient of the softmax scale and divisor of cos/sin's (0: off)."""
    num_dense_layers: int = 0
    """The first this many layers have a dense SwiGLU MLP instead of an MoE (DeepSeek-V3: 3)."""
    ffn_hidden_size: int = 0
    """Hidden size of the dense layers' MLP (used only when ``num_dense_layers`` > 0)."""
    moe_shared_expert_intermediate_size: int = 0
    """Hidden size of the shared expert every token also goes through (0: none)."""
    moe_shared_expert_gate: bool = False
    """Scale the shared expert's output by a learned per-token sigmoid gate (Qwen2-MoE)."""
    moe_router_enable_expert_bias: bool = False
    """Per-expert bias added to the sigmoid scores for selection only (aux-loss-free balancing);
    it is frozen during RL (never updated), so every policy selects with the same bias."""
    moe_router_num_groups: int = 0
    """Group-limited routing: experts split into this many groups (0: off)."""
    moe_router_group_topk: int = 0
    """Group-limited routing: groups each token may use (scored by the sum of their top
    ``K / group_topk`` selection scores)."""
    moe_router_topk_scaling_factor: float = 1.0
    """Routed scaling factor multiplying the top-K gate weights (DeepSeek-V3: 2.5)."""
    yarn_truncate: bool = True
    """YaRN: round the correction range to whole dimensions (transformers' ``truncate``; GPT-OSS: false)."""
    layer_types: list[str] = field(default_factory=list)
    """Token mixer of each layer, as config.json's ``layer_types`` (empty: full attention everywhere):
    full_attention, sliding_attention (GPT-OSS), linear_attention (Gated DeltaNet, Qwen3-Next)."""
    sliding_window: int = 0
    """Keys a sliding_attention query attends to, itself included (GPT-OSS: 128)."""
    attention_sinks: bool = False
    """A learned per-head sink logit in every attention softmax (GPT-OSS; Megatron's learnable softmax)."""
    attention_output_gate: bool = False
    """Attention output scaled by the sigmoid of a per-head gate projected with the queries (Qwen3-Next)."""
    add_bias_linear: bool = False
    """Biases on the attention QKV and output projections, the experts and the router (GPT-OSS)."""
    activation_func: Literal["silu", "quick_gelu"] = "silu"
    """GLU activation of the experts: silu (SwiGLU), or quick_gelu ``x sigmoid(1.702 x)`` (GPT-OSS)."""
    activation_func_clamp_value: float = 0.0
    """Clamp of the GLU inputs (gate at most this, linear part within +-this; 0: none; GPT-OSS: 7)."""
    glu_linear_offset: float = 0.0
    """Added to the GLU's linear part before the product (GPT-OSS: 1)."""
    norm_zero_centered: bool = False
    """RMSNorms scale by ``1 + weight`` (Qwen3-Next's norms, the GDN output norm excepted)."""
    linear_num_key_heads: int = 0
    """Gated DeltaNet: query/key heads of a linear_attention layer."""
    linear_num_value_heads: int = 0
    """Gated DeltaNet: value heads (a multiple of the key heads)."""
    linear_key_head_dim: int = 0
    """Gated DeltaNet: channels per query/key head."""
    linear_value_head_dim: int = 0
    """Gated DeltaNet: channels per value head."""
    linear_conv_kernel_dim: int = 0
    """Gated DeltaNet: width of the causal depthwise convolution over q, k and v."""

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """Global 0-based indices of the MoE layers (every layer past the dense ones)."""
        return tuple(range(self.num_dense_layers, self.num_layers))

    @property
    def mixer_types(self) -> tuple[str, ...]:
        """Each layer's token mixer (``layer_types``, or full_attention everywhere)."""
        return tuple(self.layer_types) or ("full_attention",) * self.num_layers

    @property
    def has_linear_attention(self) -> bool:
        """Some layer is a Gated DeltaNet layer (a hybrid model: Qwen3-Next, Qwen3.5)."""
        return "linear_attention" in self.layer_types

    @property
    def padded_vocab_size(self) -> int:
        """Rows of Megatron's embedding and output layer: V rounded up to ``vocab_padding_multiple``.

        The padding depends on the config alone, never on TP, so that a checkpoint (which
        stores global shapes) loads into every layout whose TP divides this size. The rows
        past V are zeros on import, dropped on export, and masked out of every softmax.
        """
        multiple = self.vocab_padding_multiple
        return -(-self.vocab_size // multiple) * multiple


def validate_model(m: ModelConfig, prefix: str = "model") -> None:
    """Check the architecture's own consistency rules."""
    for name in (
        "vocab_size",
        "vocab_padding_multiple",
        "hidden_size",
        "num_layers",
        "num_attention_heads",
        "num_query_groups",
        "head_dim",
        "num_experts",
        "moe_router_topk",
        "moe_ffn_hidden_size",
        "max_position_embeddings",
    ):
        require(getattr(m, name) > 0, f"{prefix}.{name}", "must be a positive integer")
    require(
        m.moe_router_topk <= m.num_experts,
        f"{prefix}.moe_router_topk",
        f"top-K ({m.moe_router_topk}) must not exceed model.num_experts ({m.num_experts})",
    )
    require(
        m.num_attention_heads % m.num_query_groups == 0,
        f"{prefix}.num_query_groups",
        f"must divide model.num_attention_heads ({m.num_attention_heads})",
    )
    require(m.norm_epsilon > 0, f"{prefix}.norm_epsilon", "must be > 0")
    require(m.rotary_base > 0, f"{prefix}.rotary_base", "must be > 0")
    require(m.init_method_std > 0, f"{prefix}.init_method_std", "must be > 0")
    require(m.moe_aux_loss_coeff >= 0, f"{prefix}.moe_aux_loss_coeff", "must be >= 0")
    require(
        not (m.moe_router_pre_softmax and m.moe_router_score_function == "sigmoid"),
        f"{prefix}.moe_router_pre_softmax",
        "only applies to softmax routing (model.moe_router_score_function=softmax)",
    )
    check_family_fields(m, prefix)
    check_mixer_fields(m, prefix)


def vocab_padding_hint(m: ModelConfig, tp: int) -> str:
    """How to pad the vocabulary so that ``tp`` divides it, with the size that gives."""
    # 128 is Megatron's make_vocab_size_divisible_by: it keeps every power-of-two TP up to 128.
    multiple = math.lcm(128, tp)
    padded = -(-m.vocab_size // multiple) * multiple
    return f"set model.vocab_padding_multiple={multiple} (pads to {padded})"


def check_family_fields(m: ModelConfig, prefix: str = "model") -> None:
    """Rules of the DeepSeek-V3 / GLM-4.5 / Qwen2-MoE fields of ``m``; raises :class:`ConfigError` naming the key."""
    require(0 < m.rotary_percent <= 1, f"{prefix}.rotary_percent", "must be in (0, 1]")
    require(
        0 <= m.num_dense_layers < m.num_layers,
        f"{prefix}.num_dense_layers",
        f"must be in [0, model.num_layers={m.num_layers}) (at least one MoE layer)",
    )
    require(
        m.num_dense_layers == 0 or m.ffn_hidden_size > 0,
        f"{prefix}.ffn_hidden_size",
        "must be > 0 when model.num_dense_layers > 0",
    )
    require(
        m.moe_shared_expert_intermediate_size >= 0,
        f"{prefix}.moe_shared_expert_intermediate_size",
        "must be >= 0",
    )
    require(
        not m.moe_shared_expert_gate or m.moe_shared_expert_intermediate_size > 0,
        f"{prefix}.moe_shared_expert_gate",
        "needs a shared expert (model.moe_shared_expert_intermediate_size > 0)",
    )
    require(
        not m.moe_router_enable_expert_bias or m.moe_router_score_function == "sigmoid",
        f"{prefix}.moe_router_enable_expert_bias",
        "only applies to sigmoid routing (model.moe_router_score_function=sigmoid)",
    )
    require(m.moe_router_topk_scaling_factor > 0, f"{prefix}.moe_router_topk_scaling_factor", "must be > 0")
    groups, group_topk = m.moe_router_num_groups, m.moe_router_group_topk
    require((groups == 0) == (group_topk == 0), f"{prefix}.moe_router_group_topk",
             "set both model.moe_router_num_groups and model.moe_router_group_topk, or neither")
    if groups:
        require(m.num_experts % groups == 0, f"{prefix}.moe_router_num_groups",
                 f"must divide model.num_experts ({m.num_experts})")
        require(0 < group_topk <= groups, f"{prefix}.moe_router_group_topk",
                 f"must be in [1, model.moe_router_num_groups={groups}]")
        require(m.moe_router_topk % group_topk == 0, f"{prefix}.moe_router_group_topk",
                 f"must divide model.moe_router_topk ({m.moe_router_topk}): a group is scored by "
                 "its top K / group_topk experts")
        require(m.moe_router_topk // group_topk <= m.num_experts // groups, f"{prefix}.moe_router_group_topk",
                 f"K / group_topk ({m.moe_router_topk // group_topk}) exceeds the experts per group "
                 f"({m.num_experts // groups})")
    if m.rope_scaling == "yarn":
        require(m.yarn_factor >= 1, f"{prefix}.yarn_factor", "must be >= 1")
    require(m.yarn_truncate or not m.multi_latent_attention, f"{prefix}.yarn_truncate",
             "must be true with multi-latent attention (Megatron's MLA rounds the YaRN correction range)")
    if m.multi_latent_attention:
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            require(getattr(m, name) > 0, f"{prefix}.{name}", "must be > 0 with multi-latent attention")
        require(m.q_lora_rank is None or m.q_lora_rank > 0, f"{prefix}.q_lora_rank", "must be > 0 or null")
        require(m.qk_rope_head_dim % 2 == 0, f"{prefix}.qk_rope_head_dim", "must be even (RoPE rotates pairs)")
        require(m.qk_layernorm, f"{prefix}.qk_layernorm",
                 "must be true with multi-latent attention (it norms the q and kv latents)")
        require(m.rotary_percent == 1.0, f"{prefix}.rotary_percent", "must be 1 with multi-latent attention")
        require(not m.add_qkv_bias, f"{prefix}.add_qkv_bias", "must be false with multi-latent attention")


MIXERS = ("full_attention", "sliding_attention", "linear_attention")
"""Token mixers a ``layer_types`` entry may name."""


def check_mixer_fields(m: ModelConfig, prefix: str = "model") -> None:
    """Rules of the GPT-OSS and Qwen3-Next / Qwen3.5 fields (layer types, sliding windows, sinks,
    biases, the clamped GLU, zero-centred norms, Gated DeltaNet); raises :class:`ConfigError`."""
    if m.layer_types:
        require(len(m.layer_types) == m.num_layers, f"{prefix}.layer_types",
                 f"has {len(m.layer_types)} entries, model.num_layers is {m.num_layers}")
        unknown = sorted(set(m.layer_types) - set(MIXERS))
        require(not unknown, f"{prefix}.layer_types", f"unknown token mixer {unknown[:1]}; known: {list(MIXERS)}")
    sliding = "sliding_attention" in m.layer_types
    require((m.sliding_window > 0) == sliding, f"{prefix}.sliding_window",
             "must be > 0 exactly when model.layer_types has sliding_attention layers")
    require(m.activation_func_clamp_value >= 0, f"{prefix}.activation_func_clamp_value", "must be >= 0 (0: none)")
    require(not (m.add_bias_linear and m.multi_latent_attention), f"{prefix}.add_bias_linear",
             "is not implemented with multi-latent attention")
    if m.attention_sinks or m.attention_output_gate:
        require(not m.multi_latent_attention, f"{prefix}.multi_latent_attention",
                 "attention sinks and output gates need grouped-query attention")
    linear = m.has_linear_attention
    gdn = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
           "linear_conv_kernel_dim")
    for name in gdn:
        require((getattr(m, name) > 0) == linear, f"{prefix}.{name}",
                 "must be > 0 exactly when model.layer_types has linear_attention layers")
    if linear:
        require(m.linear_num_value_heads % m.linear_num_key_heads == 0, f"{prefix}.linear_num_value_heads",
                 f"must be a multiple of model.linear_num_key_heads ({m.linear_num_key_heads})")
        require(not m.multi_latent_attention, f"{prefix}.multi_latent_attention",
                 "Gated DeltaNet hybrids have grouped-query attention layers")
        require(m.num_dense_layers == 0, f"{prefix}.num_dense_layers",
                 "Gated DeltaNet hybrids are MoE in every layer")
