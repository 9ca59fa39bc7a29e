"""Contract tests: one per Megatron-Core touch point of ``megatron_rl.parallel.mcore_compat``.

Each failure names the symbol and what we expect of it, so an upgrade that moves something
under us says what moved (the parallel suite then shows what it breaks). No process group
is needed: everything here runs in the test process.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import logging
import os
import queue
import subprocess
import sys

import pytest
import torch

from megatron_rl.parallel import mcore_checkpoint, mcore_compat as mc
from megatron_rl.parallel import mcore_layers as ml
from megatron_rl.parallel import mcore_optimizer as mo
from megatron_rl.sections import ModelConfig, ParallelConfig


def expect(ok: bool, symbol: str, expected: str) -> None:
    """Fail naming the symbol, the installed version and the expected shape or behaviour."""
    assert ok, f"megatron-core {mc.MCORE_VERSION}: {symbol}: expected {expected}"


def params(fn) -> list[str]:
    return list(inspect.signature(fn).parameters)


def test_version_range():
    assert mc.check_version(mc.MCORE_VERSION) is None
    for ok in ("0.16.1", "0.17.0", "0.19.2", "0.19.9rc1"):
        assert mc.check_version(ok) is None, ok
    for bad in ("0.16.0", "0.15.3", "0.20.0", "1.0.0"):
        message = mc.check_version(bad)
        assert message is not None and "0.16.1 ... 0.19.x" in message and bad in message, bad


def test_import_refuses_an_unsupported_version():
    """The check runs at import (a fresh interpreter told megatron-core 0.20.0 is installed)."""
    code = ("import importlib.metadata as m, warnings; real = m.version; "
            "m.version = lambda name: '0.20.0' if name == 'megatron-core' else real(name); "
            "warnings.simplefilter('error'); import megatron_rl.parallel.mcore_compat")
    env = {k: v for k, v in os.environ.items() if k != mc.ALLOW_ENV}
    refused = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert refused.returncode != 0
    assert "ImportError: megatron-core 0.20.0 is installed; megatron-rl supports 0.16.1 ... 0.19.x" in refused.stderr
    allowed = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={**env, mc.ALLOW_ENV: "1"})
    assert allowed.returncode != 0 and "RuntimeWarning: megatron-core 0.20.0 is installed" in allowed.stderr
    code = code.replace("warnings.simplefilter('error')", "warnings.simplefilter('ignore')")
    assert subprocess.run([sys.executable, "-c", code], env={**env, mc.ALLOW_ENV: "1"}).returncode == 0


def test_every_internal_resolves():
    for owner, table in ((mc, mc.INTERNALS), (ml, ml.LAYER_INTERNALS)):
        for name, internal in table.items():
            module = importlib.import_module(internal.module)
            expect(hasattr(module, internal.attribute), f"{internal.module}.{internal.attribute}",
                   f"to exist ({internal.reason})")
            assert getattr(owner, name) is getattr(module, internal.attribute)
    with pytest.raises(AttributeError, match="no attribute 'NotAThing'"):
        mc.NotAThing  # noqa: B018


def test_topk_router_routing_is_an_overridable_method():
    router = mc.TopKRouter
    expect(params(router.routing)[:2] == ["self", "logits"], "TopKRouter.routing",
           "routing(self, logits, ...) -> (probs_NE, routing_map_NE)")
    expect("self.routing(" in inspect.getsource(router.forward), "TopKRouter.forward",
           "to call self.routing(...), so a per-instance override sees every call")
    expect("router_replay" in inspect.getsource(router.__init__), "TopKRouter.__init__",
           "to create self.router_replay (moe_enable_routing_replay)")
    expect(hasattr(router, "set_layer_number"), "TopKRouter.set_layer_number",
           "routers carry their global layer number")

    class Fake:
        def routing(self, logits):
            return "class"

    fake = Fake()
    undo = mc.override_routing(fake, lambda logits: "override")
    assert fake.routing(None) == "override"
    undo()
    assert fake.routing(None) == "class" and "routing" not in vars(fake)


def _replay():
    replay = mc.RouterReplay()
    mc.RouterReplay.global_router_replay_instances.remove(replay)
    return replay


def test_router_replay_queues_and_actions():
    cls = mc.RouterReplay
    expect(isinstance(getattr(cls, "global_router_replay_instances", None), list),
           "RouterReplay.global_router_replay_instances", "a class-level list every instance joins")
    before = len(cls.global_router_replay_instances)
    replay = cls()
    expect(len(cls.global_router_replay_instances) == before + 1 and cls.global_router_replay_instances[-1] is replay,
           "RouterReplay()", "to append itself to global_router_replay_instances")
    cls.global_router_replay_instances.remove(replay)
    expect(params(cls.get_replay_topk) == ["self", "scores", "topk", "num_groups", "group_topk", "default_compute_topk"],
           "RouterReplay.get_replay_topk", "(scores, topk, num_groups, group_topk, default_compute_topk)")
    ids_a, ids_b = torch.tensor([[0, 2]]), torch.tensor([[1, 3]])
    replay.set_target_indices(ids_a)
    replay.set_target_indices(ids_b)
    expect(mc.queued_replay_ids(replay, recompute=False) is ids_b, "RouterReplay.target_topk_idx",
           "set_target_indices to set the forward target")
    expect(mc.queued_replay_ids(replay, recompute=True) is ids_a, "RouterReplay.replay_backward_list",
           "set_target_indices to append to the recompute queue (FIFO)")
    scores = torch.tensor([[0.4, 0.3, 0.2, 0.1]])
    mc.set_replay_action(replay, recompute=False)
    probs, ids = replay.get_replay_topk(scores, 2)
    expect(ids.tolist() == [[1, 3]] and torch.equal(probs, scores[:, [1, 3]]), "RouterReplayAction.REPLAY_FORWARD",
           "scores gathered at target_topk_idx")
    mc.set_replay_action(replay, recompute=True)
    probs, ids = replay.get_replay_topk(scores, 2)
    expect(ids.tolist() == [[0, 2]] and len(replay.replay_backward_list) == 1, "RouterReplayAction.REPLAY_BACKWARD",
           "to pop the head of replay_backward_list")
    mc.set_queued_replay_ids(replay, True, ids_a)
    assert mc.queued_replay_ids(replay, True) is ids_a
    mc.drop_recompute_ids(replay)
    mc.drop_recompute_ids(replay)  # empty: nothing to drop
    assert replay.replay_backward_list == []
    mc.reset_replay(replay)
    expect(replay.target_topk_idx is None and replay.router_replay_action is None, "RouterReplay.clear_indices",
           "clear_indices / clear_router_replay_action to reset target and action")


def test_topk_routing_calls_the_instance_replay_hook():
    """Megatron's top-K must reach ``router_replay.get_replay_topk`` through the instance."""
    replay = _replay()
    seen = []

    def make(original):
        def hook(scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
            seen.append(default_compute_topk is not None)
            return original(scores, topk, num_groups, group_topk, default_compute_topk)
        return hook

    original = mc.override_replay_topk(replay, make)
    expect(callable(original), "RouterReplay.get_replay_topk", "a bound method")
    replay.set_target_indices(torch.tensor([[0, 2]]))
    mc.set_replay_action(replay, recompute=False)
    probs, routing_map = mc.topk_routing_with_score_function(
        torch.tensor([[2.0, 1.9, 0.5, -1.0]]), 2, router_replay=replay)
    expect(seen == [True], "topk_routing_with_score_function(router_replay=)",
           "to call the instance's get_replay_topk with a default_compute_topk")
    assert routing_map.tolist() == [[True, False, True, False]]
    mc.reset_replay(replay)
    assert "get_replay_topk" not in vars(replay)


def test_is_checkpointing():
    expect(mc.is_checkpointing() is False, "tensor_parallel.random.is_checkpointing", "False outside a checkpoint")


def test_forget_replay_instances():
    replay = mc.RouterReplay()
    module = torch.nn.Module()
    module.router_replay = replay
    outer = torch.nn.Sequential(module)
    mc.forget_replay_instances(outer)
    expect(replay not in mc.RouterReplay.global_router_replay_instances, "RouterReplay.global_router_replay_instances",
           "a mutable list (our models leave it)")


def test_block_and_layer_specs():
    """The local spec's shape that ``parallel.model`` edits (norms, core attention, key maps)."""
    from megatron_rl.parallel.families import replicated_mla_down_projections
    from megatron_rl.parallel.model import (
        SequenceParallelRMSNorm,
        _with_norm,
        build_transformer_config,
    )

    expect({"config", "use_transformer_engine", "normalization", "pp_rank"} <= set(params(mc.get_gpt_decoder_block_spec)),
           "get_gpt_decoder_block_spec", "(config, use_transformer_engine, normalization, ..., pp_rank)")
    for model in (ModelConfig(num_dense_layers=1, ffn_hidden_size=32),
                  ModelConfig(multi_latent_attention=True, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8,
                              qk_rope_head_dim=8, v_head_dim=8, qk_layernorm=True)):
        config = build_transformer_config(model, ParallelConfig())
        block = mc.get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm", pp_rank=0)
        expect(isinstance(block, mc.TransformerBlockSubmodules) and len(block.layer_specs) == model.num_layers,
               "get_gpt_decoder_block_spec", "TransformerBlockSubmodules with one layer spec per layer")
        expect({f.name for f in dataclasses.fields(mc.TransformerBlockSubmodules)} >= {"layer_specs", "layer_norm"},
               "TransformerBlockSubmodules", "fields layer_specs and layer_norm")
        classes = [mc.spec_class(s.submodules.mlp) for s in block.layer_specs]
        expect(all(isinstance(c, type) for c in classes), "layer spec mlp",
               f"a ModuleSpec or a functools.partial of a module class (got {classes})")
        kinds = [issubclass(c, mc.MoELayer) for c in classes]
        expect(kinds == [i >= model.num_dense_layers for i in range(model.num_layers)], "MoELayer",
               "the mlp module of exactly the MoE layers' specs")
        mla = [issubclass(mc.spec_class(s.submodules.self_attention), mc.MLASelfAttention) for s in block.layer_specs]
        expect(all(m == model.multi_latent_attention for m in mla), "MLASelfAttention", "the MLA layers' attention")
        for spec in block.layer_specs:
            fields = {f.name for f in dataclasses.fields(spec.submodules)}
            expect(fields >= {"input_layernorm", "pre_mlp_layernorm", "self_attention", "mlp",
                              "sharded_state_dict_keys_map"}, "TransformerLayerSubmodules", "the fields we replace")
            edited = replicated_mla_down_projections(_with_norm(spec, SequenceParallelRMSNorm, True))
            attn = edited.submodules.self_attention.submodules
            assert attn.core_attention.__name__ == "PackedCoreAttention"
            if model.multi_latent_attention:
                expect(attn.linear_q_down_proj is mc.ReplicatedLinear, "MLASelfAttentionSubmodules",
                       "linear_q_down_proj / linear_kv_down_proj fields")
    expect(issubclass(mc.ReplicatedLinear, torch.nn.Linear), "post_training.modelopt.layers.Linear",
           "a torch.nn.Linear (replicated over TP)")
    expect(issubclass(mc.IdentityOp, torch.nn.Module), "IdentityOp", "a module")


def test_mla_transformer_engine_flag():
    mla = importlib.import_module("megatron.core.transformer.multi_latent_attention")
    expect(hasattr(mla, "HAVE_TE") and hasattr(mla, "TELinear"), "multi_latent_attention.HAVE_TE/TELinear",
           "module-level flags (the MLA build reads them)")
    before = (mla.HAVE_TE, getattr(mla, "Linear", None))
    with mc.mla_without_transformer_engine():
        assert not mla.HAVE_TE or isinstance(mla.TELinear, type)
        # MLA's down projections accept the replicated linear our local spec uses.
        expect(getattr(mla, "Linear", mc.ReplicatedLinear) is mc.ReplicatedLinear or mla.HAVE_TE,
               "multi_latent_attention.Linear", "the replicated linear (or absent) while building without TE")
    assert (mla.HAVE_TE, getattr(mla, "Linear", None)) == before


def test_core_attention_contract():
    from megatron_rl.parallel.packed_attention import PackedCoreAttention

    ours = set(params(PackedCoreAttention.__init__))
    theirs = set(params(mc.DotProductAttention.__init__))
    expect(theirs <= ours, "DotProductAttention.__init__",
           f"no argument PackedCoreAttention lacks (missing: {sorted(theirs - ours)})")
    forward = params(mc.DotProductAttention.forward)
    expect(forward[:5] == ["self", "query", "key", "value", "attention_mask"] and "packed_seq_params" in forward,
           "DotProductAttention.forward", "(query, key, value, attention_mask, ..., packed_seq_params)")
    expect({"causal", "padding_causal"} <= set(mc.AttnMaskType.__members__), "AttnMaskType", "causal, padding_causal")
    fields = {f.name for f in dataclasses.fields(mc.PackedSeqParams)}
    expect(fields >= {"qkv_format", "cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded",
                      "max_seqlen_q", "max_seqlen_kv"}, "PackedSeqParams", "the THD fields we set and read")


def test_core_attention_gets_the_cp_group():
    """``Attention`` hands core attention its ProcessGroupCollection, whose ``cp`` is the CP group."""
    from types import SimpleNamespace

    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.attention import Attention

    source = inspect.getsource(Attention.__init__)
    expect("pg_collection=self.pg_collection" in source and "cp_comm_type=cp_comm_type" in source,
           "Attention.__init__", "core_attention(..., cp_comm_type=..., pg_collection=self.pg_collection)")
    expect("cp" in {f.name for f in dataclasses.fields(ProcessGroupCollection)}, "ProcessGroupCollection.cp",
           "the context-parallel group")
    group = object()
    assert mc.core_attention_cp_group(SimpleNamespace(cp=group)) is group
    assert mc.core_attention_cp_group(None) is None


@pytest.mark.parametrize("cp_size", [2, 4])
def test_thd_rope_reads_our_context_parallel_layout(cp_size):
    """Megatron's THD RoPE on each CP rank's share (``packing.cp_partition_indices``) equals the
    whole row's RoPE at those positions: our zig-zag is the layout its CP path assumes."""
    from types import SimpleNamespace

    from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb

    from megatron_rl.parallel.packing import cp_partition_indices

    config = SimpleNamespace(apply_rope_fusion=False, rotary_interleaved=False, multi_latent_attention=False)
    lengths = torch.tensor([4, 12, 2, 20, 8]) * cp_size  # slots, every one a multiple of 2 x CP
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]).to(torch.int32)
    total = int(cu[-1])
    gen = torch.Generator().manual_seed(0)
    t = torch.randn(total, 3, 8, generator=gen)
    freqs = torch.rand(int(lengths.max()), 1, 1, 8, generator=gen) * 6.0

    def group(size, rank):
        return SimpleNamespace(size=lambda: size, rank=lambda: rank)

    whole = apply_rotary_pos_emb(t, freqs, config, cu_seqlens=cu, cp_group=group(1, 0))
    for rank in range(cp_size):
        rows = cp_partition_indices(cu, total, cp_size, rank)
        share = apply_rotary_pos_emb(t[rows], freqs, config, cu_seqlens=cu, cp_group=group(cp_size, rank))
        expect(torch.equal(share, whole[rows]), "rope_utils.apply_rotary_pos_emb (THD, CP)",
               f"rank {rank} of CP {cp_size} to rotate its rows as the whole row does ({mc.THD_CONTEXT_PARALLEL})")


