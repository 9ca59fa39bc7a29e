"""Consistency rules of the model fields that DeepSeek-V3, GLM-4.5 and Qwen2-MoE add.

Owns the checks of :class:`~megatron_rl.config.ModelConfig`'s family fields (multi-latent
attention, YaRN, dense first layers, shared experts, expert bias, group-limited routing,
partial rotary, QKV biases) that hold whatever the layout; ``config.validate_model`` runs
them. Layout rules (what TP or PP must divide) stay in ``config.validate_layout``. Imports
nothing heavy, so configs validate before any process starts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from megatron_rl.config_loading import ConfigError

if TYPE_CHECKING:
    from megatron_rl.config import ModelConfig


def _require(ok: bool, key: str, rule: str) -> None:
    if not ok:
        raise ConfigError(f"{key}: {rule}")


def check_family_fields(m: ModelConfig, prefix: str = "model") -> None:
    """Rules of the DeepSeek-V3 / GLM-4.5 / Qwen2-MoE fields of ``m``; raises :class:`ConfigError` naming the key."""
    _require(0 < m.rotary_percent <= 1, f"{prefix}.rotary_percent", "must be in (0, 1]")
    _require(
        0 <= m.num_dense_layers < m.num_layers,
        f"{prefix}.num_dense_layers",
        f"must be in [0, model.num_layers={m.num_layers}) (at least one MoE layer)",
    )
    _require(
        m.num_dense_layers == 0 or m.ffn_hidden_size > 0,
        f"{prefix}.ffn_hidden_size",
        "must be > 0 when model.num_dense_layers > 0",
    )
    _require(
        m.moe_shared_expert_intermediate_size >= 0,
        f"{prefix}.moe_shared_expert_intermediate_size",
        "must be >= 0",
    )
    _require(
        not m.moe_shared_expert_gate or m.moe_shared_expert_intermediate_size > 0,
        f"{prefix}.moe_shared_expert_gate",
        "needs a shared expert (model.moe_shared_expert_intermediate_size > 0)",
    )
    _require(
        not m.moe_router_enable_expert_bias or m.moe_router_score_function == "sigmoid",
        f"{prefix}.moe_router_enable_expert_bias",
        "only applies to sigmoid routing (model.moe_router_score_function=sigmoid)",
    )
    _require(m.moe_router_topk_scaling_factor > 0, f"{prefix}.moe_router_topk_scaling_factor", "must be > 0")
    groups, group_topk = m.moe_router_num_groups, m.moe_router_group_topk
    _require((groups == 0) == (group_topk == 0), f"{prefix}.moe_router_group_topk",
             "set both model.moe_router_num_groups and model.moe_router_group_topk, or neither")
    if groups:
        _require(m.num_experts % groups == 0, f"{prefix}.moe_router_num_groups",
                 f"must divide model.num_experts ({m.num_experts})")
        _require(0 < group_topk <= groups, f"{prefix}.moe_router_group_topk",
                 f"must be in [1, model.moe_router_num_groups={groups}]")
        _require(m.moe_router_topk % group_topk == 0, f"{prefix}.moe_router_group_topk",
                 f"must divide model.moe_router_topk ({m.moe_router_topk}): a group is scored by "
                 "its top K / group_topk experts")
        _require(m.moe_router_topk // group_topk <= m.num_experts // groups, f"{prefix}.moe_router_group_topk",
                 f"K / group_topk ({m.moe_router_topk // group_topk}) exceeds the experts per group "
                 f"({m.num_experts // groups})")
    _require(m.rope_scaling == "none" or m.multi_latent_attention, f"{prefix}.rope_scaling",
             "YaRN is implemented for multi-latent attention only (model.multi_latent_attention=true)")
    if m.rope_scaling == "yarn":
        _require(m.yarn_factor >= 1, f"{prefix}.yarn_factor", "must be >= 1")
    if m.multi_latent_attention:
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            _require(getattr(m, name) > 0, f"{prefix}.{name}", "must be > 0 with multi-latent attention")
        _require(m.q_lora_rank is None or m.q_lora_rank > 0, f"{prefix}.q_lora_rank", "must be > 0 or null")
        _require(m.qk_rope_head_dim % 2 == 0, f"{prefix}.qk_rope_head_dim", "must be even (RoPE rotates pairs)")
        _require(m.qk_layernorm, f"{prefix}.qk_layernorm",
                 "must be true with multi-latent attention (it norms the q and kv latents)")
        _require(m.rotary_percent == 1.0, f"{prefix}.rotary_percent", "must be 1 with multi-latent attention")
        _require(not m.add_qkv_bias, f"{prefix}.add_qkv_bias", "must be false with multi-latent attention")
