"""The HF <-> Megatron mapping tables, layouts and HF config translation (no Megatron, no files)."""

import pytest
import torch

from megatron_rl.checkpoint.errors import CheckpointMismatchError
from megatron_rl.checkpoint.hf_config import model_config_from_hf
from megatron_rl.checkpoint.mapping import (
    ARCHITECTURES,
    MIXTRAL,
    QWEN3_MOE,
    all_weights,
    bound_for_megatron_name,
    fuse,
    hf_name_map,
    hf_tensor_shapes,
    split,
    tp_shard,
)
from megatron_rl.sections import ModelConfig

CFG = ModelConfig(
    vocab_size=32, hidden_size=8, num_layers=2, num_attention_heads=4, num_query_groups=2,
    head_dim=2, num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=6,
)
ARCHS = [QWEN3_MOE, MIXTRAL]


def _weight(arch, megatron_name):
    return bound_for_megatron_name(arch, CFG, megatron_name)


@pytest.mark.parametrize("arch", ARCHS, ids=lambda a: a.name)
def test_every_weight_appears_once_on_each_side(arch):
    weights = all_weights(arch, CFG)
    megatron = [w.megatron for w in weights]
    hf = [n for w in weights for n in w.hf]
    assert len(set(megatron)) == len(megatron) and len(set(hf)) == len(hf)
    per_layer = 9 if arch.qk_layernorm else 7  # 2 norms, q, k, v, o, router (+ q, k norms)
    assert len(hf) == 3 + CFG.num_layers * (per_layer + 3 * CFG.num_experts)
    assert len(hf_tensor_shapes(arch, CFG)) == len(hf)


def test_registry_is_keyed_by_hf_model_type():
    assert ARCHITECTURES.get("qwen3_moe") is QWEN3_MOE and ARCHITECTURES.get("mixtral") is MIXTRAL


def test_qkv_is_interleaved_per_query_group():
    weight = _weight(QWEN3_MOE, "decoder.layers.0.self_attention.linear_qkv.weight")
    # Row r of each HF tensor carries the marker r (q), 100 + r (k), 200 + r (v).
    q = torch.arange(8.0)[:, None].expand(8, 8)
    k = 100 + torch.arange(4.0)[:, None].expand(4, 8)
    v = 200 + torch.arange(4.0)[:, None].expand(4, 8)
    fused = fuse(weight, [q, k, v], CFG)
    # Group g: its two query heads (2 rows each), then its key head, then its value head.
    expected = [0, 1, 2, 3, 100, 101, 200, 201, 4, 5, 6, 7, 102, 103, 202, 203]
    assert fused[:, 0].tolist() == expected
    assert tuple(fused.shape) == weight.megatron_shape == (16, 8)
    assert tp_shard(weight, fused, 1, 2)[:, 0].tolist() == expected[8:]


def test_swiglu_stacks_gate_then_up_and_shards_each_half():
    weight = _weight(MIXTRAL, "decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight")
    assert weight.hf == (
        "model.layers.1.block_sparse_moe.experts.3.w1.weight",
        "model.layers.1.block_sparse_moe.experts.3.w3.weight",
    )
    gate, up = torch.zeros(6, 8), torch.ones(6, 8)
    fused = fuse(weight, [gate, up], CFG)
    assert fused[:6].eq(0).all() and fused[6:].eq(1).all()
    shard = tp_shard(weight, fused, 0, 2)
    assert shard[:3].eq(0).all() and shard[3:].eq(1).all() and shard.shape == (6, 8)


def test_row_and_vocab_parallel_shards():
    proj = _weight(QWEN3_MOE, "decoder.layers.0.self_attention.linear_proj.weight")
    full = torch.arange(64.0).reshape(8, 8)
    assert torch.equal(tp_shard(proj, full, 1, 2), full[:, 4:])
    embed = _weight(QWEN3_MOE, "embedding.word_embeddings.weight")
    vocab = torch.arange(32.0)[:, None].expand(32, 8)
    assert torch.equal(tp_shard(embed, vocab, 1, 4), vocab[8:16])
    router = _weight(QWEN3_MOE, "decoder.layers.0.mlp.router.weight")
    replicated = full[:4]
    assert tp_shard(router, replicated, 1, 2) is replicated


@pytest.mark.parametrize("arch", ARCHS, ids=lambda a: a.name)
def test_split_inverts_fuse_bit_exactly(arch):
    gen = torch.Generator().manual_seed(0)
    for weight in all_weights(arch, CFG):
        parts = [torch.randn(shape, generator=gen, dtype=torch.bfloat16) for shape in weight.hf_shapes]
        fused = fuse(weight, parts, CFG)
        assert tuple(fused.shape) == weight.megatron_shape, weight.megatron
        back = split(weight, fused, CFG)
        assert all(torch.equal(a, b) for a, b in zip(parts, back)), weight.megatron
        fused_storage = fused.untyped_storage().data_ptr()
        assert all(b.is_contiguous() and b.untyped_storage().data_ptr() != fused_storage for b in back)