def test_sharded_tensor_boxes():
    tensor = mc.ShardedTensor.from_rank_offsets("w", torch.arange(6.0).reshape(2, 3), (1, 1, 2), prepend_axis_num=1)
    boxes, merge = mcore_checkpoint.stored_boxes(tensor)
    expect(boxes == [mcore_checkpoint.StoredBox("w", (0, 2, 0), (1, 2, 3), torch.float32)], "ShardedTensor",
           f"key, global_offset, local_shape, prepend_axis_num, dtype (got {boxes})")
    assert torch.equal(merge([torch.arange(6.0).reshape(1, 2, 3)]), torch.arange(6.0).reshape(2, 3))
    expect(mcore_checkpoint.stored_tensor_shapes({"w": tensor}) == {"w": (1, 4, 3)}, "ShardedTensor.global_shape",
           "the full shape, prepended axes included")
    factory = mc.ShardedTensorFactory("f", torch.zeros(2, 3), lambda key, t, *replica_and_range: [
        mc.ShardedTensor.from_rank_offsets(f"{key}.{i}", part) for i, part in enumerate(t.chunk(2))
    ], lambda parts: torch.cat(parts))
    expect(callable(getattr(factory, "build", None)) and callable(getattr(factory, "merge_fn", None)),
           "ShardedTensorFactory", "build() and merge_fn")
    boxes, merge = mcore_checkpoint.stored_boxes(factory)
    assert [b.key for b in boxes] == ["f.0", "f.1"] and merge([torch.ones(1, 3), torch.zeros(1, 3)]).shape == (2, 3)


