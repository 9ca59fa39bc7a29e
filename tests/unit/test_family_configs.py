"""DeepSeek-V3 / GLM-4.5 / Qwen2-MoE config translation and refusals (no Megatron, no files).

Configs are written as the Hub checkpoints spell them (``rope_scaling`` + ``rope_theta``,
``scoring_func``, ``topk_method``) or as transformers 5 saves them (``rope_parameters``).
"""

import copy
import dataclasses
from pathlib import Path

import pytest
import torch

from megatron_rl.checkpoint.errors import CheckpointMismatchError
from megatron_rl.checkpoint.families import (
    DEEPSEEK_V3,
    GLM4_MOE,
    QWEN2_MOE,
    mtp_tensor_names,
)
from megatron_rl.checkpoint.hf_config import hf_config_from_model, model_config_from_hf
from megatron_rl.checkpoint.mapping import (
    all_weights,
    bound_for_megatron_name,
    fuse,
    split,
)
from megatron_rl.config_loading import ConfigError
from megatron_rl.sections import ParallelConfig, validate_layout, validate_model

# DeepSeek-V3's own config.json, shrunk (the keys and kinds of values as published).
DEEPSEEK_V3_HUB = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 256,
    "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 16, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 4, "n_shared_experts": 1, "n_routed_experts": 16,
    "routed_scaling_factor": 2.5, "kv_lora_rank": 32, "q_lora_rank": 48, "qk_rope_head_dim": 8,
    "v_head_dim": 16, "qk_nope_head_dim": 16, "topk_method": "noaux_tc", "n_group": 8, "topk_group": 4,
    "num_experts_per_tok": 8, "moe_layer_freq": 1, "first_k_dense_replace": 1, "norm_topk_prob": True,
    "scoring_func": "sigmoid", "aux_loss_alpha": 0.001, "seq_aux": True, "hidden_act": "silu",
    "max_position_embeddings": 1024, "initializer_range": 0.02, "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False, "rope_theta": 10000, "attention_bias": False, "num_nextn_predict_layers": 1,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
}


def _with(config, **changes):
    out = copy.deepcopy(config)
    out.update(changes)
    return out


def test_deepseek_v3_hub_config_maps_every_feature():
    m = model_config_from_hf(DEEPSEEK_V3_HUB, "bfloat16")
    assert m.multi_latent_attention and m.q_lora_rank == 48 and m.kv_lora_rank == 32
    assert (m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim) == (16, 8, 16)
    assert m.rope_scaling == "yarn" and m.yarn_factor == 40 and m.yarn_original_max_position_embeddings == 4096
    assert m.yarn_mscale_all_dim == 1.0 and m.rotary_base == 10000
    assert m.num_dense_layers == 1 and m.ffn_hidden_size == 96 and m.moe_layers == (1, 2, 3)
    assert m.moe_shared_expert_intermediate_size == 16 and not m.moe_shared_expert_gate
    assert m.moe_router_score_function == "sigmoid" and m.moe_router_enable_expert_bias
    assert (m.moe_router_num_groups, m.moe_router_group_topk) == (8, 4)
    assert m.moe_router_topk_scaling_factor == 2.5


def test_deepseek_v3_config_round_trips():
    m = model_config_from_hf(DEEPSEEK_V3_HUB, "bfloat16")
    assert model_config_from_hf(hf_config_from_model("deepseek_v3", m), "bfloat16") == m


