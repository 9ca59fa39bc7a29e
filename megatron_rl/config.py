"""The run's configuration, read one way: one :class:`RunConfig` composed of every section,
YAML presets, dotted overrides, the model section of the starting checkpoint, and the rules
that span sections.

Each section is a kw_only dataclass with one-line attribute docstrings, living with its
owner: the shared ones and the loop's in :mod:`megatron_rl.sections` (model, parallel, optim,
train, logging), the others next to their code (``data.config``, ``rewards.config``,
``rollout.config``, ``rollout.sglang.config``, ``rollout.envs.config``, ``fp8``,
``algos.section``). All of those are leaves. A YAML preset is a partial :class:`RunConfig`;
``key.sub=value`` overrides apply on top. :func:`load_config` is the only reader every
program and test goes through: with ``init_checkpoint`` the ``model`` section comes from the
checkpoint (``checkpoint.init_source``, the one function that turns a checkpoint into model
settings; a contradicting key is an error naming both values), so this module sits above the
checkpoint readers and below the loop. :func:`validate` runs every section's rules and the
cross-section ones before any model is built: an unknown key, a value of the wrong type or a
broken rule raises :class:`ConfigError` naming the dotted key. Rules that need files besides
the checkpoint's headers (the tokenizer, the prompt files, the reward, a run directory to
resume) run in ``megatron_rl.train.prepare``.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import yaml

from megatron_rl.algos.config import ObjectiveConfig, ObjectiveConfigError
from megatron_rl.algos.section import ObjectiveSection
from megatron_rl.config_loading import (
    ConfigError,
    from_dict,
    merge,
    parse_overrides,
    require,
    to_dict,
)
from megatron_rl.data.config import DataConfig, TokenizerConfig
from megatron_rl.fp8 import FP8Config, check_fp8
from megatron_rl.rewards.config import RewardConfig
from megatron_rl.rollout.config import RolloutConfig, check_rollout_section
from megatron_rl.rollout.envs.config import check_env_section
from megatron_rl.sections import (
    ModelConfig,
    OptimConfig,
    ParallelConfig,
    thd_row_multiple,
    thd_slot_multiple,
    validate_layout,
    validate_model,
    validate_optim,
)
from megatron_rl.sections.distill import DistillConfig, validate_distill
from megatron_rl.sections.logging import (
    LoggingConfig,
    ProfileConfig,
    check_logging_config,
)
from megatron_rl.sections.train import EvalConfig, TrainerConfig, check_eval_config

__all__ = ["ConfigError", "RunConfig", "from_dict", "parse_overrides", "to_dict", "load_config", "validate"]


GROUP_RELATIVE_ADVANTAGES = ("grpo", "dr_grpo", "rloo", "reinforce_pp_baseline")


@dataclass(kw_only=True)
class RunConfig:
    """A whole run."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """Model architecture."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Parallel layout."""
    fp8: FP8Config = field(default_factory=FP8Config)
    """FP8 training through Transformer Engine (megatron_rl.fp8)."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Optimizer."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Rollouts."""
    train: TrainerConfig = field(default_factory=TrainerConfig)
    """The RL loop."""
    init_checkpoint: str | None = None
    """Where the policy starts: an HF checkpoint directory (config.json + safetensors) or a
    Megatron checkpoint written by megatron-rl-convert-hf-to-megatron; the ``model`` section
    is then read from it. None: random weights. A run's own latest checkpoint wins (resume)."""
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    """Tokenizer and chat template (default: the starting checkpoint's)."""
    data: DataConfig = field(default_factory=DataConfig)
    """Train and eval prompts: JSONL/Parquet files, or a built-in task."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """How responses are scored."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """Held-out evaluation."""
    objective: ObjectiveSection = field(default_factory=ObjectiveSection)
    """Objective: ``preset`` plus typed ObjectiveConfig overrides (megatron_rl.algos.section)."""
    distill: DistillConfig = field(default_factory=DistillConfig)
    """On-policy distillation's teachers (megatron_rl.sections.distill; weighed by objective.distill_coef)."""
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """Weights & Biases and MLflow (megatron_rl.train.sinks)."""
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    """The torch profiler on chosen steps (megatron_rl.train.phases)."""
    seed: int = 1234
    """Seed for weights, data order and sampling."""


