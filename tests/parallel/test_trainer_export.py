"""Exporting a trainer checkpoint (model + Megatron optimizer state + trainer_state.json) to HF.

Shown here: ``hf_config_from_model`` inverts ``model_config_from_hf`` for Qwen3-MoE and
Mixtral models, transformers loads what it writes, and it refuses models the architecture
cannot represent by field; a real trainer checkpoint (EP2 gloo world: model, optimizer,
one Adam step, ``save_checkpoint``) exports through the command line with a generated
config.json, and transformers' forward of the export matches the Megatron model's
log-probs (1e-4, fp32, as the HF conversion tests) with identical top-K experts; an
``--hf-config`` must describe the trainer's model; optimizer keys are skipped only in
trainer checkpoints, and anything else unknown is still rejected by name; the parity
tool reads a trainer checkpoint's model.

One spawned gloo world of 2 processes writes every checkpoint; exports run in this process.
"""

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch

from megatron_rl.checkpoint.cli import megatron_to_hf_main
from megatron_rl.checkpoint.convert import convert_megatron_to_hf
from megatron_rl.checkpoint.errors import CheckpointMismatchError
from megatron_rl.checkpoint.hf_config import hf_config_from_model, model_config_from_hf
from megatron_rl.checkpoint.hf_io import HFCheckpoint, staging_dir
from megatron_rl.checkpoint.parity import (
    ParityTolerances,
    check_parity,
    compare,
    hf_reference,
    random_prompts,
)
from megatron_rl.checkpoint.trainer_source import is_optimizer_key
from megatron_rl.parallel.world import run_world
from megatron_rl.sections import ModelConfig, ParallelConfig

pytestmark = pytest.mark.parallel

MODEL = ModelConfig(
    vocab_size=128, hidden_size=64, num_layers=2, num_attention_heads=4, num_query_groups=2, head_dim=16,
    num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=32, max_position_embeddings=64,
)
MIXTRAL_MODEL = dataclasses.replace(MODEL, qk_layernorm=False, rotary_base=10000.0, norm_epsilon=1e-5)
EP2 = ParallelConfig(expert_model_parallel_size=2)
PROMPTS = [p[:n] for p, n in zip(random_prompts(4, 12, MODEL.vocab_size, seed=5), (12, 7, 10, 5))]
# The HF conversion tests' limits (tests/parallel/test_hf_conversion.py).
TOLERANCES = ParityTolerances(logprob_max_abs=1e-4, topk_agreement_min=1.0, router_prob_max_abs=1e-5)
EXTRA_KEY = "decoder.layers.1.mlp.shared_expert_gate.weight"


# ------------------------------------------------------------------ generated HF config


@pytest.mark.parametrize(
    "arch, model",
    [
        ("qwen3_moe", MODEL),
        ("qwen3_moe", dataclasses.replace(MODEL, moe_router_pre_softmax=True, params_dtype="bfloat16")),
        ("mixtral", MIXTRAL_MODEL),
    ],
    ids=["qwen3_moe", "qwen3_moe pre-softmax bf16", "mixtral"],
)
def test_hf_config_from_model_inverts_model_config_from_hf(arch, model, tmp_path):
    from transformers import AutoConfig

    config = hf_config_from_model(arch, model)
    assert model_config_from_hf(config, model.params_dtype) == model
    (tmp_path / "config.json").write_text(json.dumps(config))
    loaded = AutoConfig.from_pretrained(tmp_path)
    assert loaded.model_type == arch and loaded.architectures == config["architectures"]
    experts = loaded.num_experts if arch == "qwen3_moe" else loaded.num_local_experts
    assert (experts, loaded.num_experts_per_tok, loaded.head_dim) == (8, 2, 16)
    assert loaded.rope_parameters["rope_theta"] == model.rotary_base
    assert loaded.dtype == getattr(torch, model.params_dtype)
    if arch == "qwen3_moe":
        assert loaded.norm_topk_prob is not model.moe_router_pre_softmax
        assert loaded.decoder_sparse_step == 1 and loaded.mlp_only_layers == []


