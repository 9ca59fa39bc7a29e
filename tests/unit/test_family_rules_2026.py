"""GPT-OSS, Qwen3-Next and Qwen3.5-MoE without a process group: config translation and refusals,
the layouts their tensors are permuted into (held to transformers' own code), MXFP4, the layouts
Megatron allows them, SGLang 0.5.23's loaders (read from its model files) and the stand-in and
hf-engine loads of a weight push.

The configs are written as the released checkpoints spell them: gpt-oss-20b's config.json (MXFP4
experts), Qwen3.5-35B-A3B's and Qwen3-Next-80B-A3B's (transformers' defaults are those models,
but for Qwen3.5's RoPE base and context length, set as released).
"""

import ast
import copy
import dataclasses
import importlib.util
import json
import re
from pathlib import Path

import pytest
import torch

from megatron_rl.checkpoint.errors import CheckpointMismatchError
from megatron_rl.checkpoint.hf_config import hf_config_from_model, model_config_from_hf
from megatron_rl.checkpoint.hf_io import HFCheckpoint
from megatron_rl.checkpoint.mapping import (
    ARCHITECTURES,
    all_weights,
    fuse,
    hf_name_map,
    hf_tensor_shapes,
    section_shard,
    split,
    unshard_sections,
)
from megatron_rl.checkpoint.mxfp4 import dequantize
from megatron_rl.config_loading import ConfigError
from megatron_rl.sections import ModelConfig, ParallelConfig, validate_layout

GPT_OSS_20B = {
    "architectures": ["GptOssForCausalLM"], "attention_bias": True, "attention_dropout": 0.0,
    "eos_token_id": 200002, "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880,
    "initial_context_length": 4096, "initializer_range": 0.02, "intermediate_size": 2880,
    "layer_types": ["sliding_attention", "full_attention"] * 12, "max_position_embeddings": 131072,
    "model_type": "gpt_oss", "num_attention_heads": 64, "num_experts_per_tok": 4, "num_hidden_layers": 24,
    "num_key_value_heads": 8, "num_local_experts": 32, "output_router_logits": False, "pad_token_id": 199999,
    "quantization_config": {"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                       "model.embed_tokens", "lm_head"], "quant_method": "mxfp4"},
    "rms_norm_eps": 1e-05, "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                                            "original_max_position_embeddings": 4096, "rope_type": "yarn",
                                            "truncate": False},
    "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0,
    "tie_word_embeddings": False, "use_cache": True, "vocab_size": 201088,
}
TINY = dict(vocab_size=64, hidden_size=32, num_layers=4, num_attention_heads=4, num_query_groups=2, head_dim=8,
            num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=16, max_position_embeddings=64)
GPT_OSS = ModelConfig(**TINY, qk_layernorm=False, add_qkv_bias=True, add_bias_linear=True, attention_sinks=True,
                      layer_types=["sliding_attention", "full_attention"] * 2, sliding_window=4,
                      activation_func="quick_gelu", activation_func_clamp_value=7.0, glu_linear_offset=1.0)
QWEN_NEXT = ModelConfig(**TINY, layer_types=["linear_attention", "full_attention"] * 2, attention_output_gate=True,
                        norm_zero_centered=True, rotary_percent=0.25, moe_shared_expert_intermediate_size=24,
                        moe_shared_expert_gate=True, linear_num_key_heads=2, linear_num_value_heads=4,
                        linear_key_head_dim=8, linear_value_head_dim=6, linear_conv_kernel_dim=3)
MODELS = {"gpt_oss": GPT_OSS, "qwen3_next": QWEN_NEXT, "qwen3_5_moe": QWEN_NEXT, "qwen3_5_moe_text": QWEN_NEXT}
SRT = Path(importlib.util.find_spec("sglang").submodule_search_locations[0]) / "srt"


def _hub_configs() -> dict:
    import transformers as tf

    qwen35 = tf.Qwen3_5MoeConfig().to_dict()
    qwen35["architectures"] = ["Qwen3_5MoeForConditionalGeneration"]
    # The release differs from transformers' defaults in two keys: RoPE base 1e7 (as Qwen3-Next;
    # miles' recipe sets --rotary-base 10000000) and 262144 positions.
    qwen35["text_config"]["rope_parameters"]["rope_theta"] = 10_000_000.0
    qwen35["text_config"].update(max_position_embeddings=262144, attn_output_gate=True, mamba_ssm_dtype="float32")
    return {"gpt_oss": GPT_OSS_20B, "qwen3_5_moe": qwen35, "qwen3_next": tf.Qwen3NextConfig().to_dict()}


