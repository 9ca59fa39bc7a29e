"""What the steps of the GPU check share: their context and outcome, the device world, the made
Qwen3-MoE-family models, random samples, a timer and NVML's view of device memory.

In the dry run (``Context.dry``) every helper does the same thing on the CPU: a gloo world of
one under the CPU platform instead of NCCL on GPU 0, and every made model at one tiny size, so
that the steps build and call what they will call on the GPU.
"""

from __future__ import annotations

import contextlib
import dataclasses
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from megatron_rl.sections import ModelConfig, ParallelConfig

REPO = Path(__file__).resolve().parents[2]
GPU_ONLY_CALLS = (
    torch.cuda.set_device, torch.cuda.synchronize, torch.cuda.memory_allocated, torch.cuda.max_memory_allocated,
    torch.cuda.max_memory_reserved, torch.cuda.reset_peak_memory_stats, torch.cuda.empty_cache,
    torch.cuda.get_device_properties, torch.cuda.get_device_name, torch.distributed.HashStore,
)
"""What the steps call only on the GPU, resolved as this module loads: the dry run fails if one is gone."""


@dataclass
class Context:
    """What a step is given."""

    name: str
    """The step's name."""
    dry: bool
    """The dry run: tiny sizes on the CPU, nothing on CUDA."""
    scratch: Path
    """A folder of its own for files it writes (removed after the check)."""

    @property
    def device(self) -> torch.device:
        return torch.device("cpu") if self.dry else torch.device("cuda", 0)

    def log(self, message: str) -> None:
        print(f"[{self.name}] {message}", flush=True)


@dataclass
class Outcome:
    """What a step reports: a verdict, one line, its figures and an optional table."""

    status: str
    """``pass`` / ``fail`` against the step's criterion, ``measured`` (no criterion), ``dry`` (dry run)."""
    headline: str
    """One line for the results table."""
    figures: dict[str, Any] = field(default_factory=dict)
    """Every number measured (JSON)."""
    table: list[dict[str, Any]] = field(default_factory=list)
    """Rows of a detail table (e.g. one per planner case), written under the summary."""

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def verdict(ctx: Context, ok: bool) -> str:
    """``dry`` in the dry run, else ``pass`` or ``fail``."""
    return "dry" if ctx.dry else ("pass" if ok else "fail")


@contextlib.contextmanager
def device_world(ctx: Context, parallel: ParallelConfig | None = None, seed: int = 1234) -> Iterator[Any]:
    """This process alone as a world, with Megatron's groups; yields the ``ParallelGroups``.

    On the GPU: NCCL on GPU 0 over an in-memory store, so no port is picked that another process
    could take. Dry run: gloo (``world_of_one``) under the CPU platform.
    """
    import torch.distributed as dist

    from megatron_rl.parallel.cpu_platform import cpu_platform
    from megatron_rl.parallel.groups import model_parallel
    from megatron_rl.parallel.world import world_of_one

    parallel = parallel or ParallelConfig()
    if ctx.dry:
        with world_of_one(), cpu_platform(), model_parallel(parallel, seed) as groups:
            yield groups
        return
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with model_parallel(parallel, seed) as groups:
            yield groups
    finally:
        dist.destroy_process_group()


MADE_MODELS = {
    # ~2.36B parameters, 0.77B active: Qwen3-30B-A3B's shape family (64 experts, top-8, GQA 12/4,
    # head dim 128, Qwen's vocabulary), 12 layers of hidden 1536.
    "rl": dict(vocab_size=151936, hidden_size=1536, num_layers=12, num_attention_heads=12, num_query_groups=4,
               head_dim=128, num_experts=64, moe_router_topk=8, moe_ffn_hidden_size=512,
               max_position_embeddings=4096),
    # ~0.50B parameters: the planner's cases and the colocated turn.
    "mid": dict(vocab_size=32768, hidden_size=1024, num_layers=8, num_attention_heads=8, num_query_groups=4,
                head_dim=128, num_experts=32, moe_router_topk=4, moe_ffn_hidden_size=512,
                max_position_embeddings=4096),
    # The dry run's size for every model (same family: qk norm, GQA, untied, top-K routing).
    "tiny": dict(vocab_size=512, hidden_size=64, num_layers=2, num_attention_heads=4, num_query_groups=2,
                 head_dim=16, num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=32,
                 max_position_embeddings=512),
}
"""Made configs of the Qwen3-MoE family (random weights), by name."""


def made_model(ctx: Context, size: str, **changes: Any) -> ModelConfig:
    """The made model ``size`` in bf16 (``tiny`` in the dry run), with ``changes`` applied."""
    fields = {**MADE_MODELS["tiny" if ctx.dry else size], "params_dtype": "bfloat16", **changes}
    return ModelConfig(**fields)


def random_samples(vocab: int, count: int, prompt: int, response: int, seed: int) -> list[torch.Tensor]:
    """``count`` token sequences of ``prompt + response`` random ids (CPU, int64)."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (prompt + response,), generator=gen) for _ in range(count)]


def synchronize(ctx: Context) -> None:
    if not ctx.dry:
        torch.cuda.synchronize()


def timed(ctx: Context, fn: Callable[[], Any]) -> tuple[float, Any]:
    """Seconds ``fn()`` takes to its last kernel, and what it returned."""
    synchronize(ctx)
    start = time.perf_counter()
    value = fn()
    synchronize(ctx)
    return time.perf_counter() - start, value


def median_seconds(ctx: Context, fn: Callable[[], Any], repeats: int) -> float:
    """Median of ``repeats`` timed calls (after one untimed warm-up call)."""
    fn()
    return statistics.median(timed(ctx, fn)[0] for _ in range(repeats))


def copy_gbps(ctx: Context, tensors: list[torch.Tensor], repeats: int = 5) -> float:
    """Bytes of ``tensors`` over the median time to copy them into preallocated buffers on their
    device (each byte counted once, as a push counts it), GB/s."""
    targets = [torch.empty_like(t) for t in tensors]

    def copy() -> None:
        for dst, src in zip(targets, tensors):
            dst.copy_(src)

    seconds = median_seconds(ctx, copy, repeats)
    return sum(t.numel() * t.element_size() for t in tensors) / seconds / 1e9


def nvml_used_bytes(ctx: Context) -> int | None:
    """Device 0's used memory as the driver reports it (NVML), or None in the dry run (the
    functions are resolved there all the same)."""
    import pynvml

    calls = (pynvml.nvmlInit, pynvml.nvmlDeviceGetHandleByIndex, pynvml.nvmlDeviceGetMemoryInfo)
    if ctx.dry:
        return None
    init, handle_of, memory_of = calls
    init()
    return int(memory_of(handle_of(0)).used)


def gib(num_bytes: float) -> float:
    return round(num_bytes / (1 << 30), 3)
