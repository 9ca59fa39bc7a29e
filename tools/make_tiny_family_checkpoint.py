"""Write a tiny random HF checkpoint of a supported MoE family with the shipped tokenizer.

Families: DeepSeek-V3, Kimi-K2, GLM-4.5, Qwen2-MoE, GPT-OSS (``--mxfp4``: its experts in the
released MXFP4 format), Qwen3-Next and Qwen3.5-MoE (a vision-language checkpoint with a small
vision tower and MTP tensors, kept aside by the conversion). For trying the trainer on these
architectures on a CPU: the checkpoint has the shipped tiny model's tokenizer and chat template
(``megatron_rl/assets/tiny_qwen3_moe``), so the CPU demo's prompt files and reward work
unchanged; its weights are random, so rewards stay near zero (this checks the machinery, not
learning). The dimensions differ from every family's defaults (held-out style: 48 wide, 12-
and 16-channel heads, 8 experts of width 24), norms are not ones and routers are decisive,
so that a swapped tensor or a near-tie cannot pass a parity check by accident; the tests
build their checkpoints with :func:`build`. Does not own the architectures' conversion
(``megatron_rl.checkpoint.families``).

    python tools/make_tiny_family_checkpoint.py gpt_oss runs/tiny_gpt_oss [--mxfp4]
    megatron-rl-train --config configs/demo_cpu.yaml init_checkpoint=runs/tiny_gpt_oss \\
        rollout.engine=megatron objective.dynamic_sampling=false train.steps=3
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch

ASSET = Path(__file__).resolve().parents[1] / "megatron_rl" / "assets" / "tiny_qwen3_moe"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")
COMMON = dict(
    vocab_size=512, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, tie_word_embeddings=False,
    rms_norm_eps=1e-6, max_position_embeddings=512, moe_intermediate_size=32, bos_token_id=0, eos_token_id=2,
    pad_token_id=0,
)
_HELD_OUT = dict(
    hidden_size=48, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, num_experts_per_tok=2,
    tie_word_embeddings=False, max_position_embeddings=512, initializer_range=0.1, bos_token_id=0, eos_token_id=2,
    pad_token_id=0,
)
_HYBRID = dict(
    **_HELD_OUT, head_dim=16, moe_intermediate_size=24, shared_expert_intermediate_size=32, num_experts=8,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=12, linear_value_head_dim=8,
    linear_conv_kernel_dim=3, layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
)
FAMILIES = {
    # MLA with query LoRA and YaRN, a dense first layer, one shared expert, top-4 in 2 of 4 groups.
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        **COMMON, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=16, n_routed_experts=8, n_shared_experts=1, first_k_dense_replace=1, intermediate_size=96,
        n_group=4, topk_group=2, num_experts_per_tok=4, routed_scaling_factor=2.5, num_nextn_predict_layers=0,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 1.0,
                         "mscale_all_dim": 1.0, "original_max_position_embeddings": 128},
    )),
    # DeepSeek-V3's architecture under Kimi-K2's model_type (which transformers does not know), one
    # expert group as Kimi-K2 has, and the auto_map of its remote code.
    "kimi_k2": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        **COMMON, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=16, n_routed_experts=8, n_shared_experts=1, first_k_dense_replace=1, intermediate_size=96,
        n_group=1, topk_group=1, num_experts_per_tok=4, routed_scaling_factor=2.827, num_nextn_predict_layers=0,
        rope_parameters={"rope_type": "yarn", "rope_theta": 50000.0, "factor": 4.0, "mscale": 1.0,
                         "mscale_all_dim": 1.0, "original_max_position_embeddings": 128},
    )),
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM", dict(
        **COMMON, num_key_value_heads=2, head_dim=16, intermediate_size=96, n_routed_experts=8, n_shared_experts=1,
        num_experts_per_tok=2, first_k_dense_replace=1, attention_bias=True, num_nextn_predict_layers=0,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    )),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(
        **COMMON, num_key_value_heads=2, intermediate_size=96, shared_expert_intermediate_size=48, num_experts=8,
        num_experts_per_tok=2, norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[],
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )),
    # Sinks, 5-key sliding windows alternating with full layers, YaRN without rounding, biases.
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", dict(
        **_HELD_OUT, head_dim=12, intermediate_size=24, num_local_experts=8, sliding_window=5, swiglu_limit=7.0,
        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 8.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 64},
    )),
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", dict(**_HYBRID, intermediate_size=64, norm_topk_prob=True)),
    "qwen3_5_moe": ("Qwen3_5MoeConfig", "Qwen3_5MoeForConditionalGeneration", dict(
        text_config=_HYBRID, tie_word_embeddings=False,
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=48,
                           num_position_embeddings=16, patch_size=4),
    )),
}

RELABELLED = {
    "kimi_k2": {"model_type": "kimi_k2", "auto_map": {
        "AutoConfig": "configuration_deepseek.DeepseekV3Config",
        "AutoModel": "modeling_deepseek.DeepseekV3Model",
        "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"}},
}
"""config.json keys a family's own checkpoints carry over what transformers writes."""

MTP_TENSORS = {"qwen3_next": 48, "qwen3_5_moe": 48}
"""Families whose released checkpoints carry ``mtp.*`` tensors (transformers neither builds nor
saves them), and the hidden size of the few written here."""


HELD_OUT_FAMILIES = ("gpt_oss", "qwen3_next", "qwen3_5_moe")
"""Families built with non-trivial norms, biases and sinks and decisive (x10) routers."""
MXFP4_DIMS = dict(hidden_size=64, intermediate_size=32)
"""GPT-OSS dimensions for an MXFP4 checkpoint: its blocks hold 32 inputs."""