@pytest.mark.parametrize(
    "changes, named",
    [
        ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope_scaling.rope_type='dynamic'"),
        ({"rope_scaling": {**DEEPSEEK_V3_HUB["rope_scaling"], "attention_factor": 0.5}}, "attention_factor"),
        ({"topk_group": 2}, "n_group=8, topk_group=2, num_experts_per_tok=8"),
        ({"norm_topk_prob": False}, "norm_topk_prob"),
        ({"scoring_func": "softmax"}, "scoring_func"),
        ({"rope_interleave": False}, "rope_interleave"),
        ({"quantization_config": {"quant_method": "fp8"}}, "quantization_config"),
        ({"moe_layer_freq": 2}, "moe_layer_freq"),
        ({"hidden_act": "gelu"}, "hidden_act"),
    ],
)
def test_deepseek_v3_settings_the_model_would_compute_differently_are_named(changes, named):
    with pytest.raises(CheckpointMismatchError, match=named.replace("(", r"\(").replace("[", r"\[")):
        model_config_from_hf(_with(DEEPSEEK_V3_HUB, **changes), "bfloat16")


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"n_group": 3, "topk_group": 2, "num_experts_per_tok": 4},
         "config.json n_group=3: must divide n_routed_experts (16)"),
        ({"first_k_dense_replace": 4},
         "config.json first_k_dense_replace=4: must be in [0, num_hidden_layers=4) (at least one MoE layer)"),
        ({"routed_scaling_factor": -1.0}, "config.json routed_scaling_factor=-1.0: must be > 0"),
        ({"num_experts_per_tok": 20, "n_group": 1, "topk_group": 1},
         "config.json num_experts_per_tok=20: top-K (20) must not exceed n_routed_experts (16)"),
        ({"n_group": 0}, "config.json n_group=0: must be an integer >= 1"),  # was reported as n_group=1
        ({"topk_group": 0}, "config.json topk_group=0: must be an integer >= 1"),
    ],
)
def test_broken_model_rules_name_the_config_json_keys_the_user_edits(changes, message):
    """Not Megatron's field names (``moe_router_num_groups``, ``model.num_experts``)."""
    with pytest.raises(CheckpointMismatchError) as caught:
        model_config_from_hf(_with(DEEPSEEK_V3_HUB, **changes), "bfloat16")
    assert str(caught.value) == message


def test_every_group_kept_is_plain_topk():
    m = model_config_from_hf(_with(DEEPSEEK_V3_HUB, n_group=1, topk_group=1, q_lora_rank=None), "bfloat16")
    assert (m.moe_router_num_groups, m.moe_router_group_topk) == (0, 0) and m.q_lora_rank is None
    names = {w.megatron for w in all_weights(DEEPSEEK_V3, m)}
    assert "decoder.layers.0.self_attention.linear_q_proj.weight" in names
    assert not any("linear_q_down_proj" in n for n in names)


def test_deepseek_v3_table_layers():
    m = model_config_from_hf(DEEPSEEK_V3_HUB, "bfloat16")
    names = {n for w in all_weights(DEEPSEEK_V3, m) for n in w.hf}
    assert "model.layers.0.mlp.gate_proj.weight" in names and "model.layers.0.mlp.gate.weight" not in names
    assert "model.layers.1.mlp.gate.e_score_correction_bias" in names
    assert "model.layers.1.mlp.shared_experts.down_proj.weight" in names
    assert "model.layers.1.mlp.gate_proj.weight" not in names
    bias = bound_for_megatron_name(DEEPSEEK_V3, m, "decoder.layers.3.mlp.router.expert_bias")
    assert bias.rule.buffer and bias.hf == ("model.layers.3.mlp.gate.e_score_correction_bias",)
    with pytest.raises(CheckpointMismatchError, match="no entry"):
        bound_for_megatron_name(DEEPSEEK_V3, m, "decoder.layers.1.mlp.linear_fc1.weight")


def test_mtp_layers_are_found_past_the_backbone():
    names = ["model.layers.3.mlp.gate.weight", "model.layers.4.eh_proj.weight", "model.layers.4.enorm.weight"]
    assert mtp_tensor_names(DEEPSEEK_V3_HUB, names) == names[1:]
    assert mtp_tensor_names(_with(DEEPSEEK_V3_HUB, num_nextn_predict_layers=0), names) == []


GLM_AIR_LIKE = {
    "architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", "vocab_size": 256, "hidden_size": 64,
    "intermediate_size": 96, "moe_intermediate_size": 16, "num_hidden_layers": 4, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "n_shared_experts": 1, "n_routed_experts": 8,
    "routed_scaling_factor": 1.0, "n_group": 1, "topk_group": 1, "num_experts_per_tok": 2,
    "first_k_dense_replace": 1, "norm_topk_prob": True, "hidden_act": "silu", "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "rope_theta": 1000000, "partial_rotary_factor": 0.5,
    "attention_bias": True, "use_qk_norm": False, "num_nextn_predict_layers": 1,
}


def test_glm4_moe_partial_rotary_bias_and_round_trip():
    m = model_config_from_hf(GLM_AIR_LIKE, "bfloat16")
    assert m.rotary_percent == 0.5 and m.add_qkv_bias and not m.qk_layernorm and not m.multi_latent_attention
    assert model_config_from_hf(hf_config_from_model(GLM4_MOE, m), "bfloat16") == m
    with pytest.raises(CheckpointMismatchError, match="rope_type='yarn'"):
        model_config_from_hf(_with(GLM_AIR_LIKE, rope_scaling={"type": "yarn", "factor": 4.0}), "bfloat16")