def test_released_configs_map_every_feature_and_round_trip():
    configs = _hub_configs()
    oss = model_config_from_hf(configs["gpt_oss"], "bfloat16")
    assert oss.layer_types[:2] == ["sliding_attention", "full_attention"] and oss.sliding_window == 128
    assert oss.attention_sinks and oss.add_bias_linear and oss.activation_func == "quick_gelu"
    assert (oss.activation_func_clamp_value, oss.glu_linear_offset) == (7.0, 1.0)
    assert oss.rope_scaling == "yarn" and oss.yarn_factor == 32 and not oss.yarn_truncate
    assert (oss.num_experts, oss.moe_router_topk, oss.moe_ffn_hidden_size) == (32, 4, 2880)
    qwen = model_config_from_hf(configs["qwen3_5_moe"], "bfloat16")
    assert qwen.mixer_types.count("linear_attention") == 30 and qwen.mixer_types[3] == "full_attention"
    assert (qwen.num_experts, qwen.moe_router_topk, qwen.moe_shared_expert_intermediate_size) == (256, 8, 512)
    assert qwen.attention_output_gate and qwen.norm_zero_centered and qwen.rotary_percent == 0.25
    assert (qwen.linear_num_key_heads, qwen.linear_num_value_heads, qwen.linear_value_head_dim) == (16, 32, 128)
    assert model_config_from_hf(configs["qwen3_next"], "bfloat16").num_experts == 512
    for name, config in configs.items():
        model = model_config_from_hf(config, "bfloat16")
        assert model_config_from_hf(hf_config_from_model(name, model), "bfloat16") == model, name


@pytest.mark.parametrize("family, changes, named", [
    ("gpt_oss", {"quantization_config": {"quant_method": "fp8"}}, "quantization_config.quant_method='fp8'"),
    ("gpt_oss", {"swiglu_alpha": 1.5}, "swiglu_alpha=1.5"),
    ("gpt_oss", {"attention_bias": False}, "attention_bias=False"),
    ("gpt_oss", {"rope_scaling": {"rope_type": "longrope", "factor": 2.0}}, "rope_scaling.rope_type='longrope'"),
    ("qwen3_next", {"layer_types": ["sliding_attention"] * 48}, "layer_types"),
    ("qwen3_next", {"linear_num_key_heads": None}, "'linear_num_key_heads' is missing"),
    ("qwen3_next", {"mlp_only_layers": [1]}, "mlp_only_layers=[1]"),
    ("qwen3_next", {"linear_num_value_heads": 24}, "linear_num_value_heads"),
])
def test_configs_megatron_would_compute_differently_are_refused_naming_the_key(family, changes, named):
    config = copy.deepcopy(_hub_configs()[family])
    config.update(changes)
    with pytest.raises(CheckpointMismatchError, match=re.escape(named)):
        model_config_from_hf(config, "bfloat16")


def test_a_qwen35_config_without_its_text_config_is_named():
    config = {k: v for k, v in _hub_configs()["qwen3_5_moe"].items() if k != "text_config"}
    with pytest.raises(CheckpointMismatchError, match="'text_config' is missing"):
        model_config_from_hf(config, "bfloat16")


@pytest.mark.parametrize("arch, model, field", [
    ("qwen3_moe", dataclasses.replace(GPT_OSS, qk_layernorm=True), "model.attention_sinks=True"),
    ("gpt_oss", dataclasses.replace(QWEN_NEXT, qk_layernorm=False), "model.norm_zero_centered=True"),
    ("qwen2_moe", dataclasses.replace(QWEN_NEXT, qk_layernorm=False), "model.layer_types="),
    ("qwen3_next", dataclasses.replace(GPT_OSS, qk_layernorm=True), "model.add_bias_linear=True"),
])
def test_a_family_without_the_feature_refuses_to_export_it(arch, model, field):
    with pytest.raises(CheckpointMismatchError, match=re.escape(field)):
        hf_config_from_model(arch, model)


