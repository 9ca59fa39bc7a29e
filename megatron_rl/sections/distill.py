"""The ``distill`` section: the teachers of on-policy distillation, and the rules they must meet
that the config alone decides.

A teacher is an HF checkpoint of any supported family (its ``model`` is read from the
checkpoint, as the run's is), either run by the trainer in a layout of its own (``parallel``:
its TP / EP / ETP / PP over the same processes, like the KL reference but not tied to the
policy's layout) or served by SGLang (``urls``: the servers that score the student's samples;
``path`` then names its checkpoint for the tokenizer and config checks). With several
teachers each sample goes to one, chosen by a column of the prompt files
(``teacher_key``; multi-teacher distillation: one teacher per data source). How much the
distillation term weighs, and which estimator it uses, are the objective's
(``objective.distill_coef``, ``objective.distill_estimator``, ``objective.rl_coef``:
``megatron_rl.algos.distill``). Rules that need files (paths, tokenizers, the prompt
column) run in ``megatron_rl.train.prepare``; how a teacher runs is ``megatron_rl.train.teachers``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from megatron_rl.config_loading import ConfigError, require
from megatron_rl.sections.model import ModelConfig
from megatron_rl.sections.parallel import ParallelConfig, validate_layout


@dataclass(kw_only=True)
class TeacherConfig:
    """One teacher."""

    name: str | None = None
    """What the metrics and messages call it (default ``teacher<i>``)."""
    path: str | None = None
    """Its checkpoint: an HF directory (config.json + safetensors) or a Megatron checkpoint of our converter."""
    engine: Literal["trainer", "sglang"] = "trainer"
    """trainer: run by the trainer's processes in ``parallel``; sglang: scored by the servers at ``urls``."""
    urls: list[str] = field(default_factory=list)
    """SGLang servers serving this teacher (engine sglang): prompt log-probs of the student's samples."""
    sources: list[str] = field(default_factory=list)
    """Values of ``distill.teacher_key`` routed to this teacher; empty: every sample no other teacher takes."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Its layout over the run's processes (engine trainer): TP, EP, ETP, PP, SP; DP fills the rest."""
    offload: bool = False
    """Keep its weights in host memory between its passes (engine trainer)."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """Its architecture, read from ``path`` (a key set here must agree with the checkpoint)."""

    def label(self, index: int) -> str:
        """Its name, or ``teacher<index>``."""
        return self.name or f"teacher{index}"


@dataclass(kw_only=True)
class DistillConfig:
    """On-policy distillation: the teachers (``objective.distill_coef`` weighs their term)."""

    teachers: list[TeacherConfig] = field(default_factory=list)
    """The teachers; one, or one per data source (``teacher_key``)."""
    teacher_key: str | None = None
    """Prompt-file column whose value picks each sample's teacher (``TeacherConfig.sources``); needed with several."""
    topk: int = 0
    """Top-k log-probs each teacher returns per token (``objective.distill_estimator: topk``); 0: the sampled token's only."""


def teacher_prefix(index: int) -> str:
    """The dotted key of teacher ``index``."""
    return f"distill.teachers[{index}]"


def validate_distill(d: DistillConfig, world_size: int | None, *, distill_coef: float, estimator: str) -> None:
    """Rules of the section and the objective's weights that the config alone decides.

    Raises:
        ConfigError: naming the dotted key.
    """
    if distill_coef > 0:
        require(bool(d.teachers), "distill.teachers", "objective.distill_coef > 0 needs at least one teacher")
    elif d.teachers:
        raise ConfigError("objective.distill_coef: distill.teachers are configured but the distillation term "
                          "weighs 0; set objective.distill_coef > 0 or remove the teachers")
    require(d.topk >= 0, "distill.topk", "must be >= 0")
    if estimator == "topk" and distill_coef > 0:
        require(d.topk > 0, "distill.topk", "objective.distill_estimator topk needs the teachers' top-k: set distill.topk > 0")
    require(len(d.teachers) < 2 or d.teacher_key is not None, "distill.teacher_key",
            f"{len(d.teachers)} teachers need a prompt-file column that says which one scores each sample")
    defaults = [i for i, t in enumerate(d.teachers) if not t.sources]
    require(len(defaults) <= 1, f"{teacher_prefix(defaults[-1]) if defaults else 'distill'}.sources",
            "only one teacher may take every sample no other teacher takes (empty sources)")
    seen: dict[str, int] = {}
    for i, t in enumerate(d.teachers):
        _validate_teacher(t, i, world_size)
        for value in t.sources:
            require(value not in seen, f"{teacher_prefix(i)}.sources",
                    f"{value!r} is already routed to {teacher_prefix(seen.get(value, i))}")
            seen[value] = i
    names = [t.label(i) for i, t in enumerate(d.teachers)]
    duplicated = sorted({n for n in names if names.count(n) > 1})
    require(not duplicated, "distill.teachers", f"teacher names must differ: {duplicated}")


def _validate_teacher(t: TeacherConfig, index: int, world_size: int | None) -> None:
    key = teacher_prefix(index)
    require(t.path is not None, f"{key}.path", "a teacher needs its checkpoint directory (its tokenizer and config)")
    if t.engine == "sglang":
        require(bool(t.urls), f"{key}.urls", "an SGLang teacher needs the URLs of its servers")
        require(not t.offload, f"{key}.offload", "applies to a teacher the trainer runs, not an SGLang one")
        return
    require(not t.urls, f"{key}.urls", "are for engine sglang; the trainer runs this teacher")
    p = t.parallel
    require(p.context_parallel_size == 1, f"{key}.parallel.context_parallel_size",
            "a teacher runs without context parallelism (its log-probs reach the policy's CP ranks whole)")
    require(p.world_size is None, f"{key}.parallel.world_size", "is the run's (parallel.world_size)")
    require(p.use_cpu_platform is None, f"{key}.parallel.use_cpu_platform", "is the run's (parallel.use_cpu_platform)")
    validate_layout(t.model, p, world_size, prefix=f"{key}.parallel")