# --------------------------------------------------------------------------- validation


def resolve_objective(cfg: RunConfig) -> ObjectiveConfig:
    """The run's ``ObjectiveConfig`` (preset + overrides); errors name ``objective.<key>``."""
    try:
        return cfg.objective.resolve(prefix="objective")
    except ObjectiveConfigError as err:
        raise ConfigError(str(err)) from None


def validate_run(cfg: RunConfig, world_size: int | None = None) -> None:
    """Rules across sections of an RL run (cheap: no file is read, no model is built)."""
    objective = resolve_objective(cfg)
    validate_distill(cfg.distill, cfg.parallel.world_size or world_size, distill_coef=objective.distill_coef,
                     estimator=objective.distill_estimator)
    require(not cfg.distill.teachers or cfg.data.source == "files", "distill.teachers",
            "a teacher must share the run's tokenizer: distillation needs prompt files (data.source=files)")
    key = cfg.distill.teacher_key
    require(key is None or key in cfg.data.metadata_keys, "distill.teacher_key",
            f"{key!r} is not a prompt-file column the trainer reads (data.metadata_keys: {cfg.data.metadata_keys}); "
            "add it to data.metadata_keys")
    for key, rule in [*check_eval_config(cfg.eval), *check_logging_config(cfg.logging, cfg.profile)]:
        raise ConfigError(f"{key}: {rule}")
    r, t = cfg.rollout, cfg.train
    require(
        r.max_new_tokens < cfg.model.max_position_embeddings,
        "rollout.max_new_tokens",
        f"{r.max_new_tokens} leaves no room for a prompt within model.max_position_embeddings "
        f"({cfg.model.max_position_embeddings})",
    )
    require(cfg.data.source != "task" or cfg.init_checkpoint is None, "data.source",
             "the built-in tasks use a character tokenizer, which no pretrained checkpoint shares; "
             "use prompt files (data.source=files) with init_checkpoint")
    require(t.save_hf_every >= 0, "train.save_hf_every", "must be >= 0")
    require(
        not (objective.advantage in GROUP_RELATIVE_ADVANTAGES and r.group_size < 2),
        "rollout.group_size",
        f"the {objective.advantage!r} advantage is group-relative and needs a group size >= 2",
    )
    require(
        not (t.routing_replay in ("R3", "R3w") and not r.return_routed_experts),
        "train.routing_replay",
        f"{t.routing_replay} replays the rollout engine's routes, but rollout.return_routed_experts is false",
    )
    check_temperature_and_mismatch(cfg)
    check_rollout_section(r)
    check_env_section(r.env, cfg.model.max_position_embeddings, r.max_new_tokens)
    if r.env.name is not None:
        require(cfg.data.source == "files" and cfg.tokenizer.chat_template, "rollout.env.name",
                "multi-turn rollouts render the environment's messages with the tokenizer's chat template: "
                "they need prompt files (data.source=files) and tokenizer.chat_template=true")
    require(t.steps >= 0, "train.steps", "must be >= 0")
    require(t.mini_batches >= 1, "train.mini_batches", "must be >= 1")
    require(t.epochs >= 1, "train.epochs", "must be >= 1")
    require(t.eval_every >= 1, "train.eval_every", "must be >= 1")
    require(t.save_every >= 1, "train.save_every", "must be >= 1")
    require(t.micro_batch_sequences >= 1, "train.micro_batch_sequences", "must be >= 1")
    if t.micro_batch_tokens is not None:
        check_micro_batch_tokens(cfg)
    require(cfg.optim.lr > 0, "optim.lr", "must be > 0")