def test_sharded_object_key_and_format_names():
    obj = mc.ShardedObject("extra", {"a": 1}, (2,), (1,), replica_id=0)
    expect(obj.unique_key.startswith("extra" + mc.SHARDED_OBJECT_SEPARATOR), "ShardedObject.unique_key",
           f"'<key>{mc.SHARDED_OBJECT_SEPARATOR}<offset>_<shape>' (got {obj.unique_key!r})")
    assert mcore_checkpoint.object_base_key(obj.unique_key) == "extra" and mcore_checkpoint.stored_object_keys({"x": obj}) == {"extra"}
    core = importlib.import_module("megatron.core.dist_checkpointing.core")
    common = importlib.import_module("megatron.core.dist_checkpointing.strategies.common")
    expect(core.CONFIG_FNAME == mc.MEGATRON_METADATA_NAME, "dist_checkpointing.core.CONFIG_FNAME",
           repr(mc.MEGATRON_METADATA_NAME))
    expect(common.COMMON_STATE_FNAME == mc.MEGATRON_COMMON_NAME, "strategies.common.COMMON_STATE_FNAME",
           repr(mc.MEGATRON_COMMON_NAME))
    serialization = importlib.import_module(mc.DIST_CHECKPOINT_LOGGER)
    expect(isinstance(getattr(serialization, "logger", None), logging.Logger)
           and serialization.logger.name == mc.DIST_CHECKPOINT_LOGGER, "dist_checkpointing.serialization.logger",
           "a logger named after its module")
    writer = importlib.import_module(mc.ASYNC_WRITER_LOGGER)
    expect(writer.logger.name == mc.ASYNC_WRITER_LOGGER and '"Local process {local_proc_idx} encountered"'
           in inspect.getsource(writer), "filesystem_async's worker error line",
           "'Local process N encountered an error', on its module's logger (parallel/checkpoint.py drops it)")
    chained = importlib.import_module("megatron.core.optimizer.optimizer").ChainedOptimizer
    expect("chained_{" in inspect.getsource(chained.sharded_state_dict), "ChainedOptimizer.sharded_state_dict",
           "to prefix member states 'chained_<i>.' (mcore_compat.OPTIMIZER_KEY)")
    assert mc.OPTIMIZER_KEY.match("chained_1.optimizer.state.exp_avg.x") and not mc.OPTIMIZER_KEY.match("decoder.x")


