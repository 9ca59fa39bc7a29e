"""The ``model`` section: the MoE decoder's architecture, and its own consistency rules.

A leaf: imports nothing of ours but the config mechanics, so every owner (parallel model
building, checkpoint tables, rollout replicas) can import it without reaching the run's
composition (``megatron_rl.config``). Layout rules (what TP or PP must divide) live with the
``parallel`` section. :func:`check_family_fields` holds the rules of the fields that
DeepSeek-V3, GLM-4.5 and Qwen2-MoE add (MLA, YaRN, dense first layers, shared experts,
expert bias, group-limited routing, partial rotary, QKV biases).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from megatron_rl.config_loading import require


@dataclass(kw_only=True)
class ModelConfig:
    """A MoE decoder: RMSNorm, RoPE, SwiGLU experts; by default Qwen3-MoE-style (GQA with
    QK-norm, softmax router, every layer MoE, no biases). The fields past ``qk_layernorm``
    add what DeepSeek-V3, GLM-4.5 and Qwen2-MoE need; each maps onto Megatron-Core's own
    ``TransformerConfig`` field or layer spec (``megatron_rl.parallel.model``)."""

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

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """Global 0-based indices of the MoE layers (every layer past the dense ones)."""
        return tuple(range(self.num_dense_layers, self.num_layers))

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
    require(m.rope_scaling == "none" or m.multi_latent_attention, f"{prefix}.rope_scaling",
             "YaRN is implemented for multi-latent attention only (model.multi_latent_attention=true)")
    if m.rope_scaling == "yarn":
        require(m.yarn_factor >= 1, f"{prefix}.yarn_factor", "must be >= 1")
    if m.multi_latent_attention:
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            require(getattr(m, name) > 0, f"{prefix}.{name}", "must be > 0 with multi-latent attention")
        require(m.q_lora_rank is None or m.q_lora_rank > 0, f"{prefix}.q_lora_rank", "must be > 0 or null")
        require(m.qk_rope_head_dim % 2 == 0, f"{prefix}.qk_rope_head_dim", "must be even (RoPE rotates pairs)")
        require(m.qk_layernorm, f"{prefix}.qk_layernorm",
                 "must be true with multi-latent attention (it norms the q and kv latents)")
        require(m.rotary_percent == 1.0, f"{prefix}.rotary_percent", "must be 1 with multi-latent attention")
        require(not m.add_qkv_bias, f"{prefix}.add_qkv_bias", "must be false with multi-latent attention")
