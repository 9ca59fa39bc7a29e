"""DeepSeek-V3 (MLA, YaRN, dense first layer, shared expert, sigmoid routing with expert bias,
group-limited top-K, routed scaling), a Moonlight-style DeepSeek-V3 (no query LoRA, one
group), GLM-4.5 (partial rotary, QKV bias, QK norm, sigmoid routing) and Qwen2-MoE (gated
shared expert, QKV bias, un-normalized softmax gates), each a tiny random checkpoint built
with transformers.

Shown here: HF -> Megatron -> HF is byte-for-byte identical; the Megatron model's log-probs
match transformers' forward within 1e-4 (fp32) with the same top-K experts per layer, in
order, and router probabilities within 1e-5 (transformers' own routers hooked), in TP1,
TP2+SP, EP2 and PP2; a config that names something the model would compute differently is
refused before anything is written, naming the key; MTP layers are skipped with a note.

TP1 runs through the command lines in this process; the three other layouts run one after
another in ONE spawned gloo world of 2 processes, each loading the TP1 checkpoint resharded,
and PP2 also starts the trainer's way, streaming the HF directory into the layout.
"""

import hashlib
import json
import shutil

import pytest
import torch
from safetensors.torch import save_file

from megatron_rl.checkpoint.cli import (
    hf_to_megatron_main,
    megatron_to_hf_main,
    parity_main,
)
from megatron_rl.checkpoint.hf_config import hf_config_from_model
from megatron_rl.checkpoint.hf_source import inspect_hf_checkpoint
from megatron_rl.checkpoint.parity import (
    ParityTolerances,
    compare,
    hf_reference,
    random_prompts,
)
from megatron_rl.parallel.world import run_world
from megatron_rl.sections import ParallelConfig

pytestmark = pytest.mark.parallel

FAMILIES = ["deepseek_v3", "moonlight", "glm4_moe", "qwen2_moe"]
LAYOUTS = {
    "TP2+SP": ParallelConfig(tensor_model_parallel_size=2),
    "EP2": ParallelConfig(expert_model_parallel_size=2),
    "PP2": ParallelConfig(pipeline_model_parallel_size=2),
}
PROMPTS = [p[:n] for p, n in zip(random_prompts(4, 12, 256, seed=5), (12, 7, 10, 5))]
TOLERANCES = ParityTolerances(logprob_max_abs=1e-4, topk_agreement_min=1.0, router_prob_max_abs=1e-5)


def tiny_hf_model(family: str):
    """A random transformers model of the family (hidden 64, 4 layers, 8 experts)."""
    import transformers as tf

    common = dict(
        vocab_size=256, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, tie_word_embeddings=False,
        rms_norm_eps=1e-6, max_position_embeddings=512, initializer_range=0.1, moe_intermediate_size=32,
    )
    if family in ("deepseek_v3", "moonlight"):
        mla = dict(
            num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
            n_routed_experts=8, n_shared_experts=1, first_k_dense_replace=1, intermediate_size=96,
            num_nextn_predict_layers=0,
        )
        if family == "deepseek_v3":
            config = tf.DeepseekV3Config(
                **common, **mla, q_lora_rank=48, n_group=4, topk_group=2, num_experts_per_tok=4,
                routed_scaling_factor=2.5,
                rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 1.0,
                                 "mscale_all_dim": 1.0, "original_max_position_embeddings": 128,
                                 "beta_fast": 32.0, "beta_slow": 1.0},
            )
        else:
            config = tf.DeepseekV3Config(
                **common, **mla, q_lora_rank=None, n_group=1, topk_group=1, num_experts_per_tok=3,
                routed_scaling_factor=2.446, rope_parameters={"rope_type": "default", "rope_theta": 50000.0},
            )
        model = tf.DeepseekV3ForCausalLM(config)
    elif family == "glm4_moe":
        config = tf.Glm4MoeConfig(
            **common, num_key_value_heads=2, head_dim=16, intermediate_size=96, n_routed_experts=8,
            n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1, n_group=1, topk_group=1,
            routed_scaling_factor=1.5, attention_bias=True, use_qk_norm=True, num_nextn_predict_layers=0,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        )
        model = tf.Glm4MoeForCausalLM(config)
    else:
        config = tf.Qwen2MoeConfig(
            **common, num_key_value_heads=2, intermediate_size=96, shared_expert_intermediate_size=48,
            num_experts=8, num_experts_per_tok=2, norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[],
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        )
        model = tf.Qwen2MoeForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 1 and "bias" not in name:
                # Norm weights other than ones: swapping two norms must change the output.
                param.copy_(1 + 0.2 * torch.randn_like(param))
            elif name.endswith("mlp.gate.weight"):
                # A trained router is decisive; near-ties would make top-K a coin toss.
                param.mul_(10)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                # A bias that changes which experts win, so selection by score alone would fail.
                buffer.copy_(0.3 * torch.randn_like(buffer))
    return model.float()


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    torch.manual_seed(0)
    dirs = {}
    for family in FAMILIES:
        dirs[family] = root / family
        tiny_hf_model(family).save_pretrained(dirs[family], max_shard_size="100KB")
    return dirs


