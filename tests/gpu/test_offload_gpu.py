"""The colocated offload on a GPU (skipped without CUDA): after a training step the state and
the weights leave the GPU (host copies pinned), torch's allocated bytes drop by at least
what was freed, memory goes back to the driver (what another process, SGLang, can take:
``torch.cuda.mem_get_info``), and everything comes back byte for byte. Prints the bytes moved and freed and the times."""

import time

import pytest
import torch

from megatron_rl.parallel.smoke_worker import random_sequences
from megatron_rl.sections import ModelConfig, OptimConfig, ParallelConfig

pytestmark = pytest.mark.gpu

MODEL = ModelConfig(vocab_size=256, hidden_size=256, ffn_hidden_size=512, moe_ffn_hidden_size=256,
                    num_layers=2, num_experts=8, moe_router_topk=2, params_dtype="bfloat16")


def _loss_fn(mb, logits_1TV):
    from megatron_rl.parallel.packing import next_token_targets

    targets_T, mask_T = (t.to(logits_1TV.device) for t in next_token_targets(mb))
    loss_T = torch.nn.functional.cross_entropy(logits_1TV[0].float(), targets_T, reduction="none")
    return (loss_T * mask_T).sum(), mask_T.sum().to(torch.int), {}


def test_offload_frees_the_gpu_and_restores_every_byte(one_gpu_world):
    from megatron_rl.parallel.logprobs import pack_for_rank
    from megatron_rl.parallel.model import build_model
    from megatron_rl.parallel.offload import TrainerOffload
    from megatron_rl.parallel.optim import build_optimizer
    from megatron_rl.parallel.schedule import run_schedule, wrap_for_training

    model = build_model(MODEL, ParallelConfig())
    ddp = wrap_for_training(model)
    opt = build_optimizer(ddp, OptimConfig(lr=1e-3))
    sequences = random_sequences(8, MODEL.vocab_size, min_len=16, max_len=64, seed=3)
    run_schedule(ddp, pack_for_rank(sequences, one_gpu_world, 2), _loss_fn, forward_only=False)
    opt.step()
    weights = [p.detach().clone() for p in model.parameters()]
    states = [v.clone() for m in getattr(opt, "chained_optimizers", [opt]) for s in m.optimizer.state.values()
              for v in s.values() if torch.is_tensor(v)]
    torch.cuda.synchronize()
    allocated, (free, _) = torch.cuda.memory_allocated(), torch.cuda.mem_get_info()
    offload = TrainerOffload(ddp, opt)
    start = time.perf_counter()
    moved = [offload.offload("state"), offload.offload("weights")]
    out_s = time.perf_counter() - start
    assert all(s.host.is_pinned() for part in moved for s in part.items if s.host is not None)
    freed = allocated - torch.cuda.memory_allocated()
    returned = torch.cuda.mem_get_info()[0] - free
    nbytes = sum(part.nbytes for part in moved)
    # Every freed storage leaves torch's count (rounded up per block); the driver gets back the
    # caching allocator's segments that nothing else shares (empty_cache), printed below.
    assert freed >= nbytes and returned > 0
    start = time.perf_counter()
    offload.restore()
    torch.cuda.synchronize()
    back_s = time.perf_counter() - start
    assert all(torch.equal(a, b) for a, b in zip(weights, model.parameters()))
    after = [v for m in getattr(opt, "chained_optimizers", [opt]) for s in m.optimizer.state.values()
             for v in s.values() if torch.is_tensor(v)]
    assert len(after) == len(states) and all(torch.equal(a, b) for a, b in zip(states, after))
    print(f"\noffload: {nbytes / 2**20:.1f} MiB moved or freed, {freed / 2**20:.1f} MiB freed, "
          f"{returned / 2**20:.1f} MiB back to the driver; out {out_s * 1e3:.1f} ms, back {back_s * 1e3:.1f} ms")
