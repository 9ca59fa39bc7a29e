"""Models built with the Transformer Engine layer spec go through every name-keyed path.

The TE-spec models are Megatron-Core's own: ``build_model(..., use_te=True)`` runs
``get_gpt_decoder_block_spec(use_transformer_engine=True)`` and Megatron's ``TE*`` wrapper
classes, over stand-ins for TE's base classes that declare TE's parameters (``te_standins``,
each name cited from TE's source). One spawned 2-process gloo world checks:

- names (TP1, data-parallel 2), for Qwen3-MoE (q/k norms), Mixtral (none) and DeepSeek-V3
  (MLA, a dense first layer, a shared expert): every TE-spec parameter's name becomes a
  table name (``global_parameter_names``), the table maps it to HF tensors of the right
  shapes and back, ``te_names.te_name`` inverts the translation, and the TE and local
  specs hold the same parameter set; their distributed-checkpoint tensor keys and global
  shapes are identical;
- values, in TP2+SP, EP2 and TP2 with expert-TP 2: a local-spec checkpoint loads into a
  TE-spec model and the reverse, and weight sync's gather of the TE model equals the
  local model's, name for name, bit for bit; with the shipped HF checkpoint (Qwen3-MoE),
  HF init of a TE model (``fill_from_hf``) and weight sync / HF export's naming
  (``hf_name_map``) give back the HF tensors exactly (TP2+SP, EP2: HF init does not
  split experts over expert-TP); the converter's checkpoint reader reads a TE-written
  checkpoint.
"""

import multiprocessing
from pathlib import Path

import pytest
import te_standins
import torch

import megatron_rl.parallel.world as world_module
from megatron_rl.parallel.world import run_world

pytestmark = pytest.mark.parallel

SHIPPED = Path(__file__).resolve().parents[2] / "megatron_rl" / "assets" / "tiny_qwen3_moe"
FAMILIES = ("qwen3_moe", "mixtral", "deepseek_v3")
LAYOUTS = {
    "TP2+SP": dict(tensor_model_parallel_size=2),
    "EP2": dict(expert_model_parallel_size=2),
    "TP2 ETP2": dict(tensor_model_parallel_size=2, expert_tensor_parallel_size=2),
}
HF_INIT_LAYOUTS = ("TP2+SP", "EP2")


def _model_configs() -> dict:
    from megatron_rl.checkpoint.hf_config import model_config_from_hf, read_config
    from megatron_rl.sections import ModelConfig

    tiny = dict(vocab_size=96, num_layers=3, num_experts=4, moe_router_topk=2)
    return {
        "qwen3_moe": model_config_from_hf(read_config(SHIPPED), "float32"),
        "mixtral": ModelConfig(**tiny, qk_layernorm=False),
        "deepseek_v3": ModelConfig(
            **tiny, qk_layernorm=True, multi_latent_attention=True, num_query_groups=4, q_lora_rank=48,
            kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, num_dense_layers=1,
            ffn_hidden_size=96, moe_shared_expert_intermediate_size=32, moe_router_score_function="sigmoid",
            moe_router_enable_expert_bias=True,
        ),
    }


def _tensor_keys(model) -> dict[str, tuple[int, ...]]:
    """Distributed-checkpoint tensor key -> global shape (one entry per key)."""
    from megatron.core.dist_checkpointing.mapping import (
        ShardedTensor,
        ShardedTensorFactory,
    )

    keys = {}
    for entry in model.sharded_state_dict().values():
        parts = entry.build() if isinstance(entry, ShardedTensorFactory) else entry
        for part in parts if isinstance(parts, list) else [parts]:
            if isinstance(part, ShardedTensor):
                keys[part.key] = tuple(part.global_shape)
    return keys


def _name_problems(te, local, arch, cfg) -> tuple[list[str], list[str]]:
    """(TE-spec parameter names, problems found) for a TP1/EP1/PP1 model."""
    from megatron_rl.checkpoint.mapping import all_weights, bound_for_megatron_name
    from megatron_rl.checkpoint.megatron_io import global_parameter_names, named_weights
    from megatron_rl.parallel.te_names import te_name

    problems = []
    table = {w.megatron: w for w in all_weights(arch, cfg)}
    by_hf = {hf: w.megatron for w in table.values() for hf in w.hf}
    names = global_parameter_names(te)
    weights = named_weights(te)
    for name, canonical in names.items():
        if te_name(canonical, cfg) != name:
            problems.append(f"{name} -> {canonical} -> {te_name(canonical, cfg)}")
        try:
            bound = bound_for_megatron_name(arch, cfg, canonical)
        except Exception as err:  # noqa: BLE001 - every unmapped name is reported
            problems.append(f"{name}: {err}")
            continue
        if tuple(weights[name].shape) != bound.megatron_shape:
            problems.append(f"{name}: {tuple(weights[name].shape)} vs the table's {bound.megatron_shape}")
        back = {by_hf.get(hf) for hf in bound.hf}
        if back != {canonical}:
            problems.append(f"{name}: HF {bound.hf} map back to {back}")
    if set(names.values()) != set(table):
        problems.append(f"TE spec vs table: {sorted(set(names.values()) ^ set(table))}")
    if set(global_parameter_names(local).values()) != set(table):
        problems.append("local spec vs table")
    return sorted(names), problems


def _gathered(model, groups) -> dict[str, torch.Tensor]:
    """Weight sync's gather (whole tensors under table names), on rank 0; empty elsewhere."""
    from megatron_rl.rollout.sglang.weight_sync import gather_full_params

    return {name: full.clone() for name, full in gather_full_params(model, groups)}


