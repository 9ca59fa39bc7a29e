"""The phase breakdown on a GPU (skipped without CUDA): torch's peak allocated and reserved
memory per phase, reset as each phase starts, the NVTX ranges, and CUDA kernels in a
profiled step's trace next to the phase ranges."""

import json

import pytest
import torch

from megatron_rl.sections.logging import ProfileConfig
from megatron_rl.train.phases import StepWatch, phase_timer

pytestmark = pytest.mark.gpu


def test_cuda_peaks_per_phase_and_kernels_in_the_trace(tmp_path):
    torch.cuda.init()
    size = 512 << 20
    watch = StepWatch(ProfileConfig(steps=[1]), tmp_path, rank=0)
    metrics: dict = {}
    watch.begin(1)  # NVTX "step 1"; phases push and pop their own ranges
    with phase_timer(metrics, "update"):
        block = torch.empty(size, dtype=torch.uint8, device="cuda")
        block.fill_(1)
        del block
    with phase_timer(metrics, "evaluation"):
        (torch.randn(256, 256, device="cuda") @ torch.randn(256, 256, device="cuda")).sum().item()
    watch.end(1, metrics)
    gib = size / (1 << 30)
    assert metrics["perf/phase/update/cuda_max_allocated_gib"] >= gib
    assert metrics["perf/phase/update/cuda_max_reserved_gib"] >= gib
    assert metrics["perf/phase/evaluation/cuda_max_allocated_gib"] < gib / 2  # reset as the phase started
    assert metrics["perf/step/cuda_max_allocated_gib"] >= gib
    trace = json.loads((tmp_path / "profile" / "step_000001" / "rank0.pt.trace.json").read_text())
    names = {event.get("name") for event in trace["traceEvents"]}
    assert {"phase/update", "phase/evaluation"} <= names
    assert any(event.get("cat") == "kernel" for event in trace["traceEvents"])
