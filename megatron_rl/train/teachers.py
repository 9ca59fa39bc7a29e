"""Distillation teachers: each scores the student's samples it is routed, token by token.

Owns :class:`Teachers`, built once on every rank when the run starts (collective), and its
:meth:`Teachers.score`, which each step turns the policy's samples into the teachers'
log-probs of the sampled tokens (and, with ``distill.topk``, their top-k ids and log-probs)
on the policy's token axis, in sample order, on every rank of the policy's replica: what
the objective's distillation term reads (``megatron_rl.algos.distill``). Two kinds of
teacher (``distill.teachers[i].engine``):

* ``trainer``: a frozen model of any supported family, streamed from its HF checkpoint
  (or a Megatron one of our converter) into a layout of its own over the run's processes
  (:class:`~megatron_rl.parallel.layouts.ModelLayout`; the policy's own groups when the
  layouts agree), scored with the policy's log-prob pass
  (:func:`~megatron_rl.parallel.logprobs.compute_logprobs`). Its data-parallel replicas are
  not the policy's: the samples are gathered, dealt to its replicas and the results brought
  back (:func:`~megatron_rl.parallel.layouts.redistribute`). A teacher whose vocabulary is
  longer than the student's has its extra ids masked out of its softmax (as the converter's
  vocabulary padding is; the tokens below are the same, ``train.teacher_checks``).
  ``offload``: its weights wait in host memory between its passes (``parallel.offload``);
  otherwise a colocated run moves them out with the trainer's weights while the engine
  generates (``EngineTurns.add_frozen``);
* ``sglang``: servers score the samples over HTTP (``/generate`` with ``max_new_tokens``
  0: prompt log-probs, ``rollout.sglang.scoring``); each policy replica's model-parallel
  rank 0 asks for its own samples and shares the answers with its peers.

Each sample goes to one teacher, by its prompt's ``distill.teacher_key`` column
(``train.teacher_checks.record_teachers``); a teacher with no sample this step still joins
its pass's collectives. Does not own how the log-probs enter the objective (``algos``).
"""

from __future__ import annotations

import dataclasses
import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator, Sequence

import torch

from megatron_rl.algos.distill import teacher_topk_mass_T
from megatron_rl.checkpoint.init_source import inspect_init_checkpoint
from megatron_rl.parallel.comm import broadcast_object, rank
from megatron_rl.parallel.layouts import ModelLayout, random_streams_kept, redistribute
from megatron_rl.parallel.logprobs import compute_logprobs
from megatron_rl.parallel.model import build_model
from megatron_rl.parallel.offload import StorageSet
from megatron_rl.train.init_weights import load_initial_weights
from megatron_rl.train.teacher_checks import record_teachers

if TYPE_CHECKING:
    from megatron_rl.config import RunConfig
    from megatron_rl.data.prompts import PromptRecord
    from megatron_rl.parallel.groups import ParallelGroups
    from megatron_rl.sections.distill import TeacherConfig
    from megatron_rl.train.colocate import EngineTurns


@dataclass
class TeacherScores:
    """What the teachers said about one rank's samples, on the policy's response-token axis."""

    logprobs_T: torch.Tensor
    """``[T_resp]`` fp32 each sampled token's log-prob under its sample's teacher."""
    topk_ids_TK: torch.Tensor | None = None
    """``[T_resp, K]`` int64 the teacher's K most likely ids at each response position."""
    topk_logprobs_TK: torch.Tensor | None = None
    """``[T_resp, K]`` fp32 their log-probs."""
    teacher_S: torch.Tensor | None = None
    """``[S]`` int64 the teacher of each sample."""

    def metrics(self, old_logprobs_T: torch.Tensor, mask_T: torch.Tensor) -> dict[str, torch.Tensor]:
        """This rank's ``distill/reverse_kl`` (the sampled estimate ``log pi_old - log mu`` over the
        generated tokens) and, with top-k, ``distill/teacher_topk_mass`` (the teacher's mass on its
        top-k); the caller averages them over data parallelism."""
        out = {"distill/reverse_kl": (old_logprobs_T - self.logprobs_T)[mask_T].mean()}
        if self.topk_logprobs_TK is not None:
            out["distill/teacher_topk_mass"] = teacher_topk_mass_T(self.topk_logprobs_TK)[mask_T].mean()
        return out


Scored = tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]
"""One sample's ``(logprobs [n], topk ids [n, K] or None, topk log-probs [n, K] or None)``."""


def same_layout(a, b) -> bool:
    """Whether two ``parallel`` sections lay a model out alike (CP aside: a teacher runs without it)."""
    keys = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "expert_model_parallel_size",
            "expert_tensor_parallel_size", "moe_token_dispatcher_type")
    return (all(getattr(a, k) == getattr(b, k) for k in keys)
            and a.sequence_parallel_enabled() == b.sequence_parallel_enabled() and b.context_parallel_size == 1)


