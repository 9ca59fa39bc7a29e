"""The plain against Megatron's distributed optimizer on CPU: step time, checkpoint time, memory.

Model: the architecture of the CPU demo's checkpoint (``megatron_rl/assets/tiny_qwen3_moe``:
Qwen3-MoE, 4 layers, hidden 64, 8 experts top-2, vocab 512), random fp32 weights. Layout:
the demo's, EP2 on two gloo processes (dense DP2, expert-DP1). Workload: ``--samples``
random sequences of 24-56 tokens (about the demo's 128 samples of a step), packed into
micro-batches of ``--micro-batch-sequences``, next-token cross-entropy, unclipped Adam.

Per optimizer (each in the same world, built from the same weights): the median over
``--steps`` steps (after one warm-up step) of the forward-backward time and of the optimizer
step time (reduce-scatter, slice update and all-gather for the distributed one), the time
of a trainer checkpoint (``train.checkpoint.save_checkpoint``, the faster of two: a process's
first save also fills DCP's caches), and the bytes of the
training state's storages (weights, gradient buffers, main weights, Adam moments) per
parameter of the rank, against ``optimizer_bytes_per_param``. Rank 0's figures.

Usage (from a checkout, with the venv active)::

    python tools/bench_distributed_optimizer.py [--steps 8] [--samples 128] [--order distributed,plain]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

from megatron_rl.parallel.smoke_worker import random_sequences
from megatron_rl.parallel.world import run_world
from megatron_rl.sections import ModelConfig, OptimConfig, ParallelConfig

MODEL = ModelConfig(vocab_size=512, hidden_size=64, num_layers=4, num_attention_heads=4, num_query_groups=2,
                    head_dim=16, num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=64)
PARALLEL = ParallelConfig(expert_model_parallel_size=2)
OPTIMIZERS = {"plain": OptimConfig(lr=1e-4, clip_grad=0.0),
              "distributed": OptimConfig(lr=1e-4, clip_grad=0.0, distributed=True)}


def _loss_fn(mb, logits_1TV):
    from megatron_rl.parallel.packing import next_token_targets

    targets_T, mask_T = next_token_targets(mb)
    logprobs_T = torch.log_softmax(logits_1TV[0].float(), dim=-1).gather(1, targets_T[:, None])[:, 0]
    return -(logprobs_T * mask_T).sum(), mask_T.sum().to(torch.int), {}


def _state_bytes(model, ddp, optimizer) -> int:
    """Bytes of every storage of weights, gradient buffers, main weights and Adam state, once each."""
    from megatron_rl.parallel.mcore_optimizer import ddp_buffers, optimizer_members

    storages = {}
    tensors = [*model.parameters(), *(buffers[0] for buffers in ddp_buffers(ddp))]  # (gradients, weights)
    for member in optimizer_members(optimizer):
        for group in member.optimizer.param_groups:
            for param in group["params"]:
                tensors += [param, *(v for v in member.optimizer.state[param].values() if v.dim() > 0)]
    for t in tensors:
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(storages.values())


def worker(samples: int, steps: int, micro_batch_sequences: int, run_dir: str, order: list[str]) -> dict:
    import torch.distributed as dist

    from megatron_rl.parallel.cpu_platform import cpu_platform
    from megatron_rl.parallel.groups import model_parallel
    from megatron_rl.parallel.logprobs import pack_for_rank
    from megatron_rl.parallel.model import build_model
    from megatron_rl.parallel.optim import build_optimizer, optimizer_step
    from megatron_rl.parallel.schedule import run_schedule, wrap_for_training
    from megatron_rl.train.checkpoint import (
        TrainerState,
        parallel_layout,
        save_checkpoint,
    )

    sequences = random_sequences(samples, MODEL.vocab_size, min_len=24, max_len=56, seed=5)
    out = {}
    with cpu_platform(), model_parallel(PARALLEL, seed=1234) as groups:
        micro_batches = pack_for_rank(sequences[groups.dp_rank :: groups.dp_size], groups, micro_batch_sequences)
        init = None
        for name in order:
            optim = OPTIMIZERS[name]
            model = build_model(MODEL, PARALLEL)
            init = init or {k: t.clone() for k, t in model.state_dict().items() if torch.is_tensor(t)}
            model.load_state_dict(init, strict=False)
            ddp = wrap_for_training(model, optim)
            optimizer = build_optimizer(ddp, optim)
            backward, update = [], []
            for _ in range(steps + 1):
                dist.barrier()
                start = time.perf_counter()
                run_schedule(ddp, micro_batches, _loss_fn, forward_only=False)
                dist.barrier()
                middle = time.perf_counter()
                optimizer_step(optimizer)
                dist.barrier()
                backward.append(middle - start)
                update.append(time.perf_counter() - middle)
            saves = []
            for step in (steps, steps + 1):  # the first save of a process also warms DCP's caches
                start = time.perf_counter()
                save_checkpoint(f"{run_dir}/{name}", ddp, optimizer, TrainerState(step, 0, step), {}, groups.world,
                                layout=parallel_layout(groups))
                saves.append(time.perf_counter() - start)
            params = sum(p.numel() for p in model.parameters())
            out[name] = {"forward_backward_s": statistics.median(backward[1:]),
                         "optimizer_step_s": statistics.median(update[1:]),
                         "checkpoint_s": min(saves),
                         "bytes_per_param": _state_bytes(model, ddp, optimizer) / params, "params": params}
    return out


def main() -> None:
    from megatron_rl.parallel.optimizer_memory import optimizer_bytes_per_param

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--samples", type=int, default=128)
    parser.add_argument("--micro-batch-sequences", type=int, default=16)
    parser.add_argument("--order", default="plain,distributed", help="which optimizer runs first")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as run_dir:
        result = run_world(worker, 2, args.samples, args.steps, args.micro_batch_sequences, run_dir,
                           args.order.split(","), timeout_s=3600)[0]
    print(f"EP2 on 2 gloo processes, {args.samples} samples, {args.steps} steps (median), rank 0, "
          f"{result['plain']['params']} parameters on the rank")
    print("| optimizer | forward-backward s | optimizer step s | checkpoint s | bytes/param measured |")
    print("|---|---:|---:|---:|---:|")
    for name, row in result.items():
        print(f"| {name} | {row['forward_backward_s']:.3f} | {row['optimizer_step_s']:.4f} | "
              f"{row['checkpoint_s']:.2f} | {row['bytes_per_param']:.2f} |")
    dense = optimizer_bytes_per_param("float32", distributed=True, data_parallel_size=2).total
    experts = optimizer_bytes_per_param("float32", distributed=True, data_parallel_size=1).total
    print(f"optimizer_bytes_per_param: plain {optimizer_bytes_per_param('float32', distributed=False).total:.0f}; "
          f"distributed {dense:.0f} (dense, D=2) and {experts:.0f} (experts, expert-DP 1)")


if __name__ == "__main__":
    main()