def check_temperature_and_mismatch(cfg: RunConfig) -> None:
    """The sampled policy needs a temperature; R3w and the breakdown need the engine's gates."""
    r, t = cfg.rollout, cfg.train
    require(not (t.policy_temperature == "sampling" and r.temperature == 0), "rollout.temperature",
            "0 (greedy) draws from no distribution, so train.policy_temperature=sampling has no policy to train; "
            "sample at a temperature > 0 (or train the T = 1 policy: train.policy_temperature=one)")
    # The distillation term compares untempered distributions (docs/distillation.md): its student
    # side (the old pass, the top-k estimator's log-probs) must be the T = 1 policy's.
    require(not (cfg.distill.teachers and t.policy_temperature == "sampling" and r.temperature not in (0, 1)),
            "train.policy_temperature", f"distillation compares the untempered distributions, and the rollouts sample "
            f"at rollout.temperature={r.temperature}: set train.policy_temperature=one (or sample at 1)")
    gates = t.routing_replay == "R3w" or t.mismatch.breakdown
    what = "train.routing_replay" if t.routing_replay == "R3w" else "train.mismatch.breakdown"
    require(not (gates and not r.return_routed_experts), what,
            "needs the engine's routes (rollout.return_routed_experts=true)")
    require(not (t.routing_replay == "R3w" and r.engine == "sglang"), "train.routing_replay",
            "R3w replays the engine's gate weights, and SGLang 0.5.23 returns expert ids only; use R3, or "
            "rollout.engine=hf|megatron")
    require(not (gates and r.env.name is not None), what,
            "multi-turn trajectories do not carry the engine's gate weights; use it with single-turn rollouts")
    require(t.mismatch.worst_tokens >= 0, "train.mismatch.worst_tokens", "must be >= 0")


def longest_sequence(cfg: RunConfig) -> int:
    """The most prompt + response tokens one sample can have under this config (a multi-turn
    trajectory: up to ``rollout.env.max_total_tokens``)."""
    room = cfg.model.max_position_embeddings
    if cfg.rollout.env.name is not None:
        return cfg.rollout.env.max_total_tokens or room
    if cfg.data.max_prompt_tokens is None:
        return room
    return min(room, cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens)


def _longest_set_by(cfg: RunConfig, longest: int) -> str:
    """The keys :func:`longest_sequence` took ``longest`` from."""
    if cfg.rollout.env.name is not None and cfg.rollout.env.max_total_tokens:
        return "rollout.env.max_total_tokens"
    if cfg.data.max_prompt_tokens is None or longest == cfg.model.max_position_embeddings:
        return "model.max_position_embeddings"
    return "data.max_prompt_tokens + rollout.max_new_tokens"