@pytest.mark.parametrize("parallel, key, words", [
    (ParallelConfig(context_parallel_size=2), "parallel.context_parallel_size", "must be 1 with Gated DeltaNet layers"),
    (ParallelConfig(tensor_model_parallel_size=4), "parallel.tensor_model_parallel_size",
     "must divide model.linear_num_key_heads (2)"),
])
def test_layouts_megatron_does_not_allow_the_delta_net_are_refused(parallel, key, words):
    with pytest.raises(ConfigError, match=re.escape(key) + ".*" + re.escape(words)):
        validate_layout(dataclasses.replace(QWEN_NEXT, num_query_groups=4), parallel)
    validate_layout(GPT_OSS, ParallelConfig(context_parallel_size=2))  # GPT-OSS's windows and sinks take CP


def test_biased_experts_refuse_expert_tensor_parallelism():
    with pytest.raises(ConfigError, match="parallel.expert_tensor_parallel_size: must be 1 with biased experts"):
        validate_layout(GPT_OSS, ParallelConfig(tensor_model_parallel_size=2, expert_tensor_parallel_size=2))


# ----------------------------------------------------------------------------- layouts


def _bound(arch: str, megatron_suffix: str, layer: int = 0):
    return next(w for w in all_weights(ARCHITECTURES.get(arch), MODELS[arch])
                if w.layer == layer and w.megatron.endswith(megatron_suffix) and w.expert in (None, 1))


def _random_parts(weight) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(shape, generator=gen) for shape in weight.hf_shapes]


@pytest.mark.parametrize("arch, suffix", [
    ("gpt_oss", "linear_fc1.weight"), ("gpt_oss", "linear_fc1.bias"), ("gpt_oss", "linear_fc2.weight"),
    ("gpt_oss", "linear_fc2.bias"), ("qwen3_next", "in_proj.weight"), ("qwen3_next", "linear_qkv.weight"),
    ("qwen3_5_moe", "in_proj.weight"), ("qwen3_5_moe", "conv1d.weight"),
])
def test_every_new_layout_is_a_permutation_split_inverts(arch, suffix):
    weight = _bound(arch, suffix, layer=1 if suffix == "linear_qkv.weight" else 0)
    parts = _random_parts(weight)
    full = fuse(weight, parts, MODELS[arch])
    assert tuple(full.shape) == weight.megatron_shape
    expected = [p[weight.expert] if weight.rule.stacked else p for p in parts]
    assert all(torch.equal(a, b) for a, b in zip(split(weight, full, MODELS[arch]), expected))
    assert sorted(full.flatten().tolist()) == sorted(torch.cat([p.flatten() for p in expected]).tolist())


def test_gpt_oss_experts_compute_transformers_gate_and_up():
    """fc1 rows [gate; up] of an expert equal transformers' ``gate_up[..., ::2]`` and ``[..., 1::2]``."""
    weight, bias = _bound("gpt_oss", "linear_fc1.weight"), _bound("gpt_oss", "linear_fc1.bias")
    gate_up, gate_up_bias = _random_parts(weight)[0], _random_parts(bias)[0]
    x = torch.randn(5, GPT_OSS.hidden_size)
    hf = x @ gate_up[1] + gate_up_bias[1]
    ours = x @ fuse(weight, [gate_up], GPT_OSS).T + fuse(bias, [gate_up_bias], GPT_OSS)
    gate, up = ours.chunk(2, dim=-1)
    torch.testing.assert_close(gate, hf[..., ::2]) and torch.testing.assert_close(up, hf[..., 1::2])