class TrainerTeacher:
    """A teacher the trainer runs in its own layout (collective constructor, every rank).

    Args:
        teacher: its section.
        run: the run config (the student's vocabulary, the world size, the FP8 choice).
        policy: this rank's policy groups.
        turns: the engine's turns (a colocated run moves the weights out while generating).
    """

    def __init__(self, teacher: TeacherConfig, run: RunConfig, policy: ParallelGroups, turns: EngineTurns) -> None:
        self.teacher, self.policy = teacher, policy
        world = torch.distributed.get_world_size(policy.world)
        self.parallel = dataclasses.replace(teacher.parallel, world_size=world)
        self.layout = None if same_layout(self.parallel, run.parallel) else ModelLayout(self.parallel)
        with self.active() as groups, random_streams_kept():
            self.model = build_model(teacher.model, self.parallel)
            load_initial_weights(self.model, inspect_init_checkpoint(teacher.path), teacher.model, groups)
        self.model.requires_grad_(False)
        # The student's ids only: the teacher's extra ids are padding to it (train.teacher_checks).
        self.model.true_vocab_size = min(teacher.model.vocab_size, run.model.vocab_size)
        self.stored = None
        if teacher.offload:
            self.stored = StorageSet((p, True) for p in self.model.parameters())
            self.stored.offload()
        else:
            turns.add_frozen(self.model)

    @contextlib.contextmanager
    def active(self) -> Iterator[ParallelGroups]:
        """The teacher's layout current (its groups), the policy's after."""
        if self.layout is None:
            yield self.policy
            return
        with self.layout.active() as groups:
            yield groups

    def score(self, items: Sequence[tuple[torch.Tensor, int]], topk: int, packing: dict) -> list[Scored]:
        """Collective over the world: ``(sequence, prompt length)`` items of this policy replica, scored."""
        with self.active() as groups:
            if self.stored is not None:
                self.stored.restore()
            try:
                def work(share: list) -> list[Scored]:
                    result = compute_logprobs(self.model, groups, [s for s, _ in share], [p for _, p in share],
                                              topk=topk, **packing)
                    return _per_sample(result, len(share))

                # Also in the policy's own layout: a replica may hold none of this teacher's samples.
                return redistribute(items, self.policy, groups, work)
            finally:
                if self.stored is not None:
                    self.stored.offload()

    def close(self) -> None:
        """Destroy its layout's groups."""
        if self.layout is not None:
            self.layout.close()


def _per_sample(result, count: int) -> list[Scored]:
    cu = result.cu_seqlens_S1
    out = []
    for i in range(count):
        rows = slice(int(cu[i]), int(cu[i + 1]))
        top = (None, None) if result.topk_ids_TK is None else (result.topk_ids_TK[rows], result.topk_logprobs_TK[rows])
        out.append((result.logprobs_T[rows].clone(), *top))
    return out


class SGLangTeacher:
    """A teacher served by SGLang; each policy replica's model-parallel rank 0 asks."""

    def __init__(self, teacher: TeacherConfig, run: RunConfig, policy: ParallelGroups) -> None:
        from megatron_rl.rollout.sglang.scoring import ScoringClient

        self.teacher, self.policy = teacher, policy
        self.client = ScoringClient(teacher.urls)

    def score(self, items: Sequence[tuple[torch.Tensor, int]], topk: int, packing: dict) -> list[Scored]:
        """Collective over the policy's replica: this replica's items, scored by the servers."""
        answers = None
        if rank(self.policy.mp) == 0:
            answers = self.client.score([s.tolist() for s, _ in items], [p for _, p in items], topk)
        if torch.distributed.get_world_size(self.policy.mp) > 1:
            answers = broadcast_object(answers, 0, self.policy.mp)
        return answers

    def close(self) -> None:
        pass


class Teachers:
    """The run's teachers (collective constructor: every rank builds every teacher together)."""

    def __init__(self, cfg: RunConfig, groups: ParallelGroups, turns: EngineTurns) -> None:
        self.cfg, self.groups = cfg, groups
        self.teachers = [SGLangTeacher(t, cfg, groups) if t.engine == "sglang" else TrainerTeacher(t, cfg, groups, turns)
                         for t in cfg.distill.teachers]

    def score(self, records: Sequence[PromptRecord], sequences: Sequence[torch.Tensor],
              prompt_lengths: Sequence[int], packing: dict) -> TeacherScores:
        """Collective over the world: each sample scored by the teacher its prompt routes it to."""
        owner = record_teachers(self.cfg.distill, records)
        k = self.cfg.distill.topk
        scored: list[Scored | None] = [None] * len(sequences)
        for index, teacher in enumerate(self.teachers):
            mine = [j for j, o in enumerate(owner) if o == index]
            got = teacher.score([(sequences[j], prompt_lengths[j]) for j in mine], k, packing)
            for j, value in zip(mine, got):
                scored[j] = value
        return TeacherScores(
            logprobs_T=torch.cat([s[0] for s in scored]).float(),
            topk_ids_TK=torch.cat([s[1] for s in scored]).long() if k else None,
            topk_logprobs_TK=torch.cat([s[2] for s in scored]).float() if k else None,
            teacher_S=torch.tensor(owner, dtype=torch.int64),
        )

    def close(self) -> None:
        """Destroy the teachers' layouts."""
        for teacher in self.teachers:
            teacher.close()