def build(family: str, vocab_size: int = 512, seed: int = 0, mxfp4: bool = False) -> torch.nn.Module:
    """The family's random transformers model (fp32); the held-out families with non-trivial
    norms, biases and sinks and decisive routers (:data:`HELD_OUT_FAMILIES`)."""
    import transformers

    config_class, model_class, fields = FAMILIES[family]
    fields = {**fields, **(MXFP4_DIMS if mxfp4 else {})}
    if "text_config" in fields:
        fields["text_config"] = {**fields["text_config"], "vocab_size": vocab_size}
    else:
        fields["vocab_size"] = vocab_size
    torch.manual_seed(seed)
    model = getattr(transformers, model_class)(getattr(transformers, config_class)(**fields))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "visual" in name or family not in HELD_OUT_FAMILIES:
                continue
            if param.dim() == 1 and "norm" in name:
                # Zero-centred norms (Qwen3-Next: 1 + w) and plain ones alike move off their init.
                param.add_(0.2 * torch.randn_like(param))
            elif name.endswith(("mlp.gate.weight", "mlp.router.weight")):
                param.mul_(10)  # a trained router is decisive; near-ties would make top-K a coin toss
            elif name.endswith(("sinks", "bias")):
                param.copy_(0.5 * torch.randn_like(param))
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(0.1 * torch.randn_like(buffer))  # a bias that moves some selections
    return model.float()


def save(model: torch.nn.Module, family: str, out: Path, mxfp4: bool = False, max_shard_size: str = "5GB") -> None:
    """Write ``model`` as the family's checkpoints are released (MTP tensors, MXFP4 experts)."""
    from safetensors.torch import load_file, save_file

    if mxfp4:
        model = model.to(torch.bfloat16)
    model.save_pretrained(out, max_shard_size=max_shard_size)
    extra = {}
    if family in MTP_TENSORS:
        width = MTP_TENSORS[family]
        gen = torch.Generator().manual_seed(1)
        extra = {"mtp.fc.weight": torch.randn(width, 2 * width, generator=gen),
                 "mtp.layers.0.input_layernorm.weight": torch.randn(width, generator=gen)}
    if mxfp4:
        extra.update(_quantized_experts(model))
    if not extra:
        return
    index_path = out / "model.safetensors.index.json"
    files = sorted(out.glob("*.safetensors"))
    tensors = load_file(files[-1])
    for name in list(extra):
        base = name.removesuffix("_blocks").removesuffix("_scales")
        tensors.pop(base, None)
    tensors.update(extra)
    save_file(tensors, str(files[-1]), metadata={"format": "pt"})
    if index_path.exists():
        index = json.loads(index_path.read_text())
        for name in extra:
            index["weight_map"].pop(name.removesuffix("_blocks").removesuffix("_scales"), None)
            index["weight_map"][name] = files[-1].name
        # The sizes as transformers writes them: every tensor's bytes and elements.
        sizes = [(t.numel() * t.element_size(), t.numel()) for f in files for t in load_file(f).values()]
        index["metadata"].update(total_size=sum(b for b, _ in sizes), total_parameters=sum(n for _, n in sizes))
        index_path.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    if mxfp4:
        config_path = out / "config.json"
        config = json.loads(config_path.read_text())
        config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
            "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
        config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def quantize_mxfp4(weight_EIO: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(blocks [E, O, I / 32, 16], scales [E, O, I / 32])`` of an ``[E, I, O]`` weight: each block
    of 32 inputs of one output scaled by a power of two so its largest value fits 6, every value
    rounded to the nearest E2M1 code (low nibble: the even element)."""
    rows = weight_EIO.float().transpose(1, 2)  # [E, O, I]
    blocks = rows.reshape(*rows.shape[:2], -1, 32)
    exponent = torch.ceil(torch.log2(blocks.abs().amax(-1).clamp(min=2.0**-100) / 6.0)).clamp(-127, 127)
    scaled = blocks / torch.exp2(exponent)[..., None]
    codes = (scaled.abs()[..., None] - E2M1).abs().argmin(-1) + 8 * (scaled < 0)
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)
    return packed, (exponent + 127).to(torch.uint8)


def _quantized_experts(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """GPT-OSS's experts in the released MXFP4 layout (their biases stay bf16)."""
    out = {}
    for name, param in model.named_parameters():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            blocks, scales = quantize_mxfp4(param.detach())
            out[f"{name}_blocks"], out[f"{name}_scales"] = blocks, scales
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("family", choices=sorted(FAMILIES))
    parser.add_argument("out", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--mxfp4", action="store_true", help="GPT-OSS: write the experts in MXFP4, the rest in bf16")
    args = parser.parse_args()
    if args.mxfp4 and args.family != "gpt_oss":
        parser.error("--mxfp4: only GPT-OSS checkpoints are released with MXFP4 experts")
    model = build(args.family, seed=args.seed, mxfp4=args.mxfp4)
    save(model, args.family, args.out, mxfp4=args.mxfp4)
    if args.family in RELABELLED:
        config_path = args.out / "config.json"
        config_path.write_text(json.dumps({**json.loads(config_path.read_text()), **RELABELLED[args.family]}, indent=2))
    for name in TOKENIZER_FILES:
        shutil.copy(ASSET / name, args.out / name)
    print(f"wrote {args.out} ({args.family}, {sum(p.numel() for p in model.parameters())} parameters)")


if __name__ == "__main__":
    main()
