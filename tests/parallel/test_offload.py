"""The trainer's state leaves device memory and comes back bit for bit (colocated rollouts).

One world of two processes enters DP2, EP2, TP2+SP and PP2 in turn. In each it trains a tiny
MoE model one step (so Adam's state exists) with Megatron's plain optimizer in fp32 (the
trainer's CPU path) and with Megatron's distributed optimizer in bf16 (fp32 main-weight
shards, DDP's parameter buffer), and in DP2 also the plain optimizer in bf16 and the
distributed one in fp32 (main shards that are views of the parameter buffer). Then
:class:`~megatron_rl.parallel.offload.TrainerOffload` moves the state out, then the weights,
and restores them. Everything is enumerated here independently of the code under test
(every parameter, DDP's gradient and parameter buffers, each optimizer's parameters and state):

* after the state part: every gradient buffer, main weight and optimizer tensor that is not
  also a weight holds no storage, and the weights are untouched;
* after the weights part: nothing holds storage;
* after restore: every parameter, parameter buffer, main weight and optimizer tensor equals
  its value before, byte for byte, and every gradient buffer is zero (not copied: the next
  backward zeroes it first);
* DP2, distributed bf16: a second step after the round trip equals the second step of a twin
  that never offloaded (weights and gradient norm, bitwise).

Megatron's distributed optimizer and its bf16 plain optimizer classify parameters by CUDA type
names (``distrib_optimizer.py:361,420,582``, ``optimizer.py:671,690``): this test answers
``Tensor.type()`` with them, as the research prototype did (the trainer's own patch comes with
the distributed optimizer's issue).
"""

import dataclasses

import pytest
import torch
from torch.overrides import TorchFunctionMode

from megatron_rl.parallel.smoke_worker import random_sequences
from megatron_rl.parallel.world import run_world
from megatron_rl.sections import ModelConfig, ParallelConfig

pytestmark = pytest.mark.parallel

MODEL = ModelConfig(vocab_size=64, num_layers=2, num_experts=4, moe_router_topk=2)
SEQUENCES = random_sequences(8, MODEL.vocab_size, min_len=6, max_len=16, seed=3)
LAYOUTS = {
    "DP2": ParallelConfig(),
    "EP2": ParallelConfig(expert_model_parallel_size=2),
    "TP2+SP": ParallelConfig(tensor_model_parallel_size=2),
    "PP2": ParallelConfig(pipeline_model_parallel_size=2),
}
OPTIMIZERS = {"DP2": [("plain", "float32"), ("distributed", "bfloat16"), ("plain", "bfloat16"),
                      ("distributed", "float32")]}
DEFAULT_OPTIMIZERS = [("plain", "float32"), ("distributed", "bfloat16")]
_CUDA_TYPE = {"torch.FloatTensor": "torch.cuda.FloatTensor", "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor"}


class _CudaTypeNames(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.Tensor.type and len(args) == 1 and not kwargs and isinstance(out, str):
            return _CUDA_TYPE.get(out, out)
        return out


def _loss_fn(mb, logits_1TV):
    """Next-token cross-entropy over the real tokens (vocab-parallel: TP splits the logits)."""
    from megatron.core import tensor_parallel

    from megatron_rl.parallel.packing import next_token_targets

    targets_T, mask_T = next_token_targets(mb)
    loss_T = tensor_parallel.vocab_parallel_cross_entropy(logits_1TV[0].float(), targets_T)
    return (loss_T * mask_T).sum(), mask_T.sum().to(torch.int), {}


def _build(parallel, optimizer: str, dtype: str, init=None):
    """Model, DDP and optimizer as the trainer builds them (distributed: Megatron's own, directly)."""
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from megatron_rl.parallel.model import build_model
    from megatron_rl.parallel.optim import build_optimizer
    from megatron_rl.parallel.schedule import wrap_for_training
    from megatron_rl.sections import OptimConfig

    model = build_model(dataclasses.replace(MODEL, params_dtype=dtype), parallel)
    if init is not None:
        model.load_state_dict(init, strict=False)
    if optimizer == "plain":
        ddp = wrap_for_training(model)
        return model, ddp, build_optimizer(ddp, OptimConfig(lr=1e-2, clip_grad=1.0))
    model.config.calculate_per_token_loss = True  # as wrap_for_training, with the distributed optimizer's buffers
    model.config.finalize_model_grads_func = finalize_model_grads
    ddp = DistributedDataParallel(config=model.config, module=model, ddp_config=DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=True, average_in_collective=False))
    config = OptimizerConfig(optimizer="adam", lr=1e-2, clip_grad=1.0, bf16=model.config.bf16,
                             params_dtype=model.config.params_dtype, use_distributed_optimizer=True)
    return model, ddp, get_megatron_optimizer(config, [ddp])


def _step(ddp, opt, micro_batches) -> float:
    from megatron_rl.parallel.schedule import run_schedule

    run_schedule(ddp, micro_batches, _loss_fn, forward_only=False)
    _, grad_norm, _ = opt.step()
    return float(grad_norm)


