"""Megatron-Core ``TransformerConfig`` fields of the DeepSeek-V3 / GLM-4.5 / Qwen2-MoE and
GPT-OSS / Qwen3-Next / Qwen3.5 features.

Owns: translating the :class:`~megatron_rl.config.ModelConfig` fields past ``qk_layernorm``
(multi-latent attention, YaRN, dense first layers, shared experts, sigmoid routing with an
expert bias, group-limited top-K, routed scaling, QKV biases; attention sinks, sliding
windows, biases, the clamped GLU, YaRN without MLA, output gates, zero-centred norms, the
Gated DeltaNet's sizes) into Megatron-Core's own config fields, which then pick Megatron's own
modules (``MLASelfAttention``, ``SharedExpertMLP``, ``TopKRouter``'s group-limited top-K, the
learnable softmax offset, the GLU's clamp and offset, GPTModel's YaRN embedding). A model that uses none of them
gets exactly the fields it had before (so its numerics are unchanged). Also owns which
layers are MoE layers (:func:`moe_layer_numbers`, the columns of routing records) and the
one local-spec change MLA needs under TP (:func:`replicated_mla_down_projections`). Does not
own the rest of the layer spec or the model build (``megatron_rl.parallel.model``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from megatron.core.transformer import ModuleSpec

from megatron_rl.sections import ModelConfig


def family_fields(model: ModelConfig) -> dict[str, Any]:
    """``TransformerConfig`` (or ``MLATransformerConfig``) fields for the family features."""
    fields: dict[str, Any] = {"add_qkv_bias": model.add_qkv_bias}
    if model.num_dense_layers:
        # 0 marks a dense layer, 1 an MoE layer; Megatron's block spec reads this list.
        fields["moe_layer_freq"] = [0] * model.num_dense_layers + [1] * len(model.moe_layers)
        fields["ffn_hidden_size"] = model.ffn_hidden_size
    if model.moe_shared_expert_intermediate_size:
        fields["moe_shared_expert_intermediate_size"] = model.moe_shared_expert_intermediate_size
        fields["moe_shared_expert_gate"] = model.moe_shared_expert_gate
    if model.moe_router_enable_expert_bias:
        fields["moe_router_enable_expert_bias"] = True
        # The bias is a checkpoint constant here: Megatron would otherwise move it every
        # step from the batch's load, changing which experts the rollout engine (which
        # receives parameters only) and the old and current policies select.
        fields["moe_router_bias_update_rate"] = 0.0
    if model.moe_router_num_groups:
        fields["moe_router_num_groups"] = model.moe_router_num_groups
        fields["moe_router_group_topk"] = model.moe_router_group_topk
    if model.moe_router_topk_scaling_factor != 1.0:
        fields["moe_router_topk_scaling_factor"] = model.moe_router_topk_scaling_factor
    if model.multi_latent_attention:
        fields.update(_mla_fields(model))
    fields.update(_mixer_fields(model))
    return fields


def _mixer_fields(model: ModelConfig) -> dict[str, Any]:
    """GPT-OSS and Qwen3-Next / Qwen3.5 fields (none for a model that uses none of them)."""
    fields: dict[str, Any] = {}
    if model.add_bias_linear:
        fields["add_bias_linear"] = True
    if model.attention_sinks:
        # Megatron's learnable softmax offset is GPT-OSS's sink: one more logit per head.
        fields["softmax_type"] = "learnable"
    if model.sliding_window:
        # HF: key j is seen from query i when i - sliding_window < j <= i; Megatron counts the keys left of i.
        fields["window_size"] = (model.sliding_window - 1, 0)
        fields["window_attn_skip_freq"] = [int(t == "sliding_attention") for t in model.mixer_types]
    if model.activation_func == "quick_gelu":
        from megatron_rl.parallel.mcore_layers import quick_gelu

        fields["activation_func"] = quick_gelu
    if model.activation_func_clamp_value:
        fields["activation_func_clamp_value"] = model.activation_func_clamp_value
    if model.glu_linear_offset:
        fields["glu_linear_offset"] = model.glu_linear_offset
    if model.attention_output_gate:
        fields["attention_output_gate"] = True
    if model.norm_zero_centered:
        fields["layernorm_zero_centered_gamma"] = True
    if model.has_linear_attention:
        # Read by Megatron's GatedDeltaNet; experimental_attention_variant stays unset because
        # 0.19.2's GPT block spec refuses it (our layer spec places the GDN layers). The pattern
        # (1: linear attention) also makes the block save each layer under its own key, as the
        # layers' parameters differ (TransformerBlock.sharded_state_dict's non_homogeneous_layers).
        fields.update(
            linear_attention_freq=[int(t == "linear_attention") for t in model.mixer_types],
            linear_conv_kernel_dim=model.linear_conv_kernel_dim,
            linear_key_head_dim=model.linear_key_head_dim,
            linear_value_head_dim=model.linear_value_head_dim,
            linear_num_key_heads=model.linear_num_key_heads,
            linear_num_value_heads=model.linear_num_value_heads,
        )
    return fields


def yarn_rope_attributes(model: ModelConfig) -> dict[str, Any]:
    """The YaRN attributes GPTModel's ``position_embedding_type='yarn'`` (its inverse
    frequencies) and Attention (the magnitude scale of cos and sin,
    ``_yarn_get_concentration_factor_from_config``) read from the config: 0.16.1-0.19.2 read
    them with ``getattr``, ``TransformerConfig`` declares none.

    transformers takes ``mscale / mscale_all_dim`` only when both are set (non-zero), else
    ``0.1 ln(factor) + 1``; Megatron takes the ratio whenever both are given, which
    ``(1, 0)`` makes the same."""
    both = bool(model.yarn_mscale and model.yarn_mscale_all_dim)
    return dict(
        yarn_rotary_scaling_factor=model.yarn_factor,
        yarn_original_max_position_embeddings=model.yarn_original_max_position_embeddings,
        yarn_beta_fast=model.yarn_beta_fast,
        yarn_beta_slow=model.yarn_beta_slow,
        yarn_mscale=model.yarn_mscale if both else 1.0,
        yarn_mscale_all_dim=model.yarn_mscale_all_dim if both else 0.0,
        yarn_correction_range_round_to_int=model.yarn_truncate,
    )


def _mla_fields(model: ModelConfig) -> dict[str, Any]:
    yarn = model.rope_scaling == "yarn"
    return dict(
        multi_latent_attention=True,
        # MLA has one key head per query head after the up-projection.
        num_query_groups=model.num_attention_heads,
        q_lora_rank=model.q_lora_rank,
        kv_lora_rank=model.kv_lora_rank,
        qk_head_dim=model.qk_nope_head_dim,
        qk_pos_emb_head_dim=model.qk_rope_head_dim,
        v_head_dim=model.v_head_dim,
        rope_type="yarn" if yarn else "rope",
        rotary_base=model.rotary_base,
        # MLA's softmax scale is mscale(rotary_scaling_factor, mscale_all_dim)^2 / sqrt(d)
        # even without YaRN; factor 1 makes it 1 / sqrt(d), as transformers computes.
        rotary_scaling_factor=model.yarn_factor if yarn else 1.0,
        original_max_position_embeddings=model.yarn_original_max_position_embeddings,
        beta_fast=model.yarn_beta_fast,
        beta_slow=model.yarn_beta_slow,
        mscale=model.yarn_mscale,
        mscale_all_dim=model.yarn_mscale_all_dim,
    )


def moe_layer_numbers(config) -> tuple[int, ...]:
    """Megatron (1-based) layer numbers of a ``TransformerConfig``'s MoE layers, ascending.

    These number the columns of routing records and of R3 routes; dense layers have none.
    """
    freq = config.moe_layer_freq
    pattern = freq if isinstance(freq, list) else [int(i % freq == 0) for i in range(config.num_layers)]
    return tuple(i + 1 for i, moe in enumerate(pattern) if moe)


def replicated_mla_down_projections(spec: ModuleSpec) -> ModuleSpec:
    """A local layer spec whose MLA down projections are replicated over TP (no-op without MLA).

    Megatron-Core's local MLA spec (0.16.1 to 0.19.2) splits the q and kv down projections over TP and
    gathers their outputs; the rope key part of the gathered kv latent then feeds every
    rank's heads over the whole sequence, but its gradient is split back without summing
    over the ranks' heads, so layers below get wrong gradients under TP (router gradients
    off by 1e-3 relative in a TP2 check). The TE spec keeps these projections replicated
    (``parallel_mode='duplicated'``); this does the same with the replicated linear that
    Megatron's MLA accepts, whose weight is flagged ``sequence_parallel`` so its partial
    gradients are summed over TP, and whose rope key is gathered over the sequence with a
    reduce-scatter backward.
    """
    layer = spec.submodules
    attn = layer.self_attention.submodules
    if not hasattr(attn, "linear_kv_down_proj"):
        return spec
    from megatron_rl.parallel.mcore_compat import ReplicatedLinear

    attn = dataclasses.replace(attn, linear_q_down_proj=ReplicatedLinear, linear_kv_down_proj=ReplicatedLinear)
    self_attention = dataclasses.replace(layer.self_attention, submodules=attn)
    return dataclasses.replace(spec, submodules=dataclasses.replace(layer, self_attention=self_attention))
