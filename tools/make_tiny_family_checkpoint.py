"""Write a tiny random HF checkpoint of DeepSeek-V3, Kimi-K2, GLM-4.5 or Qwen2-MoE with the shipped tokenizer.

For trying the trainer on these architectures on a CPU: the checkpoint has the shipped
tiny model's tokenizer and chat template (``megatron_rl/assets/tiny_qwen3_moe``), so the
CPU demo's prompt files and reward work unchanged; its weights are random, so rewards stay
near zero (this checks the machinery, not learning). Does not own the architectures'
conversion (``megatron_rl.checkpoint.families``).

    python tools/make_tiny_family_checkpoint.py deepseek_v3 runs/tiny_deepseek_v3
    megatron-rl-train --config configs/demo_cpu.yaml init_checkpoint=runs/tiny_deepseek_v3 \\
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
FAMILIES = {
    # MLA with query LoRA and YaRN, a dense first layer, one shared expert, top-4 in 2 of 4 groups.
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=16, n_routed_experts=8, n_shared_experts=1, first_k_dense_replace=1, intermediate_size=96,
        n_group=4, topk_group=2, num_experts_per_tok=4, routed_scaling_factor=2.5, num_nextn_predict_layers=0,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 1.0,
                         "mscale_all_dim": 1.0, "original_max_position_embeddings": 128},
    )),
    # DeepSeek-V3's architecture under Kimi-K2's model_type (which transformers does not know), one
    # expert group as Kimi-K2 has, and the auto_map of its remote code.
    "kimi_k2": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=16, n_routed_experts=8, n_shared_experts=1, first_k_dense_replace=1, intermediate_size=96,
        n_group=1, topk_group=1, num_experts_per_tok=4, routed_scaling_factor=2.827, num_nextn_predict_layers=0,
        rope_parameters={"rope_type": "yarn", "rope_theta": 50000.0, "factor": 4.0, "mscale": 1.0,
                         "mscale_all_dim": 1.0, "original_max_position_embeddings": 128},
    )),
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM", dict(
        num_key_value_heads=2, head_dim=16, intermediate_size=96, n_routed_experts=8, n_shared_experts=1,
        num_experts_per_tok=2, first_k_dense_replace=1, attention_bias=True, num_nextn_predict_layers=0,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    )),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(
        num_key_value_heads=2, intermediate_size=96, shared_expert_intermediate_size=48, num_experts=8,
        num_experts_per_tok=2, norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[],
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )),
}

RELABELLED = {
    "kimi_k2": {"model_type": "kimi_k2", "auto_map": {
        "AutoConfig": "configuration_deepseek.DeepseekV3Config",
        "AutoModel": "modeling_deepseek.DeepseekV3Model",
        "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"}},
}
"""config.json keys a family's own checkpoints carry over what transformers writes."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("family", choices=sorted(FAMILIES))
    parser.add_argument("out", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    import transformers

    config_class, model_class, fields = FAMILIES[args.family]
    torch.manual_seed(args.seed)
    model = getattr(transformers, model_class)(getattr(transformers, config_class)(**COMMON, **fields))
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                # A bias that moves some selections, as a trained one does.
                buffer.copy_(0.1 * torch.randn_like(buffer))
    model.float().save_pretrained(args.out)
    if args.family in RELABELLED:
        config_path = args.out / "config.json"
        config_path.write_text(json.dumps({**json.loads(config_path.read_text()), **RELABELLED[args.family]}, indent=2))
    for name in TOKENIZER_FILES:
        shutil.copy(ASSET / name, args.out / name)
    print(f"wrote {args.out} ({args.family}, {sum(p.numel() for p in model.parameters())} parameters)")


if __name__ == "__main__":
    main()