def _everything(model, ddp, opt) -> dict[str, tuple[torch.Tensor, str]]:
    """Every tensor of the training state by name, with its kind, found without the code under test."""
    found = {f"param {n}": (p, "weights") for n, p in model.named_parameters()}
    for i, buffer in enumerate(ddp.buffers + ddp.expert_parallel_buffers):
        found[f"buffer{i}.grad_data"] = (buffer.grad_data, "grads")
        if buffer.param_data is not None:
            found[f"buffer{i}.param_data"] = (buffer.param_data, "weights")
    members = getattr(opt, "chained_optimizers", [opt])
    for j, member in enumerate(members):
        for g, group in enumerate(member.optimizer.param_groups):
            for k, main in enumerate(group["params"]):
                found[f"opt{j}.group{g}.main{k}"] = (main, "state")
                for key, value in member.optimizer.state[main].items():
                    found[f"opt{j}.group{g}.main{k}.{key}"] = (value, "state")
    return found


def _round_trip(parallel, optimizer: str, dtype: str, groups) -> dict:
    from megatron_rl.parallel.logprobs import pack_for_rank
    from megatron_rl.parallel.offload import TrainerOffload

    model, ddp, opt = _build(parallel, optimizer, dtype)
    micro_batches = pack_for_rank(SEQUENCES[groups.dp_rank::groups.dp_size], groups, 2)
    _step(ddp, opt, micro_batches)
    everything = _everything(model, ddp, opt)
    before = {name: t.detach().clone() for name, (t, _) in everything.items()}
    weight_storages = {t.untyped_storage().data_ptr() for t, kind in everything.values() if kind == "weights"}
    offload = TrainerOffload(ddp, opt)
    state = offload.offload("state")
    kept_after_state = sorted(n for n, (t, kind) in everything.items() if kind != "weights"
                              and t.untyped_storage().data_ptr() not in weight_storages
                              and t.untyped_storage().nbytes() > 0)
    weights_touched = sorted(n for n, (t, kind) in everything.items()
                             if kind == "weights" and not torch.equal(t.detach(), before[n]))
    weights = offload.offload("weights")
    kept_after_both = sorted(n for n, (t, _) in everything.items() if t.untyped_storage().nbytes() > 0)
    offload.restore()
    differ = sorted(n for n, (t, kind) in everything.items() if kind != "grads"
                    and not torch.equal(t.detach().reshape(-1).view(torch.uint8), before[n].reshape(-1).view(torch.uint8)))
    grads_zero = all(not t.any() for t, kind in everything.values() if kind == "grads")
    return {"kept_after_state": kept_after_state, "weights_touched": weights_touched,
            "kept_after_both": kept_after_both, "differ": differ, "grads_zero": grads_zero,
            "tensors": len(everything), "state_bytes": state.nbytes, "weights_bytes": weights.nbytes,
            "main_weights": sum(1 for n in everything if ".main" in n and n.count(".") == 2)}


def _continues_exactly(groups) -> dict:
    """DP2, distributed bf16: step, offload and restore, step == step, step."""
    from megatron_rl.parallel.logprobs import pack_for_rank
    from megatron_rl.parallel.offload import TrainerOffload

    micro_batches = pack_for_rank(SEQUENCES[groups.dp_rank::groups.dp_size], groups, 2)
    runs = {}
    init = None
    for name in ("twin", "offloaded"):
        model, ddp, opt = _build(ParallelConfig(), "distributed", "bfloat16", init)
        if init is None:
            init = {k: v.clone() for k, v in model.state_dict().items() if torch.is_tensor(v)}
        norms = [_step(ddp, opt, micro_batches)]
        if name == "offloaded":
            offload = TrainerOffload(ddp, opt)
            offload.offload("state")
            offload.offload("weights")
            offload.restore()
        norms.append(_step(ddp, opt, micro_batches))
        runs[name] = (norms, [p.detach().clone() for p in model.parameters()])
    (twin_norms, twin_weights), (norms, weights) = runs["twin"], runs["offloaded"]
    return {"norms_equal": twin_norms == norms, "weights_equal": all(torch.equal(a, b) for a, b in
                                                                      zip(twin_weights, weights))}


def _world() -> dict:
    from megatron_rl.parallel.cpu_platform import cpu_platform
    from megatron_rl.parallel.groups import model_parallel

    results = {}
    with cpu_platform(), _CudaTypeNames():
        for name, parallel in LAYOUTS.items():
            with model_parallel(parallel, seed=1234) as groups:
                for optimizer, dtype in OPTIMIZERS.get(name, DEFAULT_OPTIMIZERS):
                    results[(name, optimizer, dtype)] = _round_trip(parallel, optimizer, dtype, groups)
                if name == "DP2":
                    results["continues"] = _continues_exactly(groups)
    return results


def test_offload_and_restore_are_bitwise_in_every_layout():
    for rank, results in enumerate(run_world(_world, 2, timeout_s=900)):
        assert results.pop("continues") == {"norms_equal": True, "weights_equal": True}, rank
        assert len(results) == 10
        for case, r in results.items():
            assert r["kept_after_state"] == [] and r["weights_touched"] == [], (rank, case, r)
            assert r["kept_after_both"] == [], (rank, case, r)
            assert r["differ"] == [] and r["grads_zero"], (rank, case, r)
            assert r["state_bytes"] > 0 and r["weights_bytes"] > 0, (rank, case, r)
            assert r["main_weights"] > 0, (rank, case, r)