def test_qwen3_next_in_proj_is_transformers_ordering():
    """Megatron's in_proj rows [q; k; v; z; b; a] against transformers' own
    ``Qwen3NextGatedDeltaNet.fix_query_key_value_ordering`` of the grouped projections."""
    import transformers as tf
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

    m = QWEN_NEXT
    config = tf.Qwen3NextConfig(hidden_size=m.hidden_size, linear_num_key_heads=m.linear_num_key_heads,
                                linear_num_value_heads=m.linear_num_value_heads, linear_key_head_dim=m.linear_key_head_dim,
                                linear_value_head_dim=m.linear_value_head_dim, linear_conv_kernel_dim=3,
                                num_hidden_layers=1, layer_types=["linear_attention"])
    net = Qwen3NextGatedDeltaNet(config, 0)
    weight = _bound("qwen3_next", "in_proj.weight")
    x = torch.randn(1, 3, m.hidden_size)
    qkvz, ba = _random_parts(weight)
    expected = [t.reshape(1, 3, -1) for t in net.fix_query_key_value_ordering(x @ qkvz.T, x @ ba.T)]
    qk, v, heads = m.linear_num_key_heads * m.linear_key_head_dim, m.linear_num_value_heads * m.linear_value_head_dim, 4
    ours = (x @ fuse(weight, [qkvz, ba], m).T).split([qk, qk, v, v, heads, heads], dim=-1)
    for a, b in zip(ours, expected):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_gated_queries_are_transformers_chunks():
    """Per query group Megatron reads queries, gates, key, value; transformers chunks each head's 2 D rows."""
    m = QWEN_NEXT
    weight = _bound("qwen3_next", "linear_qkv.weight", layer=1)
    q, k, v = _random_parts(weight)
    x = torch.randn(3, m.hidden_size)
    hf_query, hf_gate = (x @ q.T).view(3, m.num_attention_heads, 2 * m.head_dim).chunk(2, dim=-1)
    mixed = (x @ fuse(weight, [q, k, v], m).T).view(3, m.num_query_groups, -1)
    per_group = m.num_attention_heads // m.num_query_groups * m.head_dim
    query, gate, key, value = mixed.split([per_group, per_group, m.head_dim, m.head_dim], dim=-1)
    torch.testing.assert_close(query.reshape(3, -1, m.head_dim), hf_query, rtol=0, atol=0)
    torch.testing.assert_close(gate.reshape(3, -1, m.head_dim), hf_gate, rtol=0, atol=0)
    torch.testing.assert_close(key.reshape(3, -1), x @ k.T, rtol=0, atol=0)


def test_sections_split_over_tp_and_come_back():
    full = torch.arange(24.0)[:, None].repeat(1, 3)
    sections = [4, 4, 8, 8]
    shards = [section_shard(full, sections, r, 2) for r in range(2)]
    assert shards[0][:, 0].tolist() == [0, 1, 4, 5, 8, 9, 10, 11, 16, 17, 18, 19]
    assert torch.equal(unshard_sections(shards, sections), full)
    with pytest.raises(CheckpointMismatchError, match="do not split over TP=3"):
        section_shard(full, sections, 0, 3)


def test_stacked_experts_are_given_once_whole():
    arch = ARCHITECTURES.get("gpt_oss")
    name_map = hf_name_map(arch, GPT_OSS)
    gen = torch.Generator().manual_seed(0)
    seen = {}
    for weight in all_weights(arch, GPT_OSS):
        for name, tensor in name_map(weight.megatron, torch.randn(weight.megatron_shape, generator=gen)):
            assert name not in seen, name
            seen[name] = tuple(tensor.shape)
    assert seen == hf_tensor_shapes(arch, GPT_OSS)


# ----------------------------------------------------------------------------- MXFP4


def test_mxfp4_dequantization_is_transformers():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    gen = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 8, 2, 16), generator=gen, dtype=torch.uint8)
    scales = torch.randint(100, 140, (3, 8, 2), generator=gen, dtype=torch.uint8)
    assert torch.equal(dequantize(blocks, scales), convert_moe_packed_tensors(blocks, scales))
    assert torch.equal(dequantize(blocks[1], scales[1]), convert_moe_packed_tensors(blocks, scales)[1])


def test_mxfp4_pairs_read_as_the_weights_they_encode(tmp_path):
    from safetensors.torch import save_file

    blocks = torch.randint(0, 256, (2, 4, 1, 16), dtype=torch.uint8)
    scales = torch.full((2, 4, 1), 127, dtype=torch.uint8)
    save_file({"w_blocks": blocks, "w_scales": scales, "b": torch.zeros(2, dtype=torch.bfloat16)},
              str(tmp_path / "model.safetensors"))
    ckpt = HFCheckpoint(tmp_path)
    assert sorted(ckpt.names()) == ["b", "w"] and ckpt.shape("w") == (2, 32, 4) and ckpt.dtype("w") == torch.bfloat16
    assert torch.equal(ckpt.get("w", 1), dequantize(blocks, scales)[1])
    save_file({"w_blocks": blocks, "stray": blocks.clone()}, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointMismatchError, match="uint8 tensors that are not MXFP4 block/scale pairs: .*stray"):
        HFCheckpoint(tmp_path)


# ----------------------------------------------------------------------------- SGLang 0.5.23


def _function(relative: str, owner: str, name: str) -> str:
    tree = ast.parse((SRT / relative).read_text())
    for cls in ast.walk(tree):
        if isinstance(cls, ast.ClassDef) and cls.name == owner:
            for node in cls.body:
                if isinstance(node, ast.FunctionDef) and node.name == name:
                    return ast.unparse(node)
    raise AssertionError(f"{relative}: no {owner}.{name}")