def test_a_synchronous_save_takes_its_write_results_from_the_queue_we_set():
    writer = importlib.import_module(mcore_checkpoint.WRITER_MODULE)
    getter = getattr(writer, "get_write_results_queue", None) or writer._get_write_results_queue
    base = importlib.import_module("megatron.core.dist_checkpointing.strategies.base")
    expect("execute_sync()" in inspect.getsource(base.AsyncSaveShardedStrategy.save),
           "AsyncSaveShardedStrategy.save", "a synchronous save runs the writer in the calling process")
    saved = writer._results_queue
    try:
        writer._results_queue = None
        mcore_checkpoint.collect_write_results_here()
        expect(isinstance(writer._results_queue, queue.Queue) and getter() is writer._results_queue,
               f"filesystem_async.{getter.__name__}", "to hand out the module's _results_queue once it is set")
    finally:
        writer._results_queue = saved


def test_strict_load_mode():
    from megatron.core import dist_checkpointing

    expect("strict" in params(dist_checkpointing.load), "dist_checkpointing.load", "a strict= argument")
    expect(mcore_checkpoint.return_unexpected() is mc.StrictHandling.RETURN_UNEXPECTED, "StrictHandling.RETURN_UNEXPECTED",
           "the mode that returns (state, missing, unexpected)")


