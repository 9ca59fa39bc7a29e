"""A whole plan: every phase of a step on its GPUs, host memory per node, and the verdict.

Owns :func:`make_plan` (config + machine [+ layout] -> :class:`Plan`), the layout a config
describes (:func:`layout_from_config`), and the printed table (:func:`format_plan`).
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_rl.config import RunConfig
from megatron_rl.plan.machine import CPU_RESIDENT_EXCESS, Layout, Machine, gib
from megatron_rl.plan.params import model_params
from megatron_rl.plan.phases import (
    Phase,
    generate_phases,
    host_terms,
    logprob_phase,
    teacher_phases,
    train_phase,
)
from megatron_rl.plan.state import distributed_optimizer


@dataclass(frozen=True)
class Plan:
    """Predicted memory of one run on one machine."""

    cfg: RunConfig
    """The run."""
    machine: Machine
    """The hardware."""
    layout: Layout
    """How the run uses it."""
    phases: tuple[Phase, ...]
    """Every phase on every kind of GPU (training phases: each pipeline stage)."""
    host: Phase
    """Host memory of one node."""
    distributed: bool
    """Whether the run builds the distributed optimizer."""
    train_peak_distributed: int
    """The training phases' peak with the distributed optimizer (equal to the plain one when it is used)."""
    gpus_needed: int
    """Trainer GPUs plus SGLang's own GPUs."""

    @property
    def binding(self) -> Phase:
        """The phase that needs the most (SGLang's KV pool counted at its minimum)."""
        return max(self.phases, key=lambda p: p.need)

    @property
    def margin(self) -> int:
        """GPU memory left at the binding phase's need (negative: short by that much)."""
        return self.machine.gpu_memory - self.binding.need

    @property
    def host_fits(self) -> bool:
        """Host memory suffices (True when it was not given)."""
        return self.machine.host_memory is None or self.host.peak <= self.machine.host_memory

    @property
    def fits(self) -> bool:
        """Every phase fits its GPU, the host memory suffices, and there are GPUs enough."""
        return self.margin >= 0 and self.host_fits and self.gpus_needed <= self.machine.gpus

    def refusal(self) -> str:
        """Why it does not fit, in one line naming the phase and the term ('' when it fits)."""
        if self.gpus_needed > self.machine.gpus:
            return (f"the layout needs {self.gpus_needed} GPUs ({self.layout.describe()}) but the machine has "
                    f"{self.machine.gpus}")
        if self.margin < 0:
            p = self.binding
            return (f"phase '{p.name}' ({p.device}) needs {gib(p.need)} GiB of {gib(self.machine.gpu_memory)} GiB "
                    f"per GPU; the biggest term is {p.biggest.name} ({gib(p.biggest.bytes)} GiB)")
        if not self.host_fits:
            return (f"host memory: a node needs {gib(self.host.peak)} GiB of {gib(self.machine.host_memory or 0)} "
                    f"GiB; the biggest term is {self.host.biggest.name} ({gib(self.host.biggest.bytes)} GiB)")
        return ""


def layout_from_config(cfg: RunConfig, machine: Machine) -> Layout:
    """The layout the config describes on ``machine`` (world: ``parallel.world_size`` or the
    GPUs SGLang's own servers leave)."""
    r = cfg.rollout
    server_gpus = 0
    if r.engine == "sglang" and r.placement == "disaggregated":
        server_gpus = r.sglang.num_servers * r.sglang.server_tp_size
    world = cfg.parallel.world_size or max(1, machine.gpus - server_gpus)
    return Layout(parallel=cfg.parallel, world=world, recompute=cfg.train.recompute, placement=r.placement,
                  server_gpus=server_gpus)


def make_plan(cfg: RunConfig, machine: Machine, layout: Layout | None = None) -> Plan:
    """Plan ``cfg`` on ``machine`` (in the config's own layout unless ``layout`` is given)."""
    layout = layout or layout_from_config(cfg, machine)
    distributed = distributed_optimizer(cfg)
    stages = range(layout.parallel.pipeline_model_parallel_size)
    phases = [*generate_phases(cfg, layout, machine, distributed),
              *(logprob_phase(cfg, layout, machine, s, distributed) for s in stages),
              *teacher_phases(cfg, layout, machine, distributed),
              *(train_phase(cfg, layout, machine, s, distributed) for s in stages)]
    train_peak_distributed = max(train_phase(cfg, layout, machine, s, True).peak for s in stages)
    return Plan(cfg=cfg, machine=machine, layout=layout, phases=tuple(phases),
                host=Phase("host", "one node", tuple(host_terms(cfg, layout, machine, distributed))),
                distributed=distributed, train_peak_distributed=train_peak_distributed,
                gpus_needed=layout.world + layout.server_gpus)


def format_plan(plan: Plan) -> str:
    """The printed report: one table per phase, host memory, and the verdict."""
    m, machine = plan.cfg.model, plan.machine
    counts = model_params(m)
    unit = "process" if machine.cpu else "GPU"
    lines = [f"model: {counts.total / 1e9:.2f}B parameters ({counts.active / 1e9:.2f}B active per token), "
             f"{m.params_dtype}",
             f"layout: {plan.layout.describe()}",
             f"machine: {machine.gpus} x {gib(machine.gpu_memory)} GiB per {unit}"
             + (f", {gib(machine.host_memory)} GiB host memory per node" if machine.host_memory else ""), ""]
    for phase in (*plan.phases, plan.host):
        lines.append(f"{phase.name} [{phase.device}]")
        for term in phase.terms:
            when = f"  (at {term.moment})" if term.moment else ""
            lines.append(f"  {gib(term.bytes):>9} GiB  {term.name}{when}")
        lines.append(f"  {gib(phase.peak):>9} GiB  peak")
        if phase.need != phase.peak:
            lines.append(f"  {gib(phase.need):>9} GiB  needed (the KV pool takes what is left; one sample needs "
                         f"{gib(min(t.minimum for t in phase.terms if t.minimum is not None))} GiB)")
        lines.append("")
    binding = plan.binding
    lines.append(f"highest: phase '{binding.name}' [{binding.device}], {gib(binding.need)} GiB; biggest term: "
                 f"{binding.biggest.name} ({gib(binding.biggest.bytes)} GiB)")
    train_peak = max(p.peak for p in plan.phases if p.name == "train")
    if machine.cpu:
        lines.append(f"resident (CPU): allow {gib(train_peak * (1 + CPU_RESIDENT_EXCESS))} GiB per process in "
                     f"training, {100 * CPU_RESIDENT_EXCESS:.0f}% over its peak and not counted above: glibc's heaps "
                     "keep freed activations (the worst case of tools/bench_memory_plan.py; docs/memory.md)")
    if not plan.distributed:
        lines.append(f"optimizer: Megatron's plain optimizer (train peak {gib(train_peak)} GiB); the distributed "
                     f"optimizer would make it {gib(plan.train_peak_distributed)} GiB")
    else:
        lines.append("optimizer: Megatron's distributed optimizer (optim.distributed)")
    verdict = "FITS" if plan.fits else "DOES NOT FIT"
    lines.append(f"{verdict}: margin {gib(plan.margin)} GiB per {unit} "
                 f"({100 * plan.margin / machine.gpu_memory:.1f}% of {gib(machine.gpu_memory)} GiB)"
                 + (f"; {plan.refusal()}" if not plan.fits else ""))
    return "\n".join(lines)
