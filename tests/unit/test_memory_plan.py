"""The memory planner's arithmetic, verdicts, command line, search and launcher check (no world).

Parameter counts and activations are checked against the real model in
``tests/parallel/test_memory_plan_model.py``; measured peaks live in
``tools/bench_memory_plan.py`` (docs/memory.md).
"""

import dataclasses
from pathlib import Path

import pytest
import yaml

from megatron_rl import launcher
from megatron_rl.checkpoint.hf_config import model_config_from_hf
from megatron_rl.config import load_config
from megatron_rl.config_loading import ConfigError
from megatron_rl.plan import Machine, make_plan, parse_bytes
from megatron_rl.plan.cli import load_plan_config, main
from megatron_rl.plan.machine import CPU_RESIDENT_EXCESS, GIB, gib
from megatron_rl.plan.params import model_params
from megatron_rl.plan.report import format_plan
from megatron_rl.plan.search import cost_key, search
from megatron_rl.plan.state import optimizer_bytes_per_param
from megatron_rl.sections import OptimConfig

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
ON_CPU = ["init_checkpoint=null", "fp8.enabled=false"]
"""The GPU presets name cluster paths and FP8; neither changes what the planner counts."""

# DeepSeek-V3's config.json as published (huggingface.co/deepseek-ai/DeepSeek-V3, the keys the
# converter reads); its multi-token-prediction layer is outside the 671B (DeepSeek-V3 README:
# "671B of the Main Model weights and 14B of the Multi-Token Prediction (MTP) Module weights").
DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 129280,
    "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
    "num_attention_heads": 128, "num_key_value_heads": 128, "n_shared_experts": 1, "n_routed_experts": 256,
    "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64,
    "v_head_dim": 128, "qk_nope_head_dim": 128, "topk_method": "noaux_tc", "n_group": 8, "topk_group": 4,
    "num_experts_per_tok": 8, "moe_layer_freq": 1, "first_k_dense_replace": 3, "norm_topk_prob": True,
    "scoring_func": "sigmoid", "aux_loss_alpha": 0.001, "seq_aux": True, "hidden_act": "silu",
    "max_position_embeddings": 163840, "initializer_range": 0.02, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
    "rope_theta": 10000, "attention_bias": False, "num_nextn_predict_layers": 1,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
}


def _truncated(count: int, unit: float) -> float:
    """Model cards truncate: 30.53B is "30.5B", 3.353B is "3.3B", 37.55B is "37B"."""
    return int(count / unit) * unit / 1e9


def test_parameter_counts_match_the_published_totals():
    qwen = model_params(load_config(CONFIGS / "qwen3_30b_a3b.yaml", ON_CPU).model)
    assert (_truncated(qwen.total, 1e8), _truncated(qwen.active, 1e8)) == (30.5, 3.3)
    deepseek = model_params(model_config_from_hf(DEEPSEEK_V3, "bfloat16"))
    assert (_truncated(deepseek.total, 1e9), _truncated(deepseek.active, 1e9)) == (671, 37)


@pytest.mark.parametrize("dtype, optimizer, distributed, dp, expected", [
    # Research notes A.3: bf16 params, fp32 grads: 18 plain, 6 + 12/D distributed.
    ("bfloat16", "adam", False, 4, 18),
    ("bfloat16", "adam", True, 4, 6 + 12 / 4),
    # fp32 params (FP32Optimizer: no main copy): 16 plain, 8 + 8/D distributed.
    ("float32", "adam", False, 2, 16),
    ("float32", "adam", True, 2, 8 + 8 / 2),
    # SGD with momentum keeps one moment, without none.
    ("bfloat16", "sgd_momentum", False, 1, 2 + 4 + 4 + 4),
    ("bfloat16", "sgd", False, 1, 2 + 4 + 4),
])
def test_training_state_bytes_per_parameter(dtype, optimizer, distributed, dp, expected):
    optim = OptimConfig(optimizer="sgd", sgd_momentum=0.9) if optimizer == "sgd_momentum" else OptimConfig(
        optimizer=optimizer)
    assert optimizer_bytes_per_param(optim, dtype, distributed, dp).total == expected


def test_memory_sizes_parse_in_decimal_and_binary_units():
    assert parse_bytes("80GiB", "--gpu-memory") == 80 * GIB
    assert parse_bytes("1.5TB", "--host-memory") == 1.5e12
    assert parse_bytes("512 mib", "x") == 512 << 20
    with pytest.raises(ConfigError, match="--gpu-memory: '80 parsecs' is not a memory size"):
        parse_bytes("80 parsecs", "--gpu-memory")


