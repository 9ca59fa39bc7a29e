"""A run's inputs, checked against its config before any process group or model exists.

Owns :func:`check_inputs` (the starting checkpoint, the tokenizer and its chat template, the
prompt files row by row, the reward function's import path and signature, the environment's
class and arguments, a run directory to resume, distillation's teachers: ``train.teacher_checks``)
and the tokenizer and prompt limit a run uses. Every entry point (``megatron-rl-train``, ``megatron-rl-launch``) reads the config
(``megatron_rl.config.load_config``) and calls this first, so a bad input costs seconds and
one line, never a started world. Imports no Megatron.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from megatron_rl.checkpoint.errors import CheckpointMismatchError
from megatron_rl.checkpoint.init_source import InitSource, inspect_init_checkpoint
from megatron_rl.checkpoint.trainer_source import check_trainer_checkpoint
from megatron_rl.config import RunConfig
from megatron_rl.config_loading import ConfigError
from megatron_rl.data.prompts import PromptSet, check_data_config, load_prompts
from megatron_rl.data.tokenizer import (
    PromptTokenizer,
    check_tokenizer_config,
    load_tokenizer,
)
from megatron_rl.parallel.mcore_optimizer import optimizer_member_count
from megatron_rl.rewards.core import check_reward_config
from megatron_rl.rollout.envs.load import check_env_config, env_tools
from megatron_rl.train.teacher_checks import check_teacher_inputs


@dataclass(kw_only=True)
class RunPrompts:
    """The run's tokenizer and both prompt splits, as the input check loaded them. The ranks
    start from these rather than reading and tokenizing the files again (0.7 CPU-s per rank for
    the demo's 2,500 prompts, more with more), so every rank trains on exactly the prompts that
    were checked, with the tokenizer that encoded them."""

    tokenizer: PromptTokenizer
    """The run's tokenizer (:func:`run_tokenizer`)."""
    train: PromptSet
    """The training prompts kept."""
    eval: PromptSet
    """The held-out prompts kept (may be empty)."""


@dataclass(kw_only=True)
class InputSummary:
    """What the checks found: the one-line report before training, and the prompts the ranks use."""

    init: InitSource | None
    """The starting checkpoint (None: random weights)."""
    prompts: RunPrompts
    """The tokenizer and the prompts, loaded once for the whole run."""

    def describe(self) -> str:
        """One line for the run's log."""
        start = f"{self.init.hf.architecture} checkpoint {self.init.path}" if self.init else "random weights"
        train, evals = self.prompts.train, self.prompts.eval
        return (f"policy from {start}; prompts: {len(train)} train, {len(evals)} eval "
                f"({train.num_filtered + evals.num_filtered} over the length limit dropped)")


def max_prompt_tokens(cfg: RunConfig) -> int:
    """Longest prompt the run keeps: the configured limit, or what the model's length (or a
    trajectory's, ``rollout.env.max_total_tokens``) leaves."""
    return prompt_limit(cfg)[0]


def prompt_limit(cfg: RunConfig) -> tuple[int, str]:
    """:func:`max_prompt_tokens`, and what sets it, named as a message names its culprit."""
    total_key = "rollout.env.max_total_tokens" if cfg.rollout.env.max_total_tokens else "model.max_position_embeddings"
    total = cfg.rollout.env.max_total_tokens or cfg.model.max_position_embeddings
    room = total - cfg.rollout.max_new_tokens
    if cfg.data.max_prompt_tokens is not None and cfg.data.max_prompt_tokens <= room:
        return cfg.data.max_prompt_tokens, "data.max_prompt_tokens"
    return room, f"rollout.max_new_tokens ({cfg.rollout.max_new_tokens}, of {total_key} {total})"


def run_tokenizer(cfg: RunConfig) -> PromptTokenizer:
    """The run's tokenizer (files: from ``tokenizer.path`` or the starting checkpoint; with an
    environment that has tools, its prompts list them as the chat template does)."""
    if cfg.data.source == "task":
        from megatron_rl.data.tasks import build_task
        from megatron_rl.data.tokenizer import char_tokenizer_adapter

        return char_tokenizer_adapter(build_task(cfg.data.task).tokenizer)
    return load_tokenizer(cfg.tokenizer, cfg.init_checkpoint, env_tools(cfg.rollout.env))


def check_inputs(cfg: RunConfig) -> InputSummary:
    """Every check that needs files but no process: checkpoint, tokenizer, prompts, reward.

    Raises:
        ConfigError: naming the key and the file (and row) at fault.
    """
    check_run_dir(cfg)
    init = inspect_init_checkpoint(cfg.init_checkpoint) if cfg.init_checkpoint else None
    if init is not None and init.kind == "hf" and cfg.parallel.expert_tensor_parallel_size != 1:
        raise ConfigError("parallel.expert_tensor_parallel_size: streaming an HF checkpoint splits experts "
                          "over EP only; convert it with megatron-rl-convert-hf-to-megatron for ETP > 1")
    if init is not None and cfg.rollout.engine == "sglang" and init.hf.architecture != cfg.rollout.sglang.hf_architecture:
        raise ConfigError(f"rollout.sglang.hf_architecture: {cfg.rollout.sglang.hf_architecture!r}, but the "
                          f"starting checkpoint is {init.hf.architecture!r}")
    if cfg.rollout.engine == "hf":
        _check_hf_engine(cfg, init)
    check_data_config(cfg.data)
    check_reward_config(cfg.reward)
    check_env_config(cfg.rollout.env)
    if cfg.data.source == "files":
        if cfg.tokenizer.path is None and cfg.init_checkpoint is None:
            raise ConfigError("tokenizer.path: prompt files need a tokenizer; set tokenizer.path or init_checkpoint")
        check_tokenizer_config(cfg.tokenizer, cfg.init_checkpoint, cfg.model.vocab_size)
    tokenizer = run_tokenizer(cfg)
    if tokenizer.vocab_size > cfg.model.vocab_size:
        raise ConfigError(f"model.vocab_size: the tokenizer uses {tokenizer.vocab_size} ids, more than "
                          f"the model's {cfg.model.vocab_size}")
    limit, set_by = prompt_limit(cfg)
    frame = len(tokenizer.encode_prompt(""))
    if frame > limit:  # known before a prompt file is read (thousands of rows: seconds)
        raise ConfigError(f"{set_by}: leaves {limit} tokens for a prompt, fewer than the {frame} the tokenizer's "
                          "chat template takes around an empty one")
    prompts = load_run_prompts(cfg, tokenizer)
    check_teacher_inputs(cfg, tokenizer, prompts.train.records)
    return InputSummary(init=init, prompts=prompts)


def load_run_prompts(cfg: RunConfig, tokenizer: PromptTokenizer | None = None) -> RunPrompts:
    """Both prompt splits read, tokenized with ``tokenizer`` (default: :func:`run_tokenizer`)
    and length-filtered.

    Raises:
        ConfigError: as :func:`~megatron_rl.data.prompts.load_prompts`.
    """
    if tokenizer is None:
        tokenizer = run_tokenizer(cfg)
    limit, set_by = prompt_limit(cfg)
    return RunPrompts(tokenizer=tokenizer, train=load_prompts(cfg.data, "train", tokenizer, limit, set_by),
                      eval=load_prompts(cfg.data, "eval", tokenizer, limit, set_by))


def _check_hf_engine(cfg: RunConfig, init: InitSource | None) -> None:
    """The hf rollout engine can build the policy as a transformers model (before any process)."""
    from megatron_rl.rollout.local.hf_model import (
        UnsupportedArchitecture,
        check_servable,
    )

    architecture = init.hf.architecture if init is not None else cfg.rollout.sglang.hf_architecture
    try:
        check_servable(architecture, cfg.model)
    except (UnsupportedArchitecture, CheckpointMismatchError) as err:
        raise ConfigError(f"rollout.engine: {err}") from None


RESUME_KEYS = ("seed", "model")
"""Run-config sections a resumed run must share with its checkpoint (the seed fixes the data
order and sampling; the model fixes the tensors). The layout may change as far as the
checkpoint's optimizer format reshards (:func:`check_resume_layout`)."""

LAYOUT_SIZES = (("TP", "tensor_model_parallel_size"), ("PP", "pipeline_model_parallel_size"),
                ("EP", "expert_model_parallel_size"), ("ETP", "expert_tensor_parallel_size"))
"""The model-parallel sizes of a layout, as ``trainer_state.json``'s ``layout`` records them."""
MEMBER_SIZES = ("expert_model_parallel_size", "expert_tensor_parallel_size", "tensor_model_parallel_size")
"""What decides how many optimizers Megatron chains (``mcore_optimizer.optimizer_member_count``)."""


def check_run_dir(cfg: RunConfig) -> None:
    """The run directory can be written, and a checkpoint in it can be resumed by this config.

    Raises:
        ConfigError: ``train.run_dir`` is a file or not writable; its latest checkpoint is
            unreadable, or was written with another seed or model (the key and both values named).
    """
    run_dir = Path(cfg.train.run_dir)
    existing = next((p for p in (run_dir, *run_dir.parents) if p.exists()), None)
    if existing is not None and not existing.is_dir():
        raise ConfigError(f"train.run_dir: {existing} is a file, not a directory")
    if existing is not None and not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"train.run_dir: {existing} is not writable")
    pointer = run_dir / "checkpoints" / "latest"
    if not cfg.train.resume or not pointer.is_file():
        return
    state_file = run_dir / "checkpoints" / pointer.read_text().strip() / "trainer_state.json"
    try:
        body = json.loads(state_file.read_text())
        stored = body["config"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ConfigError(f"train.run_dir: cannot resume: {state_file} is unreadable ({type(err).__name__}: "
                          f"{err}); move the run directory away or set train.resume=false") from None
    current = {"seed": cfg.seed, "model": asdict(cfg.model)}
    for key in RESUME_KEYS:
        if key == "model":
            for name, value in current["model"].items():
                if stored.get("model", {}).get(name, value) != value:
                    raise ConfigError(f"model.{name}: the run directory's checkpoint {state_file.parent.name} was "
                                      f"trained with {stored['model'][name]!r}, this config says {value!r}")
        elif stored.get(key, current[key]) != current[key]:
            raise ConfigError(f"{key}: the run directory's checkpoint {state_file.parent.name} was trained with "
                              f"{stored[key]!r}, this config says {current[key]!r}")
    check_resume_layout(cfg, body, state_file.parent.name)
    try:
        check_trainer_checkpoint(state_file.parent)
    except CheckpointMismatchError as err:
        raise ConfigError(f"train.run_dir: cannot resume: {err}; move the run directory away or set "
                          "train.resume=false") from None


def _describe_layout(sizes: dict, world_size: int | None) -> str:
    """``TP2 PP1 EP2 ETP1 DP1 (2 processes)``; DP is left out when the world size is unknown."""
    text = " ".join(f"{short}{sizes.get(key, 1)}" for short, key in LAYOUT_SIZES)
    if world_size:
        dp = world_size // (sizes.get("tensor_model_parallel_size", 1) * sizes.get("pipeline_model_parallel_size", 1))
        text += f" DP{dp} ({world_size} processes)"
    return text


def check_resume_layout(cfg: RunConfig, stored: dict, checkpoint: str) -> None:
    """The run directory's latest checkpoint can be resumed in this config's layout and optimizer.

    Megatron's checkpoints reshard the model to any layout, and the optimizer state as far
    as its format allows: the plain optimizer's and the distributed optimizer's
    ``fully_reshardable`` state to any TP/PP/DP and EP > 1; the ``dp_reshardable`` state
    to another DP size only. Neither loads across EP1 <-> EP > 1 (one chained optimizer
    against two: ``mcore_optimizer.optimizer_member_count``), nor from one optimizer kind into
    the other. ``stored`` is the checkpoint's ``trainer_state.json``; its ``layout`` and
    ``optimizer`` are absent in checkpoints written before they were recorded (then the
    stored run config's ``parallel`` section says the layout, and the optimizer was the plain one).

    Raises:
        ConfigError: naming the key, the saved layout (or optimizer) and the requested one.
    """
    config = stored.get("config") or {}
    saved_sizes = stored.get("layout") or config.get("parallel") or {}
    saved_world = saved_sizes.get("world_size")
    saved_optimizer = stored.get("optimizer") or {"distributed": False, "sharding": None}
    requested_sizes = {key: getattr(cfg.parallel, key) for _, key in LAYOUT_SIZES}
    saved_text = _describe_layout(saved_sizes, saved_world)
    requested_text = _describe_layout(requested_sizes, cfg.parallel.world_size)
    where = f"the run directory's checkpoint {checkpoint} was saved at {saved_text}, this config asks for {requested_text}"
    kinds = {True: "distributed", False: "plain"}
    if bool(saved_optimizer.get("distributed")) != cfg.optim.distributed:
        raise ConfigError(
            f"optim.distributed: the run directory's checkpoint {checkpoint} holds the "
            f"{kinds[bool(saved_optimizer.get('distributed'))]} optimizer's state, this config asks for the "
            f"{kinds[cfg.optim.distributed]} one; resume with optim.distributed="
            f"{str(bool(saved_optimizer.get('distributed'))).lower()}, or start a new train.run_dir")
    saved_members = optimizer_member_count(*(saved_sizes.get(key, 1) for key in MEMBER_SIZES))
    requested_members = optimizer_member_count(*(requested_sizes[key] for key in MEMBER_SIZES))
    if saved_members != requested_members:
        raise ConfigError(
            f"parallel.expert_model_parallel_size: {where}; Megatron chains {saved_members} optimizer(s) there and "
            f"{requested_members} here (the expert weights get their own when EP > 1), and the optimizer state "
            "does not load into a chain of another length (EP1 <-> EP>1): resume with "
            f"{'EP>1' if saved_members == 2 else 'EP1'}, or start a new train.run_dir")
    if saved_optimizer.get("sharding") == "dp_reshardable":
        changed = [short for short, key in LAYOUT_SIZES if saved_sizes.get(key, 1) != requested_sizes[key]]
        if changed:
            raise ConfigError(
                f"parallel: {where}; its optimizer state is dp_reshardable (optim.checkpoint_sharding), which "
                f"reshards over DP only, and {', '.join(changed)} changed")
        saved_optim = config.get("optim") or {}
        if _buckets(saved_optim) != _buckets(asdict(cfg.optim)):
            raise ConfigError(
                f"optim.bucket_size: the run directory's checkpoint {checkpoint} stores dp_reshardable optimizer "
                f"state laid out by gradient bucket {_buckets(saved_optim)}, this config asks for "
                f"{_buckets(asdict(cfg.optim))} (optim.overlap_grad_reduce, optim.bucket_size)")


def _buckets(optim: dict) -> str:
    """How DDP splits its buffers into buckets: one per buffer unless the reduce-scatter overlaps."""
    if not optim.get("overlap_grad_reduce"):
        return "one bucket per buffer"
    size = optim.get("bucket_size")
    return f"buckets of {size} elements" if size else "buckets of Megatron's default size"
