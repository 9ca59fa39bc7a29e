"""The HF engine's transformers replica: weight loading checked against ``from_pretrained``,
KV-cached generation against transformers' own full forward, and the requests it refuses.

Loading: random Megatron tensors go through the HF name table (the names SGLang loads)
into a safetensors checkpoint that transformers' ``from_pretrained`` reads with its own
conversion rules, and into the replica with :class:`HFWeightLoader`; both must hold the
same bytes, for Qwen3-MoE and Mixtral. Generation: the shipped demo checkpoint decodes a
left-padded batch with the KV cache; each sample's log-probs and routes equal a full
no-cache forward over its own unpadded tokens.
"""

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from megatron_rl.checkpoint.hf_config import hf_config_from_model
from megatron_rl.checkpoint.mapping import ARCHITECTURES, all_weights, to_hf
from megatron_rl.rollout.engine import SamplingParams
from megatron_rl.rollout.local.hf_generate import generate
from megatron_rl.rollout.local.hf_model import (
    HFWeightLoader,
    UnsupportedArchitecture,
    build_hf_model,
    check_architecture,
    check_transformers,
)
from megatron_rl.sections import ModelConfig

ASSET = Path(__file__).resolve().parents[2] / "megatron_rl" / "assets" / "tiny_qwen3_moe"
MODEL = ModelConfig(
    vocab_size=96, hidden_size=32, num_layers=2, num_attention_heads=4, num_query_groups=2, head_dim=8,
    num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=16, max_position_embeddings=64,
)
MIXTRAL_MODEL = dataclasses.replace(MODEL, qk_layernorm=False, rotary_base=10000.0, norm_epsilon=1e-5)


def _hf_tensors(arch: str, model: ModelConfig) -> dict[str, torch.Tensor]:
    """Checkpoint-named tensors of random Megatron weights, through the HF table."""
    gen = torch.Generator().manual_seed(0)
    named = {}
    for weight in all_weights(ARCHITECTURES.get(arch), model):
        full = torch.randn(weight.megatron_shape, generator=gen)
        named.update(to_hf(weight, full, model))
    return named


@pytest.mark.parametrize("arch, model", [("qwen3_moe", MODEL), ("mixtral", MIXTRAL_MODEL)])
def test_loader_fills_the_replica_as_from_pretrained_does(arch, model, tmp_path):
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    named = _hf_tensors(arch, model)
    save_file({k: v.contiguous() for k, v in named.items()}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(hf_config_from_model(arch, model)))
    expected = AutoModelForCausalLM.from_pretrained(str(tmp_path)).state_dict()
    replica = build_hf_model(arch, model)
    loader = HFWeightLoader(replica, arch)
    with torch.no_grad():
        for name, tensor in named.items():
            loader.load(name, tensor)
    loader.finish()
    got = replica.state_dict()
    assert sorted(got) == sorted(expected)
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), name


def test_loader_names_what_is_missing_unknown_or_misshapen():
    replica = build_hf_model("qwen3_moe", MODEL)
    named = _hf_tensors("qwen3_moe", MODEL)
    loader = HFWeightLoader(replica, "qwen3_moe")
    with torch.no_grad():
        for name, tensor in named.items():
            if name != "model.layers.1.mlp.experts.3.up_proj.weight":
                loader.load(name, tensor)
        with pytest.raises(ValueError, match=r"model.layers.1.mlp.experts.gate_up_proj \(7 of 8 pieces\)"):
            loader.finish()
        with pytest.raises(KeyError, match="model.layers.0.mlp.shared_expert.weight"):
            loader.load("model.layers.0.mlp.shared_expert.weight", torch.zeros(1))
        with pytest.raises(ValueError, match=r"model.norm.weight: shape \(3,\)"):
            loader.load("model.norm.weight", torch.zeros(3))


def test_unmapped_architecture_is_named():
    with pytest.raises(UnsupportedArchitecture, match="'deepseek_v3'.*supported: gpt_oss, mixtral, "):
        check_architecture("deepseek_v3")


def test_a_transformers_that_would_decode_without_the_cache_is_refused():
    """transformers 5.17 (a GPU image's) takes ``cache=`` into ``**kwargs``: every decode step then
    runs without the KV cache (the test below fails there by 6.1 nats). Refused, naming both versions."""
    with pytest.raises(RuntimeError, match=r"transformers >= 5\.24\.0 .* this is transformers 5\.17\.0"):
        check_transformers("5.17.0")
    check_transformers("5.24.0")


def test_kv_cached_batch_equals_full_forward_per_sample():
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(ASSET)).eval()
    prompts = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [20, 21, 22, 23, 24]]
    params = SamplingParams(temperature=1.0, max_new_tokens=12, stop_token_ids=(2,))
    samples = generate(model, prompts, params, generator=torch.Generator().manual_seed(0), return_routes=True,
                       max_length=128)
    for prompt, s in zip(prompts, samples):
        assert len(s.output_ids) == 12 or (s.stopped and s.output_ids[-1] == 2)
        with torch.no_grad():
            out = model(input_ids=torch.tensor([prompt + s.output_ids]), output_router_logits=True)
        logp = out.logits[0, len(prompt) - 1 : -1].float().log_softmax(-1)
        expected = logp.gather(-1, torch.tensor(s.output_ids)[:, None])[:, 0]
        assert (s.logprobs - expected).abs().max() <= 1e-5
        routes = torch.stack([r.float().topk(2, dim=-1).indices for r in out.router_logits], dim=1)[:-1]
        assert s.routes_NLK.shape == (len(prompt) + len(s.output_ids) - 1, 4, 2)
        assert torch.equal(s.routes_NLK.long().sort(-1).values, routes.sort(-1).values)


def test_request_beyond_the_model_length_names_the_sample():
    model = build_hf_model("qwen3_moe", MODEL)
    with pytest.raises(ValueError, match=r"^sample 1: prompt of 60 tokens \+ max_new_tokens 8 = 68 exceeds .* 64"):
        generate(model, [[1, 2], [3] * 60], SamplingParams(max_new_tokens=8), generator=torch.Generator(),
                 return_routes=False, max_length=64)
