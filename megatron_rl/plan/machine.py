"""What a plan is made for: the machine (GPUs and their memory, host memory per node) and the
layout of one RL run on it (trainer parallelism, recompute, where the rollout engine runs).

Also owns reading memory sizes (``80GiB``, ``1.5TB``, ``512MiB``, a plain number of bytes)
and writing them back in GiB.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from megatron_rl.config_loading import ConfigError
from megatron_rl.plan.activations import Recompute
from megatron_rl.sections import ParallelConfig

GIB = 1 << 30
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}

RUNTIME_RESERVE = 3 * GIB
"""Per trainer GPU, memory that no tensor of ours holds: the CUDA context (about 0.5 GiB with
torch), NCCL's communicator buffers (about 1 GiB for the TP, EP, DP and PP groups) and the
caching allocator's fragmentation (about 1.5 GiB). Not counted on a CPU machine."""

CPU_RESIDENT_EXCESS = 0.54
"""On a CPU machine, how far a rank's resident set rose above the planned train peak in the
worst case of ``tools/bench_memory_plan.py`` (tp2; 17-54% over its ten cases, 2026-11-29):
glibc's heaps keep freed activations resident, fragmented, which no formula of the config
gives (docs/memory.md, "Resident memory on CPU"). Not in any peak; the report states it."""

Placement = Literal["disaggregated", "colocated"]


def parse_bytes(text: str, key: str) -> int:
    """``"80GiB"`` -> bytes; decimal (GB) and binary (GiB) units, case-insensitive.

    Raises:
        ConfigError: naming ``key`` when the text is not a size.
    """
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ConfigError(f"{key}: {text!r} is not a memory size (e.g. 80GiB, 1.5TB, 512MiB)")
    return int(float(match.group(1)) * _UNITS[unit])


def gib(num_bytes: float) -> str:
    """Bytes as GiB with two decimals."""
    return f"{num_bytes / GIB:.2f}"


@dataclass(frozen=True)
class Machine:
    """The hardware a run is planned for."""

    gpus: int
    """Accelerators in all (trainer and, when disaggregated, rollout servers)."""
    gpu_memory: int
    """Bytes of memory per accelerator."""
    host_memory: int | None = None
    """Bytes of host memory per node (None: not checked)."""
    gpus_per_node: int = 8
    """Accelerators per node (host memory is shared by a node's processes)."""
    cpu: bool = False
    """A CPU machine: each "GPU" is a process, there is no runtime reserve and no SGLang."""

    @property
    def runtime_reserve(self) -> int:
        """Memory per trainer GPU outside our tensors (:data:`RUNTIME_RESERVE`; 0 on CPU)."""
        return 0 if self.cpu else RUNTIME_RESERVE


@dataclass(frozen=True)
class Layout:
    """How one RL run uses the machine."""

    parallel: ParallelConfig
    """Trainer parallelism (TP, SP, EP, ETP, PP)."""
    world: int
    """Trainer processes (one per GPU)."""
    recompute: Recompute = "none"
    """Activation recompute of the policy update."""
    placement: Placement = "disaggregated"
    """SGLang on GPUs of its own, or taking turns with the trainer on the same GPUs."""
    offload: bool = True
    """Colocated: the trainer moves its weights, main weights and optimizer state to host
    memory and frees its gradient buffers while SGLang generates (False: all of it stays,
    and SGLang gets what is left, as ``megatron-rl-launch --sglang`` runs today)."""
    server_gpus: int = 0
    """Disaggregated SGLang: the GPUs its servers use (``num_servers x server_tp_size``)."""

    @property
    def data_parallel(self) -> int:
        """Dense data-parallel size (DP)."""
        return self.world // self.parallel.model_parallel_size

    @property
    def expert_data_parallel(self) -> int:
        """Expert data-parallel size: ``world / (ETP x EP x PP)``."""
        p = self.parallel
        return self.world // (p.expert_tensor_parallel_size * p.expert_model_parallel_size
                              * p.pipeline_model_parallel_size)

    def describe(self) -> str:
        """One line: ``TP2 SP EP8 ETP1 PP1 DP4, recompute full, colocated (offload)``."""
        p = self.parallel
        sp = " SP" if p.sequence_parallel_enabled() else ""
        where = self.placement
        if self.placement == "colocated":
            where += " (offload to host)" if self.offload else " (static split, no offload)"
        elif self.server_gpus:
            where += f" ({self.server_gpus} SGLang GPUs)"
        return (f"TP{p.tensor_model_parallel_size}{sp} EP{p.expert_model_parallel_size} "
                f"ETP{p.expert_tensor_parallel_size} PP{p.pipeline_model_parallel_size} DP{self.data_parallel} "
                f"on {self.world} trainer GPUs, recompute {self.recompute}, {where}")