def check_micro_batch_tokens(cfg: RunConfig) -> None:
    """A token budget must hold the longest possible sample and split evenly over TP under SP.

    Under context parallelism the budget is per CP rank: a row holds ``budget x CP`` tokens,
    each sequence in a slot padded to 2 x CP, and each CP rank's share splits over TP under SP.
    """
    budget, p = cfg.train.micro_batch_tokens, cfg.parallel
    cp, tp = p.context_parallel_size, p.tensor_model_parallel_size
    longest = longest_sequence(cfg)
    slot = -(-longest // thd_slot_multiple(cp)) * thd_slot_multiple(cp)
    per_rank = f" per CP rank x parallel.context_parallel_size ({cp})" if cp > 1 else ""
    require(budget * cp >= slot, "train.micro_batch_tokens",
             f"{budget}{per_rank} is smaller than the longest possible sample, {longest} tokens"
             f"{f' ({slot} in its CP slot)' if cp > 1 else ''} ({_longest_set_by(cfg, longest)})")
    multiple = thd_row_multiple(tp if p.sequence_parallel_enabled() else 1, cp) // cp
    if cp == 1:
        rule = (f"parallel.tensor_model_parallel_size ({tp}): sequence parallelism splits every micro-batch row "
                "over the TP ranks")
    else:
        rule = (f"{multiple}: context parallelism cuts every sequence into 2 x parallel.context_parallel_size "
                f"({cp}) chunks and, under sequence parallelism, each CP rank's share over "
                f"parallel.tensor_model_parallel_size ({tp}) ranks")
    require(budget % multiple == 0, "train.micro_batch_tokens", f"{budget}{per_rank} is not a multiple of {rule}")


def validate(cfg: RunConfig, world_size: int | None = None, *, this_machine: bool = True) -> RunConfig:
    """Validate a whole run config; returns it for chaining (``this_machine``: :func:`load_config`)."""
    validate_model(cfg.model)
    validate_layout(cfg.model, cfg.parallel, world_size)
    validate_optim(cfg.optim)
    check_fp8(cfg.fp8, this_machine=this_machine)
    validate_run(cfg, world_size)
    world = cfg.parallel.world_size or world_size
    if world is not None:
        validate_batch_split(cfg, cfg.parallel.data_parallel_size(world))
    return cfg


def validate_batch_split(cfg: RunConfig, dp_size: int) -> None:
    """Prompts (and warm-start examples) must split evenly over the data-parallel ranks."""
    r, t = cfg.rollout, cfg.train
    require(r.prompts_per_step % dp_size == 0 and (r.prompts_per_step // dp_size) % t.mini_batches == 0,
             "rollout.prompts_per_step",
             f"{r.prompts_per_step} must split evenly over {dp_size} data-parallel ranks and then into "
             f"train.mini_batches ({t.mini_batches})")
    require(t.sft_steps == 0 or t.sft_batch_size % dp_size == 0, "train.sft_batch_size",
             f"{t.sft_batch_size} must split evenly over {dp_size} data-parallel ranks")


PATH_KEYS = (("init_checkpoint",), ("tokenizer", "path"), ("data", "train_files"), ("data", "eval_files"),
             ("distill", "teachers", "*", "path"))
"""Input paths; a relative one in a YAML preset is relative to that file (on the command line: to the cwd);
``*`` is every item of a list."""


def map_paths(data: dict[str, Any], change: Callable[[Any], Any]) -> dict[str, Any]:
    """``data`` (a config as nested dicts) with ``change`` applied to the value of every
    :data:`PATH_KEYS` key it has (a string, a list of them, or None), in place."""

    def visit(node: Any, keys: tuple[str, ...]) -> None:
        if keys[0] == "*":
            for item in node if isinstance(node, list) else []:
                visit(item, keys[1:])
        elif isinstance(node, dict) and keys[0] in node:
            if len(keys) == 1:
                node[keys[0]] = change(node[keys[0]])
            else:
                visit(node[keys[0]], keys[1:])

    for keys in PATH_KEYS:
        visit(data, keys)
    return data


def _anchor_paths(loaded: dict[str, Any], directory: Path) -> dict[str, Any]:
    """``loaded`` with the relative input paths of :data:`PATH_KEYS` made relative to ``directory``."""

    def anchor(value: Any) -> Any:
        if isinstance(value, str) and value and not Path(value).is_absolute():
            return os.path.normpath(directory / value)
        if isinstance(value, list):
            return [anchor(v) for v in value]
        return value

    return map_paths(loaded, anchor)


def preset_chain(path: str | Path, _seen: tuple[Path, ...] = ()) -> list[tuple[Path, dict[str, Any]]]:
    """The files of a YAML preset's ``base:`` chain, the farthest base first, each with the keys
    it sets itself (relative input paths, :data:`PATH_KEYS`, taken relative to that file).

    ``base: other.yaml`` (relative to the file) makes a preset a small diff of another,
    e.g. one file per objective preset on top of the demo config.
    """
    path = Path(path).resolve()
    if path in _seen:
        raise ConfigError(f"{path}: base chain loops back to itself")
    if not path.is_file():
        raise ConfigError(f"--config: {path} is not a file")
    try:
        loaded = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML: {' '.join(str(err).split())}") from None
    if not isinstance(loaded, dict):
        raise ConfigError(f"{path}: top level must be a mapping")
    loaded = _anchor_paths(loaded, path.parent)
    base = loaded.pop("base", None)
    if base is None:
        return [(path, loaded)]
    if not isinstance(base, str):
        raise ConfigError(f"{path}: base: expected a file name, got {base!r}")
    return [*preset_chain(path.parent / base, (*_seen, path)), (path, loaded)]


def read_preset(path: str | Path) -> dict[str, Any]:
    """A YAML preset as a nested dict, its ``base:`` chain merged in first (:func:`preset_chain`)."""
    merged: dict[str, Any] = {}
    for _, loaded in preset_chain(path):
        merged = merge(merged, loaded)
    return merged


def load_config(path: str | Path | None = None, overrides: Sequence[str] = (), world_size: int | None = None,
                *, check_pushes: bool = True, this_machine: bool = True) -> RunConfig:
    """The one way a run's config is read (train, launch, smoke, plan, the stand-in, tests): a
    YAML preset, dotted overrides on top, the ``model`` section from ``init_checkpoint`` when one
    is named (:func:`megatron_rl.checkpoint.init_source.checkpoint_model_section`: headers and
    JSON only), every section's rules and the cross-section ones, and the served architecture's.

    Args:
        path: YAML preset; None starts from the dataclass defaults.
        overrides: ``key.path=value`` strings, applied after the preset.
        world_size: number of processes, when known, for layout validation.
        check_pushes: apply :func:`check_served_architecture`, the trainer's rule on what it
            pushes into SGLang servers. The stand-in, a server that serves its starting
            checkpoint's own architecture, reads the run's config without it.
        this_machine: False reads a config meant for another machine (``megatron-rl-plan``):
            every rule holds except those on this machine's files and packages. A starting
            checkpoint or teacher that is not here leaves the preset's ``model`` section (one
            that is here is read and checked as usual), and FP8 is not checked against this
            machine's Transformer Engine or GPU.

    Raises:
        ConfigError: naming the key (for a contradiction with the checkpoint, both values).
    """
    # Imported here: the checkpoint's headers are read with torch and safetensors, which
    # importing the config's dataclasses and rules (the planner, --help) does not need.
    from megatron_rl.checkpoint.init_source import checkpoint_model_section, teacher_model_sections

    data = merge(read_preset(path) if path is not None else {}, parse_overrides(overrides))
    init = data.get("init_checkpoint")
    if init is not None and (this_machine or not _planned_elsewhere(init, data.get("model"))):
        data["model"] = checkpoint_model_section(init, data.get("model"))
    teacher_model_sections(data, absent_ok=not this_machine)
    cfg = validate(from_dict(RunConfig, data), world_size, this_machine=this_machine)
    if check_pushes:
        check_served_architecture(cfg)
    return cfg


def _planned_elsewhere(path: Any, model: Any) -> bool:
    """A checkpoint that lives on another machine (not here) under a config whose own ``model``
    section describes it: a plan for that machine reads the section instead."""
    return isinstance(path, str) and not Path(path).exists() and isinstance(model, dict) and bool(model)


def check_served_architecture(cfg: RunConfig) -> None:
    """SGLang servers run an HF architecture's own block: its table must exist and, when the
    trainer pushes weights into it, compute the same model (or rollouts would silently come
    from another policy). Needs the checkpoint tables (``checkpoint.hf_config``)."""
    from megatron_rl.checkpoint.hf_config import check_architecture_holds

    s = cfg.rollout.sglang
    if cfg.rollout.engine == "sglang":
        pushed = cfg.model if s.weight_sync != "none" else None
        check_architecture_holds(s.hf_architecture, pushed, "rollout.sglang.hf_architecture")