def _demo():
    return load_config(CONFIGS / "demo_cpu.yaml")


def test_a_plan_that_cannot_fit_names_the_phase_and_the_term():
    plan = make_plan(_demo(), Machine(gpus=2, gpu_memory=16 << 20, cpu=True))
    assert not plan.fits and plan.margin < 0
    binding = plan.binding
    assert binding.peak == max(p.peak for p in plan.phases)
    assert plan.refusal().startswith(f"phase '{binding.name}' ({binding.device}) needs ")
    assert f"the biggest term is {binding.biggest.name}" in plan.refusal()
    roomy = make_plan(_demo(), Machine(gpus=2, gpu_memory=64 * GIB, cpu=True))
    assert roomy.fits and roomy.refusal() == ""


def test_a_cpu_plan_states_the_resident_excess_it_does_not_count():
    """Issue 34 item 11: a CPU rank's resident set runs above the planned tensors (glibc's heaps).
    The report says by how much, the worst case of the table docs/memory.md gives from
    tools/bench_memory_plan.py (a rerun that changes it changes this), and counts it in no peak."""
    docs = (CONFIGS.parent / "docs" / "memory.md").read_text()
    rows = [r.split("|")[1:-1] for r in docs.splitlines() if r.startswith("| ") and r.count("|") == 11]
    ratios = [float(r[7]) / float(r[4]) for r in rows if r[0].strip() != "case"]
    assert len(ratios) == 10 and round(max(ratios) - 1, 2) == CPU_RESIDENT_EXCESS
    cpu = make_plan(_demo(), Machine(gpus=2, gpu_memory=64 * GIB, cpu=True))
    train_peak = max(p.peak for p in cpu.phases if p.name == "train")
    allowance = gib(train_peak * (1 + CPU_RESIDENT_EXCESS))
    assert f"resident (CPU): allow {allowance} GiB per process" in format_plan(cpu)
    tight = make_plan(_demo(), Machine(gpus=2, gpu_memory=max(p.need for p in cpu.phases), cpu=True))
    assert tight.fits and tight.margin == 0
    assert "resident (CPU)" not in format_plan(make_plan(_demo(), Machine(gpus=2, gpu_memory=64 * GIB)))


def test_a_phase_peak_is_its_resident_terms_plus_its_costliest_moment():
    plan = make_plan(_demo(), Machine(gpus=2, gpu_memory=64 * GIB, cpu=True))
    train = next(p for p in plan.phases if p.name == "train")
    resident = sum(t.bytes for t in train.terms if not t.moment)
    moments = {m: sum(t.bytes for t in train.terms if t.moment == m) for m in {t.moment for t in train.terms} - {""}}
    assert set(moments) == {"loss", "backward"}
    assert train.peak == resident + max(moments.values())


def test_recompute_and_smaller_token_budgets_lower_the_update_peak():
    cfg = _demo()
    machine = Machine(gpus=2, gpu_memory=64 * GIB, cpu=True)

    def update_peak(**train):
        run = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, **{"micro_batch_tokens": 4096, **train}))
        return max(p.peak for p in make_plan(run, machine).phases if p.name == "train")

    assert update_peak(recompute="full") < update_peak(recompute="selective") < update_peak()
    assert update_peak(micro_batch_tokens=1024) < update_peak()


def test_the_one_node_preset_fits_eight_h100s_colocated():
    cfg = load_plan_config(str(CONFIGS / "qwen3_30b_a3b_1node.yaml"), ON_CPU)
    assert cfg.rollout.placement == "colocated"
    plan = make_plan(cfg, Machine(gpus=8, gpu_memory=80 * GIB, host_memory=2 << 40))
    assert plan.fits and plan.layout.world == 8 and plan.gpus_needed == 8
    generate = next(p for p in plan.phases if p.name == "generate")
    assert generate.device == "shared GPU" and not any("optimizer" in t.name for t in generate.terms)
    assert any(t.name.startswith("offloaded trainer state") for t in plan.host.terms)


