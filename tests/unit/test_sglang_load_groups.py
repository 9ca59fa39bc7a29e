"""SGLang's loader rules as weight sync and the stand-in apply them (no server, no process group).

Item 2 of the SGLang issue: DeepSeek-V3's loader fuses ``q_a_proj`` and ``kv_a_proj_with_mqa``
of a layer only when both arrive in one request and drops a lone half silently
(``deepseek_weight_loader.py:436-513``; test_sglang_conformance.py checks that reading of the
source). Buckets cut by bytes alone split the pair; the bucketer never does, and the
stand-in drops a split pair exactly as SGLang does (and reports it).
"""

import pytest
import torch

from megatron_rl.checkpoint.mapping import (
    ARCHITECTURES,
    all_weights,
    hf_name_map,
    to_hf,
)
from megatron_rl.rollout.sglang.loader_rules import (
    Bucketer,
    load_group,
    loader_rules,
    unknown_name_outcome,
)
from megatron_rl.sglang_standin.weights import ServedWeights
from megatron_rl.sections import ModelConfig

DEEPSEEK = ModelConfig(vocab_size=64, hidden_size=32, num_layers=3, num_attention_heads=2, num_query_groups=2,
                       head_dim=8, num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=16, ffn_hidden_size=48,
                       max_position_embeddings=64, multi_latent_attention=True, q_lora_rank=16, kv_lora_rank=16,
                       qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, num_dense_layers=1,
                       moe_shared_expert_intermediate_size=16, moe_router_score_function="sigmoid",
                       moe_router_enable_expert_bias=True)


def _stream(cfg: ModelConfig) -> list[tuple[str, torch.Tensor]]:
    """Every HF tensor of a model in the order weight sync produces them (Megatron's natural order)."""
    rules = loader_rules("deepseek_v3")
    name_map = hf_name_map(ARCHITECTURES.get("deepseek_v3"), cfg)
    gen = torch.Generator().manual_seed(0)
    out = []
    for weight in all_weights(ARCHITECTURES.get("deepseek_v3"), cfg):
        full = torch.randn(weight.megatron_shape, generator=gen)
        out.extend(name_map(weight.megatron, full))
    assert any(load_group(rules, cfg, n) for n, _ in out)
    return out


def test_buckets_never_split_a_pair_deepseek_loads_together():
    rules = loader_rules("deepseek_v3")
    stream = _stream(DEEPSEEK)
    sizes = {}
    for name, _ in stream:
        if (group := load_group(rules, DEEPSEEK, name)) is not None:
            sizes[group] = sizes.get(group, 0) + 1
    assert len(sizes) == DEEPSEEK.num_layers and set(sizes.values()) == {2}
    for limit in (1, 700, 4096, 1 << 20):
        bucketer = Bucketer(limit, lambda n: load_group(rules, DEEPSEEK, n), sizes)
        buckets = [b for n, t in stream for b in bucketer.add(n, t)] + bucketer.finish()
        assert [n for b in buckets for n, _ in b] != [] and sorted(n for b in buckets for n, _ in b) == sorted(
            n for n, _ in stream)
        for bucket in buckets:
            names = {n for n, _ in bucket}
            for name in names:
                if "q_a_proj" in name:
                    assert name.replace("q_a_proj", "kv_a_proj_with_mqa") in names, (limit, name)
            if len(bucket) > 2:  # a bucket over the limit holds one tensor or one group
                assert sum(t.numel() * t.element_size() for _, t in bucket) <= max(limit, 1), limit


def test_the_stand_in_drops_a_split_pair_as_sglang_does_and_loads_a_whole_one():
    stream = dict(_stream(DEEPSEEK))
    table = ARCHITECTURES.get("deepseek_v3")
    params = {w.megatron: torch.zeros(w.megatron_shape) for w in all_weights(table, DEEPSEEK)}
    served = ServedWeights(params, DEEPSEEK, "deepseek_v3")
    q_a, kv_a = "model.layers.0.self_attn.q_a_proj.weight", "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"
    served.begin()
    assert served.load([(q_a, stream[q_a])]) == 0 and served.load([(kv_a, stream[kv_a])]) == 0
    served.end()
    assert served.last_session.dropped == [q_a, kv_a] and q_a in served.last_session.not_updated
    assert not params["decoder.layers.0.self_attention.linear_q_down_proj.weight"].any()  # stays old
    served.begin()
    assert served.load([(q_a, stream[q_a]), ("model.norm.weight", stream["model.norm.weight"]),
                        (kv_a, stream[kv_a])]) == 3
    served.end()
    assert torch.equal(params["decoder.layers.0.self_attention.linear_q_down_proj.weight"], stream[q_a])
    assert torch.equal(params["decoder.layers.0.self_attention.linear_kv_down_proj.weight"], stream[kv_a])


def test_stacked_parts_load_shard_by_shard_and_unknown_names_follow_the_loader():
    cfg = ModelConfig(vocab_size=64, hidden_size=32, num_layers=1, num_attention_heads=4, num_query_groups=2,
                      head_dim=8, num_experts=2, moe_router_topk=1, moe_ffn_hidden_size=16,
                      max_position_embeddings=64)
    table = ARCHITECTURES.get("qwen3_moe")
    params = {w.megatron: torch.zeros(w.megatron_shape) for w in all_weights(table, cfg)}
    served = ServedWeights(params, cfg, "qwen3_moe")
    qkv = next(w for w in all_weights(table, cfg) if w.megatron.endswith("linear_qkv.weight"))
    full = torch.randn(qkv.megatron_shape)
    parts = to_hf(qkv, full, cfg)
    served.begin()
    for part in parts:  # q, k and v in three requests: each lands in its slice
        assert served.load([part, ("model.layers.0.mlp.unknown.weight", torch.ones(1))]) == 1
    served.end()
    assert torch.equal(params[qkv.megatron], full)
    assert served.last_session.skipped == ["model.layers.0.mlp.unknown.weight"] * 3  # qwen3_moe.py:1266-1267
    assert unknown_name_outcome(loader_rules("mixtral"), "model.layers.0.self_attn.q_proj.bias") == "KeyError"
    assert unknown_name_outcome(loader_rules("deepseek_v3"), "model.layers.0.mlp.experts.9.gate_proj.weight") \
        == "skipped"
    assert unknown_name_outcome(loader_rules("deepseek_v3"), "model.layers.0.mlp.dense.gate_proj.weight") == "KeyError"
    mixtral = ServedWeights(params, cfg, "mixtral")
    mixtral.begin()
    with pytest.raises(KeyError):  # mixtral.py:435: a KeyError, which kills a server on the tensor path
        mixtral.load([("model.layers.0.self_attn.q_proj.lora", torch.ones(1))])