def test_sglang_loaders_are_as_the_rules_say():
    """The lines ``rollout/sglang/loader_rules.py`` cites, as SGLang 0.5.23 has them."""
    from megatron_rl.rollout.sglang.loader_rules import RULES, unknown_name_outcome

    oss = _function("models/gpt_oss.py", "GptOssForCausalLM", "_load_normal_weights")
    assert "make_expert_params_mapping_fused(ckpt_gate_up_proj_name='gate_up_proj'" in oss
    assert "ckpt_gate_up_proj_bias_name='gate_up_proj_bias'" in oss and "if 'sinks' in name" in oss
    assert oss.count("if name not in params_dict:\n") >= 3  # unknown names: skipped, no error
    nxt = _function("models/qwen3_next.py", "Qwen3NextForCausalLM", "load_weights")
    assert re.search(r"if not is_mtp and 'mtp' in name:\s+continue", nxt)
    assert re.search(r"if name.endswith\('_scale'\) and name not in params_dict:.*?param = params_dict\[name\]", nxt, re.S)
    vlm = _function("models/qwen3_5.py", "Qwen3_5MoeForConditionalGeneration", "load_weights")
    assert "name = name.replace('model.language_model.', 'model.')" in vlm
    assert "('in_proj_qkvz.', 'in_proj_qkv.', (0, 1, 2))" in vlm and "('in_proj_ba.', 'in_proj_a.', 1)" in vlm
    assert "logger.warning(f'Parameter {name} not found in params_dict')" in vlm
    # Routes: one column per decoder layer of the text model (Qwen3.5: text_config's count), the MTP
    # draft's routers never captured, so no route of an MTP layer can reach a record or replay.
    capturer = (SRT / "state_capturer/routed_experts.py").read_text()
    assert "num_layers = model_config.hf_text_config.num_hidden_layers" in capturer
    assert "def disable_routed_experts_capture_for_draft(model: Any) -> None:" in capturer
    assert "disable_routed_experts_capture_for_draft(self.model)" in (SRT / "model_executor/model_runner.py").read_text()
    assert unknown_name_outcome(RULES["qwen3_next"], "model.layers.0.linear_attn.bogus") == "KeyError"
    assert unknown_name_outcome(RULES["qwen3_5_moe"], "model.layers.0.linear_attn.bogus") == "skipped"
    assert unknown_name_outcome(RULES["gpt_oss"], "model.layers.0.mlp.bogus") == "skipped"


@pytest.mark.parametrize("arch", ["gpt_oss", "qwen3_next", "qwen3_5_moe"])
def test_every_pushed_name_reaches_an_sglang_parameter(arch):
    """Each name weight sync pushes is one SGLang's loader routes to a parameter: a stacked or
    expert mapping of its load_weights, or a module attribute its model file creates."""
    relative, owner, method = {"gpt_oss": ("models/gpt_oss.py", "GptOssForCausalLM", "_load_normal_weights"),
                               "qwen3_next": ("models/qwen3_next.py", "Qwen3NextForCausalLM", "load_weights"),
                               "qwen3_5_moe": ("models/qwen3_5.py", "Qwen3_5MoeForConditionalGeneration",
                                               "load_weights")}[arch]
    loader = _function(relative, owner, method)
    source = (SRT / relative).read_text() + (SRT / "models/qwen2_moe.py").read_text()
    mapped = re.findall(r"\('[\w.]+', '([\w.]+)', ", loader) + ["gate_proj", "up_proj", "down_proj", "gate_up_proj",
                                                             "down_proj_bias", "gate_up_proj_bias"]
    for name in hf_tensor_shapes(ARCHITECTURES.get(arch), MODELS[arch]):
        if any(fragment in name for fragment in mapped):
            continue
        module = name.rsplit(".", 2)[-2] if name.endswith((".weight", ".bias")) else name.rsplit(".", 1)[-1]
        assert re.search(rf"self\.{module}\b\s*=", source), (arch, name, module)


