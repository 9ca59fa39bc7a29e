"""Step-0 parity of a run that starts from an HF checkpoint, and the HF checkpoint it writes back.

The trainer's own path is exercised: ``load_run_config`` reads the model section from the
checkpoint's config.json, ``load_initial_weights`` streams the safetensors into the run's
layout (TP1 (DP2), TP2+SP, EP2, PP2), and the forward-only log-prob pass with routing
records is compared with transformers' forward of the same checkpoint on the same tokens:
log-probs within 1e-4 (fp32) and the same top-K experts at every position and layer. The
checkpoints: a tiny random Qwen3-MoE built here with transformers (decisive routers, so
top-K has no near-ties), the same converted to a Megatron checkpoint by the converter
(loaded in EP2 and PP2), and the shipped pretrained one. Then, in EP2, the policy is changed
(as training would) and exported with ``export_hf``; transformers loads the export as is
and reproduces the Megatron log-probs within 1e-4.

One spawned 2-process gloo world runs every layout.
"""

from pathlib import Path

import pytest
import torch

from megatron_rl.checkpoint.parity import (
    ParityTolerances,
    compare,
    hf_reference,
    random_prompts,
)
from megatron_rl.parallel.world import run_world

pytestmark = pytest.mark.parallel

SHIPPED = Path(__file__).resolve().parents[2] / "megatron_rl" / "assets" / "tiny_qwen3_moe"
LAYOUTS = {
    "TP1 (DP2)": [],
    "TP2+SP": ["parallel.tensor_model_parallel_size=2"],
    "EP2": ["parallel.expert_model_parallel_size=2"],
    "PP2": ["parallel.pipeline_model_parallel_size=2"],
}
TOLERANCES = ParityTolerances(logprob_max_abs=1e-4, topk_agreement_min=1.0, router_prob_max_abs=1e-5)
TRAINED_NOISE = 0.05


def _tiny_random_checkpoint(directory: Path) -> None:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    config = Qwen3MoeConfig(
        vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, num_experts_per_tok=2, tie_word_embeddings=False, rope_theta=1e6, rms_norm_eps=1e-6,
        max_position_embeddings=128, initializer_range=0.1, intermediate_size=128, moe_intermediate_size=32,
        num_experts=8, decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True,
    )
    model = Qwen3MoeForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 1:
                param.copy_(1 + 0.2 * torch.randn_like(param))
            elif name.endswith("gate.weight"):
                param.mul_(10)
    model.float().save_pretrained(directory, max_shard_size="60KB")


def _worker(checkpoints: dict[str, str], prompts: dict[str, list], export_dir: str, megatron_dir: str) -> dict:
    import torch.distributed as dist

    from megatron_rl.checkpoint.convert import hf_to_megatron_world_entry
    from megatron_rl.checkpoint.init_source import inspect_init_checkpoint
    from megatron_rl.checkpoint.parity import megatron_outputs
    from megatron_rl.parallel.cpu_platform import cpu_platform
    from megatron_rl.parallel.groups import model_parallel
    from megatron_rl.parallel.model import build_model
    from megatron_rl.sections import ParallelConfig
    from megatron_rl.train.hf_export import HFExportSpec, export_hf
    from megatron_rl.train.init_weights import load_initial_weights
    from megatron_rl.config import load_config as load_run_config

    results: dict = {"layouts": {}, "exported": None}
    hf_to_megatron_world_entry(checkpoints["random"], megatron_dir, ParallelConfig(), False)
    checkpoints = {**checkpoints, "megatron": megatron_dir}
    prompts = {**prompts, "megatron": prompts["random"]}
    with cpu_platform():
        for name, path in checkpoints.items():
            for layout, overrides in LAYOUTS.items():
                if name == "megatron" and layout not in ("EP2", "PP2"):
                    continue
                cfg = load_run_config(None, [f"init_checkpoint={path}", "parallel.world_size=2", *overrides],
                                      world_size=2)
                with model_parallel(cfg.parallel, cfg.seed) as groups:
                    source = inspect_init_checkpoint(path)
                    gpt = build_model(cfg.model, cfg.parallel)
                    load_initial_weights(gpt, source, cfg.model, groups)
                    outputs = megatron_outputs(gpt, groups, prompts[name])
                    results["layouts"][(name, layout)] = outputs
                    if name == "random" and layout == "EP2":
                        with torch.no_grad():
                            for param in gpt.parameters():
                                param.add_(TRAINED_NOISE * torch.randn_like(param))
                        results["exported"] = megatron_outputs(gpt, groups, prompts[name])
                        spec = HFExportSpec(architecture=source.hf.architecture, model=cfg.model,
                                            side_files=[Path(f) for f in source.hf.files])
                        export_hf(gpt, groups, export_dir, spec)
    return results if dist.get_rank() == dist.get_world_size() - 1 else {}


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("init")
    _tiny_random_checkpoint(root / "random")
    checkpoints = {"random": str(root / "random"), "shipped": str(SHIPPED)}
    prompts = {
        "random": [p[:n] for p, n in zip(random_prompts(4, 14, 256, seed=5), (14, 9, 11, 6))],
        "shipped": [p[:n] for p, n in zip(random_prompts(4, 14, 300, seed=6), (14, 9, 11, 6))],
    }
    results = run_world(_worker, 2, checkpoints, prompts, str(root / "export"), str(root / "megatron"),
                        timeout_s=600)
    return checkpoints, prompts, results[-1], root / "export"


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("name", ["random", "shipped"])
def test_step0_logprobs_and_routes_match_transformers(world, name, layout):
    checkpoints, prompts, results, _ = world
    reference = hf_reference(checkpoints[name], prompts[name], topk=2)
    report = compare(reference, results["layouts"][(name, layout)])
    assert not report.violations(TOLERANCES), (name, layout, report.to_dict())


@pytest.mark.parametrize("layout", ["EP2", "PP2"])
def test_megatron_checkpoint_of_the_converter_starts_the_same_policy(world, layout):
    checkpoints, prompts, results, _ = world
    reference = hf_reference(checkpoints["random"], prompts["random"], topk=2)
    report = compare(reference, results["layouts"][("megatron", layout)])
    assert not report.violations(TOLERANCES), (layout, report.to_dict())


def test_exported_checkpoint_loads_in_transformers_and_reproduces_the_trainer(world):
    _, prompts, results, export_dir = world
    from transformers import AutoModelForCausalLM

    assert (export_dir / "config.json").is_file() and not list(export_dir.parent.glob(".export*"))
    AutoModelForCausalLM.from_pretrained(str(export_dir))  # loads as is, no warnings about missing keys
    reference = hf_reference(export_dir, prompts["random"], topk=2)
    report = compare(reference, results["exported"])
    assert report.logprob_max_abs_diff <= 1e-4, report.to_dict()
