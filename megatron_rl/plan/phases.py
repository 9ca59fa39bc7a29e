"""The memory of each phase of one RL step, per GPU, and the host memory per node.

A step's phases, in order: generation (the rollout engine), the old-policy log-prob pass
(and the reference pass), the policy update, the weight push to SGLang. Each phase is a list
of :class:`Term`: the *resident* ones hold for the whole phase; the others exist at one
*moment* (the loss: logits and log-prob chunks; the backward of a layer: a recomputed block
and the expert dispatch buffers) and add up with the resident ones only at that moment, so a
phase's peak is its resident sum plus its costliest moment. Pipeline stages differ (the
first holds the embedding and the most micro-batches in flight, the last the output layer and
the logits), so the trainer's phases are planned for every stage.

Where the rollout engine runs (:class:`~megatron_rl.plan.machine.Layout`):

- disaggregated: SGLang servers on their own GPUs; the trainer's state stays on its GPUs;
- colocated with offload (``rollout.placement: colocated``, the issue-28 design): while
  SGLang generates, the trainer's weights, main weights and optimizer state wait in pinned
  host memory and its gradient buffers are freed; while the trainer works, SGLang has released
  its weights, KV cache and CUDA graphs (``/release_memory_occupation``). The push needs the
  trainer's weights and SGLang's resumed weights at once, so the trainer sends its weights
  before it offloads them and SGLang resumes its KV cache after;
- colocated without offload (``megatron-rl-launch --sglang``): both stay resident.

Tokens: a micro-batch row holds ``train.micro_batch_tokens`` (else ``micro_batch_sequences``
times the longest sample); micro-batch counts assume every sample at the longest length
(an upper bound). Pure arithmetic over the config.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from megatron_rl.config import RunConfig, longest_sequence
from megatron_rl.plan import activations as act
from megatron_rl.plan import generation as gen
from megatron_rl.plan.machine import GIB, Layout, Machine
from megatron_rl.plan.params import rank_params, stage_layers
from megatron_rl.plan.state import optimizer_bytes_per_param, uses_reference
from megatron_rl.plan.teachers import (
    describe,
    teacher_host_items,
    teacher_weight_bytes,
    teacher_weight_items,
    trainer_teachers,
)
from megatron_rl.rollout.sglang.config import SGLangConfig
from megatron_rl.sections import ModelConfig, ParallelConfig
from moe_routing.types import compact_id_dtype

SGLANG_RELEASED = 1 * GIB
"""A colocated SGLang server's process while its memory is released: CUDA context and NCCL buffers."""
LOGPROB_CHUNK_TOKENS = 1024
"""``chunk_tokens`` of the trainer's log-prob passes and updates (``parallel.logprobs``, ``parallel.train_step``)."""
RECORD_VALUE_BYTES = 8
"""A routing record's bytes per (token, MoE layer, k) besides the expert id: fp32 probability and
fp32 gate (``moe_routing.types``)."""


def record_bytes_per_entry(num_experts: int) -> int:
    """A routing record's bytes per (token, MoE layer, k): the expert id in the record's own
    compact dtype (``moe_routing.types.compact_id_dtype``) and :data:`RECORD_VALUE_BYTES`."""
    return compact_id_dtype(num_experts).itemsize + RECORD_VALUE_BYTES


@dataclass(frozen=True)
class Term:
    """One contribution to a phase's memory."""

    name: str
    """What it is."""
    bytes: int
    """Its size on one GPU (host terms: on one node)."""
    moment: str = ""
    """Empty: held for the whole phase; else the moment it exists at (terms of one moment add up)."""
    minimum: int | None = None
    """None: a need. Else the term takes what the GPU has left (SGLang's KV pool) and needs
    only this much (one sample at the longest length) to work."""