@pytest.mark.parametrize(
    "arch, change, message",
    [
        ("qwen3_moe", {"moe_router_score_function": "sigmoid"}, "model.moe_router_score_function='sigmoid'"),
        ("qwen3_moe", {"qk_layernorm": False}, "model.qk_layernorm=False: qwen3_moe has qk_layernorm=True"),
        ("mixtral", {}, "model.qk_layernorm=True: mixtral has qk_layernorm=False"),
        ("qwen3_moe", {"untie_embeddings_and_output_weights": False}, "model.untie_embeddings_and_output_weights"),
        ("mixtral", {"qk_layernorm": False, "moe_router_pre_softmax": True}, "model.moe_router_pre_softmax=True"),
        ("qwen3_moe", {"rotary_base": 10000.5}, "model.rotary_base=10000.5 is not an integer"),
        ("qwen3_moe", {"moe_router_topk": 9}, "model.moe_router_topk"),
    ],
    ids=["sigmoid router", "no qk norm", "mixtral qk norm", "tied", "mixtral pre-softmax", "theta", "top-K"],
)
def test_hf_config_from_model_refuses_what_the_architecture_cannot_represent(arch, change, message):
    with pytest.raises(CheckpointMismatchError, match=message):
        hf_config_from_model(arch, dataclasses.replace(MODEL, **change))


def test_optimizer_key_rule_is_precise():
    for key in ("chained_0.optimizer.state.exp_avg.decoder.layers.mlp.router.weight",
                "chained_12.optimizer.state.fp32_param.output_layer.weight",
                "optimizer.state.exp_avg_sq.embedding.word_embeddings.weight",
                "optimizer.param_groups/shard_0_2"):
        assert is_optimizer_key(key), key
    for key in ("decoder.layers.mlp.router.weight", "decoder.optimizer.state.x", "chained_x.optimizer.state.y",
                "chained_0.optimizerX.state", "model.optimizer.state.exp_avg", "optimizers.state"):
        assert not is_optimizer_key(key), key


# ------------------------------------------------------------------ a real trainer checkpoint