def test_search_lists_only_fitting_layouts_best_first():
    cfg = dataclasses.replace(_demo(), parallel=dataclasses.replace(_demo().parallel, world_size=None))
    plan = make_plan(cfg, Machine(gpus=4, gpu_memory=int(1.2 * (1 << 20) * 20), cpu=True))
    found = search(plan)
    assert found and all(p.fits for p in found)
    assert [cost_key(p) for p in found] == sorted(cost_key(p) for p in found)
    assert {p.layout.recompute for p in found} <= {"none", "selective", "full"}


def test_command_line_exit_status_and_verdict(capsys):
    demo = ["--config", str(CONFIGS / "demo_cpu.yaml"), "--cpu"]
    assert main([*demo, "--gpu-memory", "64GiB"]) == 0
    out = capsys.readouterr().out
    assert "train [trainer GPU, stage 0]" in out and "FITS: margin" in out
    assert main([*demo, "--gpu-memory", "16MiB"]) == 1
    assert "DOES NOT FIT" in capsys.readouterr().out
    assert main([*demo, "--gpu-memory", "lots"]) == 2
    assert "--gpu-memory: 'lots' is not a memory size" in capsys.readouterr().err


def test_a_preset_plans_for_its_machine_without_the_checkpoint_or_transformer_engine_here(tmp_path, capsys):
    """Issue 34: the README's plan command exited 2 here (``init_checkpoint: /data/models/Qwen3-30B-A3B
    does not exist``, then FP8 without Transformer Engine). The planner reads the config as the trainer
    does except for this machine's files and packages; every other rule still holds."""
    preset = CONFIGS / "qwen3_30b_a3b_1node.yaml"
    with pytest.raises(ConfigError, match=r"^init_checkpoint: /data/models/Qwen3-30B-A3B does not exist$"):
        load_config(preset)  # the trainer still checks its machine
    cfg = load_plan_config(str(preset), [])
    assert cfg.fp8.enabled and cfg.init_checkpoint == "/data/models/Qwen3-30B-A3B"
    assert cfg.model == load_config(preset, ON_CPU).model  # the preset's model section
    assert main(["--config", str(preset), "--gpu-memory", "80GiB", "--host-memory", "2TiB"]) == 0
    assert "FITS: margin" in capsys.readouterr().out
    for bad, key in (["fp8.amax_history_len=0"], "fp8.amax_history_len"), (["model.num_layers=0"], "model.num_layers"):
        with pytest.raises(ConfigError, match=rf"^{key}: "):
            load_plan_config(str(preset), bad)
    # A checkpoint that is here is read and checked as the trainer does.
    demo = CONFIGS / "demo_cpu.yaml"
    with pytest.raises(ConfigError, match=r"^model.num_experts: the config sets 4 but the checkpoint"):
        load_plan_config(str(demo), ["model.num_experts=4"])
    # A teacher that is not here keeps the model section the config gives it; without one it is refused.
    teacher = load_config(CONFIGS / "demo_distill.yaml").distill.teachers[0]
    entry = {"name": "far", "path": "/nonexistent/teacher", "model": dataclasses.asdict(teacher.model)}
    (tmp_path / "far.yaml").write_text(yaml.safe_dump({"base": str(CONFIGS / "demo_distill.yaml"),
                                                      "distill": {"teachers": [entry]}}))
    assert load_plan_config(str(tmp_path / "far.yaml"), []).distill.teachers[0].model == teacher.model
    with pytest.raises(ConfigError, match=r"^distill.teachers\[0\].path: /nonexistent/teacher does not exist$"):
        load_config(tmp_path / "far.yaml")
    del entry["model"]
    (tmp_path / "far.yaml").write_text(yaml.safe_dump({"base": str(CONFIGS / "demo_distill.yaml"),
                                                      "distill": {"teachers": [entry]}}))
    with pytest.raises(ConfigError, match=r"^distill.teachers\[0\].path: /nonexistent/teacher does not exist$"):
        load_plan_config(str(tmp_path / "far.yaml"), [])


def test_launcher_refuses_a_layout_that_cannot_fit_before_any_worker(monkeypatch, capsys):
    def no_process(*args, **kwargs):
        raise AssertionError(f"a process was started: {args}")

    monkeypatch.setattr(launcher.subprocess, "Popen", no_process)
    argv = ["--config", str(CONFIGS / "demo_cpu.yaml"), "--gpu-memory", "8GiB", "train.micro_batch_tokens=200000"]
    assert launcher.main(argv) == launcher.CONFIG_ERROR_EXIT
    err = capsys.readouterr().err
    assert "memory: phase 'train' (trainer GPU, stage 0) needs" in err
    assert "the biggest term is activations (1 micro-batch of 200000 tokens, recompute none)" in err