def _differences(a: dict, b: dict) -> list[str]:
    if set(a) != set(b):
        return [f"names differ: {sorted(set(a) ^ set(b))[:8]}"]
    return [n for n in a if a[n].shape != b[n].shape or not torch.equal(a[n], b[n])]


def _te_world(tmp: str) -> dict:
    te_standins.install()
    import torch.distributed as dist

    from megatron_rl.checkpoint.hf_io import HFCheckpoint
    from megatron_rl.checkpoint.mapping import ARCHITECTURES, hf_name_map
    from megatron_rl.checkpoint.megatron_io import (
        DistCheckpointReader,
        build_model_for,
        fill_from_hf,
    )
    from megatron_rl.parallel.checkpoint import load_model, save_model
    from megatron_rl.parallel.cpu_platform import cpu_platform
    from megatron_rl.parallel.groups import model_parallel
    from megatron_rl.parallel.model import build_model
    from megatron_rl.sections import ParallelConfig

    configs = _model_configs()
    out: dict = {}
    with cpu_platform():
        with model_parallel(ParallelConfig(), seed=1):
            for family in FAMILIES:
                cfg, arch = configs[family], ARCHITECTURES.get(family)
                te = build_model(cfg, ParallelConfig(), use_te=True)
                local = build_model(cfg, ParallelConfig(), use_te=False)
                out[f"names/{family}"] = _name_problems(te, local, arch, cfg)
                out[f"keys/{family}"] = (_tensor_keys(te), _tensor_keys(local))

        cfg, arch = configs["qwen3_moe"], ARCHITECTURES.get("qwen3_moe")
        hf = HFCheckpoint(SHIPPED)
        references = {}
        for layout, fields in LAYOUTS.items():
            parallel = ParallelConfig(**fields)
            with model_parallel(parallel, seed=2) as groups:
                local = build_model(cfg, parallel, use_te=False)
                save_model(local, f"{tmp}/{layout}/local")
                te = build_model(cfg, parallel, use_te=True)
                load_model(te, f"{tmp}/{layout}/local")
                reference = references[layout] = _gathered(local, groups)
                out[f"local->te/{layout}"] = _differences(_gathered(te, groups), reference)
                save_model(te, f"{tmp}/{layout}/te")
                with torch.random.fork_rng():
                    torch.manual_seed(99)  # a different init, so that the load has to change it
                    fresh = build_model(cfg, parallel, use_te=False)
                load_model(fresh, f"{tmp}/{layout}/te")
                out[f"te->local/{layout}"] = _differences(_gathered(fresh, groups), reference)
                if layout in HF_INIT_LAYOUTS:
                    fill_from_hf(te, arch, cfg, hf, groups.tp_rank, groups.tp_size)
                    name_map = hf_name_map(arch, cfg)
                    exported = {n: t for name, full in _gathered(te, groups).items() for n, t in name_map(name, full)}
                    if dist.get_rank() == 0:
                        original = {n: hf.get(n) for n in hf.names()}
                        out[f"hf->te->hf/{layout}"] = _differences(exported, original)
        # MLA's duplicated TE linears (not split over TP although TE flags them so).
        cfg = configs["deepseek_v3"]
        parallel = ParallelConfig(tensor_model_parallel_size=2)
        with model_parallel(parallel, seed=2) as groups:
            local = build_model(cfg, parallel, use_te=False)
            save_model(local, f"{tmp}/mla/local")
            te = build_model(cfg, parallel, use_te=True)
            load_model(te, f"{tmp}/mla/local")
            out["local->te/deepseek_v3 TP2+SP"] = _differences(_gathered(te, groups), _gathered(local, groups))
        cfg = configs["qwen3_moe"]
        with model_parallel(ParallelConfig(), seed=1):
            template = build_model_for(arch, cfg, ParallelConfig(), meta=True)
            reader = DistCheckpointReader(f"{tmp}/EP2/te", template)
            if dist.get_rank() == 0:
                out["reader"] = _differences(reader.read(sorted(references["EP2"])), references["EP2"])
    return out


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("te_spec")
    # Spawned ranks: the stand-ins go in before Megatron-Core is imported, which the
    # forkserver's preloaded ranks have done already.
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(world_module, "_rank_context", lambda: multiprocessing.get_context("spawn"))
        return run_world(_te_world, 2, str(tmp))[0]


@pytest.mark.parametrize("family", FAMILIES)
def test_every_te_spec_name_maps_to_hf_and_back(world, family):
    names, problems = world[f"names/{family}"]
    assert problems == []
    # The model really was the TE spec's: fused norms and grouped experts.
    assert any(".linear_fc1.weight0" in n for n in names)
    fused = "linear_q_up_proj.layer_norm_weight" if family == "deepseek_v3" else "linear_qkv.layer_norm_weight"
    assert any(fused in n for n in names)


@pytest.mark.parametrize("family", FAMILIES)
def test_checkpoint_keys_are_the_same_in_both_specs(world, family):
    te_keys, local_keys = world[f"keys/{family}"]
    assert te_keys == local_keys


@pytest.mark.parametrize("layout", LAYOUTS)
def test_checkpoints_cross_specs_and_weight_sync_gathers_the_same(world, layout):
    assert world[f"local->te/{layout}"] == []
    assert world[f"te->local/{layout}"] == []


def test_mla_weight_sync_at_tp2(world):
    assert world["local->te/deepseek_v3 TP2+SP"] == []


@pytest.mark.parametrize("layout", HF_INIT_LAYOUTS)
def test_hf_init_and_export_of_a_te_model_are_exact(world, layout):
    assert world[f"hf->te->hf/{layout}"] == []


def test_converter_reads_a_te_written_checkpoint(world):
    assert world["reader"] == []