def test_replay_hazard_fields_exist():
    from megatron.core.transformer import TransformerConfig

    fields = {f.name for f in dataclasses.fields(TransformerConfig)}
    for name in ("moe_router_fusion", "moe_router_load_balancing_type", "mtp_num_layers",
                 mc.VIRTUAL_PIPELINE_KEY, "moe_expert_capacity_factor", "moe_enable_routing_replay"):
        expect(name in fields, f"TransformerConfig.{name}", "a field (mcore_compat.replay_hazards reads it)")


CPU_PLATFORM_TARGETS = (
    ("megatron.core.tensor_parallel.random", "_get_cuda_rng_state", ["device", "clone", "graph_safe"]),
    ("megatron.core.tensor_parallel.random", "_set_cuda_rng_state", ["new_state", "device", "graph_safe"]),
    ("megatron.core.transformer.moe.token_dispatcher", "all_to_all",
     ["group", "input_", "output_split_sizes_", "input_split_sizes"]),
    ("megatron.core.optimizer.clip_grads", "clip_grad_by_total_norm_fp32",
     ["parameters", "max_norm", "total_norm", "use_decoupled_grad"]),
    ("megatron.core.optimizer.optimizer", "clip_grad_by_total_norm_fp32",
     ["parameters", "max_norm", "total_norm", "use_decoupled_grad"]),
)


