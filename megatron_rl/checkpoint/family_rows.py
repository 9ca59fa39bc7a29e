"""The rows and config keys the HF weight tables of :mod:`megatron_rl.checkpoint.families` share.

Owns: the Megatron and HF name prefixes, the embedding / norm / attention / expert rows
every GQA family is made of (:func:`experts` and :func:`shared_expert` for a family's own
HF expert names), and reading and writing RoPE keys (:func:`read_rope`, :func:`write_rope`).
Shape legend as in :mod:`megatron_rl.checkpoint.mapping`. Does not own any family's table
or the registry.
"""

from __future__ import annotations

from typing import Any

from megatron_rl.checkpoint.errors import CheckpointMismatchError
from megatron_rl.checkpoint.weight_rules import weight_rule as _rule
from megatron_rl.sections import ModelConfig

L = "decoder.layers.{layer}."
H = "model.layers.{layer}."
A = L + "self_attention."
VH = ("vocab", "hidden")

EMBEDDING_AND_NORMS = (
    _rule("embedding.word_embeddings.weight", "model.embed_tokens.weight", VH, tp_axis=0, pads_vocab=True),
    _rule(L + "input_layernorm.weight", H + "input_layernorm.weight", ("hidden",)),
    _rule(L + "pre_mlp_layernorm.weight", H + "post_attention_layernorm.weight", ("hidden",)),
    _rule("decoder.final_layernorm.weight", "model.norm.weight", ("hidden",)),
    _rule("output_layer.weight", "lm_head.weight", VH, tp_axis=0, pads_vocab=True),
)

QKV_AND_OUTPUT = (
    _rule(
        A + "linear_qkv.weight",
        (H + "self_attn.q_proj.weight", H + "self_attn.k_proj.weight", H + "self_attn.v_proj.weight"),
        (("q", "hidden"), ("kv", "hidden"), ("kv", "hidden")), fuse="qkv", tp_axis=0, fp8=True,
    ),
    _rule(A + "linear_proj.weight", H + "self_attn.o_proj.weight", ("hidden", "q"), tp_axis=1, fp8=True),
)

GQA_WITH_BIAS = (
    *QKV_AND_OUTPUT,
    _rule(
        A + "linear_qkv.bias",
        (H + "self_attn.q_proj.bias", H + "self_attn.k_proj.bias", H + "self_attn.v_proj.bias"),
        (("q",), ("kv",), ("kv",)), fuse="qkv", tp_axis=0, needs="qkv_bias",
    ),
    _rule(A + "q_layernorm.weight", H + "self_attn.q_norm.weight", ("head_dim",), needs="qk_norm"),
    _rule(A + "k_layernorm.weight", H + "self_attn.k_norm.weight", ("head_dim",), needs="qk_norm"),
)


def experts(hf_expert: str, gate: str = "gate_proj", up: str = "up_proj", down: str = "down_proj") -> tuple:
    """The rows of routed experts stored one HF tensor per expert and projection (``hf_expert``
    holds ``{expert}``)."""
    return (
        _rule(L + "mlp.experts.local_experts.{expert}.linear_fc1.weight",
              (hf_expert + gate + ".weight", hf_expert + up + ".weight"),
              ("expert_ffn", "hidden"), fuse="gate_up", tp_axis=0, fp8=True, layers="moe"),
        _rule(L + "mlp.experts.local_experts.{expert}.linear_fc2.weight", hf_expert + down + ".weight",
              ("hidden", "expert_ffn"), tp_axis=1, fp8=True, layers="moe"),
    )


def shared_expert(hf: str) -> tuple:
    """The rows of a shared expert whose HF projections start with ``hf``."""
    return (
        _rule(L + "mlp.shared_experts.linear_fc1.weight", (hf + "gate_proj.weight", hf + "up_proj.weight"),
              ("shared_ffn", "hidden"), fuse="gate_up", tp_axis=0, fp8=True, layers="moe", needs="shared_expert"),
        _rule(L + "mlp.shared_experts.linear_fc2.weight", hf + "down_proj.weight", ("hidden", "shared_ffn"),
              tp_axis=1, fp8=True, layers="moe", needs="shared_expert"),
    )


