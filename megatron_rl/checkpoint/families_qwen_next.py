"""Qwen3-Next and Qwen3.5-MoE (Gated DeltaNet hybrids): their HF weight tables and config translation.

Shape legend as in :mod:`megatron_rl.checkpoint.mapping`, plus: q_gate (heads x 2 x head_dim:
each head's queries and its output gate), gdn_qk / gdn_v (key / value width of the Gated
DeltaNet), gdn_qkv (2 gdn_qk + gdn_v), gdn_qkvz (+ gdn_v), gdn_heads (value heads), gdn_ba (2 x
gdn_heads), gdn_dv (value head channels), conv_k (the convolution's width).

``layer_types`` says which layers are Gated DeltaNet layers (``linear_attention``; transformers'
default: every fourth layer is full attention) and which gated full-attention layers; every
layer is MoE (a softmax router with renormalized top-K, a shared expert scaled by a sigmoid
gate). Each maps onto Megatron-Core's own module or field: its ``GatedDeltaNet`` (run over
packed rows by ``parallel.gated_delta_net``), ``attention_output_gate`` (per query group:
queries, gates, key, value), partial rotary (``rotary_percent``), zero-centred RMSNorms
(``layernorm_zero_centered_gamma``: ``(1 + w) x_normed`` everywhere but the DeltaNet's output
norm, which multiplies by ``w``), ``moe_shared_expert_gate``.

Weights: Qwen3-Next stores a DeltaNet's input projection grouped per key head
(``in_proj_qkvz``: q, k, v, z of each key head; ``in_proj_ba``: b, a of each), Qwen3.5 as four
tensors (``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``); both become Megatron's
``in_proj`` rows ``[q; k; v; z; b; a]``, split over TP section by section. A full-attention
layer's ``q_proj`` holds each head's queries then its gate. Permutations only: round trips
are byte for byte.

Qwen3.5's checkpoints are its vision-language model (``model_type: qwen3_5_moe``, the language
model's keys under ``text_config``, its tensors under ``model.language_model.``): the language
model is converted, the vision tower (``model.visual.*``) and the MTP layers (``mtp.*``, also in
Qwen3-Next's) are kept aside and written back unchanged on export (``Architecture.passthrough``);
no routing record or replay ever covers them (the Megatron model has no such layers).
``qwen3_5_moe_text`` is the text-only model (``Qwen3_5MoeForCausalLM``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from megatron_rl.checkpoint.errors import CheckpointMismatchError
from megatron_rl.checkpoint.family_rows import (
    COMMON_UNSUPPORTED,
    EMBEDDING_AND_NORMS,
    A,
    H,
    L,
    experts,
    get_key,
    read_rope,
    shared_expert,
    write_rope,
)
from megatron_rl.checkpoint.weight_rules import Architecture, WeightRule
from megatron_rl.checkpoint.weight_rules import weight_rule as _rule
from megatron_rl.sections import ModelConfig

_LA = H + "linear_attn."
_GDN_SECTIONS = ("gdn_qk", "gdn_qk", "gdn_v", "gdn_v", "gdn_heads", "gdn_heads")

_GATED_ATTENTION = (
    _rule(
        A + "linear_qkv.weight",
        (H + "self_attn.q_proj.weight", H + "self_attn.k_proj.weight", H + "self_attn.v_proj.weight"),
        (("q_gate", "hidden"), ("kv", "hidden"), ("kv", "hidden")), fuse="gated_qkv", tp_axis=0, fp8=True,
        layers="attention",
    ),
    _rule(A + "linear_proj.weight", H + "self_attn.o_proj.weight", ("hidden", "q"), tp_axis=1, fp8=True,
          layers="attention"),
    _rule(A + "q_layernorm.weight", H + "self_attn.q_norm.weight", ("head_dim",), layers="attention"),
    _rule(A + "k_layernorm.weight", H + "self_attn.k_norm.weight", ("head_dim",), layers="attention"),
)

_DELTA_NET = (
    _rule(A + "conv1d.weight", _LA + "conv1d.weight", ("gdn_qkv", "one", "conv_k"), tp_axis=0,
          tp_sections=("gdn_qk", "gdn_qk", "gdn_v"), layers="linear"),
    _rule(A + "dt_bias", _LA + "dt_bias", ("gdn_heads",), tp_axis=0, layers="linear"),
    _rule(A + "A_log", _LA + "A_log", ("gdn_heads",), tp_axis=0, layers="linear"),
    _rule(A + "out_norm.weight", _LA + "norm.weight", ("gdn_dv",), layers="linear"),
    _rule(A + "out_proj.weight", _LA + "out_proj.weight", ("hidden", "gdn_v"), tp_axis=1, fp8=True, layers="linear"),
)

_MOE = (
    _rule(L + "mlp.router.weight", H + "mlp.gate.weight", ("experts", "hidden")),
    *experts(H + "mlp.experts.{expert}."),
    *shared_expert(H + "mlp.shared_expert."),
    _rule(L + "mlp.shared_experts.gate_weight", H + "mlp.shared_expert_gate.weight", ("one", "hidden"),
          needs="shared_expert_gate"),
)

QWEN3_NEXT_RULES = (
    *EMBEDDING_AND_NORMS, *_GATED_ATTENTION, *_DELTA_NET, *_MOE,
    _rule(A + "in_proj.weight", (_LA + "in_proj_qkvz.weight", _LA + "in_proj_ba.weight"),
          (("gdn_qkvz", "hidden"), ("gdn_ba", "hidden")), fuse="gdn_grouped", tp_axis=0,
          tp_sections=_GDN_SECTIONS, fp8=True, layers="linear"),
)

QWEN3_5_RULES = (
    *EMBEDDING_AND_NORMS, *_GATED_ATTENTION, *_DELTA_NET, *_MOE,
    _rule(A + "in_proj.weight",
          (_LA + "in_proj_qkv.weight", _LA + "in_proj_z.weight", _LA + "in_proj_b.weight", _LA + "in_proj_a.weight"),
          (("gdn_qkv", "hidden"), ("gdn_v", "hidden"), ("gdn_heads", "hidden"), ("gdn_heads", "hidden")),
          fuse="concat", tp_axis=0, tp_sections=_GDN_SECTIONS, fp8=True, layers="linear"),
)


def _under_language_model(rule: WeightRule) -> WeightRule:
    """``rule`` with its HF names under ``model.language_model.`` (Qwen3.5's VLM checkpoints)."""
    return dataclasses.replace(rule, hf=tuple(n.replace("model.", "model.language_model.", 1) for n in rule.hf))


def _layer_types(config: dict[str, Any]) -> list[str]:
    """config.json's ``layer_types``, or transformers' default (every ``full_attention_interval``-th
    layer full attention, 4 unless it says)."""
    layers = get_key(config, "num_hidden_layers")
    interval = config.get("full_attention_interval") or 4
    kinds = config.get("layer_types") or ["linear_attention" if (i + 1) % interval else "full_attention"
                                          for i in range(layers)]
    return list(kinds)


def read_qwen_next(config: dict[str, Any]) -> dict[str, Any]:
    """ModelConfig fields of a Qwen3-Next / Qwen3.5 (text) config.json."""
    kinds = _layer_types(config)
    if "sliding_attention" in kinds:
        raise CheckpointMismatchError("config.json layer_types: sliding_attention is not a Qwen3-Next layer type")
    shared = config.get("shared_expert_intermediate_size") or 0
    rope = read_rope(config, allow_yarn=False)
    return dict(
        **rope,
        layer_types=kinds,
        attention_output_gate=True,
        norm_zero_centered=True,
        moe_shared_expert_intermediate_size=shared,
        moe_shared_expert_gate=shared > 0,
        linear_num_key_heads=get_key(config, "linear_num_key_heads"),
        linear_num_value_heads=get_key(config, "linear_num_value_heads"),
        linear_key_head_dim=get_key(config, "linear_key_head_dim"),
        linear_value_head_dim=get_key(config, "linear_value_head_dim"),
        linear_conv_kernel_dim=get_key(config, "linear_conv_kernel_dim"),
    )


def write_qwen_next(model: ModelConfig) -> dict[str, Any]:
    """config.json keys of a Qwen3-Next / Qwen3.5 model (inverse of :func:`read_qwen_next`)."""
    problems = [f"model.{name}={getattr(model, name)!r}" for name in ("attention_output_gate", "norm_zero_centered",
                                                                       "moe_shared_expert_gate")
                if not getattr(model, name)]
    if problems:
        raise CheckpointMismatchError("the model cannot be exported as a Qwen3-Next / Qwen3.5 model: "
                                      + "; ".join(problems))
    return {
        **write_rope(model),
        "layer_types": list(model.mixer_types),
        "shared_expert_intermediate_size": model.moe_shared_expert_intermediate_size,
        "linear_num_key_heads": model.linear_num_key_heads,
        "linear_num_value_heads": model.linear_num_value_heads,
        "linear_key_head_dim": model.linear_key_head_dim,
        "linear_value_head_dim": model.linear_value_head_dim,
        "linear_conv_kernel_dim": model.linear_conv_kernel_dim,
    }


_FEATURES = ("layer_types", "attention_output_gate", "norm_zero_centered", "linear_num_key_heads",
             "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim")
_UNSUPPORTED = {**COMMON_UNSUPPORTED, "decoder_sparse_step": 1, "mlp_only_layers": [], "attention_bias": False,
                "attn_output_gate": True}
_MTP = (r"^mtp\.",)

QWEN3_NEXT = Architecture(
    name="qwen3_next",
    hf_class="Qwen3NextForCausalLM",
    experts_keys=("num_experts",),
    expert_ffn_key="moe_intermediate_size",
    norm_topk_key="norm_topk_prob",
    qk_layernorm=True,
    supported_values=_UNSUPPORTED,
    rules=QWEN3_NEXT_RULES,
    read_extra=read_qwen_next,
    write_extra=write_qwen_next,
    passthrough=_MTP,
    features=_FEATURES,
    config_keys={"moe_shared_expert_intermediate_size": "shared_expert_intermediate_size"},
)

QWEN3_5_MOE_TEXT = dataclasses.replace(
    QWEN3_NEXT, name="qwen3_5_moe_text", hf_class="Qwen3_5MoeForCausalLM", rules=QWEN3_5_RULES,
    # Qwen3.5's router always renormalizes its top-K (no norm_topk_prob key).
    norm_topk_key=None,
)

QWEN3_5_MOE = dataclasses.replace(
    QWEN3_5_MOE_TEXT, name="qwen3_5_moe", hf_class="Qwen3_5MoeForConditionalGeneration",
    rules=tuple(_under_language_model(r) for r in QWEN3_5_RULES), text_config=True,
    passthrough=(r"^model\.visual\.", *_MTP),
)
