"""Config loading: YAML presets, dotted overrides and strict validation with named keys."""

import dataclasses
from pathlib import Path

import pytest

from megatron_rl.config import RunConfig, load_config, validate
from megatron_rl.config import load_config as load_run_config
from megatron_rl.config_loading import ConfigError, parse_overrides

PRESET = Path(__file__).resolve().parents[2] / "configs" / "tiny_moe.yaml"


def test_preset_loads_with_overrides():
    cfg = load_config(
        PRESET,
        ["model.num_experts=16", "parallel.tensor_model_parallel_size=2", "seed=7"],
        world_size=2,
    )
    assert isinstance(cfg, RunConfig)
    assert cfg.model.num_experts == 16
    assert cfg.parallel.tensor_model_parallel_size == 2
    assert cfg.parallel.sequence_parallel_enabled()
    assert cfg.seed == 7
    assert cfg.model.vocab_size == 256  # from the preset, untouched


def test_overrides_parse_yaml_scalars():
    assert parse_overrides(["a.b=1", "a.c=0.5", "d=true", "e=null", "f=alltoall"]) == {
        "a": {"b": 1, "c": 0.5},
        "d": True,
        "e": None,
        "f": "alltoall",
    }


def test_float_field_accepts_integer_and_exponent_literals():
    cfg = load_config(None, ["model.rotary_base=10000", "optim.lr=1e-3"])
    assert cfg.model.rotary_base == 10000.0 and isinstance(cfg.model.rotary_base, float)
    assert cfg.optim.lr == 1e-3


INVALID = [
    (["model.num_expert=8"], "model.num_expert", "unknown key"),
    (["bogus=1"], "bogus", "unknown key"),
    (["parallel.expert_model_parallel_size=3"], "parallel.expert_model_parallel_size", "must divide model.num_experts"),
    (["parallel.tensor_model_parallel_size=3"], "parallel.tensor_model_parallel_size", "must divide model.num_attention_heads"),
    (["parallel.tensor_model_parallel_size=4"], "parallel.tensor_model_parallel_size", "must divide model.num_query_groups"),
    (["model.moe_router_topk=9"], "model.moe_router_topk", "must not exceed model.num_experts"),
    (["model.vocab_size=255", "parallel.tensor_model_parallel_size=2", "parallel.world_size=2"], "parallel.tensor_model_parallel_size", "must divide the padded vocabulary 255"),
    (["model.vocab_size=255", "model.vocab_padding_multiple=3", "parallel.tensor_model_parallel_size=2", "parallel.world_size=2"], "parallel.tensor_model_parallel_size", "set model.vocab_padding_multiple=128 (pads to 256)"),
    (["model.vocab_padding_multiple=0"], "model.vocab_padding_multiple", "must be a positive integer"),
    (["parallel.pipeline_model_parallel_size=3"], "parallel.pipeline_model_parallel_size", "must divide model.num_layers"),
    (["parallel.world_size=3", "parallel.tensor_model_parallel_size=2"], "parallel.world_size", "not divisible by TP x PP x CP"),
    (["parallel.moe_token_dispatcher_type=flex"], "parallel.moe_token_dispatcher_type", "is not one of"),
    (["model.hidden_size=abc"], "model.hidden_size", "expected an integer"),
    (["parallel.sequence_parallel=true"], "parallel.sequence_parallel", "needs parallel.tensor_model_parallel_size > 1"),
    (["parallel.context_parallel_size=0"], "parallel.context_parallel_size", "must be >= 1"),
    (["parallel.world_size=6", "parallel.context_parallel_size=4"], "parallel.world_size",
     "not divisible by TP x PP x CP = 4"),
    (["model.num_query_groups=3"], "model.num_query_groups", "must divide model.num_attention_heads"),
    (["parallel.tensor_model_parallel_size=2", "parallel.sequence_parallel=false"], "parallel.sequence_parallel", "requires sequence parallelism"),
    (["model.moe_router_score_function=sigmoid", "model.moe_router_pre_softmax=true"], "model.moe_router_pre_softmax", "only applies to softmax"),
    (["model=3"], "model", "expected a mapping"),
]


