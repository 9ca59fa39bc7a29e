"""The ``train`` and ``eval`` sections: the RL loop's schedule, checkpoints and held-out
evaluation. A leaf: the loop lives in ``train.trainer``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass(kw_only=True)
class TrainerConfig:
    """The RL loop."""

    steps: int = 30
    """RL steps (each: rollouts, old-policy pass, updates)."""
    mini_batches: int = 1
    """Policy updates per step (the step's groups split into this many mini-batches)."""
    epochs: int = 1
    """Passes over the step's mini-batches."""
    micro_batch_sequences: int = 32
    """Sequences packed per micro-batch (when ``micro_batch_tokens`` is null)."""
    micro_batch_tokens: int | None = None
    """Token budget of a micro-batch (prompt + response tokens) in the log-prob passes, the
    updates and the embedded engine: samples are packed into as few micro-batches of at most
    this many tokens as fit, balanced, and each step's groups are balanced over data-parallel
    ranks by tokens. Null: ``micro_batch_sequences`` consecutive samples per micro-batch."""
    recompute: Literal["none", "selective", "full"] = "none"
    """Activation recompute in the policy update (Megatron's ``recompute_granularity``):
    selective checkpoints each MoE block (router, dispatch, experts); full checkpoints every
    layer. A checkpointed piece keeps only its input and runs again in backward. Log-prob
    passes store no activations, so it changes only the update's memory and time."""
    routing_replay: Literal["none", "R2", "R3"] = "R2"
    """Routing plan during updates."""
    routing_diagnostics: bool = True
    """Measure replay agreement, flip rate and router shift each update (one extra forward)."""
    eval_every: int = 5
    """Held-out evaluation every N steps (and at the start and the end)."""
    save_every: int = 10
    """Checkpoint every N steps (and at the end)."""
    save_hf: bool = True
    """Write a Hugging Face checkpoint of the policy at the end (``<run_dir>/hf/step_NNNNNN``)."""
    save_hf_every: int = 0
    """Also write one every N steps (0: only at the end)."""
    run_dir: str = "runs/demo"
    """Metrics, plots and checkpoints go here."""
    resume: bool = True
    """Continue from the latest checkpoint in run_dir when there is one."""
    sft_steps: int = 0
    """Supervised warm-start steps on the training prompts' reference answers before RL
    (for a model that starts from random weights; 0 for a pretrained checkpoint)."""
    sft_lr: float = 3e-3
    """Warm-start learning rate (Adam)."""
    sft_batch_size: int = 64
    """Warm-start examples per step (over all data-parallel ranks)."""
    progress: bool = True
    """Show progress bars on rank 0."""


@dataclass(kw_only=True)
class EvalConfig:
    """Held-out evaluation on the eval prompts (every ``train.eval_every`` steps, at the start and the end)."""

    num_samples: int = 1
    """Responses per eval prompt (n)."""
    temperature: float = 1.0
    """Sampling temperature of those responses (0: greedy, then n must be 1)."""
    pass_k: list[int] = field(default_factory=lambda: [1])
    """k values reported as ``eval/pass@k`` (each k <= num_samples)."""
    greedy: bool = True
    """Also report ``eval/accuracy_greedy`` (one response per prompt at temperature 0)."""
    max_prompts: int | None = None
    """Evaluate on the first N eval prompts only (None: all of them)."""


def check_eval_config(cfg: EvalConfig) -> list[tuple[str, str]]:
    """Violated rules as ``(key, rule)`` pairs (empty when valid)."""
    problems = []
    if cfg.num_samples < 1:
        problems.append(("eval.num_samples", "must be >= 1"))
    if cfg.temperature < 0:
        problems.append(("eval.temperature", "must be >= 0"))
    if cfg.temperature == 0 and cfg.num_samples > 1:
        problems.append(("eval.num_samples", "greedy decoding (eval.temperature=0) gives one answer; use 1"))
    for k in cfg.pass_k:
        if not 1 <= k <= cfg.num_samples:
            problems.append(("eval.pass_k", f"k={k} must be between 1 and eval.num_samples ({cfg.num_samples})"))
    if cfg.max_prompts is not None and cfg.max_prompts < 1:
        problems.append(("eval.max_prompts", "must be >= 1 or null"))
    return problems