def trainer_worker(root: str) -> dict:
    """Every rank: build, step and save like the trainer; then two malformed variants."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    from megatron_rl.checkpoint.parity import megatron_outputs
    from megatron_rl.config import RunConfig
    from megatron_rl.config_loading import to_dict
    from megatron_rl.parallel.cpu_platform import cpu_platform
    from megatron_rl.parallel.groups import model_parallel
    from megatron_rl.parallel.model import build_model
    from megatron_rl.parallel.optim import build_optimizer, optimizer_step
    from megatron_rl.parallel.schedule import wrap_for_training
    from megatron_rl.sections import OptimConfig
    from megatron_rl.train.checkpoint import TrainerState, save_checkpoint

    rank = dist.get_rank()
    with cpu_platform(), model_parallel(EP2, seed=1234) as groups:
        model = build_model(MODEL, EP2, moe_enable_routing_replay=True)
        with torch.no_grad():
            for layer in model.decoder.layers:
                # A trained router is decisive; near-ties would make top-K a coin toss.
                layer.mlp.router.weight.mul_(50)
        ddp = wrap_for_training(model)
        optimizer = build_optimizer(ddp, OptimConfig(optimizer="adam", lr=1e-2))
        before = model.output_layer.weight.detach().clone()
        for param in ddp.parameters():
            # A function of the weights: replicated weights get replicated gradients.
            param.main_grad.copy_(torch.sin(7 * param.detach()))
        optimizer_step(optimizer)
        moved = float((model.output_layer.weight - before).abs().max())
        config = to_dict(RunConfig(model=MODEL, parallel=EP2))
        state = TrainerState(step=3, data_position=48, weight_version=3)
        path = save_checkpoint(Path(root) / "run", ddp, optimizer, state, config, groups.world)
        outputs = megatron_outputs(model, groups, PROMPTS)

        # Malformed variants, written like save_checkpoint writes its state.
        model_sd = model.sharded_state_dict()
        full = {"model": model_sd, "optimizer": optimizer.sharded_state_dict(model_sd)}
        extra = ShardedTensor.from_rank_offsets(EXTRA_KEY, torch.zeros(1, MODEL.hidden_size), replica_id=rank)
        variants = {"plain": full, "extra": {**full, "extra": extra}}
        for name, sharded in variants.items():
            if rank == 0:
                (Path(root) / name).mkdir()
            dist.barrier()
            dist_checkpointing.save(sharded, str(Path(root) / name))
            dist.barrier()
        if rank == 0:
            # A trainer checkpoint with one tensor no model has.
            shutil.copy(path / "trainer_state.json", Path(root) / "extra")
    return {"rank": rank, "path": str(path), "outputs": outputs, "moved": moved}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("trainer")
    results = sorted(run_world(trainer_worker, 2, str(root), timeout_s=300), key=lambda r: r["rank"])
    return root, results


@pytest.fixture(scope="module")
def exported(trained):
    """Through the command line, with nothing but the trainer checkpoint."""
    root, results = trained
    out = root / "hf"
    assert megatron_to_hf_main([results[0]["path"], str(out), "--no-progress"]) == 0
    return out


def test_the_checkpoint_really_holds_optimizer_state(trained):
    import torch.distributed.checkpoint as dcp

    root, results = trained
    path = Path(results[0]["path"])
    assert (path / "trainer_state.json").exists() and len(list((path / "rng").iterdir())) == 2
    keys = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    optimizer = [k for k in keys if is_optimizer_key(k)]
    assert any(k.startswith("chained_0.optimizer.state.exp_avg.") for k in optimizer)
    assert any(k.startswith("chained_1.optimizer.state.exp_avg_sq.decoder.layers.mlp.experts") for k in optimizer)
    assert all(r["moved"] > 1e-3 for r in results)  # the exported weights are the stepped ones


def test_export_writes_the_generated_config(trained, exported):
    root, results = trained
    assert sorted(p.name for p in exported.iterdir()) == ["config.json", "model.safetensors"]
    config = json.loads((exported / "config.json").read_text())
    assert config == hf_config_from_model("qwen3_moe", MODEL, "float32")
    checkpoint = HFCheckpoint(exported)
    assert {checkpoint.dtype(n) for n in checkpoint.names()} == {torch.float32}
    assert checkpoint.shape("model.layers.1.mlp.experts.7.down_proj.weight") == (64, 32)


def test_transformers_matches_the_megatron_model(trained, exported):
    from transformers import Qwen3MoeForCausalLM

    root, results = trained
    model = Qwen3MoeForCausalLM.from_pretrained(exported, dtype=torch.float32)
    assert type(model).__name__ == "Qwen3MoeForCausalLM" and model.dtype == torch.float32
    reference = hf_reference(exported, PROMPTS, topk=MODEL.moe_router_topk)
    for result in results:
        report = compare(reference, result["outputs"])
        print(f"\nrank {result['rank']}: {json.dumps(report.to_dict())}")
        assert report.violations(TOLERANCES) == []
        assert report.topk_ids_identical and report.num_scored_tokens == sum(len(p) - 1 for p in PROMPTS)
    for out in reference:
        top = out.router_probs_NLE.double().topk(3, dim=-1).values.log()
        assert (top[..., 1] - top[..., 2]).min() > 1e-2  # top-K equality is meaningful: no near-ties


def test_parity_tool_loads_the_trainer_checkpoint_at_tp1(trained, exported):
    """The model's part only: the optimizer's common state is no model key."""
    root, results = trained
    report = check_parity(exported, results[0]["path"], PROMPTS)
    assert report.violations(TOLERANCES) == [] and report.topk_ids_identical


def test_hf_config_must_describe_the_trained_model(trained, exported, tmp_path):
    root, results = trained
    same, other = tmp_path / "same", tmp_path / "other"
    for directory, model in ((same, MODEL), (other, dataclasses.replace(MODEL, rotary_base=10000.0, num_layers=3))):
        directory.mkdir()
        (directory / "config.json").write_text(json.dumps(hf_config_from_model("qwen3_moe", model)))
    out = tmp_path / "out"
    message = "num_layers: trainer 2, .* 3; rotary_base: trainer 1000000.0, .* 10000.0"
    with pytest.raises(CheckpointMismatchError, match=message):
        convert_megatron_to_hf(results[0]["path"], out, hf_config=other, progress=False)
    assert not out.exists() and not staging_dir(out).exists()
    convert_megatron_to_hf(results[0]["path"], out, hf_config=same, progress=False)
    exported_here, generated = HFCheckpoint(out), HFCheckpoint(exported)
    assert all(torch.equal(exported_here.get(n), generated.get(n)) for n in generated.names())


def test_unknown_tensors_are_still_rejected_by_name(trained, tmp_path):
    root, results = trained
    out = tmp_path / "out"
    with pytest.raises(CheckpointMismatchError, match=f"unknown tensor {EXTRA_KEY} \\(1, 64\\)"):
        convert_megatron_to_hf(root / "extra", out, progress=False)
    assert not out.exists() and not staging_dir(out).exists()


def test_optimizer_keys_are_unknown_in_a_plain_model_checkpoint(trained, tmp_path):
    root, results = trained
    (tmp_path / "config.json").write_text(json.dumps(hf_config_from_model("qwen3_moe", MODEL)))
    out = tmp_path / "out"
    with pytest.raises(CheckpointMismatchError, match="unknown tensor chained_0.optimizer.state.exp_avg"):
        convert_megatron_to_hf(root / "plain", out, hf_config=tmp_path, progress=False)
    assert not out.exists() and not staging_dir(out).exists()