@pytest.mark.parametrize("overrides,key,rule", INVALID, ids=[c[1] + ":" + c[2] for c in INVALID])
def test_invalid_config_names_key_and_rule(overrides, key, rule):
    with pytest.raises(ConfigError) as err:
        load_config(PRESET, overrides)
    message = str(err.value)
    assert message.startswith(key + ":"), message
    assert rule in message, message


def test_world_size_from_launcher_is_checked():
    cfg = load_config(PRESET, ["parallel.tensor_model_parallel_size=2"])
    with pytest.raises(ConfigError, match="parallel.world_size: world size 3 is not divisible"):
        validate(cfg, world_size=3)
    with pytest.raises(ConfigError, match="parallel.expert_model_parallel_size: world size 2"):
        validate(load_config(PRESET, ["parallel.expert_model_parallel_size=4"]), world_size=2)
    with pytest.raises(ConfigError, match="expects 4 processes but the launcher started 2"):
        validate(load_config(PRESET, ["parallel.world_size=4"]), world_size=2)


def test_a_pipeline_stage_of_dense_layers_only_is_a_valid_layout():
    """PP3 on three layers, the first dense: stage 0 has no router (parallel/test_sigmoid_routing.py runs such a stage)."""
    dense_first = ["model.num_layers=3", "model.num_dense_layers=1", "model.ffn_hidden_size=64"]
    cfg = load_config(PRESET, [*dense_first, "parallel.pipeline_model_parallel_size=3"], world_size=3)
    assert cfg.parallel.pipeline_model_parallel_size == 3 and cfg.model.moe_layers == (1, 2)


def test_malformed_override_is_rejected():
    with pytest.raises(ConfigError, match="expected key.path=value"):
        parse_overrides(["model.num_experts"])


@pytest.mark.parametrize("value", ["[a", "{a: 1", '"abc', "@x", "a: b: c"])
def test_override_value_that_is_not_yaml_names_the_key_in_one_line(value):
    with pytest.raises(ConfigError) as caught:
        parse_overrides([f"data.train_files={value}"])
    message = str(caught.value)
    assert message.startswith(f"data.train_files: override value {value!r} is not valid YAML (")
    assert "\n" not in message


