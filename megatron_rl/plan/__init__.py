"""The RL memory planner: what one RL step needs per GPU and per node, before anything starts.

Pure arithmetic over the config sections (no torch, no Megatron): parameter counts
(:mod:`.params`), training state per parameter (:mod:`.state`, from the one home of those
facts, :mod:`megatron_rl.parallel.optimizer_memory`), activations
(:mod:`.activations`), the rollout engines (:mod:`.generation`), the phases of a step
(:mod:`.phases`), the report and verdict (:mod:`.report`) and the layout search
(:mod:`.search`). The command line is :mod:`megatron_rl.plan.cli` (``megatron-rl-plan``);
the launcher calls :func:`make_plan` before any worker starts. Does not own the config
sections it reads, nor building anything it plans.
"""

from megatron_rl.plan.machine import Layout, Machine, parse_bytes
from megatron_rl.plan.report import Plan, format_plan, make_plan

__all__ = ["Layout", "Machine", "Plan", "format_plan", "make_plan", "parse_bytes"]