@pytest.mark.parametrize("arch", ["gpt_oss", "qwen3_next", "qwen3_5_moe"])
def test_the_stand_in_loads_a_whole_push_under_sglangs_rules(arch):
    from megatron_rl.sglang_standin.weights import ServedWeights

    table, model = ARCHITECTURES.get(arch), MODELS[arch]
    weights = all_weights(table, model)
    gen = torch.Generator().manual_seed(0)
    expected = {w.megatron: torch.randn(w.megatron_shape, generator=gen) for w in weights}
    name_map = hf_name_map(table, model)
    pushed = [pair for w in weights for pair in name_map(w.megatron, expected[w.megatron])]
    served = ServedWeights({n: torch.zeros_like(t) for n, t in expected.items()}, model, arch)
    served.begin()
    assert served.load(pushed) == len(pushed)
    served.end()
    report = served.last_session
    assert report.not_updated == [] and report.skipped == [] and report.dropped == []
    assert all(torch.equal(served.params[n], t) for n, t in expected.items())


# ----------------------------------------------------------------------------- hf engine


@pytest.mark.parametrize("arch", ["gpt_oss", "qwen3_next", "qwen3_5_moe"])
def test_hf_engine_replica_takes_the_push_as_from_pretrained_does(arch, tmp_path):
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from megatron_rl.rollout.local.hf_model import HFWeightLoader, build_hf_model

    table, model = ARCHITECTURES.get(arch), MODELS[arch]
    name_map = hf_name_map(table, model)
    gen = torch.Generator().manual_seed(0)
    named = dict(pair for w in all_weights(table, model)
                 for pair in name_map(w.megatron, torch.randn(w.megatron_shape, generator=gen)))
    text = "qwen3_5_moe_text" if arch == "qwen3_5_moe" else arch
    save_file({k.replace("model.language_model.", "model."): v.contiguous() for k, v in named.items()},
              str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(hf_config_from_model(text, model)))
    expected = AutoModelForCausalLM.from_pretrained(str(tmp_path)).state_dict()
    replica = build_hf_model(arch, model)
    loader = HFWeightLoader(replica, arch)
    with torch.no_grad():
        for name, tensor in named.items():
            loader.load(name, tensor)
    loader.finish()
    got = replica.state_dict()
    assert sorted(got) == sorted(expected)
    assert all(torch.equal(got[n], t) for n, t in expected.items())


# ----------------------------------------------------------------------------- presets


@pytest.mark.parametrize("preset, family", [("gpt_oss_20b_1node", "gpt_oss"), ("qwen35_35b_a3b_1node", "qwen3_5_moe")])
def test_one_node_presets_plan_to_fit_and_hold_the_released_model(preset, family):
    """Planned as ``megatron-rl-plan --config configs/<preset>.yaml --gpu-memory 80GiB --host-memory
    2TiB`` plans them; their model section is the released config.json's."""
    from megatron_rl.plan.cli import load_plan_config
    from megatron_rl.plan.machine import Machine
    from megatron_rl.plan.report import make_plan

    path = Path(__file__).resolve().parents[2] / "configs" / f"{preset}.yaml"
    cfg = load_plan_config(str(path), ["init_checkpoint=null"])
    plan = make_plan(cfg, Machine(gpus=8, gpu_memory=80 << 30, host_memory=2 << 40))
    assert plan.fits and plan.layout.world == 8, plan
    released = model_config_from_hf(_hub_configs()[family], "bfloat16")
    assert cfg.model == dataclasses.replace(released, init_method_std=cfg.model.init_method_std)


def test_hf_generation_drops_finished_rows_of_a_delta_net_cache():
    """A batch whose rows stop at different steps decodes as each row alone (no padding, no
    neighbours): the rows leaving the batch take their convolution and recurrent states along."""
    from megatron_rl.rollout.engine import SamplingParams
    from megatron_rl.rollout.local.hf_generate import generate
    from megatron_rl.rollout.local.hf_model import build_hf_model

    torch.manual_seed(0)
    model = build_hf_model("qwen3_next", dataclasses.replace(QWEN_NEXT, vocab_size=64))
    prompts = [[5, 6, 7, 8], [9, 10], [11, 12, 13]]
    stops = tuple(range(24))  # over a third of the vocabulary: rows stop at different steps
    params = SamplingParams(temperature=1.0, max_new_tokens=6, stop_token_ids=stops)
    batch = generate(model, prompts, params, generator=torch.Generator().manual_seed(1), return_routes=False,
                     max_length=64)
    assert len({len(g.output_ids) for g in batch}) > 1
    for prompt, got in zip(prompts, batch):
        ids = torch.tensor([prompt + got.output_ids[:-1]])
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=ids).logits[0].float(), -1)[len(prompt) - 1:]
        expected = logp.gather(1, torch.tensor(got.output_ids)[:, None])[:, 0]
        torch.testing.assert_close(got.logprobs, expected, rtol=0, atol=1e-4)