def get_key(config: dict[str, Any], key: str) -> Any:
    """``config[key]``, or an error naming the missing key."""
    if config.get(key) is None:
        raise CheckpointMismatchError(f"config.json: key {key!r} is missing")
    return config[key]


YARN_KEYS = {"rope_type", "type", "rope_theta", "factor", "original_max_position_embeddings",
             "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate", "partial_rotary_factor"}


def read_rope(config: dict[str, Any], allow_yarn: bool, allow_untruncated: bool = False) -> dict[str, Any]:
    """ModelConfig RoPE fields (base, YaRN, partial rotary) of a config, refusing the rest.

    Reads transformers 5's ``rope_parameters`` or 4.x / Hub ``rope_theta`` + ``rope_scaling``.
    ``allow_untruncated``: YaRN's ``truncate: false`` is read (``yarn_truncate``; GQA families,
    whose YaRN is GPTModel's: it takes the unrounded range, MLA's does not).
    """
    params = config.get("rope_parameters")
    field = "rope_parameters"
    if params is None:
        params = dict(config.get("rope_scaling") or {})
        field = "rope_scaling"
        params.setdefault("rope_theta", get_key(config, "rope_theta"))
    kind = params.get("rope_type", params.get("type", "default"))
    partial = params.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
    if params.get("rope_theta") is None:
        raise CheckpointMismatchError(f"config.json: key '{field}.rope_theta' is missing")
    out: dict[str, Any] = {"rotary_base": float(params["rope_theta"]), "rotary_percent": float(partial)}
    if kind == "default":
        return out
    if kind != "yarn" or not allow_yarn:
        supported = "default or yarn" if allow_yarn else "default"
        raise CheckpointMismatchError(f"config.json {field}.rope_type={kind!r}: only {supported} RoPE is implemented")
    unknown = sorted(set(params) - YARN_KEYS)
    if unknown:
        raise CheckpointMismatchError(f"config.json {field}.{unknown[0]}: YaRN setting not implemented")
    truncate = params.get("truncate", True)
    if truncate is not True and not (truncate is False and allow_untruncated):
        # Megatron's MLA rounds YaRN's correction range to integers, as transformers does by default.
        raise CheckpointMismatchError(f"config.json {field}.truncate={truncate!r}: only the rounded YaRN ramp is implemented")
    out.update(
        rope_scaling="yarn",
        yarn_truncate=truncate,
        yarn_factor=float(get_key(params, "factor")),
        yarn_original_max_position_embeddings=int(get_key(params, "original_max_position_embeddings")),
        yarn_beta_fast=float(params.get("beta_fast", 32.0)),
        yarn_beta_slow=float(params.get("beta_slow", 1.0)),
        yarn_mscale=float(params.get("mscale", 1.0)),
        yarn_mscale_all_dim=float(params.get("mscale_all_dim", 0.0)),
    )
    return out


def write_rope(model: ModelConfig) -> dict[str, Any]:
    """config.json RoPE keys of a model (inverse of :func:`read_rope`)."""
    params: dict[str, Any] = {"rope_type": "default", "rope_theta": float(model.rotary_base)}
    if model.rope_scaling == "yarn":
        params.update(
            rope_type="yarn", factor=model.yarn_factor,
            original_max_position_embeddings=model.yarn_original_max_position_embeddings,
            beta_fast=model.yarn_beta_fast, beta_slow=model.yarn_beta_slow,
            mscale=model.yarn_mscale, mscale_all_dim=model.yarn_mscale_all_dim,
        )
        if not model.yarn_truncate:
            params["truncate"] = False
    if model.rotary_percent != 1.0:
        params["partial_rotary_factor"] = model.rotary_percent
    return {"rope_theta": float(model.rotary_base), "rope_parameters": params}


COMMON_UNSUPPORTED = {"tie_word_embeddings": False, "hidden_act": "silu"}
