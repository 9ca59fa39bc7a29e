"""The planner's model terms against the real Megatron model built on CPU, in ONE gloo world of 2.

- Parameters: for each family (Qwen3-MoE; DeepSeek-V3 with MLA and query LoRA, a dense first
  layer, a shared expert and group-limited sigmoid routing; Moonlight's MLA without query
  LoRA; Qwen2-MoE's gated shared expert and QKV biases; GLM-4.5's half-width RoPE; a
  Mixtral-like model with tied embeddings; GPT-OSS's biases and sinks; Qwen3-Next's Gated
  DeltaNet layers and gated attention) in the layouts listed, every rank's sum of
  ``numel`` equals ``megatron_rl.plan.params.rank_params``, and so does the part Megatron
  reduces over the expert data-parallel group (``allreduce=False``).
- Activations: the bytes autograd saves for backward inside each decoder layer during one
  training micro-batch (unique storages, parameters excluded, counted with
  ``torch.autograd.graph.saved_tensors_hooks``) equal ``activations.layer_bytes`` exactly, in
  TP1 (fp32 and bf16), TP2+SP, and with a dense first layer and a gated shared expert.
- Recompute: ``train.recompute`` full and selective change no gradient.
"""

import dataclasses

import pytest
import torch
from saved_bytes import saved_per_layer

from megatron_rl.parallel.world import run_world
from megatron_rl.plan.activations import DTYPE_BYTES, RankShape, layer_bytes
from megatron_rl.plan.params import rank_params
from megatron_rl.sections import ModelConfig, ParallelConfig

pytestmark = pytest.mark.parallel

QWEN3 = ModelConfig(vocab_size=256, num_layers=4, num_experts=8, moe_router_topk=2)
FAMILIES = {
    "qwen3": QWEN3,
    "deepseek_v3": dataclasses.replace(
        QWEN3, multi_latent_attention=True, num_query_groups=4, q_lora_rank=48, kv_lora_rank=32,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, rope_scaling="yarn", yarn_factor=4.0,
        num_dense_layers=1, ffn_hidden_size=96, moe_shared_expert_intermediate_size=32,
        moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True, moe_router_num_groups=4,
        moe_router_group_topk=2, moe_router_topk_scaling_factor=2.5),
    "moonlight": dataclasses.replace(
        QWEN3, multi_latent_attention=True, num_query_groups=4, kv_lora_rank=32, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16, num_dense_layers=1, ffn_hidden_size=96,
        moe_shared_expert_intermediate_size=64, moe_router_score_function="sigmoid"),
    "qwen2_moe": dataclasses.replace(QWEN3, qk_layernorm=False, add_qkv_bias=True, moe_router_pre_softmax=True,
                                     moe_shared_expert_intermediate_size=64, moe_shared_expert_gate=True),
    "glm4_moe": dataclasses.replace(QWEN3, add_qkv_bias=True, rotary_percent=0.5, num_dense_layers=1,
                                    ffn_hidden_size=96, moe_shared_expert_intermediate_size=32,
                                    moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True),
    "mixtral_tied": dataclasses.replace(QWEN3, qk_layernorm=False, untie_embeddings_and_output_weights=False),
    "gpt_oss": dataclasses.replace(
        QWEN3, qk_layernorm=False, add_qkv_bias=True, add_bias_linear=True, attention_sinks=True,
        layer_types=["sliding_attention", "full_attention"] * 2, sliding_window=4, activation_func="quick_gelu",
        activation_func_clamp_value=7.0, glu_linear_offset=1.0),
    "qwen3_next": dataclasses.replace(
        QWEN3, layer_types=["linear_attention", "full_attention"] * 2, attention_output_gate=True,
        norm_zero_centered=True, rotary_percent=0.25, moe_shared_expert_intermediate_size=32,
        moe_shared_expert_gate=True, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
        linear_value_head_dim=6, linear_conv_kernel_dim=3),
}
LAYOUTS = {
    "DP2": ParallelConfig(),
    "TP2+SP": ParallelConfig(tensor_model_parallel_size=2),
    "EP2": ParallelConfig(expert_model_parallel_size=2),
    "PP2": ParallelConfig(pipeline_model_parallel_size=2),
    "TP2+SP x EP2": ParallelConfig(tensor_model_parallel_size=2, expert_model_parallel_size=2),
    "TP2+SP ETP2": ParallelConfig(tensor_model_parallel_size=2, expert_tensor_parallel_size=2),
}
COUNTED = [("qwen3", layout) for layout in LAYOUTS] + [
    ("deepseek_v3", "TP2+SP"), ("deepseek_v3", "PP2"), ("deepseek_v3", "EP2"), ("moonlight", "TP2+SP x EP2"),
    ("qwen2_moe", "TP2+SP x EP2"), ("glm4_moe", "TP2+SP ETP2"), ("glm4_moe", "PP2"), ("mixtral_tied", "TP2+SP"),
    ("gpt_oss", "TP2+SP x EP2"), ("qwen3_next", "TP2+SP x EP2"), ("qwen3_next", "PP2"),
]
ACTIVATION_MODEL = dataclasses.replace(QWEN3, vocab_size=512, hidden_size=128, num_attention_heads=8,
                                       num_query_groups=4, head_dim=16, num_experts=8, moe_ffn_hidden_size=96)