@dataclass(frozen=True)
class Phase:
    """One phase of the step on one kind of GPU."""

    name: str
    """E.g. ``train``, ``generate``."""
    device: str
    """Which GPU: ``trainer GPU, stage 0``, ``SGLang GPU``."""
    terms: tuple[Term, ...]
    """Its contributions."""

    @property
    def peak(self) -> int:
        """Resident terms plus the costliest moment."""
        resident = sum(t.bytes for t in self.terms if not t.moment)
        moments: dict[str, int] = {}
        for t in self.terms:
            if t.moment:
                moments[t.moment] = moments.get(t.moment, 0) + t.bytes
        return resident + max(moments.values(), default=0)

    @property
    def need(self) -> int:
        """The peak with every term that takes what is left at its minimum: what must fit."""
        return self.peak - sum(t.bytes - t.minimum for t in self.terms if t.minimum is not None)

    @property
    def biggest(self) -> Term:
        """The largest single term."""
        return max(self.terms, key=lambda t: t.bytes)


@dataclass(frozen=True)
class StepShape:
    """Token and sample counts of one step on one data-parallel rank."""

    micro_batch_tokens: int
    """T: tokens of one micro-batch row."""
    response_tokens: int
    """Response tokens of one row, at the run's response share of the longest sample."""
    step_tokens: int
    """Tokens of all of this rank's samples of a step (every sample at the longest length)."""
    micro_batches: int
    """Micro-batches of one mini-batch."""
    samples: int
    """Samples of a step on this data-parallel rank."""