RUN_INVALID = [
    (["objective.preset=ppo2"], "objective.preset", "unknown objective 'ppo2'"),
    (["objective.eps_hgh=0.3"], "objective.eps_hgh", "unknown key; did you mean objective.eps_high? ObjectiveSection accepts"),
    (["objective.eps_low=abc"], "objective.eps_low", "expected a number, got 'abc'"),
    (["objective.dynamic_sampling=maybe"], "objective.dynamic_sampling", "expected true/false, got 'maybe'"),
    (["objective.eps_low=null"], "objective.eps_low", "expected a number, got None"),
    (["objective.aggregation=sum"], "objective.aggregation", "is not one of"),
    (["objective.eps_low=-0.1"], "objective.eps_low", "must be >= 0, got -0.1"),
    (["objective.eps_low=nan"], "objective.eps_low", "is NaN"),
    (["objective.advantage=gae"], "objective.advantage", "advantage='gae' is not one of"),
    (["objective.preset=dr_grpo", "objective.aggregation=token_mean"], "objective.max_len",
     "is only used by aggregation='constant_normalizer'"),
    (["rollout.group_size=1"], "rollout.group_size", "group-relative"),
    (["train.routing_replay=R3", "rollout.return_routed_experts=false"], "train.routing_replay", "R3 replays"),
    (["data.task.max_opernd=3"], "data.task.max_opernd", "unknown key"),
    (["reward.num_wokers=3"], "reward.num_wokers", "unknown key"),
    (["eval.pass_k=[1, 8]", "eval.num_samples=4"], "eval.pass_k", "k=8 must be between 1 and eval.num_samples"),
    (["rollout.max_new_tokens=200"], "rollout.max_new_tokens", "leaves no room for a prompt"),
    (["train.micro_batch_tokens=100"], "train.micro_batch_tokens",
     "100 is smaller than the longest possible sample, 128 tokens (model.max_position_embeddings)"),
    (["train.micro_batch_tokens=60", "data.max_prompt_tokens=50"], "train.micro_batch_tokens",
     "60 is smaller than the longest possible sample, 66 tokens (data.max_prompt_tokens + rollout.max_new_tokens)"),
    (["train.micro_batch_tokens=511", "parallel.tensor_model_parallel_size=2", "parallel.expert_model_parallel_size=1"],
     "train.micro_batch_tokens", "511 is not a multiple of parallel.tensor_model_parallel_size (2)"),
    # Under CP the budget is per CP rank: rows of budget x CP tokens, slots of 2 x CP.
    (["train.micro_batch_tokens=63", "parallel.context_parallel_size=2", "parallel.expert_model_parallel_size=1"],
     "train.micro_batch_tokens", "63 per CP rank x parallel.context_parallel_size (2) is smaller than the longest "
     "possible sample, 128 tokens (128 in its CP slot)"),
    (["train.micro_batch_tokens=101", "parallel.context_parallel_size=2", "parallel.expert_model_parallel_size=1"],
     "train.micro_batch_tokens", "101 per CP rank x parallel.context_parallel_size (2) is not a multiple of 2"),
    (["rollout.prompts_per_step=5"], "rollout.prompts_per_step", "must split evenly over 2 data-parallel ranks"),
    (["model.num_layers=2"], "model.num_layers", "the config sets 2 but the checkpoint"),
    (["train.routing_replay=R4"], "train.routing_replay", "is not one of"),
    (["rollout.engine=sglang"], "rollout.sglang.urls", "either server URLs or url_dir"),
    (["rollout.engine=sglang", "rollout.sglang.urls=[http://a:1]", "rollout.sglang.url_dir=/tmp/u"],
     "rollout.sglang.urls", "exactly one"),
    (["rollout.engine=sglang", "rollout.sglang.urls=[http://a:1, node3:30000]"], "rollout.sglang.urls[1]",
     "'node3:30000' is not an http(s) base URL"),
    (["rollout.engine=sglang", "rollout.sglang.urls=[http://a:1, http://a:1]"], "rollout.sglang.urls", "twice"),
    (["rollout.engine=sglang", "rollout.sglang.urls=[http://a:1]", "rollout.sglang.max_concurrency=0"],
     "rollout.sglang.max_concurrency", ">= 1"),
    (["rollout.engine=sglang", "rollout.sglang.urls=[http://a:1]", "rollout.sglang.request_timeout_s=0"],
     "rollout.sglang.request_timeout_s", "> 0"),
    (["rollout.engine=sglang", "rollout.sglang.urls=[http://a:1]", "rollout.sglang.hf_architecture=llama"],
     "rollout.sglang.hf_architecture", "unknown architecture 'llama'"),
    (["model.moe_router_score_function=sigmoid"], "model.moe_router_score_function",
     "the config sets 'sigmoid' but the checkpoint"),
    (["rollout.engine=sglang", "rollout.sglang.urls=[http://a:1]", "rollout.sglang.hf_architecture=mixtral"],
     "rollout.sglang.hf_architecture", "model.qk_layernorm=True: mixtral has qk_layernorm=False"),
    (["rollout.engine=sglang", "rollout.sglang.urls=[http://a:1]", "rollout.sglang.weight_sync=ipc"],
     "rollout.sglang.weight_sync", "is not one of"),
    (["optim.optimizer=sgd", "optim.distributed=true"], "optim.distributed", "checkpoints Adam's state"),
    (["optim.overlap_grad_reduce=true"], "optim.overlap_grad_reduce", "set optim.distributed=true"),
    (["optim.distributed=true", "optim.overlap_param_gather=true"], "optim.overlap_param_gather",
     "needs optim.overlap_grad_reduce=true"),
    (["optim.distributed=true", "optim.overlap_grad_reduce=true", "optim.bucket_size=0"], "optim.bucket_size", "> 0"),
    (["optim.checkpoint_sharding=fully_sharded_model_space"], "optim.checkpoint_sharding", "is not one of"),
]