def test_qwen2_moe_shared_expert_gate_and_qkv_bias():
    config = {
        "architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe", "vocab_size": 256, "hidden_size": 64,
        "intermediate_size": 96, "moe_intermediate_size": 16, "shared_expert_intermediate_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4, "num_experts": 8,
        "num_experts_per_tok": 4, "norm_topk_prob": False, "decoder_sparse_step": 1, "mlp_only_layers": [],
        "hidden_act": "silu", "max_position_embeddings": 1024, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "tie_word_embeddings": False, "use_sliding_window": False,
    }
    m = model_config_from_hf(config, "bfloat16")
    assert m.moe_shared_expert_gate and m.moe_shared_expert_intermediate_size == 64 and m.add_qkv_bias
    assert m.moe_router_pre_softmax and m.moe_router_score_function == "softmax"
    assert model_config_from_hf(hf_config_from_model(QWEN2_MOE, m), "bfloat16") == m
    bias = bound_for_megatron_name(QWEN2_MOE, m, "decoder.layers.0.self_attention.linear_qkv.bias")
    parts = [torch.arange(64.0), 100 + torch.arange(64.0), 200 + torch.arange(64.0)]
    fused = fuse(bias, parts, m)
    # Per query group (4 groups of 16 channels): q, then k, then v.
    assert fused[:48].tolist() == [*range(16), *range(100, 116), *range(200, 216)]
    assert all(torch.equal(a, b) for a, b in zip(split(bias, fused, m), parts))
    with pytest.raises(CheckpointMismatchError, match="mlp_only_layers"):
        model_config_from_hf({**config, "mlp_only_layers": [0]}, "bfloat16")


def test_model_rules_name_the_field():
    m = model_config_from_hf(DEEPSEEK_V3_HUB, "bfloat16")
    with pytest.raises(ConfigError, match="model.moe_router_group_topk"):
        validate_model(_model(m, moe_router_group_topk=3))
    # Without MLA, YaRN is GPTModel's (GPT-OSS); with MLA only the rounded ramp.
    validate_model(_model(m, multi_latent_attention=False))
    with pytest.raises(ConfigError, match="model.yarn_truncate"):
        validate_model(_model(m, yarn_truncate=False))
    # A stage of dense layers only records no routing; records are per MoE layer, by number.
    validate_layout(_model(m, num_dense_layers=2), ParallelConfig(pipeline_model_parallel_size=2))
    with pytest.raises(ConfigError, match=r"model.moe_shared_expert_intermediate_size \(18\)"):
        validate_layout(_model(m, moe_shared_expert_intermediate_size=18), ParallelConfig(tensor_model_parallel_size=4))


def _model(m, **changes):
    return dataclasses.replace(m, **changes)


# ------------------------------------------------------------------ presets of real checkpoints

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
# The published config.json of each checkpoint (the keys the converter reads, as released).
MOONLIGHT_HUB = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 163840,
    "hidden_size": 2048, "intermediate_size": 11264, "moe_intermediate_size": 1408, "num_hidden_layers": 27,
    "num_attention_heads": 16, "num_key_value_heads": 16, "n_shared_experts": 2, "n_routed_experts": 64,
    "routed_scaling_factor": 2.446, "kv_lora_rank": 512, "q_lora_rank": None, "qk_rope_head_dim": 64,
    "v_head_dim": 128, "qk_nope_head_dim": 128, "topk_method": "noaux_tc", "n_group": 1, "topk_group": 1,
    "num_experts_per_tok": 6, "moe_layer_freq": 1, "first_k_dense_replace": 1, "norm_topk_prob": True,
    "scoring_func": "sigmoid", "aux_loss_alpha": 0.001, "seq_aux": True, "hidden_act": "silu",
    "max_position_embeddings": 8192, "initializer_range": 0.02, "rms_norm_eps": 1e-5, "rope_theta": 50000.0,
    "rope_scaling": None, "attention_bias": False, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
}
GLM45_AIR_HUB = {**GLM_AIR_LIKE, "vocab_size": 151552, "hidden_size": 4096, "intermediate_size": 10944,
                 "moe_intermediate_size": 1408, "num_hidden_layers": 46, "num_attention_heads": 96,
                 "num_key_value_heads": 8, "head_dim": 128, "n_routed_experts": 128, "num_experts_per_tok": 8,
                 "max_position_embeddings": 131072, "rope_scaling": None, "torch_dtype": "bfloat16"}