@pytest.fixture(scope="module")
def references(hf_dirs):
    out = {}
    for family in FAMILIES:
        model = inspect_hf_checkpoint(hf_dirs[family]).model
        out[family] = hf_reference(hf_dirs[family], PROMPTS, model.moe_router_topk, model.moe_router_score_function)
    return out


@pytest.fixture(scope="module")
def tp1(hf_dirs, tmp_path_factory):
    """In this process, through the command lines: convert at TP1, export back, check parity."""
    root = tmp_path_factory.mktemp("megatron")
    prompts = root / "prompts.json"
    prompts.write_text(json.dumps([p.tolist() for p in PROMPTS]))
    out = {}
    for family in FAMILIES:
        megatron, back, report = root / family, root / f"{family}-back", root / f"{family}-parity.json"
        assert hf_to_megatron_main([str(hf_dirs[family]), str(megatron), "--no-progress"]) == 0
        assert megatron_to_hf_main([str(megatron), str(back), "--no-progress"]) == 0
        code = parity_main(["--hf", str(hf_dirs[family]), "--megatron", str(megatron), "--prompts", str(prompts),
                            "--json", str(report)])
        out[family] = {"megatron": str(megatron), "back": back, "code": code, "report": json.loads(report.read_text())}
    return out


def layouts_worker(megatron_dirs: dict[str, str], hf_dirs: dict[str, str]) -> dict:
    """Every rank of a 2-process world: each layout in turn, each family loaded resharded;
    in PP2 also the trainer's own start from the HF directory (``load_initial_weights``)."""
    import torch.distributed as dist

    from megatron_rl.checkpoint.convert import read_export_source
    from megatron_rl.checkpoint.init_source import inspect_init_checkpoint
    from megatron_rl.checkpoint.megatron_io import load_megatron_model
    from megatron_rl.checkpoint.parity import megatron_outputs
    from megatron_rl.parallel.cpu_platform import cpu_platform
    from megatron_rl.parallel.groups import model_parallel
    from megatron_rl.parallel.model import build_model
    from megatron_rl.train.init_weights import load_initial_weights

    results = {}
    with cpu_platform():
        for layout, parallel in LAYOUTS.items():
            with model_parallel(parallel, seed=0) as groups:
                for family, directory in megatron_dirs.items():
                    source = read_export_source(directory)
                    model = load_megatron_model(source.arch, source.model, parallel, directory)
                    results[(layout, family)] = megatron_outputs(model, groups, PROMPTS)
                    if layout == "PP2":
                        source = inspect_init_checkpoint(hf_dirs[family])
                        gpt = build_model(source.hf.model, parallel, moe_enable_routing_replay=True)
                        load_initial_weights(gpt, source, source.hf.model, groups)
                        results[("trainer init", family)] = megatron_outputs(gpt, groups, PROMPTS)
    return results if dist.get_rank() == 0 else None


@pytest.fixture(scope="module")
def layouts(tp1, hf_dirs):
    megatron_dirs = {f: tp1[f]["megatron"] for f in FAMILIES}
    return run_world(layouts_worker, 2, megatron_dirs, {f: str(d) for f, d in hf_dirs.items()}, timeout_s=600)[0]


@pytest.mark.parametrize("family", FAMILIES)
def test_round_trip_is_bit_exact(family, hf_dirs, tp1):
    original, back = hf_dirs[family], tp1[family]["back"]
    files = sorted(p.name for p in original.iterdir())
    assert sorted(p.name for p in back.iterdir()) == files
    for name in files:
        digest = [hashlib.sha256((d / name).read_bytes()).hexdigest() for d in (original, back)]
        assert digest[0] == digest[1], name


@pytest.mark.parametrize("family", FAMILIES)
def test_parity_tool_passes_at_tp1(family, tp1):
    report = tp1[family]["report"]
    assert tp1[family]["code"] == 0, report
    assert report["topk_ids_identical"] and report["logprob_max_abs_diff"] <= 1e-4


