"""Predicted (``megatron-rl-plan``) vs measured peak memory of a policy-update step on CPU.

    python tools/bench_memory_plan.py            # every case, one gloo world each
    python tools/bench_memory_plan.py --only ep2 tp2

Each case is a run config (a test-sized Qwen3-MoE-style model, a layout, a token budget, a
recompute choice); its world builds the model, Megatron's DDP and Adam exactly as the
trainer does (``build_model`` with ``recompute_fields``, ``wrap_for_training``,
``build_optimizer``) and runs two update steps (``train_step.forward_backward`` with the
Dr. GRPO objective, then ``optimizer_step``) on samples of the config's longest length.

Measured: the peak of the bytes held by PyTorch's CPU allocator during the second step
(Adam's state exists from the first), on the busiest rank. PyTorch has no allocator
statistics for CPU tensors, so the allocations and frees come from ``torch.profiler`` with
``profile_memory=True``, which records each with its address, size and time; the count
starts before the model is built, so it is absolute (:func:`peak_held` says how frees the
profiler misses are handled). Not counted: memory that no tensor holds (the interpreter,
Megatron's modules, gloo's own buffers).

Resident: the peak resident set (``VmHWM``, restarted at the second step) above the process's
resident size before the model was built, in a second world of the case that runs the same
two steps without the profiler (whose event records, held until it stops, and the heap
fragmentation they cause would count: 355-490 MiB more on tp1-1k): what the machine must
hold, which the allocator's bytes understate by whatever the C allocator keeps of freed
memory and the library code the steps page in (docs/memory.md, "Resident memory on CPU").
Step CPU-s: the CPU-seconds of that second step, all ranks together, so that a malloc tunable
(``MALLOC_MMAP_THRESHOLD_=131072 python tools/bench_memory_plan.py``) shows what it costs
beside what it saves.

Predicted: the ``train`` phase of ``megatron_rl.plan.make_plan`` on a CPU machine (no runtime
reserve), worst pipeline stage. The table goes to docs/memory.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from megatron_rl.config import RunConfig, validate  # noqa: E402
from megatron_rl.config_loading import from_dict, merge, parse_overrides  # noqa: E402
from megatron_rl.parallel.world import run_world  # noqa: E402
from megatron_rl.plan import Machine, make_plan  # noqa: E402
from megatron_rl.plan.machine import GIB  # noqa: E402

MODEL = {
    "vocab_size": 4096, "hidden_size": 384, "num_layers": 4, "num_attention_heads": 8, "num_query_groups": 4,
    "head_dim": 48, "num_experts": 16, "moe_router_topk": 2, "moe_ffn_hidden_size": 384,
    "max_position_embeddings": 4096, "params_dtype": "float32",
}
"""Test-sized Qwen3-MoE-style model: 30M parameters, big enough that the planned terms dominate."""
SAMPLE = (128, 384)
"""Prompt and response tokens of every sample (512 in all)."""


@dataclasses.dataclass(frozen=True)
class Case:
    """One measured configuration."""

    name: str
    """Short name (``--only``)."""
    world: int
    """Processes."""
    overrides: tuple[str, ...]
    """``key=value`` overrides of the run config."""


CASES = (
    Case("tp1-1k", 1, ("train.micro_batch_tokens=1024",)),
    Case("tp1-1k-bf16", 1, ("train.micro_batch_tokens=1024", "model.params_dtype=bfloat16")),
    Case("tp1-4k", 1, ("train.micro_batch_tokens=4096",)),
    Case("tp1-4k-full", 1, ("train.micro_batch_tokens=4096", "train.recompute=full")),
    Case("tp2", 2, ("parallel.tensor_model_parallel_size=2", "train.micro_batch_tokens=2048")),
    Case("ep2", 2, ("parallel.expert_model_parallel_size=2", "train.micro_batch_tokens=2048")),
    Case("ep2-selective", 2, ("parallel.expert_model_parallel_size=2", "train.micro_batch_tokens=4096",
                              "train.recompute=selective")),
    Case("pp2", 2, ("parallel.pipeline_model_parallel_size=2", "train.micro_batch_tokens=1024")),
    Case("tp2-ep2", 4, ("parallel.tensor_model_parallel_size=2", "parallel.expert_model_parallel_size=2",
                        "train.micro_batch_tokens=2048")),
    Case("shared-dense-tp2", 2, ("parallel.tensor_model_parallel_size=2", "train.micro_batch_tokens=2048",
                                 "model.num_dense_layers=1", "model.ffn_hidden_size=768",
                                 "model.moe_shared_expert_intermediate_size=384", "model.moe_shared_expert_gate=true")),
)


def case_config(case: Case) -> RunConfig:
    """The run config the planner reads for ``case`` (8 samples per data-parallel rank)."""
    prompt, response = SAMPLE
    base = {
        "model": MODEL,
        "data": {"max_prompt_tokens": prompt},
        "rollout": {"max_new_tokens": response, "group_size": 4, "prompts_per_step": 2},
        "train": {"routing_replay": "none", "routing_diagnostics": False, "mini_batches": 1},
        "objective": {"preset": "dr_grpo"},
        "optim": {"optimizer": "adam", "lr": 1e-5},
    }
    cfg = from_dict(RunConfig, merge(base, parse_overrides(case.overrides)))
    dp = case.world // cfg.parallel.model_parallel_size
    cfg = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, prompts_per_step=2 * dp))
    return validate(cfg, case.world)


def predicted_peak(cfg: RunConfig, world: int) -> int:
    """The planner's train-phase peak (worst stage) on a CPU machine of ``world`` processes."""
    plan = make_plan(cfg, Machine(gpus=world, gpu_memory=1 << 40, cpu=True))
    return max(p.peak for p in plan.phases if p.name == "train")


