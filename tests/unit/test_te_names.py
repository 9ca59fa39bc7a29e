"""``parallel/te_names``: the TE-spec <-> local-spec name translation is a bijection on every
table name (pure string checks; the names Megatron's TE spec really builds are checked in
``tests/parallel/test_te_spec_names.py``)."""

import pytest

from megatron_rl.checkpoint.mapping import ARCHITECTURES, all_weights
from megatron_rl.parallel.te_names import (
    canonical_name,
    te_checkpoint_prefixes,
    te_name,
)
from megatron_rl.sections import ModelConfig

TINY = dict(vocab_size=96, num_layers=3, num_experts=4, moe_router_topk=2)
CONFIGS = {
    "qwen3_moe": ModelConfig(**TINY),
    "mixtral": ModelConfig(**TINY, qk_layernorm=False),
    "deepseek_v3": ModelConfig(
        **TINY, multi_latent_attention=True, num_query_groups=4, q_lora_rank=48, kv_lora_rank=32,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, num_dense_layers=1, ffn_hidden_size=96,
        moe_shared_expert_intermediate_size=32, moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,
    ),
}


@pytest.mark.parametrize("family", CONFIGS)
def test_every_table_name_round_trips_through_its_te_name(family):
    cfg = CONFIGS[family]
    names = [w.megatron for w in all_weights(ARCHITECTURES.get(family), cfg)]
    te = [te_name(n, cfg) for n in names]
    assert [canonical_name(n) for n in te] == names
    assert [canonical_name(n) for n in names] == names  # local names pass through
    assert len(set(te)) == len(te)
    assert sum(n != t for n, t in zip(names, te)) > 0


def test_the_translations_megatron_documents():
    cfg = CONFIGS["deepseek_v3"]
    assert te_name("decoder.layers.0.pre_mlp_layernorm.weight", cfg) == "decoder.layers.0.mlp.linear_fc1.layer_norm_weight"
    assert te_name("decoder.layers.1.pre_mlp_layernorm.weight", cfg) == "decoder.layers.1.pre_mlp_layernorm.weight"
    assert te_name("decoder.layers.1.input_layernorm.weight", cfg) == "decoder.layers.1.input_layernorm.weight"
    qwen = CONFIGS["qwen3_moe"]
    assert te_name("decoder.layers.2.input_layernorm.weight", qwen) == "decoder.layers.2.self_attention.linear_qkv.layer_norm_weight"
    assert te_name("decoder.layers.2.mlp.experts.local_experts.3.linear_fc2.weight", qwen) == (
        "decoder.layers.2.mlp.experts.linear_fc2.weight3"
    )
    assert te_checkpoint_prefixes(dense_mlp=False, mla=False) == {
        "input_layernorm.": "self_attention.linear_qkv.layer_norm_"
    }