@pytest.mark.parametrize("module, name, arguments", CPU_PLATFORM_TARGETS, ids=[t[1] for t in CPU_PLATFORM_TARGETS])
def test_cpu_platform_targets(module, name, arguments):
    """``parallel/cpu_platform.py`` rebinds these module globals; a rename would patch nothing."""
    owner = importlib.import_module(module)
    expect(hasattr(owner, name), f"{module}.{name}", "to exist (cpu_platform rebinds it)")
    # Arguments may be added after these (0.19's all_to_all: use_nccl_stream); the shims pass them on.
    expect(params(getattr(owner, name))[:len(arguments)] == arguments, f"{module}.{name}", f"arguments {arguments}")


def test_cpu_platform_router_gemm_name():
    moe_utils = importlib.import_module("megatron.core.transformer.moe.moe_utils")
    expect("te_general_gemm" in inspect.getsource(moe_utils), "moe_utils.te_general_gemm",
           "the name the router GEMM looks up (cpu_platform defines it when TE is absent)")


def test_distributed_optimizer_touch_points():
    """The distributed optimizer's internals that ``mcore_compat`` reads or corrects."""
    owner = mc.DistributedOptimizer
    module = importlib.import_module(owner.__module__)
    expect(isinstance(getattr(module, "HAVE_APEX_OR_TE", None), bool), f"{owner.__module__}.HAVE_APEX_OR_TE",
           "a module flag: False when it falls back to torch's Adam")
    expect(params(owner._set_main_param_and_optimizer_states) == ["self", "model_param", "tensors"],
           "DistributedOptimizer._set_main_param_and_optimizer_states", "(self, model_param, tensors)")
    setter = inspect.getsource(owner._set_main_param_and_optimizer_states)
    expect("self.optimizer.state[main_param]" in setter and "model_param_group_index_map" in setter,
           "DistributedOptimizer._set_main_param_and_optimizer_states",
           "to copy into self.optimizer.state of the main param found by model_param_group_index_map")
    loader = inspect.getsource(owner.load_state_dict)
    expect('s["step"] = step' in loader, "DistributedOptimizer.load_state_dict",
           "to set every state's 'step' from the param groups' (adam_step_fix replaces the shared tensor)")
    expect(set(mo.DISTRIBUTED_OPTIMIZER_SHARDINGS) <= {"fully_reshardable", "dp_reshardable"}
           and "fully_reshardable" in owner.checkpoint_fully_reshardable_formats,
           "DistributedOptimizer.checkpoint_fully_reshardable_formats", "to hold 'fully_reshardable'")
    sharded = inspect.getsource(owner.sharded_state_dict) + inspect.getsource(owner.sharded_param_state_fully_reshardable)
    for key in ("distrib_optim_sharding_type", "distrib_optim_fully_reshardable_mem_efficient"):
        expect(key in sharded and key in mo.distributed_optimizer_metadata("fully_reshardable"),
               "DistributedOptimizer.sharded_state_dict", f"to read metadata[{key!r}]")
    writer = importlib.import_module(mc.ASYNC_WRITER_LOGGER)
    expect(writer.logger.name == mc.ASYNC_WRITER_LOGGER and '"Local process {local_proc_idx} encountered"'
           in inspect.getsource(writer), "filesystem_async's worker error line",
           "'Local process N encountered an error', on its module's logger (parallel/checkpoint.py drops it)")
    chained = importlib.import_module("megatron.core.optimizer.optimizer").ChainedOptimizer
    expect("chained_optim_avoid_prefix" in inspect.getsource(chained.sharded_state_dict),
           "ChainedOptimizer.sharded_state_dict", "to read metadata['chained_optim_avoid_prefix']")
    expect("self.chained_optimizers" in inspect.getsource(chained.__init__), "ChainedOptimizer.chained_optimizers",
           "the list of member optimizers")
    with pytest.raises(ValueError, match="fully_sharded_model_space"):
        mo.distributed_optimizer_metadata("fully_sharded_model_space")