def test_kimi_k2_checkpoint_passes_the_parity_tool(hf_dirs, tmp_path):
    """Kimi-K2's config.json says ``kimi_k2``, a type transformers does not know (and an
    ``auto_map`` to its own modelling code); its architecture and tensors are DeepSeek-V3's."""
    kimi = shutil.copytree(hf_dirs["deepseek_v3"], tmp_path / "kimi_k2")
    config = json.loads((kimi / "config.json").read_text())
    config.update(model_type="kimi_k2", auto_map={
        "AutoConfig": "configuration_deepseek.DeepseekV3Config",
        "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"})
    (kimi / "config.json").write_text(json.dumps(config))
    prompts, report = tmp_path / "prompts.json", tmp_path / "parity.json"
    prompts.write_text(json.dumps([p.tolist() for p in PROMPTS]))
    assert hf_to_megatron_main([str(kimi), str(tmp_path / "megatron"), "--no-progress"]) == 0
    code = parity_main(["--hf", str(kimi), "--megatron", str(tmp_path / "megatron"), "--prompts", str(prompts),
                        "--json", str(report)])
    assert code == 0, report.read_text() if report.exists() else "no report"
    result = json.loads(report.read_text())
    assert result["topk_ids_identical"] and result["logprob_max_abs_diff"] <= TOLERANCES.logprob_max_abs


@pytest.mark.parametrize("layout", [*LAYOUTS, "trainer init"])
@pytest.mark.parametrize("family", FAMILIES)
def test_layout_matches_transformers(family, layout, layouts, references):
    report = compare(references[family], layouts[(layout, family)])
    assert report.violations(TOLERANCES) == [], report
    assert report.topk_ids_identical


@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe"])
def test_selection_bias_and_groups_change_the_experts(family, references):
    """The expert bias (and DeepSeek-V3's group limit) decide some tokens' experts, so
    parity above could not hold for a model that selected by the sigmoid scores alone."""
    changed = 0
    for ref in references[family]:
        plain_NLK = ref.router_probs_NLE.topk(ref.expert_ids_NLK.shape[-1], dim=-1).indices
        changed += int((plain_NLK.sort(-1).values != ref.expert_ids_NLK.sort(-1).values).any(-1).sum())
    assert changed > 0


def test_mtp_layers_are_skipped_with_a_note_and_bad_configs_are_named(hf_dirs, tmp_path, capsys):
    """An MTP layer past the backbone is left out (printed); an unknown RoPE scaling stops
    the converter before it writes anything, naming the key (exit 2)."""
    import shutil

    source = tmp_path / "with_mtp"
    shutil.copytree(hf_dirs["deepseek_v3"], source)
    config = json.loads((source / "config.json").read_text())
    config["num_nextn_predict_layers"] = 1
    (source / "config.json").write_text(json.dumps(config))
    index = json.loads((source / "model.safetensors.index.json").read_text())
    extra = {"model.layers.4.eh_proj.weight": torch.ones(64, 128), "model.layers.4.enorm.weight": torch.ones(64)}
    save_file(extra, source / "mtp.safetensors")
    index["weight_map"].update({name: "mtp.safetensors" for name in extra})
    (source / "model.safetensors.index.json").write_text(json.dumps(index))
    assert hf_to_megatron_main([str(source), str(tmp_path / "megatron"), "--no-progress"]) == 0
    assert "skipping 2 tensors of the multi-token-prediction layer(s)" in capsys.readouterr().out

    config["rope_parameters"] = {"rope_type": "longrope", "rope_theta": 10000.0}
    (source / "config.json").write_text(json.dumps(config))
    assert hf_to_megatron_main([str(source), str(tmp_path / "refused"), "--no-progress"]) == 2
    assert "rope_parameters.rope_type='longrope'" in capsys.readouterr().err
    assert not (tmp_path / "refused").exists()


@pytest.mark.parametrize("family", FAMILIES)
def test_generated_config_is_the_same_model_for_transformers(family, hf_dirs, references, tmp_path):
    """The config.json written for a checkpoint with no HF origin (trainer runs from random
    weights) makes transformers compute what the original config does."""
    import shutil

    source = inspect_hf_checkpoint(hf_dirs[family])
    for path in hf_dirs[family].iterdir():
        if path.name != "config.json":
            shutil.copy(path, tmp_path / path.name)
    (tmp_path / "config.json").write_text(json.dumps(hf_config_from_model(source.architecture, source.model)))
    model = source.model
    got = hf_reference(tmp_path, PROMPTS, model.moe_router_topk, model.moe_router_score_function)
    report = compare(references[family], got)
    assert report.logprob_max_abs_diff == 0.0 and report.topk_ids_identical, report
