"""``megatron-rl-plan --search``: the layouts of a run that fit a machine, best first.

Tried: every TP (within a node; SP on when TP > 1), EP, ETP and PP the ``parallel``
section accepts for the model, DP filling the trainer's GPUs, each recompute choice, and
for SGLang runs each placement: disaggregated (the config's servers on GPUs of their own,
the trainer on the rest), colocated with offload (all GPUs take turns), colocated without
offload (SGLang gets what the resident trainer leaves, ``megatron-rl-launch --sglang``).

Cost model, stated and simple (an order, not a time): a layout ranks before another when,
compared in this order,

1. it recomputes less (none, selective, full: each repeats forward work of the update);
2. its pipeline bubble is smaller: ``(PP - 1) / (micro-batches + PP - 1)`` of a 1F1B step idles;
3. it moves less state per step: disaggregated or colocated without offload, before
   colocated with offload (weights, main weights and optimizer state cross PCIe twice a step);
4. it trains on more GPUs (colocated runs train on all of them);
5. its TP, then its ETP, is smaller (their collectives sit on every layer's critical path);
6. it leaves more memory free.
"""

from __future__ import annotations

import dataclasses
from typing import Iterator

from megatron_rl.config_loading import ConfigError
from megatron_rl.plan.machine import Layout
from megatron_rl.plan.phases import step_shape
from megatron_rl.plan.report import Plan, make_plan
from megatron_rl.sections import ParallelConfig, validate_layout

RECOMPUTE_ORDER = ("none", "selective", "full")


def _divisors(n: int, limit: int) -> list[int]:
    return [d for d in range(1, min(n, limit) + 1) if n % d == 0]


def candidate_layouts(plan: Plan) -> Iterator[Layout]:
    """Every layout the model and machine allow (invalid ones skipped)."""
    cfg, machine = plan.cfg, plan.machine
    m = cfg.model
    base = plan.layout.parallel
    placements: list[tuple[str, bool, int]] = [("disaggregated", True, plan.layout.server_gpus)]
    if cfg.rollout.engine == "sglang":
        s = cfg.rollout.sglang
        placements = [("disaggregated", True, s.num_servers * s.server_tp_size),
                      ("colocated", True, 0), ("colocated", False, 0)]
    for placement, offload, server_gpus in placements:
        world = machine.gpus - server_gpus
        if world < 1:
            continue
        for tp in _divisors(world, machine.gpus_per_node):
            for pp in _divisors(world // tp, m.num_layers):
                for ep in _divisors(m.num_experts, world):
                    for etp in _divisors(world, machine.gpus_per_node):
                        parallel = dataclasses.replace(
                            base, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                            expert_model_parallel_size=ep, expert_tensor_parallel_size=etp,
                            sequence_parallel=None, world_size=world)
                        if not _valid(cfg, parallel, world):
                            continue
                        for recompute in RECOMPUTE_ORDER:
                            yield Layout(parallel=parallel, world=world, recompute=recompute, placement=placement,
                                         offload=offload, server_gpus=server_gpus)


def _valid(cfg, parallel: ParallelConfig, world: int) -> bool:
    try:
        validate_layout(cfg.model, parallel, world)
    except ConfigError:
        return False
    tokens = cfg.train.micro_batch_tokens
    tp = parallel.tensor_model_parallel_size
    return tokens is None or not parallel.sequence_parallel_enabled() or tokens % tp == 0


def cost_key(plan: Plan) -> tuple:
    """The sort key of the cost model in the module docstring (smaller is better)."""
    layout = plan.layout
    p = layout.parallel
    pp = p.pipeline_model_parallel_size
    micro_batches = step_shape(plan.cfg, layout).micro_batches
    bubble = (pp - 1) / (micro_batches + pp - 1)
    moves_state = layout.placement == "colocated" and layout.offload
    return (RECOMPUTE_ORDER.index(layout.recompute), round(bubble, 3), moves_state, -layout.world,
            p.tensor_model_parallel_size, p.expert_tensor_parallel_size, -plan.margin)


def search(plan: Plan) -> list[Plan]:
    """Every candidate layout of ``plan``'s run that fits ``plan``'s machine, best first."""
    fitting = []
    for layout in candidate_layouts(plan):
        candidate = make_plan(plan.cfg, plan.machine, layout)
        if candidate.fits:
            fitting.append(candidate)
    return sorted(fitting, key=cost_key)


def format_search(plans: list[Plan], top: int) -> str:
    """A table of the best ``top`` fitting layouts."""
    if not plans:
        return "no layout fits this machine"
    rows = ["| # | TP | EP | ETP | PP | DP | recompute | placement | needs GiB | margin GiB | highest phase |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    for i, plan in enumerate(plans[:top], 1):
        layout, p = plan.layout, plan.layout.parallel
        where = layout.placement
        if layout.placement == "colocated":
            where += ", offload" if layout.offload else ", no offload"
        rows.append(f"| {i} | {p.tensor_model_parallel_size} | {p.expert_model_parallel_size} | "
                    f"{p.expert_tensor_parallel_size} | {p.pipeline_model_parallel_size} | {layout.data_parallel} | "
                    f"{layout.recompute} | {where} | {plan.binding.need / 2**30:.1f} | {plan.margin / 2**30:.1f} | "
                    f"{plan.binding.name} |")
    rows.append(f"{len(plans)} layouts fit; best first by the cost model of megatron_rl/plan/search.py")
    return "\n".join(rows)