def _allocations(prof) -> tuple[list[tuple[int, int, int]], dict[str, tuple[int, int]]]:
    """Every allocation and free (time, address, signed bytes), and the spans of the STEP record functions."""
    from torch._C._profiler import _EventType

    events, spans = [], {}
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        if node.tag == _EventType.Allocation:
            events.append((node.start_time_ns, node.extra_fields.ptr, node.extra_fields.alloc_size))
        elif node.name.startswith("STEP"):
            spans[node.name] = (node.start_time_ns, node.end_time_ns)
        stack.extend(node.children)
    return sorted(events), spans


def peak_held(events: list[tuple[int, int, int]], begin: int, end: int) -> int:
    """The most bytes live at once between ``begin`` and ``end``.

    A block is live from its allocation to its free. The profiler does not see frees that
    happen on threads it does not follow (gloo's, which drop the last reference to a
    collective's buffers), so a block also counts as freed when the allocator hands its
    address out again; a free never seen whose address is never reused keeps counting
    (the figure can only err high). Frees of blocks allocated before profiling are ignored.
    """
    live: dict[int, int] = {}
    held = peak = 0
    for when, address, size in events:
        if size > 0:
            held += size - live.get(address, 0)
            live[address] = size
        else:
            held -= live.pop(address, 0)
        if begin <= when <= end:
            peak = max(peak, held)
    return peak


def measure_rank(cfg: RunConfig, seed: int, profiled: bool) -> dict:
    """On one rank: build as the trainer does, two update steps; the allocator peak of the
    second (``profiled``), or its resident peak and CPU-seconds (not: the profiler's records
    and its time would count)."""
    from torch.profiler import ProfilerActivity, profile

    from megatron_rl.algos.presets import get_preset
    from megatron_rl.parallel.cpu_platform import cpu_platform
    from megatron_rl.parallel.groups import model_parallel
    from megatron_rl.parallel.model import build_model, recompute_fields
    from megatron_rl.parallel.optim import build_optimizer, optimizer_step
    from megatron_rl.parallel.schedule import wrap_for_training
    from megatron_rl.parallel.train_step import (
        RoutingPlan,
        TrainBatch,
        forward_backward,
    )

    prompt, response = cfg.data.max_prompt_tokens, cfg.rollout.max_new_tokens
    with cpu_platform(), model_parallel(cfg.parallel, seed) as groups:
        samples = cfg.rollout.prompts_per_step * cfg.rollout.group_size // groups.dp_size
        gen = torch.Generator().manual_seed(seed + groups.dp_rank)
        sequences = [torch.randint(0, cfg.model.vocab_size, (prompt + response,), generator=gen) for _ in range(samples)]
        batch = TrainBatch(
            sequences=sequences,
            prompt_lengths=[prompt] * samples,
            old_logprobs_T=torch.full((samples * response,), -6.0),
            advantages_T=torch.randn(samples * response, generator=gen),
        )
        before = resident_bytes("VmRSS")
        prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        if profiled:
            prof.start()
        model = build_model(cfg.model, cfg.parallel, moe_enable_routing_replay=True,
                            **recompute_fields(cfg.train.recompute))
        ddp = wrap_for_training(model)
        optimizer = build_optimizer(ddp, cfg.optim)
        for step in range(2):
            if step == 1:
                reset_resident_peak()
                cpu_start = time.process_time()
            with torch.profiler.record_function(f"STEP{step}"):
                forward_backward(ddp, groups, batch, get_preset("dr_grpo"), RoutingPlan(mode="none", diagnostics=False),
                                 micro_batch_tokens=cfg.train.micro_batch_tokens)
                optimizer_step(optimizer)
        cpu_s = time.process_time() - cpu_start
        resident = resident_bytes("VmHWM") - before
        if not profiled:
            return {"resident": resident, "cpu_s": cpu_s}
        prof.stop()
    events, spans = _allocations(prof)
    return {"peak": peak_held(events, *spans["STEP1"])}


def resident_bytes(field: str) -> int:
    """``VmRSS`` (resident now) or ``VmHWM`` (its peak) of this process, from /proc (Linux)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def reset_resident_peak() -> None:
    """Start ``VmHWM`` again from the resident size now (``clear_refs`` 5, Linux >= 4.0)."""
    Path("/proc/self/clear_refs").write_text("5")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="*", help="case names to run")
    args = parser.parse_args(argv)
    cases = [c for c in CASES if not args.only or c.name in args.only]
    print("| case | layout | tokens | recompute | predicted MiB | measured MiB | error | resident MiB | error "
          "| step CPU-s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    worst = 0.0
    for case in cases:
        cfg = case_config(case)
        predicted = predicted_peak(cfg, case.world)
        measured = max(r["peak"] for r in run_world(measure_rank, case.world, cfg, 1234, True, timeout_s=1800))
        unprofiled = run_world(measure_rank, case.world, cfg, 1234, False, timeout_s=1800)
        resident = max(r["resident"] for r in unprofiled)
        error = (predicted - measured) / measured
        worst = max(worst, abs(error))
        layout = make_plan(cfg, Machine(gpus=case.world, gpu_memory=GIB, cpu=True)).layout.describe().split(" on ")[0]
        print(f"| {case.name} | {layout} | {cfg.train.micro_batch_tokens} | {cfg.train.recompute} | "
              f"{predicted / 2**20:.1f} | {measured / 2**20:.1f} | {100 * error:+.1f}% | {resident / 2**20:.1f} | "
              f"{100 * (predicted - resident) / resident:+.1f}% | {sum(r['cpu_s'] for r in unprofiled):.1f} |",
              flush=True)
    print(f"\nworst error {100 * worst:.1f}% over {len(cases)} cases")
    return 0


if __name__ == "__main__":
    sys.exit(main())