def test_optimizer_members_follow_expert_parallelism():
    layers = inspect.getsource(importlib.import_module("megatron.core.tensor_parallel.layers"))
    if mo.EXPERT_GROUPS_WHEN_ETP_DIFFERS:
        rule = "self.config.expert_tensor_parallel_size != self.config.tensor_model_parallel_size"
    else:
        rule = 'setattr(self.weight, "allreduce", not (self.is_expert and self.expert_parallel))'
    expect(rule in layers and "self.expert_parallel = config.expert_model_parallel_size > 1" in layers,
           "tensor_parallel.layers", f"expert weights take the expert groups (allreduce=False) by {rule!r}")
    builder = inspect.getsource(importlib.import_module("megatron.core.optimizer").get_megatron_optimizer)
    expect("is_expert_parallel" in builder and "ChainedOptimizer(optimizers)" in builder,
           "optimizer.get_megatron_optimizer", "a second chained optimizer for the is_expert_parallel groups")
    assert [mo.optimizer_member_count(ep) for ep in (1, 2, 8)] == [1, 2, 2]
    assert mo.optimizer_member_count(1, 1, 2) == (2 if mo.EXPERT_GROUPS_WHEN_ETP_DIFFERS else 1)


def test_ddp_sync_hooks():
    ddp = importlib.import_module("megatron.core.distributed").DistributedDataParallel
    expect("force_sync" in params(ddp.start_param_sync), "DistributedDataParallel.start_param_sync",
           "a force_sync argument (synchronous all-gather of the updated weights)")
    for name in ("no_sync", "start_grad_sync", "zero_grad_buffer"):
        expect(callable(getattr(ddp, name, None)), f"DistributedDataParallel.{name}", "a method")
    expect("self.ddp_config" in inspect.getsource(ddp.__init__), "DistributedDataParallel.ddp_config",
           "the DistributedDataParallelConfig it was built with")


def test_training_state_storages():
    """``mcore_optimizer.ddp_buffers`` and ``optimizer_members`` (the colocated offload walks them)."""
    ddp = inspect.getsource(importlib.import_module("megatron.core.distributed.distributed_data_parallel"))
    for name in ("self.buffers", "self.expert_parallel_buffers"):
        expect(name in ddp, f"DistributedDataParallel.{name[5:]}", "the dense / expert-parallel buffer lists")
    buffers = inspect.getsource(importlib.import_module("megatron.core.distributed.param_and_grad_buffer"))
    for name in ("self.grad_data = ", "self.param_data = None"):
        expect(name in buffers, f"_ParamAndGradBuffer.{name.split()[0][5:]}", "a buffer attribute (None: no param buffer)")
    writer = importlib.import_module(mc.ASYNC_WRITER_LOGGER)
    expect(writer.logger.name == mc.ASYNC_WRITER_LOGGER and '"Local process {local_proc_idx} encountered"'
           in inspect.getsource(writer), "filesystem_async's worker error line",
           "'Local process N encountered an error', on its module's logger (parallel/checkpoint.py drops it)")
    chained = importlib.import_module("megatron.core.optimizer.optimizer").ChainedOptimizer
    expect("self.chained_optimizers" in inspect.getsource(chained.__init__), "ChainedOptimizer.chained_optimizers",
           "the member optimizers' list")
