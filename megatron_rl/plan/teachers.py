"""What distillation's teachers cost a trainer GPU and a node's host memory (``megatron_rl.train.teachers``).

A teacher the trainer runs (``distill.teachers[i].engine: trainer``) holds its weights on every
rank of its own layout (its TP / EP / ETP / PP over the run's processes; a rank's share is that
of the teacher's costliest pipeline stage, since which stage a rank holds there does not follow
its policy stage): resident beside the policy's state in every phase of the trainer
(:func:`teacher_weight_items`), unless the teacher is offloaded between its passes
(``offload``: then they wait in host memory, :func:`teacher_host_items`). A colocated run with
offload moves the resident ones out with the trainer's weights while the engine generates
(``plan.phases.host_terms`` counts them in the offloaded state). Each teacher's pass is a phase
of its own (``plan.phases.teacher_phases``): the policy's state, every resident teacher, this teacher's
weights (also when offloaded: they are back for the pass), and its forward: one layer's
intermediates, the MoE dispatch buffers and, on its last stage, its logits and log-prob
chunks at its own vocabulary, for micro-batches of ``train.micro_batch_tokens`` in its layout.
An SGLang teacher costs the trainer nothing (its servers are its own). Pure arithmetic; this
module gives the sizes, ``plan.phases`` makes them terms.
"""

from __future__ import annotations

from megatron_rl.config import RunConfig
from megatron_rl.plan import activations as act
from megatron_rl.plan.machine import Layout
from megatron_rl.plan.params import rank_params


def trainer_teachers(cfg: RunConfig) -> list[tuple[int, object]]:
    """``(index, section)`` of every teacher the trainer runs."""
    return [(i, t) for i, t in enumerate(cfg.distill.teachers) if t.engine == "trainer"]


def teacher_weight_bytes(teacher, layout: Layout) -> int:
    """A rank's share of the teacher's weights (its costliest stage), in the teacher's dtype."""
    pp = teacher.parallel.pipeline_model_parallel_size
    width = act.DTYPE_BYTES[teacher.model.params_dtype]
    return max(rank_params(teacher.model, teacher.parallel, s).total * width for s in range(pp))


def teacher_weight_items(cfg: RunConfig, layout: Layout) -> list[tuple[str, int]]:
    """``(name, bytes)`` per trainer-run teacher whose weights stay on the device (not offloaded)."""
    return [(f"teacher {t.label(i)} weights", teacher_weight_bytes(t, layout))
            for i, t in trainer_teachers(cfg) if not t.offload]


def teacher_host_items(cfg: RunConfig, layout: Layout, procs: int) -> list[tuple[str, int]]:
    """``(name, bytes)`` of one node's host memory for the teachers offloaded between their passes."""
    return [(f"teacher {t.label(i)} weights, offloaded between passes ({procs} processes)",
             procs * teacher_weight_bytes(t, layout)) for i, t in trainer_teachers(cfg) if t.offload]


def describe(parallel, layout: Layout) -> str:
    """``TP2 SP EP1 ETP1 PP1 DP1``: a teacher's layout over the run's processes."""
    p = parallel
    sp = " SP" if p.sequence_parallel_enabled() else ""
    return (f"TP{p.tensor_model_parallel_size}{sp} EP{p.expert_model_parallel_size} ETP{p.expert_tensor_parallel_size} "
            f"PP{p.pipeline_model_parallel_size} DP{layout.data_parallel}")
