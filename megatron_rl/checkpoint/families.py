"""HF weight tables of every supported family (Qwen3-MoE, Mixtral, DeepSeek-V3 with Kimi-K2 and
Moonlight, GLM-4.5, Qwen2-MoE; GPT-OSS, Qwen3-Next and Qwen3.5 from their own modules,
``families_gpt_oss`` and ``families_qwen_next``) and the config translation of the families
past the first two.

Shape legend as in :mod:`megatron_rl.checkpoint.mapping`, plus: ffn (a dense layer's MLP
width), shared_ffn (the shared expert's width), q_lora / kv_lora (MLA latent ranks), mla_q
(heads x (nope + rope) query channels), mla_kv_down (kv_lora + rope), mla_kv_up (heads x
(nope + v)), mla_o (heads x v).

Owns: the weight tables, built from shared rows (embedding and norms, attention, experts:
``family_rows``) and registered in :data:`ARCHITECTURES`, and the config.json keys that describe their features (multi-latent attention, YaRN, dense
first layers, shared experts, sigmoid routing with an expert-score-correction bias, group-
limited top-K, routed scaling, partial rotary embeddings, QKV biases). Everything a config
says that the Megatron model would compute differently stops here, naming the key:
an unknown RoPE scaling type, un-normalized sigmoid gates, a group scoring Megatron-Core
does not share, quantized weights, dense layers anywhere but first.

Group-limited routing: transformers scores an expert group by the sum of its top-2
selection scores, Megatron-Core by the sum of its top ``K / topk_group``. They agree when
``K = 2 topk_group`` (DeepSeek-V3: K 8, 4 of 8 groups), or when every group is kept
(``n_group == topk_group``; Moonlight, GLM-4.5: 1 of 1), which is then no restriction and
is converted as plain top-K. Any other setting is refused.

MTP (multi-token prediction) layers, ``model.layers.{num_hidden_layers + i}.*`` of a
checkpoint whose config has ``num_nextn_predict_layers > 0``, are not part of the
backbone: the converter skips them with a printed note (:func:`mtp_tensor_names`), and no
routing record ever covers them (the Megatron model has no such layers to replay into).
Does not own files or Megatron modules.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Iterable

from megatron_rl.checkpoint.errors import CheckpointMismatchError
from megatron_rl.checkpoint.families_gpt_oss import GPT_OSS
from megatron_rl.checkpoint.families_qwen_next import QWEN3_5_MOE, QWEN3_5_MOE_TEXT, QWEN3_NEXT
from megatron_rl.checkpoint.family_rows import (
    COMMON_UNSUPPORTED,
    EMBEDDING_AND_NORMS,
    GQA_WITH_BIAS,
    QKV_AND_OUTPUT,
    A,
    H,
    L,
    experts,
    get_key,
    read_rope,
    shared_expert,
    write_rope,
)
from megatron_rl.checkpoint.weight_rules import Architecture
from megatron_rl.checkpoint.weight_rules import weight_rule as _rule
from megatron_rl.registry import Registry
from megatron_rl.sections import ModelConfig

# MLA: the down projections are replicated over TP (``parallel.families.
# replicated_mla_down_projections``), the up projections split by heads; every HF tensor keeps its layout (per head: [nope, rope] queries, [nope, v]
# key/value up-projection, and the rope key after the kv latent).
_MLA = (
    _rule(A + "linear_q_down_proj.weight", H + "self_attn.q_a_proj.weight", ("q_lora", "hidden"),
          fp8=True, needs="q_lora"),
    _rule(A + "q_layernorm.weight", H + "self_attn.q_a_layernorm.weight", ("q_lora",), needs="q_lora"),
    _rule(A + "linear_q_up_proj.weight", H + "self_attn.q_b_proj.weight", ("mla_q", "q_lora"),
          tp_axis=0, fp8=True, needs="q_lora"),
    _rule(A + "linear_q_proj.weight", H + "self_attn.q_proj.weight", ("mla_q", "hidden"),
          tp_axis=0, fp8=True, needs="no_q_lora"),
    _rule(A + "linear_kv_down_proj.weight", H + "self_attn.kv_a_proj_with_mqa.weight",
          ("mla_kv_down", "hidden"), fp8=True),
    _rule(A + "kv_layernorm.weight", H + "self_attn.kv_a_layernorm.weight", ("kv_lora",)),
    _rule(A + "linear_kv_up_proj.weight", H + "self_attn.kv_b_proj.weight", ("mla_kv_up", "kv_lora"),
          tp_axis=0, fp8=True),
    _rule(A + "linear_proj.weight", H + "self_attn.o_proj.weight", ("hidden", "mla_o"), tp_axis=1, fp8=True),
)

_DENSE_MLP = (
    _rule(L + "mlp.linear_fc1.weight", (H + "mlp.gate_proj.weight", H + "mlp.up_proj.weight"),
          ("ffn", "hidden"), fuse="gate_up", tp_axis=0, fp8=True, layers="dense"),
    _rule(L + "mlp.linear_fc2.weight", H + "mlp.down_proj.weight", ("hidden", "ffn"),
          tp_axis=1, fp8=True, layers="dense"),
)


# DeepSeek-V3 and GLM-4.5 share the MoE block: sigmoid router with a selection bias.
_SIGMOID_MOE = (
    _rule(L + "mlp.router.weight", H + "mlp.gate.weight", ("experts", "hidden"), layers="moe"),
    _rule(L + "mlp.router.expert_bias", H + "mlp.gate.e_score_correction_bias", ("experts",),
          layers="moe", needs="expert_bias", buffer=True),
    *experts(H + "mlp.experts.{expert}."),
    *shared_expert(H + "mlp.shared_experts."),
)


# ----------------------------------------------------------------------------- config keys


_SIGMOID_ROUTER_KEYS = {
    "moe_router_num_groups": "n_group",
    "moe_router_group_topk": "topk_group",
    "moe_router_topk_scaling_factor": "routed_scaling_factor",
    "num_dense_layers": "first_k_dense_replace",
    "ffn_hidden_size": "intermediate_size",
    "moe_shared_expert_intermediate_size": "n_shared_experts",
}
"""config.json keys of the fields :func:`_read_sigmoid_router` reads (``Architecture.config_keys``)."""


def _read_sigmoid_router(config: dict[str, Any]) -> dict[str, Any]:
    """Routing and MoE-block fields shared by DeepSeek-V3 and GLM-4.5."""
    if config.get("quantization_config") is not None:
        method = config["quantization_config"].get("quant_method", "?")
        raise CheckpointMismatchError(
            f"config.json quantization_config (quant_method={method!r}): quantized checkpoints are not "
            "converted; dequantize to bf16 first"
        )
    topk = get_key(config, "num_experts_per_tok")
    # Absent (or null): one group. A value is read as written: 0 is not 1.
    groups, group_topk = (1 if config.get(key) is None else config[key] for key in ("n_group", "topk_group"))
    for key, value in (("n_group", groups), ("topk_group", group_topk)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise CheckpointMismatchError(f"config.json {key}={value!r}: must be an integer >= 1")
    if group_topk > groups:
        raise CheckpointMismatchError(f"config.json topk_group={group_topk} exceeds n_group={groups}")
    if group_topk == groups:
        # Every group is kept: no restriction, whatever the group scoring.
        groups = group_topk = 0
    elif topk != 2 * group_topk:
        raise CheckpointMismatchError(
            f"config.json n_group={groups}, topk_group={group_topk}, num_experts_per_tok={topk}: transformers "
            f"scores a group by its top-2 experts, Megatron-Core by its top num_experts_per_tok / topk_group "
            f"= {topk / group_topk:g}; only settings where they agree (num_experts_per_tok = 2 x topk_group) "
            "or every group is kept are supported"
        )
    first_dense = config.get("first_k_dense_replace") or 0
    shared = config.get("n_shared_experts") or 0
    return dict(
        moe_router_score_function="sigmoid",
        moe_router_pre_softmax=False,
        moe_router_enable_expert_bias=True,
        moe_router_num_groups=groups,
        moe_router_group_topk=group_topk,
        moe_router_topk_scaling_factor=float(config.get("routed_scaling_factor") or 1.0),
        num_dense_layers=first_dense,
        ffn_hidden_size=get_key(config, "intermediate_size") if first_dense else 0,
        moe_shared_expert_intermediate_size=shared * get_key(config, "moe_intermediate_size"),
    )


def _write_sigmoid_router(model: ModelConfig) -> dict[str, Any]:
    groups = model.moe_router_num_groups or 1
    shared = model.moe_shared_expert_intermediate_size // model.moe_ffn_hidden_size
    if shared * model.moe_ffn_hidden_size != model.moe_shared_expert_intermediate_size:
        raise CheckpointMismatchError(
            f"model.moe_shared_expert_intermediate_size={model.moe_shared_expert_intermediate_size} is not a "
            f"multiple of model.moe_ffn_hidden_size={model.moe_ffn_hidden_size} (n_shared_experts)"
        )
    return {
        "n_group": groups,
        "topk_group": model.moe_router_group_topk or 1,
        "routed_scaling_factor": model.moe_router_topk_scaling_factor,
        "first_k_dense_replace": model.num_dense_layers,
        "intermediate_size": model.ffn_hidden_size or model.moe_ffn_hidden_size,
        "n_shared_experts": shared,
        "num_nextn_predict_layers": 0,
        **write_rope(model),
    }


def _check_sigmoid_model(model: ModelConfig, name: str) -> None:
    problems = []
    if model.moe_router_score_function != "sigmoid" or not model.moe_router_enable_expert_bias:
        problems.append("model.moe_router_score_function must be sigmoid with model.moe_router_enable_expert_bias")
    if model.moe_shared_expert_gate:
        problems.append(f"model.moe_shared_expert_gate=True: {name}'s shared experts have no gate")
    if problems:
        raise CheckpointMismatchError(f"the model cannot be exported as {name}: " + "; ".join(problems))


def _read_deepseek_v3(config: dict[str, Any]) -> dict[str, Any]:
    if config.get("rope_interleave", True) is not True:
        # Megatron's MLA always de-interleaves the rope channels (DeepSeek's layout).
        raise CheckpointMismatchError("config.json rope_interleave=False: only interleaved MLA RoPE is implemented")
    heads = get_key(config, "num_attention_heads")
    nope, rope = get_key(config, "qk_nope_head_dim"), get_key(config, "qk_rope_head_dim")
    return dict(
        **_read_sigmoid_router(config),
        **read_rope(config, allow_yarn=True),
        multi_latent_attention=True,
        qk_layernorm=True,
        num_query_groups=heads,
        head_dim=nope + rope,
        q_lora_rank=config.get("q_lora_rank"),
        kv_lora_rank=get_key(config, "kv_lora_rank"),
        qk_nope_head_dim=nope,
        qk_rope_head_dim=rope,
        v_head_dim=get_key(config, "v_head_dim"),
    )


def _write_deepseek_v3(model: ModelConfig) -> dict[str, Any]:
    _check_sigmoid_model(model, "deepseek_v3")
    if not model.multi_latent_attention:
        raise CheckpointMismatchError("the model cannot be exported as deepseek_v3: model.multi_latent_attention=False")
    return {
        **_write_sigmoid_router(model),
        "q_lora_rank": model.q_lora_rank,
        "kv_lora_rank": model.kv_lora_rank,
        "qk_nope_head_dim": model.qk_nope_head_dim,
        "qk_rope_head_dim": model.qk_rope_head_dim,
        "v_head_dim": model.v_head_dim,
        "num_key_value_heads": model.num_attention_heads,
        # transformers' own value (it recomputes it so from the rope dim on load).
        "head_dim": model.qk_rope_head_dim,
        "rope_interleave": True,
    }


def _read_glm4_moe(config: dict[str, Any]) -> dict[str, Any]:
    return dict(
        **_read_sigmoid_router(config),
        **read_rope(config, allow_yarn=False),
        qk_layernorm=bool(config.get("use_qk_norm", False)),
        add_qkv_bias=bool(config.get("attention_bias", False)),
    )


def _write_glm4_moe(model: ModelConfig) -> dict[str, Any]:
    _check_sigmoid_model(model, "glm4_moe")
    if model.multi_latent_attention:
        raise CheckpointMismatchError("the model cannot be exported as glm4_moe: model.multi_latent_attention=True")
    return {**_write_sigmoid_router(model), "use_qk_norm": model.qk_layernorm, "attention_bias": model.add_qkv_bias}


def _read_qwen2_moe(config: dict[str, Any]) -> dict[str, Any]:
    shared = config.get("shared_expert_intermediate_size") or 0
    return dict(
        **read_rope(config, allow_yarn=False),
        # transformers' Qwen2-MoE has QKV biases unless the config says qkv_bias false.
        add_qkv_bias=bool(config.get("qkv_bias", True)),
        moe_shared_expert_intermediate_size=shared,
        moe_shared_expert_gate=shared > 0,
    )


def _write_qwen2_moe(model: ModelConfig) -> dict[str, Any]:
    if model.moe_shared_expert_intermediate_size and not model.moe_shared_expert_gate:
        raise CheckpointMismatchError(
            "the model cannot be exported as qwen2_moe: its shared expert is gated (model.moe_shared_expert_gate)"
        )
    return {
        "shared_expert_intermediate_size": model.moe_shared_expert_intermediate_size,
        "qkv_bias": model.add_qkv_bias,
        **write_rope(model),
    }


QWEN3_MOE = Architecture(
    name="qwen3_moe",
    hf_class="Qwen3MoeForCausalLM",
    # transformers 5 writes num_local_experts; Hub checkpoints carry num_experts.
    experts_keys=("num_experts", "num_local_experts"),
    expert_ffn_key="moe_intermediate_size",
    norm_topk_key="norm_topk_prob",
    qk_layernorm=True,
    supported_values={
        **COMMON_UNSUPPORTED, "decoder_sparse_step": 1, "mlp_only_layers": [], "attention_bias": False,
        "use_sliding_window": False,
    },
    rules=(
        *EMBEDDING_AND_NORMS, *GQA_WITH_BIAS,
        _rule(L + "mlp.router.weight", H + "mlp.gate.weight", ("experts", "hidden")),
        *experts(H + "mlp.experts.{expert}."),
    ),
)

MIXTRAL = Architecture(
    name="mixtral",
    hf_class="MixtralForCausalLM",
    experts_keys=("num_local_experts",),
    expert_ffn_key="intermediate_size",
    # Mixtral always renormalizes its top-K softmax weights.
    norm_topk_key=None,
    qk_layernorm=False,
    supported_values={**COMMON_UNSUPPORTED, "sliding_window": None, "attention_bias": False},
    rules=(
        *EMBEDDING_AND_NORMS, *QKV_AND_OUTPUT,
        _rule(L + "mlp.router.weight", H + "block_sparse_moe.gate.weight", ("experts", "hidden")),
        # w1 is the gate projection, w3 the up projection, w2 the down projection.
        *experts(H + "block_sparse_moe.experts.{expert}.", gate="w1", up="w3", down="w2"),
    ),
)

DEEPSEEK_V3 = Architecture(
    name="deepseek_v3",
    hf_class="DeepseekV3ForCausalLM",
    experts_keys=("n_routed_experts",),
    expert_ffn_key="moe_intermediate_size",
    # Megatron normalizes sigmoid gates over the top-K; un-normalized ones are refused.
    norm_topk_key=None,
    qk_layernorm=True,
    supported_values={
        **COMMON_UNSUPPORTED, "norm_topk_prob": True, "attention_bias": False,
        "scoring_func": "sigmoid", "topk_method": "noaux_tc", "moe_layer_freq": 1,
    },
    rules=(*EMBEDDING_AND_NORMS, *_MLA, *_DENSE_MLP, *_SIGMOID_MOE),
    score_function="sigmoid",
    read_extra=_read_deepseek_v3,
    write_extra=_write_deepseek_v3,
    config_keys=_SIGMOID_ROUTER_KEYS,
)

GLM4_MOE = Architecture(
    name="glm4_moe",
    hf_class="Glm4MoeForCausalLM",
    experts_keys=("n_routed_experts",),
    expert_ffn_key="moe_intermediate_size",
    norm_topk_key=None,
    # use_qk_norm decides (GLM-4.5 and -Air: false).
    qk_layernorm=None,
    supported_values={**COMMON_UNSUPPORTED, "norm_topk_prob": True},
    rules=(*EMBEDDING_AND_NORMS, *GQA_WITH_BIAS, *_DENSE_MLP, *_SIGMOID_MOE),
    score_function="sigmoid",
    read_extra=_read_glm4_moe,
    write_extra=_write_glm4_moe,
    config_keys=_SIGMOID_ROUTER_KEYS,
)

QWEN2_MOE = Architecture(
    name="qwen2_moe",
    hf_class="Qwen2MoeForCausalLM",
    experts_keys=("num_experts",),
    expert_ffn_key="moe_intermediate_size",
    norm_topk_key="norm_topk_prob",
    qk_layernorm=False,
    supported_values={
        **COMMON_UNSUPPORTED, "decoder_sparse_step": 1, "mlp_only_layers": [], "use_sliding_window": False,
    },
    rules=(
        *EMBEDDING_AND_NORMS, *GQA_WITH_BIAS,
        _rule(L + "mlp.router.weight", H + "mlp.gate.weight", ("experts", "hidden")),
        *experts(H + "mlp.experts.{expert}."),
        *shared_expert(H + "mlp.shared_expert."),
        _rule(L + "mlp.shared_experts.gate_weight", H + "mlp.shared_expert_gate.weight", ("one", "hidden"),
              needs="shared_expert_gate"),
    ),
    read_extra=_read_qwen2_moe,
    write_extra=_write_qwen2_moe,
    config_keys={"moe_shared_expert_intermediate_size": "shared_expert_intermediate_size"},
)

# Kimi-K2 ships DeepSeek-V3's architecture and tensor names under its own model_type (so
# that engines can tell them apart); transformers itself knows it only as deepseek_v3 (its
# kimi_k25 reads a kimi_k2 text model that way: models/kimi_k25/configuration_kimi_k25.py).
KIMI_K2 = dataclasses.replace(DEEPSEEK_V3, name="kimi_k2", transformers_model_type="deepseek_v3")

ARCHITECTURES: Registry[Architecture] = Registry("checkpoint architecture")
"""Every supported HF ``model_type`` and its table."""
for _arch in (QWEN3_MOE, MIXTRAL, DEEPSEEK_V3, KIMI_K2, GLM4_MOE, QWEN2_MOE, GPT_OSS, QWEN3_NEXT, QWEN3_5_MOE,
              QWEN3_5_MOE_TEXT):
    ARCHITECTURES.register(_arch.name)(_arch)


_LAYER_INDEX = re.compile(r"^model\.layers\.(\d+)\.")


def mtp_tensor_names(config: dict[str, Any], names: Iterable[str]) -> list[str]:
    """Tensors of the checkpoint's MTP layers (past ``num_hidden_layers``), which conversion skips."""
    if not config.get("num_nextn_predict_layers"):
        return []
    layers = config.get("num_hidden_layers") or 0
    return sorted(n for n in names if (m := _LAYER_INDEX.match(n)) and int(m.group(1)) >= layers)