QWEN15_MOE_HUB = {
    "architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe", "vocab_size": 151936, "hidden_size": 2048,
    "intermediate_size": 5632, "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632,
    "num_hidden_layers": 24, "num_attention_heads": 16, "num_key_value_heads": 16, "num_experts": 60,
    "num_experts_per_tok": 4, "norm_topk_prob": False, "decoder_sparse_step": 1, "hidden_act": "silu",
    "max_position_embeddings": 8192, "max_window_layers": 21, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
    "router_aux_loss_coef": 0.001, "sliding_window": 32768, "use_sliding_window": False,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16",
}


@pytest.mark.parametrize(
    "preset, hub",
    [("moonlight_16b_a3b.yaml", MOONLIGHT_HUB), ("glm45_air.yaml", GLM45_AIR_HUB),
     ("qwen15_moe_a27b.yaml", QWEN15_MOE_HUB)],
)
def test_preset_model_section_is_what_the_checkpoint_says(preset, hub):
    """The launcher's own check (``init_source.model_section``) accepts every key of the preset."""
    from megatron_rl.checkpoint.hf_source import HFSource
    from megatron_rl.checkpoint.init_source import InitSource, model_section
    from megatron_rl.config import read_preset

    model = model_config_from_hf(hub, "bfloat16")
    source = InitSource(kind="hf", path=CONFIGS, hf=HFSource(architecture=hub["model_type"], model=model,
                                                                index=None, files=[]))
    requested = read_preset(CONFIGS / preset)["model"]
    assert model_section(source, requested) == dataclasses.asdict(model)
    assert len(requested) >= 20


@pytest.mark.parametrize("preset, nnodes", [("moonlight_16b_a3b.yaml", 1), ("glm45_air.yaml", 4),
                                            ("qwen15_moe_a27b.yaml", 1)])
def test_presets_fit_their_intended_layouts(preset, nnodes):
    from megatron_rl.config import load_config
    from megatron_rl.fp8 import Fp8Environment
    from megatron_rl.launcher import validate_launch

    # The presets name checkpoints on a cluster's file system; their layout is what is checked here.
    cfg = load_config(CONFIGS / preset, ["init_checkpoint=null"])
    hopper = Fp8Environment(te_version="2.8.0", cuda_available=True, compute_capability=(9, 0), cuda_version="12.9")
    validate_launch(cfg, nnodes, 8, gpus_per_node=8, fp8_env=hopper)
    with pytest.raises(ConfigError, match="parallel"):
        validate_launch(cfg, nnodes + 1, 8, gpus_per_node=8, fp8_env=hopper)


def test_weight_sync_names_are_the_checkpoints():
    """Weight sync to SGLang sends HF names and layouts (the same table as conversion)."""
    from megatron_rl.checkpoint.mapping import hf_name_map

    m = model_config_from_hf(DEEPSEEK_V3_HUB, "bfloat16")
    name_map = hf_name_map(DEEPSEEK_V3, m)
    fc1 = torch.arange(2 * 16 * 64.0).reshape(32, 64)
    sent = name_map("decoder.layers.2.mlp.shared_experts.linear_fc1.weight", fc1)
    assert [n for n, _ in sent] == ["model.layers.2.mlp.shared_experts.gate_proj.weight",
                                    "model.layers.2.mlp.shared_experts.up_proj.weight"]
    assert torch.equal(torch.cat([t for _, t in sent]), fc1)
    down = name_map("decoder.layers.0.self_attention.linear_kv_down_proj.weight", torch.zeros(40, 64))
    assert [n for n, _ in down] == ["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"]
    with pytest.raises(CheckpointMismatchError, match="is \\(41, 64\\)"):
        name_map("decoder.layers.0.self_attention.linear_kv_down_proj.weight", torch.zeros(41, 64))


def test_kimi_k2_is_deepseek_v3_under_its_own_model_type():
    kimi = _with(DEEPSEEK_V3_HUB, model_type="kimi_k2", n_group=1, topk_group=1, quantization_config=None)
    m = model_config_from_hf(kimi, "bfloat16")
    assert m == model_config_from_hf(_with(kimi, model_type="deepseek_v3"), "bfloat16")
    assert hf_config_from_model("kimi_k2", m)["model_type"] == "kimi_k2"
