"""The steps of ``tools/gpu_check.py``: names, modules, time limits and what each proves.

This table is all the runner reads before a step starts (it imports no torch): each step
module is imported only inside that step's own process. A step module defines ``run(ctx)``
(``common.Context``) and returns a ``common.Outcome``; under ``ctx.dry`` it builds the same
objects at a tiny size on the CPU and runs them there, with nothing on CUDA.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Step:
    """One step of the check."""

    name: str
    """Short name (``--only``, the results' keys)."""
    module: str
    """Module of this package that runs it."""
    limit_s: int
    """Wall-clock limit of its process on the GPU machine; past it the process group is killed."""
    proves: str
    """What a pass shows, one line (the results table and docs/gpu.md)."""


STEPS = (
    Step("cuda", "cuda_up", 60,
         "CUDA and NVML answer; measured bf16 GEMM rate and device-to-device copy bandwidth"),
    Step("gpu_tests", "gpu_tests", 120,
         "pytest tests/gpu: every test that needs neither Transformer Engine nor SGLang passes"),
    Step("rl_step", "rl_step", 120,
         "a bf16 RL step of a ~2.4B Qwen3-MoE-family model: log-prob pass and R2 update tokens/s, MFU"),
    Step("planner", "planner", 120,
         "the memory planner's update peak within 10% of torch.cuda.max_memory_allocated, every case"),
    Step("colocate", "colocate", 90,
         "a colocated turn gives the trainer's freed memory back to the driver (NVML) and restores it bit for bit"),
    Step("engine", "engine", 90,
         "the hf engine's generation tokens/s on the GPU"),
    Step("gap", "gap", 90,
         "train-vs-rollout bf16 log-prob gap on GPU kernels (hf engine vs trainer), routing flips per layer"),
    Step("ipc", "ipc_push", 120,
         "a CUDA-IPC weight push to the SGLang stand-in in another process: >= 50% of a device copy's GB/s"),
)
"""In the order they run."""

BUDGET_S = 480
"""The whole check on the GPU machine: 8 minutes (a step gets at most what is left)."""

DRY_LIMIT_S = 600
"""The dry run: ``gpu_tests``' process, and one CPU process for every other step, each."""


def step(name: str) -> Step:
    """The step called ``name``.

    Raises:
        KeyError: naming the steps there are.
    """
    for s in STEPS:
        if s.name == name:
            return s
    raise KeyError(f"no step {name!r}; steps: {', '.join(s.name for s in STEPS)}")
