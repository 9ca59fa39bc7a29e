"""The colocated offload's cost: bytes moved and freed, and the time out and back.

    python tools/bench_offload.py [--repeats 5] [--dtype float32|bfloat16]

One process (a gloo world of one on CPU, NCCL on GPU 0 when CUDA is present) builds a
test-sized Qwen3-MoE-style model, Megatron's DDP and Adam as the trainer does
(``build_model``, ``wrap_for_training``, ``build_optimizer``), trains one step so that Adam's
state exists, then times :class:`~megatron_rl.parallel.offload.TrainerOffload` moving the
state out, then the weights, and restoring both (the order of a colocated turn,
``megatron_rl/train/colocate.py``), ``--repeats`` times; it prints the median of each and the
bytes. On a GPU it also prints the memory given back to the driver (``torch.cuda.mem_get_info``,
what SGLang can take). Every round trip is checked bitwise against the first state.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from megatron_rl.parallel.world import run_world  # noqa: E402
from megatron_rl.sections import ModelConfig, OptimConfig, ParallelConfig  # noqa: E402

MODEL = {"vocab_size": 4096, "hidden_size": 384, "num_layers": 4, "num_attention_heads": 8, "num_query_groups": 4,
         "head_dim": 48, "num_experts": 16, "moe_router_topk": 2, "moe_ffn_hidden_size": 384,
         "max_position_embeddings": 4096}
"""Test-sized Qwen3-MoE-style model (30M parameters, the memory benchmark's)."""


def _loss_fn(mb, logits_1TV):
    from megatron_rl.parallel.packing import next_token_targets

    targets_T, mask_T = next_token_targets(mb)
    loss_T = torch.nn.functional.cross_entropy(logits_1TV[0].float(), targets_T, reduction="none")
    return (loss_T * mask_T).sum(), mask_T.sum().to(torch.int), {}


def _snapshot(model, opt) -> list[torch.Tensor]:
    from megatron_rl.parallel.mcore_optimizer import optimizer_members

    members = optimizer_members(opt)
    return [t.detach().clone() for t in [*model.parameters(), *(v for m in members for s in m.optimizer.state.values()
                                                               for v in s.values() if torch.is_tensor(v))]]


def _measure(dtype: str, repeats: int) -> dict:
    import contextlib

    from megatron_rl.parallel.cpu_platform import cpu_platform
    from megatron_rl.parallel.groups import model_parallel
    from megatron_rl.parallel.logprobs import pack_for_rank
    from megatron_rl.parallel.model import build_model
    from megatron_rl.parallel.offload import TrainerOffload
    from megatron_rl.parallel.optim import build_optimizer
    from megatron_rl.parallel.schedule import run_schedule, wrap_for_training
    from megatron_rl.parallel.smoke_worker import random_sequences

    cuda = torch.cuda.is_available()
    with (contextlib.nullcontext() if cuda else cpu_platform()), model_parallel(ParallelConfig(), seed=1) as groups:
        model = build_model(ModelConfig(**MODEL, params_dtype=dtype), ParallelConfig())
        ddp = wrap_for_training(model)
        opt = build_optimizer(ddp, OptimConfig(lr=1e-4))
        sequences = random_sequences(4, MODEL["vocab_size"], min_len=64, max_len=128, seed=3)
        run_schedule(ddp, pack_for_rank(sequences, groups, 2), _loss_fn, forward_only=False)
        opt.step()
        before = _snapshot(model, opt)
        offload = TrainerOffload(ddp, opt)
        times: dict[str, list[float]] = {"state out": [], "weights out": [], "back": []}
        returned, sizes = 0, {}
        for _ in range(repeats):
            free = torch.cuda.mem_get_info()[0] if cuda else 0
            for part in ("state", "weights"):
                start = time.perf_counter()
                moved = offload.offload(part)
                times[f"{part} out"].append(time.perf_counter() - start)
                sizes[part] = (moved.nbytes, moved.host_bytes)
            if cuda:
                returned = torch.cuda.mem_get_info()[0] - free
            start = time.perf_counter()
            offload.restore()
            if cuda:
                torch.cuda.synchronize()
            times["back"].append(time.perf_counter() - start)
            assert all(torch.equal(a, b) for a, b in zip(before, _snapshot(model, opt))), "a round trip changed a byte"
        return {"device": torch.cuda.get_device_name() if cuda else "cpu", "sizes": sizes, "returned": returned,
                "median_s": {k: statistics.median(v) for k, v in times.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = parser.parse_args()
    if torch.cuda.is_available():
        import torch.distributed as dist

        torch.cuda.set_device(0)
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)  # one process: no port
        result = _measure(args.dtype, args.repeats)
    else:
        (result,) = run_world(_measure, 1, args.dtype, args.repeats, timeout_s=900)
    mib = 1 << 20
    print(f"device {result['device']}, params {args.dtype}, median of {args.repeats}")
    print("| part | device bytes freed (MiB) | copied to host (MiB) | out (ms) |")
    print("|---|---|---|---|")
    for part, (freed, copied) in result["sizes"].items():
        print(f"| {part} | {freed / mib:.1f} | {copied / mib:.1f} | {result['median_s'][f'{part} out'] * 1e3:.1f} |")
    print(f"back (both parts): {result['median_s']['back'] * 1e3:.1f} ms; every byte restored")
    if result["returned"]:
        print(f"GPU memory given back to the driver: {result['returned'] / mib:.1f} MiB")


if __name__ == "__main__":
    main()