DEMO = Path(__file__).resolve().parents[2] / "configs" / "demo_cpu.yaml"


@pytest.mark.parametrize("overrides,key,rule", RUN_INVALID, ids=[c[1] + ":" + c[2] for c in RUN_INVALID])
def test_invalid_run_config_is_rejected_before_any_model(overrides, key, rule):
    with pytest.raises(ConfigError) as err:
        load_run_config(DEMO, overrides, world_size=2)
    message = str(err.value)
    assert message.startswith(key + ":"), message
    assert rule in message, message


def test_sglang_section_is_checked_only_when_it_is_the_engine():
    assert load_run_config(DEMO, ["rollout.sglang.max_retries=-1"], world_size=2).rollout.engine == "hf"
    cfg = load_run_config(DEMO, ["rollout.engine=sglang", "rollout.sglang.url_dir=/tmp/urls"], world_size=2)
    assert cfg.rollout.sglang.url_dir == "/tmp/urls" and cfg.rollout.sglang.num_servers == 1


def test_demo_config_is_valid():
    cfg = load_run_config(DEMO, world_size=2)
    assert cfg.parallel.expert_model_parallel_size == 2
    assert cfg.train.routing_replay == "R2" and cfg.objective.rspo_gamma_min > 0


def test_context_parallel_layouts_load():
    """CP composes with TP+SP, EP and PP; its budget is per CP rank (rows of budget x CP tokens)."""
    for overrides in (["parallel.context_parallel_size=2", "parallel.expert_model_parallel_size=1"],
                      ["parallel.context_parallel_size=2", "parallel.tensor_model_parallel_size=2",
                       "parallel.world_size=4", "train.micro_batch_tokens=64"],
                      ["parallel.context_parallel_size=2", "parallel.world_size=4"]):
        cfg = load_run_config(DEMO, overrides, world_size=None)
        assert cfg.parallel.context_parallel_size == 2


def test_objective_preset_configs_resolve_to_their_presets():

    from megatron_rl.algos.presets import get_preset
    from megatron_rl.config import resolve_objective

    files = sorted((DEMO.parent / "objectives").glob("*.yaml"))
    assert len(files) == 14
    for path in files:
        cfg = load_run_config(path, world_size=2)
        assert resolve_objective(cfg) == get_preset(cfg.objective.preset), path
        assert cfg.train.run_dir.endswith(path.stem) and cfg.model.num_experts == 8


def test_every_program_reads_the_starting_checkpoint_through_the_one_loader():
    """Issue 35: ``config.load_config`` (smoke, plan, tests) accepted ``init_checkpoint`` naming
    nothing while the runs' loader refused it, and gave the demo a model section of its own
    while the runs took the checkpoint's. Every reader is ``load_config`` now."""
    from megatron_rl.checkpoint.init_source import checkpoint_model_section
    from megatron_rl.smoke import smoke_config
    from megatron_rl.train.config_report import resolved_config_yaml

    missing = ["init_checkpoint=/nonexistent/ckpt"]
    # The planner reads it too, but plans for another machine: test_memory_plan.py.
    for read in (load_config, smoke_config, resolved_config_yaml):
        with pytest.raises(ConfigError, match=r"^init_checkpoint: /nonexistent/ckpt does not exist$"):
            read(PRESET, missing)
    demo = load_config(DEMO, world_size=2)
    assert dataclasses.asdict(demo.model) == checkpoint_model_section(demo.init_checkpoint, None)
    with pytest.raises(ConfigError, match=r"^model.num_experts: the config sets 4 but the checkpoint .* says 8"):
        load_config(DEMO, ["model.num_experts=4"])


def test_base_chain_loops_are_rejected(tmp_path):
    (tmp_path / "a.yaml").write_text("base: b.yaml\n")
    (tmp_path / "b.yaml").write_text("base: a.yaml\n")
    with pytest.raises(ConfigError, match="base chain loops back"):
        load_config(tmp_path / "a.yaml")


