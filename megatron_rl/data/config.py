"""The ``data`` and ``tokenizer`` sections (and the built-in task's): where prompts come from
and which tokenizer reads them. A leaf: the loading lives in ``data.prompts`` and
``data.tokenizer``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass(kw_only=True)
class TaskConfig:
    """Which built-in task to train and evaluate on, and how many problems of it."""

    name: str = "addition"
    """Registered task name (``TASKS``): "addition" or "reverse"."""
    num_train_prompts: int = 2000
    """Problems for the supervised warm start and for RL."""
    num_eval_prompts: int = 256
    """Held-out problems for accuracy; never among the training problems."""
    seed: int = 0
    """Seed of the problem draw; separate from the run seed so the held-out set stays put."""
    max_operand: int = 49
    """addition: both operands are drawn from [0, max_operand]."""
    min_digits: int = 2
    """reverse: length of the shortest digit string."""
    max_digits: int = 5
    """reverse: length of the longest digit string."""


@dataclass(kw_only=True)
class DataConfig:
    """Where prompts come from."""

    source: Literal["files", "task"] = "files"
    """files: JSONL/JSON/Parquet prompt files; task: a built-in task (``megatron_rl.data.tasks``)."""
    train_files: list[str] = field(default_factory=list)
    """Training prompt files (.jsonl, .json, .parquet); at least one when source is files."""
    eval_files: list[str] = field(default_factory=list)
    """Held-out prompt files; optional: none gives an empty eval split."""
    prompt_key: str = "prompt"
    """Column of the prompt: a string, or a list of {"role", "content"} messages."""
    answer_key: str = "answer"
    """Column of the ground truth passed to the reward (converted with str())."""
    id_key: str | None = "id"
    """Column of the sample id; None or an absent column: "<file stem>:<row>"."""
    metadata_keys: list[str] = field(default_factory=list)
    """Extra columns passed to the reward as metadata."""
    max_prompt_tokens: int | None = None
    """Longer prompts (after the template) are dropped and counted; None: set by the trainer."""
    task: TaskConfig = field(default_factory=TaskConfig)
    """The built-in task used when source is task."""


@dataclass(kw_only=True)
class TokenizerConfig:
    """Which tokenizer turns prompts into ids and responses into text."""

    path: str | None = None
    """Local directory for ``transformers.AutoTokenizer``; None: the init checkpoint's directory."""
    chat_template: bool = True
    """Apply the tokenizer's chat template (with generation prompt) to prompts; False: plain encode."""
    system_prompt: str | None = None
    """Prepended as a system message when the template is applied and the prompt has none."""
    extra_stop_tokens: list[str] = field(default_factory=list)
    """More strings, each a single token of the tokenizer, whose id ends a response."""
