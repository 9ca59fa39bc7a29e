"""GPT-OSS (gpt-oss-20b, gpt-oss-120b): its HF weight table and config translation.

Shape legend as in :mod:`megatron_rl.checkpoint.mapping`, plus: expert_ffn2 (an expert's fused
gate/up width, 2 F), heads (query heads: one sink logit each).

What GPT-OSS adds, each onto Megatron-Core's own field (``parallel.families``): learnable
attention sinks (``softmax_type='learnable'``: one more logit per head in the softmax),
sliding-window layers alternating with full ones as ``layer_types`` says (``window_size``,
``window_attn_skip_freq``), biases on the attention projections, the experts and the router
(``add_bias_linear``), the clamped SwiGLU with its offset (``quick_gelu`` = ``x sigmoid(1.702
x)`` on ``min(gate, limit)``, times ``clamp(up, -limit, limit) + 1``:
``activation_func_clamp_value``, ``glu_linear_offset``), YaRN RoPE with ``truncate: false``
(GPTModel's ``position_embedding_type='yarn'``, its magnitude scale folded into the softmax
scale), top-K on the router logits then a softmax over the K (Megatron's softmax router with
renormalized gates).

The checkpoint stores each layer's experts stacked, ``[E, H, 2F]`` with gate and up columns
interleaved (``gate_up[..., ::2]``, ``gate_up[..., 1::2]``), ``[E, F, H]`` for down, biases
``[E, 2F]`` and ``[E, H]``; every Megatron expert parameter is a permuted slice
(``WeightRule.stacked``, ``transpose``, ``glu_interleaved``), so a round trip is byte for byte.
The released MXFP4 experts (``*_blocks`` and ``*_scales``, ``quantization_config.quant_method:
mxfp4``) are dequantized to bf16 as they are read (:mod:`megatron_rl.checkpoint.mxfp4`), and an
export is bf16 without ``quantization_config``: re-quantizing trained weights to MXFP4 is lossy,
and SGLang and transformers both load the bf16 layout. Refused, naming the key: another
quantization method, ``swiglu_alpha`` other than 1.702 (Megatron's ``quick_gelu`` has it
fixed), ``attention_bias: false`` (Megatron's one bias switch covers attention and experts).
"""

from __future__ import annotations

from typing import Any

from megatron_rl.checkpoint.errors import CheckpointMismatchError
from megatron_rl.checkpoint.family_rows import (
    COMMON_UNSUPPORTED,
    EMBEDDING_AND_NORMS,
    GQA_WITH_BIAS,
    A,
    H,
    L,
    get_key,
    read_rope,
    write_rope,
)
from megatron_rl.checkpoint.weight_rules import Architecture
from megatron_rl.checkpoint.weight_rules import weight_rule as _rule
from megatron_rl.sections import ModelConfig

QUICK_GELU_ALPHA = 1.702
"""The sigmoid gain of Megatron-Core's ``quick_gelu`` (``megatron/core/activations.py``)."""

_E = L + "mlp.experts.local_experts.{expert}."
_HE = H + "mlp.experts."

GPT_OSS_RULES = (
    *EMBEDDING_AND_NORMS, *GQA_WITH_BIAS,
    _rule(A + "linear_proj.bias", H + "self_attn.o_proj.bias", ("hidden",), needs="bias_linear"),
    _rule(A + "core_attention.softmax_offset", H + "self_attn.sinks", ("heads",), tp_axis=0, needs="sinks"),
    _rule(L + "mlp.router.weight", H + "mlp.router.weight", ("experts", "hidden")),
    _rule(L + "mlp.router.bias", H + "mlp.router.bias", ("experts",), needs="bias_linear"),
    _rule(_E + "linear_fc1.weight", _HE + "gate_up_proj", ("experts", "hidden", "expert_ffn2"),
          fuse="glu_interleaved", stacked=True, transpose=True, tp_axis=0, fp8=True, layers="moe"),
    _rule(_E + "linear_fc1.bias", _HE + "gate_up_proj_bias", ("experts", "expert_ffn2"),
          fuse="glu_interleaved", stacked=True, tp_axis=0, layers="moe", needs="bias_linear"),
    _rule(_E + "linear_fc2.weight", _HE + "down_proj", ("experts", "expert_ffn", "hidden"),
          stacked=True, transpose=True, tp_axis=1, fp8=True, layers="moe"),
    _rule(_E + "linear_fc2.bias", _HE + "down_proj_bias", ("experts", "hidden"),
          stacked=True, layers="moe", needs="bias_linear"),
)


