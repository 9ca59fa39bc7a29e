"""What distillation's teachers cost a trainer GPU and a node's host memory (``megatron_rl.train.teachers``).

A teacher the trainer runs (``distill.teachers[i].engine: trainer``) holds its weights on every
rank of its own layout (its TP / EP / ETP / PP over the run's processes; a rank's share is that
of the teacher's costliest pipeline stage, since which stage a rank holds there does not follow
its policy stage): resident beside the policy's state in every phase of the trainer
(:func:`teacher_weight_terms`), unless the teacher is offloaded between its passes
(``offload``: then they wait in host memory, :func:`teacher_host_terms`). A colocated run with
offload moves the resident ones out with the trainer's weights while the engine generates
(``plan.phases.host_terms`` counts them in the offloaded state). Each teacher's pass is a phase
of its own (:func:`teacher_phases`): the policy's state, every resident teacher, this teacher's
weights (also when offloaded: they are back for the pass), and its forward: one layer's
intermediates, the MoE dispatch buffers and, on its last stage, its logits and log-prob
chunks at its own vocabulary, for micro-batches of ``train.micro_batch_tokens`` in its layout.
An SGLang teacher costs the trainer nothing (its servers are its own). Pure arithmetic.
"""

from __future__ import annotations

from megatron_rl.config import RunConfig
from megatron_rl.plan import activations as act
from megatron_rl.plan.machine import Layout, Machine
from megatron_rl.plan.params import rank_params, stage_layers

LOSS_CHUNK_TOKENS = 1024
"""``chunk_tokens`` of the teachers' log-prob passes (``parallel.logprobs``)."""


def _trainer_teachers(cfg: RunConfig) -> list[tuple[int, object]]:
    return [(i, t) for i, t in enumerate(cfg.distill.teachers) if t.engine == "trainer"]


def teacher_layout(teacher, layout: Layout) -> Layout:
    """The teacher's layout over the run's processes."""
    return Layout(parallel=teacher.parallel, world=layout.world)


def teacher_weight_bytes(teacher, layout: Layout) -> int:
    """A rank's share of the teacher's weights (its costliest stage), in the teacher's dtype."""
    pp = teacher.parallel.pipeline_model_parallel_size
    width = act.DTYPE_BYTES[teacher.model.params_dtype]
    return max(rank_params(teacher.model, teacher.parallel, s).total * width for s in range(pp))


def teacher_weight_terms(cfg: RunConfig, layout: Layout, resident_only: bool = True) -> list:
    """``Term`` per trainer-run teacher whose weights stay on the device (all of them without ``resident_only``)."""
    from megatron_rl.plan.phases import Term

    return [Term(f"teacher {t.label(i)} weights", teacher_weight_bytes(t, layout))
            for i, t in _trainer_teachers(cfg) if not (resident_only and t.offload)]


def teacher_host_terms(cfg: RunConfig, layout: Layout, procs: int) -> list:
    """Host memory of one node for the teachers offloaded between their passes."""
    from megatron_rl.plan.phases import Term

    return [Term(f"teacher {t.label(i)} weights, offloaded between passes ({procs} processes)",
                 procs * teacher_weight_bytes(t, layout)) for i, t in _trainer_teachers(cfg) if t.offload]


def teacher_phases(cfg: RunConfig, layout: Layout, machine: Machine, distributed: bool) -> list:
    """One phase per trainer-run teacher and stage of its layout: its pass beside the policy's state."""
    from megatron_rl.plan.phases import Phase, Term, _runtime, state_terms, step_shape

    phases = []
    policy_pp = layout.parallel.pipeline_model_parallel_size
    policy = max((state_terms(cfg, layout, s, distributed) for s in range(policy_pp)),
                 key=lambda terms: sum(t.bytes for t in terms))
    for i, t in _trainer_teachers(cfg):
        mine = teacher_layout(t, layout)
        shape = step_shape(cfg, mine)
        s = act.RankShape(tokens=shape.micro_batch_tokens, tp=t.parallel.tensor_model_parallel_size,
                          sequence_parallel=t.parallel.sequence_parallel_enabled(),
                          etp=t.parallel.expert_tensor_parallel_size, dtype_bytes=act.DTYPE_BYTES[t.model.params_dtype])
        pp = t.parallel.pipeline_model_parallel_size
        for stage in range(pp):
            layers = stage_layers(t.model, pp, stage)
            terms = list(policy) + _runtime(machine)
            if t.offload:
                terms.append(Term(f"teacher {t.label(i)} weights (back for its pass)", teacher_weight_bytes(t, layout)))
            terms.append(Term(f"teacher {t.label(i)}: one layer's forward intermediates",
                              max(act.layer_bytes(t.model, s, j) for j in layers), moment="forward"))
            if any(j >= t.model.num_dense_layers for j in layers):
                terms.append(Term(f"teacher {t.label(i)}: MoE dispatch buffers", act.dispatch_bytes(t.model, s),
                                  moment="forward"))
            if stage == pp - 1:
                terms += [Term(f"teacher {t.label(i)}: logits and the response rows' copy",
                               act.logits_bytes(t.model, s, shape.response_tokens), moment="loss"),
                          Term(f"teacher {t.label(i)}: vocab-parallel log-prob chunks",
                               act.logprob_chunk_bytes(t.model, s, LOSS_CHUNK_TOKENS), moment="loss")]
            name = f"teacher pass ({t.label(i)}, {_describe(t.parallel, mine)})"
            phases.append(Phase(name, f"trainer GPU, teacher stage {stage}", tuple(terms)))
    return phases


def _describe(parallel, layout: Layout) -> str:
    p = parallel
    sp = " SP" if p.sequence_parallel_enabled() else ""
    return (f"TP{p.tensor_model_parallel_size}{sp} EP{p.expert_model_parallel_size} ETP{p.expert_tensor_parallel_size} "
            f"PP{p.pipeline_model_parallel_size} DP{layout.data_parallel}")