def test_objective_section_mirrors_objective_config():
    """One option per ObjectiveConfig field, in order: its type plus the preset marker; each
    option's one-line docstring exists once, on its ObjectiveConfig field."""
    import ast
    import inspect
    import typing

    from megatron_rl.algos import config as objective_module
    from megatron_rl.algos import section as section_module
    from megatron_rl.algos.config import ObjectiveConfig
    from megatron_rl.algos.section import FROM_PRESET, FromPreset, ObjectiveSection

    def attribute_docs(module, cls_name):
        (cls,) = [n for n in ast.parse(inspect.getsource(module)).body
                  if isinstance(n, ast.ClassDef) and n.name == cls_name]
        return {target.target.id: doc.value.value for target, doc in zip(cls.body, cls.body[1:])
                if isinstance(target, ast.AnnAssign) and isinstance(doc, ast.Expr)}

    options = [f for f in dataclasses.fields(ObjectiveSection) if f.name != "preset"]
    assert [f.name for f in options] == [f.name for f in dataclasses.fields(ObjectiveConfig)]
    config_types = typing.get_type_hints(ObjectiveConfig)
    section_types = typing.get_type_hints(ObjectiveSection)
    config_docs = attribute_docs(objective_module, "ObjectiveConfig")
    section_docs = attribute_docs(section_module, "ObjectiveSection")
    for f in options:
        assert section_types[f.name] == typing.Union[config_types[f.name], FromPreset], f.name
        assert f.default == FROM_PRESET, f.name
        doc = config_docs[f.name]
        assert doc.strip() and "\n" not in doc, f.name
    assert section_docs.keys() == {"preset"}


def test_each_preset_resolves_to_itself_without_overrides():
    from megatron_rl.algos.presets import OBJECTIVE_PRESETS, get_preset
    from megatron_rl.config import resolve_objective
    from megatron_rl.config_loading import from_dict, to_dict

    for name in OBJECTIVE_PRESETS.names():
        cfg = from_dict(RunConfig, {"objective": {"preset": name}})
        assert cfg.objective.overrides() == {}
        assert resolve_objective(cfg) == get_preset(name), name
        assert from_dict(RunConfig, to_dict(cfg)) == cfg, name


def test_objective_null_overrides_a_preset_value():
    """null keeps ObjectiveConfig's meaning (None), so a preset's non-None value can be unset."""
    from megatron_rl.config import resolve_objective

    cfg = load_config(None, ["objective.preset=rspo", "objective.rspo_gamma_min=null"])
    assert resolve_objective(cfg).rspo_gamma_min is None
    cfg = load_config(None, ["objective.preset=dr_grpo", "objective.aggregation=token_mean",
                             "objective.max_len=null", "objective.eps_high=1e-3"])
    objective = resolve_objective(cfg)
    assert (objective.aggregation, objective.max_len, objective.eps_high) == ("token_mean", None, 1e-3)
    assert objective.advantage == "dr_grpo"


def test_malformed_yaml_names_its_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  steps: [1, 2\n")
    with pytest.raises(ConfigError, match=f"^{bad}: not valid YAML"):
        load_run_config(bad)
    with pytest.raises(ConfigError, match="--config: .* is not a file"):
        load_run_config(tmp_path / "missing.yaml")


GPU_PRESETS = sorted(p for p in PRESET.parent.glob("*.yaml") if "params_dtype: bfloat16" in p.read_text())
"""The presets written for GPUs (bf16 weights); the CPU demos keep fp32."""


@pytest.mark.parametrize("preset", GPU_PRESETS, ids=[p.stem for p in GPU_PRESETS])
def test_gpu_presets_use_the_distributed_optimizer(preset):
    assert len(GPU_PRESETS) >= 5
    # FP8 needs TE and a GPU to validate; the checkpoint path names a cluster's copy.
    cfg = load_config(preset, ["fp8.enabled=false", "init_checkpoint=null"])
    assert cfg.optim.distributed and cfg.optim.checkpoint_sharding == "fully_reshardable"