def _layer_types(config: dict[str, Any]) -> list[str]:
    """config.json's ``layer_types``, or transformers' default (sliding first, then alternating)."""
    layers = get_key(config, "num_hidden_layers")
    kinds = config.get("layer_types") or ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)]
    return list(kinds)


def read_gpt_oss(config: dict[str, Any]) -> dict[str, Any]:
    """ModelConfig fields of a GPT-OSS config.json (refusing what Megatron would compute differently)."""
    quant = config.get("quantization_config")
    if quant is not None and quant.get("quant_method") != "mxfp4":
        raise CheckpointMismatchError(
            f"config.json quantization_config.quant_method={quant.get('quant_method')!r}: only the released "
            "MXFP4 experts are dequantized on load; dequantize to bf16 first"
        )
    alpha = float(config.get("swiglu_alpha", QUICK_GELU_ALPHA))
    if alpha != QUICK_GELU_ALPHA:
        raise CheckpointMismatchError(
            f"config.json swiglu_alpha={alpha}: Megatron-Core's quick_gelu has the gain {QUICK_GELU_ALPHA} fixed"
        )
    kinds = _layer_types(config)
    return dict(
        **read_rope(config, allow_yarn=True, allow_untruncated=True),
        layer_types=kinds,
        sliding_window=int(get_key(config, "sliding_window")) if "sliding_attention" in kinds else 0,
        attention_sinks=True,
        add_bias_linear=True,
        add_qkv_bias=True,
        activation_func="quick_gelu",
        activation_func_clamp_value=float(config.get("swiglu_limit", 7.0)),
        glu_linear_offset=1.0,
    )


def write_gpt_oss(model: ModelConfig) -> dict[str, Any]:
    """config.json keys of a GPT-OSS model (inverse of :func:`read_gpt_oss`)."""
    problems = [
        f"model.{name}={getattr(model, name)!r} (GPT-OSS: {wanted!r})"
        for name, wanted in (("attention_sinks", True), ("add_bias_linear", True), ("add_qkv_bias", True),
                             ("activation_func", "quick_gelu"), ("glu_linear_offset", 1.0))
        if getattr(model, name) != wanted
    ]
    if problems:
        raise CheckpointMismatchError("the model cannot be exported as gpt_oss: " + "; ".join(problems))
    return {
        **write_rope(model),
        "layer_types": list(model.mixer_types),
        "sliding_window": model.sliding_window or None,
        "swiglu_limit": model.activation_func_clamp_value,
        "swiglu_alpha": QUICK_GELU_ALPHA,
    }


GPT_OSS = Architecture(
    name="gpt_oss",
    hf_class="GptOssForCausalLM",
    experts_keys=("num_local_experts", "num_experts"),
    expert_ffn_key="intermediate_size",
    # Top-K of the logits, then a softmax over those K: renormalized softmax gates.
    norm_topk_key=None,
    qk_layernorm=False,
    supported_values={**COMMON_UNSUPPORTED, "attention_bias": True},
    rules=GPT_OSS_RULES,
    read_extra=read_gpt_oss,
    write_extra=write_gpt_oss,
    features=("yarn_truncate", "layer_types", "sliding_window", "attention_sinks", "add_bias_linear",
              "activation_func", "activation_func_clamp_value", "glu_linear_offset"),
    config_keys={"sliding_window": "sliding_window", "activation_func_clamp_value": "swiglu_limit"},
)