ACTIVATIONS = {
    "TP1 fp32": (ACTIVATION_MODEL, ParallelConfig()),
    "TP1 bf16": (dataclasses.replace(ACTIVATION_MODEL, params_dtype="bfloat16"), ParallelConfig()),
    "TP2+SP fp32": (ACTIVATION_MODEL, ParallelConfig(tensor_model_parallel_size=2)),
    "dense + gated shared expert": (dataclasses.replace(
        ACTIVATION_MODEL, num_dense_layers=1, ffn_hidden_size=192, moe_shared_expert_intermediate_size=64,
        moe_shared_expert_gate=True), ParallelConfig()),
}
TOKENS = 256
"""One micro-batch: 4 samples of 64 tokens, the budget exactly."""


def _count(model_cfg, parallel):
    from megatron_rl.parallel.model import build_model

    model = build_model(model_cfg, parallel)
    params = list(model.parameters())
    return sum(p.numel() for p in params), sum(p.numel() for p in params if not getattr(p, "allreduce", True))


def _batch(model_cfg, dp_rank):
    from megatron_rl.parallel.train_step import TrainBatch

    gen = torch.Generator().manual_seed(dp_rank)
    sequences = [torch.randint(0, model_cfg.vocab_size, (TOKENS // 4,), generator=gen) for _ in range(4)]
    responses = 4 * (TOKENS // 4 - 16)
    return TrainBatch(sequences=sequences, prompt_lengths=[16] * 4, old_logprobs_T=torch.full((responses,), -5.0),
                      advantages_T=torch.randn(responses, generator=gen))


def _saved_per_layer(model_cfg, parallel, groups):
    """Bytes saved for backward inside each decoder layer (global 0-based index) in one update."""
    from megatron_rl.algos.presets import get_preset
    from megatron_rl.parallel.model import build_model
    from megatron_rl.parallel.schedule import wrap_for_training
    from megatron_rl.parallel.train_step import RoutingPlan, forward_backward

    model = build_model(model_cfg, parallel)
    ddp = wrap_for_training(model)
    return saved_per_layer(model, lambda: forward_backward(
        ddp, groups, _batch(model_cfg, groups.dp_rank), get_preset("dr_grpo"),
        RoutingPlan(mode="none", diagnostics=False), micro_batch_tokens=TOKENS))


def _grads_per_recompute(model_cfg, groups):
    """The update's gradients under each ``train.recompute`` choice, from the same weights."""
    from megatron_rl.algos.presets import get_preset
    from megatron_rl.parallel.model import build_model, recompute_fields
    from megatron_rl.parallel.schedule import wrap_for_training
    from megatron_rl.parallel.train_step import RoutingPlan, forward_backward

    weights, grads = None, {}
    for recompute in ("none", "selective", "full"):
        model = build_model(model_cfg, ParallelConfig(), moe_enable_routing_replay=True, **recompute_fields(recompute))
        weights = weights or [p.detach().clone() for p in model.parameters()]
        with torch.no_grad():
            for param, weight in zip(model.parameters(), weights):
                param.copy_(weight)
        ddp = wrap_for_training(model)
        forward_backward(ddp, groups, _batch(model_cfg, groups.dp_rank), get_preset("dr_grpo"),
                         RoutingPlan(mode="none", diagnostics=False), micro_batch_tokens=TOKENS)
        grads[recompute] = {name: p.main_grad.clone() for name, p in model.named_parameters()}
    return grads


def _world():
    """Every check, one model-parallel setup per layout (setting groups up is what costs)."""
    from megatron_rl.parallel.cpu_platform import cpu_platform
    from megatron_rl.parallel.groups import model_parallel

    out = {"counts": {}, "saved": {}, "recompute": {}}
    with cpu_platform():
        for layout, parallel in LAYOUTS.items():
            with model_parallel(parallel, seed=1) as groups:
                for family in (f for f, counted_layout in COUNTED if counted_layout == layout):
                    out["counts"][family, layout] = (groups.pp_rank, *_count(FAMILIES[family], parallel))
                for name, (model_cfg, activation_layout) in ACTIVATIONS.items():
                    if activation_layout == parallel:
                        out["saved"][name] = _saved_per_layer(model_cfg, parallel, groups)
                if parallel == ParallelConfig():
                    out["recompute"] = _grads_per_recompute(ACTIVATION_MODEL, groups)
    return out


@pytest.fixture(scope="module")
def world():
    return run_world(_world, 2, timeout_s=900)


@pytest.mark.parametrize("family, layout", COUNTED)
def test_parameter_count_per_rank_equals_the_built_model(world, family, layout):
    model_cfg, parallel = FAMILIES[family], LAYOUTS[layout]
    for rank in world:
        stage, total, expert = rank["counts"][family, layout]
        predicted = rank_params(model_cfg, parallel, stage)
        assert (total, expert) == (predicted.total, predicted.expert)


@pytest.mark.parametrize("name", ACTIVATIONS)
def test_saved_activations_per_layer_equal_the_formula(world, name):
    model_cfg, parallel = ACTIVATIONS[name]
    shape = RankShape(tokens=TOKENS, tp=parallel.tensor_model_parallel_size,
                      sequence_parallel=parallel.sequence_parallel_enabled(),
                      etp=parallel.expert_tensor_parallel_size, dtype_bytes=DTYPE_BYTES[model_cfg.params_dtype])
    for rank in world:
        predicted = {i: layer_bytes(model_cfg, shape, i) for i in range(model_cfg.num_layers)}
        assert rank["saved"][name] == predicted


@pytest.mark.parametrize("recompute", ["selective", "full"])
def test_recompute_changes_no_gradient(world, recompute):
    for rank in world:
        reference, got = rank["recompute"]["none"], rank["recompute"][recompute]
        assert got.keys() == reference.keys()
        for name in reference:
            assert torch.equal(got[name], reference[name]), name