def test_megatron_names_resolve_to_hf_names():
    weight = _weight(QWEN3_MOE, "decoder.layers.1.mlp.experts.local_experts.2.linear_fc2.weight")
    assert (weight.layer, weight.expert) == (1, 2)
    assert weight.hf == ("model.layers.1.mlp.experts.2.down_proj.weight",)
    assert weight.hf_shapes == ((8, 6),)
    with pytest.raises(CheckpointMismatchError, match="decoder.layers.0.mlp.shared_experts.linear_fc1.weight"):
        _weight(QWEN3_MOE, "decoder.layers.0.mlp.shared_experts.linear_fc1.weight")
    with pytest.raises(CheckpointMismatchError, match="expert 4 >= num_experts 4"):
        _weight(QWEN3_MOE, "decoder.layers.0.mlp.experts.local_experts.4.linear_fc1.weight")
    with pytest.raises(CheckpointMismatchError, match="q_layernorm"):
        _weight(MIXTRAL, "decoder.layers.0.self_attention.q_layernorm.weight")


def test_name_map_for_weight_sync():
    name_map = hf_name_map(MIXTRAL, CFG)
    qkv = torch.randn(16, 8)
    pairs = name_map("decoder.layers.1.self_attention.linear_qkv.weight", qkv)
    assert [n for n, _ in pairs] == [f"model.layers.1.self_attn.{p}_proj.weight" for p in "qkv"]
    assert [tuple(t.shape) for _, t in pairs] == [(8, 8), (4, 8), (4, 8)]
    assert torch.equal(fuse(_weight(MIXTRAL, "decoder.layers.1.self_attention.linear_qkv.weight"),
                            [t for _, t in pairs], CFG), qkv)
    with pytest.raises(CheckpointMismatchError, match=r"linear_qkv.weight is \(12, 8\), the config implies \(16, 8\)"):
        name_map("decoder.layers.1.self_attention.linear_qkv.weight", torch.zeros(12, 8))


def test_fp8_flags_cover_exactly_the_linear_layers():
    quantized = {n for w in all_weights(QWEN3_MOE, CFG) if w.rule.fp8 for n in w.hf}
    kept = {n for w in all_weights(QWEN3_MOE, CFG) if not w.rule.fp8 for n in w.hf}
    assert all(n.endswith(("_proj.weight",)) for n in quantized)
    assert {n.split(".")[-2] for n in kept} == {
        "embed_tokens", "lm_head", "norm", "input_layernorm", "post_attention_layernorm", "q_norm", "k_norm", "gate",
    }


# ------------------------------------------------------------------ HF config translation

QWEN3_CONFIG = {
    "model_type": "qwen3_moe", "vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_local_experts": 8,
    "num_experts_per_tok": 2, "moe_intermediate_size": 32, "intermediate_size": 128, "norm_topk_prob": True,
    "decoder_sparse_step": 1, "mlp_only_layers": [], "tie_word_embeddings": False, "attention_bias": False,
    "use_sliding_window": False, "sliding_window": None, "hidden_act": "silu", "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6, "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"},
}
MIXTRAL_CONFIG = {
    "model_type": "mixtral", "vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "num_local_experts": 8, "num_experts_per_tok": 2,
    "intermediate_size": 32, "tie_word_embeddings": False, "sliding_window": None, "hidden_act": "silu",
    "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 1000000.0,
}


def test_qwen3_config_translation():
    model = model_config_from_hf(QWEN3_CONFIG, "bfloat16")
    assert (model.num_layers, model.num_query_groups, model.head_dim, model.num_experts) == (2, 2, 16, 8)
    assert (model.moe_ffn_hidden_size, model.moe_router_topk, model.rotary_base) == (32, 2, 1e6)
    assert model.moe_router_pre_softmax is False and model.params_dtype == "bfloat16"
    assert model_config_from_hf({**QWEN3_CONFIG, "norm_topk_prob": False}, "float32").moe_router_pre_softmax
    hub_style = {k: v for k, v in QWEN3_CONFIG.items() if k != "num_local_experts"} | {"num_experts": 8}
    assert model_config_from_hf(hub_style, "float32").num_experts == 8


def test_mixtral_config_translation_defaults_head_dim_and_reads_legacy_rope_theta():
    model = model_config_from_hf(MIXTRAL_CONFIG, "float32")
    assert model.head_dim == 16 and model.rotary_base == 1e6 and model.norm_epsilon == 1e-5
    assert model.moe_ffn_hidden_size == 32 and model.moe_router_pre_softmax is False


@pytest.mark.parametrize(
    "base, key, value",
    [
        (QWEN3_CONFIG, "mlp_only_layers", [1]),
        (QWEN3_CONFIG, "decoder_sparse_step", 2),
        (QWEN3_CONFIG, "use_sliding_window", True),
        (QWEN3_CONFIG, "tie_word_embeddings", True),
        (QWEN3_CONFIG, "attention_bias", True),
        (QWEN3_CONFIG, "rope_parameters", {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}),
        (MIXTRAL_CONFIG, "sliding_window", 4096),
        (MIXTRAL_CONFIG, "hidden_act", "gelu"),
        (QWEN3_CONFIG, "model_type", "llama"),
        (QWEN3_CONFIG, "num_experts", 6),
    ],
)
def test_unsupported_config_values_are_rejected_by_key(base, key, value):
    with pytest.raises(CheckpointMismatchError, match=key):
        model_config_from_hf({**base, key: value}, "float32")


def test_missing_required_key_is_named():
    config = {k: v for k, v in MIXTRAL_CONFIG.items() if k != "num_key_value_heads"}
    with pytest.raises(CheckpointMismatchError, match="num_key_value_heads"):
        model_config_from_hf(config, "float32")