def test_recompute_choices_reach_megatrons_transformer_config():
    from megatron_rl.parallel.model import build_transformer_config, recompute_fields
    from megatron_rl.sections import ModelConfig, ParallelConfig

    full = build_transformer_config(ModelConfig(), ParallelConfig(), **recompute_fields("full"))
    assert (full.recompute_granularity, full.recompute_method, full.recompute_num_layers) == ("full", "uniform", 1)
    selective = build_transformer_config(ModelConfig(), ParallelConfig(), **recompute_fields("selective"))
    assert selective.recompute_granularity == "selective" and selective.recompute_modules == ["moe"]
    assert build_transformer_config(ModelConfig(), ParallelConfig()).recompute_granularity is None


def test_a_teacher_is_counted_in_every_trainer_phase_its_pass_and_when_offloaded_on_the_host():
    """A trainer-run teacher in TP2 (+SP) beside the demo's EP2 policy: its weights are a rank's share
    of its costliest stage in its own layout (``rank_params``), resident in every trainer phase and
    moved out with the trainer's weights when colocated; its pass is a phase of its own with its
    forward at its own width and vocabulary. Offloaded between passes, it leaves the other phases
    and waits in host memory."""
    from megatron_rl.plan.params import rank_params
    from megatron_rl.sections import ParallelConfig
    from megatron_rl.sections.distill import DistillConfig, TeacherConfig

    cfg = _demo()
    teacher_model = dataclasses.replace(cfg.model, hidden_size=96, moe_ffn_hidden_size=96, head_dim=24, vocab_size=576)
    teacher = TeacherConfig(name="big", path="unused", model=teacher_model,
                            parallel=ParallelConfig(tensor_model_parallel_size=2))
    cfg = dataclasses.replace(cfg, distill=DistillConfig(teachers=[teacher]))
    machine = Machine(gpus=2, gpu_memory=8 * GIB, cpu=True)
    plan = make_plan(cfg, machine)
    weights = rank_params(teacher_model, teacher.parallel, 0).total * 4  # fp32
    for phase in plan.phases:
        got = [t.bytes for t in phase.terms if t.name == "teacher big weights"]
        assert got == ([weights] if phase.device.startswith("trainer GPU") else []), phase.name
    passes = [p for p in plan.phases if p.name.startswith("teacher pass (big, TP2 SP EP1 ETP1 PP1 DP1)")]
    assert len(passes) == 1
    logits = next(t for t in passes[0].terms if t.name.endswith("logits and the response rows' copy"))
    assert logits.bytes > 0
    train = next(p for p in plan.phases if p.name == "train")
    for name in ("weights", "gradient buffer (fp32)", "fp32 main weights", "optimizer state"):  # the policy's state
        assert [t.bytes for t in passes[0].terms if t.name == name] == [t.bytes for t in train.terms if t.name == name]
    # Colocated with offload: the resident teacher leaves the GPU with the trainer's weights while SGLang generates.
    from megatron_rl.plan.machine import Layout
    from megatron_rl.plan.phases import host_terms

    colocated = Layout(parallel=cfg.parallel, world=2, placement="colocated", offload=True)
    without = dataclasses.replace(cfg, distill=DistillConfig())
    moved = [t.bytes for t in host_terms(cfg, colocated, machine, False) if t.name.startswith("offloaded trainer state")]
    moved_without = [t.bytes for t in host_terms(without, colocated, machine, False)
                     if t.name.startswith("offloaded trainer state")]
    assert [a - b for a, b in zip(moved, moved_without)] == [2 * weights]
    offloaded = dataclasses.replace(cfg, distill=DistillConfig(teachers=[dataclasses.replace(teacher, offload=True)]))
    plan = make_plan(offloaded, machine)
    assert not any(t.name == "teacher big weights" for p in plan.phases for t in p.terms)
    pass_terms = next(p for p in plan.phases if p.name.startswith("teacher pass")).terms
    assert [t.bytes for t in pass_terms if t.name == "teacher big weights (back for its pass)"] == [weights]
    assert [t.bytes for t in plan.host.terms if t.name.startswith("teacher big weights, offloaded")] == [2 * weights]