def step_shape(cfg: RunConfig, layout: Layout) -> StepShape:
    """The per-rank token counts the phases read."""
    longest, t = longest_sequence(cfg), cfg.train
    tokens = t.micro_batch_tokens or t.micro_batch_sequences * longest
    samples = -(-cfg.rollout.prompts_per_step * cfg.rollout.group_size // layout.data_parallel)
    step_tokens = samples * longest
    response = min(tokens, math.ceil(tokens * cfg.rollout.max_new_tokens / longest))
    return StepShape(micro_batch_tokens=tokens, response_tokens=response, step_tokens=step_tokens,
                     micro_batches=max(1, -(-step_tokens // t.mini_batches // tokens)), samples=samples)


def rank_shape(model: ModelConfig, parallel: ParallelConfig, machine: Machine, tokens: int) -> act.RankShape:
    """The activation formulas' view of one rank of ``machine`` (a GPU's norms are fused)."""
    return act.RankShape(tokens=tokens, tp=parallel.tensor_model_parallel_size,
                         sequence_parallel=parallel.sequence_parallel_enabled(),
                         etp=parallel.expert_tensor_parallel_size, dtype_bytes=act.DTYPE_BYTES[model.params_dtype],
                         fused_norm=not machine.cpu)


def state_terms(cfg: RunConfig, layout: Layout, stage: int, distributed: bool) -> list[Term]:
    """Weights, gradient buffer, fp32 main weights, optimizer state (and the reference's weights)."""
    counts = rank_params(cfg.model, layout.parallel, stage)
    dense = optimizer_bytes_per_param(cfg.optim, cfg.model.params_dtype, distributed, layout.data_parallel)
    expert = optimizer_bytes_per_param(cfg.optim, cfg.model.params_dtype, distributed, layout.expert_data_parallel)

    def total(field: str) -> int:
        return int(counts.dense * getattr(dense, field) + counts.expert * getattr(expert, field))

    terms = [Term("weights", total("weights")), Term("gradient buffer (fp32)", total("grads")),
             Term("fp32 main weights", total("main_weights")), Term("optimizer state", total("optimizer_state"))]
    if uses_reference(cfg):
        terms.append(Term("reference model weights", total("weights")))
    return terms + [Term(name, size) for name, size in teacher_weight_items(cfg, layout)]


def _moe_layers(cfg: RunConfig, layers: range) -> int:
    return sum(1 for i in layers if i >= cfg.model.num_dense_layers)


def _runtime(machine: Machine) -> list[Term]:
    return [Term("CUDA context, NCCL, allocator reserve", machine.runtime_reserve)] if machine.runtime_reserve else []


def train_phase(cfg: RunConfig, layout: Layout, machine: Machine, stage: int, distributed: bool) -> Phase:
    """The policy update on one rank of pipeline stage ``stage``."""
    m, pp = cfg.model, layout.parallel.pipeline_model_parallel_size
    shape = step_shape(cfg, layout)
    s = rank_shape(cfg.model, layout.parallel, machine, shape.micro_batch_tokens)
    layers = stage_layers(m, pp, stage)
    in_flight = min(pp - stage, shape.micro_batches)
    per_micro_batch = sum(act.layer_bytes(m, s, i, layout.recompute) for i in layers)
    if stage == pp - 1:
        per_micro_batch += act.head_bytes(m, s)
    terms = state_terms(cfg, layout, stage, distributed) + _runtime(machine)
    terms.append(Term(f"activations ({in_flight} micro-batch{'es' if in_flight > 1 else ''} of "
                      f"{shape.micro_batch_tokens} tokens, recompute {layout.recompute})", in_flight * per_micro_batch))
    if stage == pp - 1:
        terms += _loss_terms(cfg, s, shape)
    if layout.recompute != "none":
        terms.append(Term("recomputed block", act.recompute_transient_bytes(m, s, layers, layout.recompute),
                          moment="backward"))
    if _moe_layers(cfg, layers):
        terms.append(Term("MoE dispatch buffers", act.dispatch_bytes(m, s), moment="backward"))
    if layout.placement == "colocated" and layout.offload:
        terms.append(Term("SGLang, memory released", SGLANG_RELEASED))
    return Phase("train", f"trainer GPU, stage {stage}", tuple(terms))


def logprob_phase(cfg: RunConfig, layout: Layout, machine: Machine, stage: int, distributed: bool,
                  name: str = "log-prob pass") -> Phase:
    """A forward-only pass over the step's samples (old policy, reference; the embedded engine's decoding)."""
    m, pp = cfg.model, layout.parallel.pipeline_model_parallel_size
    shape = step_shape(cfg, layout)
    s = rank_shape(cfg.model, layout.parallel, machine, shape.micro_batch_tokens)
    layers = stage_layers(m, pp, stage)
    terms = state_terms(cfg, layout, stage, distributed) + _runtime(machine)
    if name == "log-prob pass":
        terms.append(Term("routing records (old-policy pass)", _record_bytes(cfg, s, shape.step_tokens, layers)))
    # Without grad a layer's intermediates are freed as it goes: its saved set bounds them.
    terms.append(Term("one layer's forward intermediates", max(act.layer_bytes(m, s, i) for i in layers),
                      moment="forward"))
    if _moe_layers(cfg, layers):
        terms.append(Term("MoE dispatch buffers", act.dispatch_bytes(m, s), moment="forward"))
    if stage == pp - 1:
        terms += _loss_terms(cfg, s, shape)
    if layout.placement == "colocated" and layout.offload:
        terms.append(Term("SGLang, memory released", SGLANG_RELEASED))
    return Phase(name, f"trainer GPU, stage {stage}", tuple(terms))


def _loss_terms(cfg: RunConfig, s: act.RankShape, shape: StepShape) -> list[Term]:
    logits = act.logits_bytes(cfg.model, s, shape.response_tokens)
    chunks = act.logprob_chunk_bytes(cfg.model, s, LOGPROB_CHUNK_TOKENS)
    return [Term("logits and the response rows' copy (or their gradients)", logits, moment="loss"),
            Term("vocab-parallel log-prob chunks", chunks, moment="loss")]


def _record_bytes(cfg: RunConfig, s: act.RankShape, tokens: int, layers: range) -> int:
    """Routing records a pass holds on the device until it ends (each router call's rows; then they
    move to host memory, ``megatron_rl.parallel.routing_layout.gather_call_field``). The update's probe pass (RSPO,
    diagnostics) records only a mini-batch, so the old-policy pass bounds it."""
    per_entry = record_bytes_per_entry(cfg.model.num_experts)
    rows = tokens // s.tp if s.sequence_parallel else tokens
    return rows * _moe_layers(cfg, layers) * cfg.model.moe_router_topk * per_entry


def generate_phases(cfg: RunConfig, layout: Layout, machine: Machine, distributed: bool) -> list[Phase]:
    """Generation, and for SGLang the weight push, on the GPUs that do them."""
    engine = cfg.rollout.engine
    if engine == "megatron":
        return [logprob_phase(cfg, layout, machine, stage, distributed, name="generate (embedded engine)")
                for stage in range(layout.parallel.pipeline_model_parallel_size)]
    if engine == "hf":
        terms = state_terms(cfg, layout, 0, distributed) + _runtime(machine)
        terms += [Term("hf replica (whole model)", gen.hf_replica_bytes(cfg)),
                  Term("hf KV cache", gen.hf_kv_bytes(cfg, layout.data_parallel, layout.parallel.model_parallel_size))]
        return [Phase("generate (hf engine)", "trainer GPU, stage 0", tuple(terms))]
    return _sglang_phases(cfg, layout, machine, distributed)


def _sglang_phases(cfg: RunConfig, layout: Layout, machine: Machine, distributed: bool) -> list[Phase]:
    s: SGLangConfig = cfg.rollout.sglang
    tp = s.server_tp_size
    colocated = layout.placement == "colocated"
    servers = max(1, layout.world // tp) if colocated else s.num_servers
    fixed = [Term("SGLang weights (bf16)", gen.sglang_weights_bytes(cfg.model, tp)),
             Term("SGLang activations and CUDA graphs (its own reserve)",
                  gen.sglang_reserve_bytes(cfg.model, tp, machine.gpu_memory))]
    bucket = Term("weight-push bucket", s.weight_sync_bucket_mb << 20, moment="push")
    trainer = state_terms(cfg, layout, 0, distributed) + _runtime(machine)
    if not colocated:
        beside: list[Term] = []
    elif layout.offload:
        beside = _runtime(machine)
    else:
        # Static split: SGLang's pool is taken at start-up, beside the trainer's whole update.
        update = max((train_phase(cfg, layout, machine, stage, distributed)
                      for stage in range(layout.parallel.pipeline_model_parallel_size)), key=lambda p: p.peak)
        beside = [Term("trainer's update (its peak, resident)", update.peak)]
    # SGLang sizes its pool from what is left after its weights and its reserve; the push's
    # bucket lands in that reserve only in part, so it is kept out of the pool here.
    serving = fixed + [_kv_term(cfg, layout, machine, servers, sum(t.bytes for t in beside + fixed + [bucket]))]
    if not colocated:
        return [Phase("generate", "SGLang GPU", tuple(serving + [bucket])),
                Phase("weight push", "trainer GPU, stage 0", tuple(trainer + [bucket]))]
    if not layout.offload:
        return [Phase("generate (static split)", "shared GPU", tuple(beside + serving + [bucket]))]
    push = Phase("weight push", "shared GPU", tuple(_runtime(machine) + [trainer[0], fixed[0], bucket]))
    return [Phase("generate", "shared GPU", tuple(beside + serving)), push]


def _kv_term(cfg: RunConfig, layout: Layout, machine: Machine, servers: int, taken: int) -> Term:
    """SGLang's KV cache: the samples in flight at the longest length, or, when they do not fit,
    the pool SGLang makes of what is left (it then queues the rest; nothing fails)."""
    tp = cfg.rollout.sglang.server_tp_size
    needed = gen.sglang_kv_bytes(cfg, tp, servers, layout.data_parallel)
    per_sequence = gen.kv_bytes_per_sequence(cfg.model, tp, longest_sequence(cfg))
    left = machine.gpu_memory - taken
    if needed <= left:
        return Term("SGLang KV cache (samples in flight at the longest length)", needed)
    held = max(left, per_sequence) // per_sequence
    in_flight = -(-gen.sequences_in_flight(cfg, layout.data_parallel) // servers)
    return Term(f"SGLang KV cache pool: {held} of {in_flight} samples at the longest length, the rest queue",
                held * per_sequence, minimum=per_sequence)


def host_terms(cfg: RunConfig, layout: Layout, machine: Machine, distributed: bool) -> list[Term]:
    """Host memory of one node: offloaded trainer state or checkpoint staging, and routing records."""
    procs = min(layout.world, machine.gpus_per_node)
    pp = layout.parallel.pipeline_model_parallel_size
    state = max((state_terms(cfg, layout, stage, distributed) for stage in range(pp)),
                key=lambda terms: sum(t.bytes for t in terms))
    # Gradient buffers are recomputed, not kept; the reference model and teachers are not checkpointed.
    offloaded = sum(t.bytes for t in state if t.name != "gradient buffer (fp32)")
    saved = offloaded - sum(t.bytes for t in state if t.name == "reference model weights" or t.name.startswith("teacher "))
    shape = step_shape(cfg, layout)
    m = cfg.model
    record = shape.step_tokens * len(m.moe_layers) * m.moe_router_topk * record_bytes_per_entry(m.num_experts)
    terms = [Term(f"routing records of a step ({procs} processes)", procs * record)]
    terms += [Term(name, size) for name, size in teacher_host_items(cfg, layout, procs)]
    if cfg.train.routing_replay == "R3":
        routes = shape.step_tokens * len(m.moe_layers) * m.moe_router_topk * 4
        terms.append(Term(f"rollout routes for R3, int32 ({procs} processes)", procs * routes))
    if layout.placement == "colocated" and layout.offload:
        terms.append(Term(f"offloaded trainer state, pinned ({procs} processes)", procs * offloaded,
                          moment="generate"))
    # Megatron's torch_dist writer copies a rank's tensors to host before writing them, in sync
    # saves too (dist_checkpointing/strategies/filesystem_async.py:212-232, preload_tensors).
    terms.append(Term(f"checkpoint save staging ({procs} processes)", procs * saved, moment="checkpoint"))
    return terms


def teacher_phases(cfg: RunConfig, layout: Layout, machine: Machine, distributed: bool) -> list[Phase]:
    """One phase per trainer-run teacher and stage of its layout: its pass beside the policy's
    state (``plan.teachers``)."""
    phases = []
    policy_pp = layout.parallel.pipeline_model_parallel_size
    policy = max((state_terms(cfg, layout, s, distributed) for s in range(policy_pp)),
                 key=lambda terms: sum(t.bytes for t in terms))
    for i, t in trainer_teachers(cfg):
        mine = Layout(parallel=t.parallel, world=layout.world)
        shape = step_shape(cfg, mine)
        s = rank_shape(t.model, t.parallel, machine, shape.micro_batch_tokens)
        pp, name = t.parallel.pipeline_model_parallel_size, t.label(i)
        for stage in range(pp):
            layers = stage_layers(t.model, pp, stage)
            terms = list(policy) + _runtime(machine)
            if t.offload:
                terms.append(Term(f"teacher {name} weights (back for its pass)", teacher_weight_bytes(t, layout)))
            terms.append(Term(f"teacher {name}: one layer's forward intermediates",
                              max(act.layer_bytes(t.model, s, j) for j in layers), moment="forward"))
            if any(j >= t.model.num_dense_layers for j in layers):
                terms.append(Term(f"teacher {name}: MoE dispatch buffers", act.dispatch_bytes(t.model, s),
                                  moment="forward"))
            if stage == pp - 1:
                terms += [Term(f"teacher {name}: logits and the response rows' copy",
                               act.logits_bytes(t.model, s, shape.response_tokens), moment="loss"),
                          Term(f"teacher {name}: vocab-parallel log-prob chunks",
                               act.logprob_chunk_bytes(t.model, s, LOGPROB_CHUNK_TOKENS), moment="loss")]
            phases.append(Phase(f"teacher pass ({name}, {describe(t.parallel, mine)})",
                                f"trainer GPU, teacher stage {stage}", tuple(terms)))
    return phases
