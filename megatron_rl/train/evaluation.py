"""Held-out evaluation settings and its statistics (pure Python: no torch, no I/O).

Owns: the ``eval`` section of the run config and the unbiased pass@k estimator of Chen et
al. (2021): with ``n`` samples of which ``c`` are correct, ``pass@k = 1 - C(n-c, k) / C(n, k)``,
the probability that at least one of ``k`` samples drawn without replacement from the
``n`` is correct, averaged over prompts. Does not own generation or scoring (the trainer
runs the engine and the reward scorer).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from math import comb
from typing import Sequence


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


def pass_at_k(correct_per_prompt: Sequence[int], n: int, k: int) -> float:
    """Sum over prompts of the unbiased pass@k (divide by the prompt count for the mean).

    Args:
        correct_per_prompt: correct responses ``c`` of each prompt (0 <= c <= n).
        n: responses per prompt.
        k: responses the metric may pick (1 <= k <= n).
    """
    if not 1 <= k <= n:
        raise ValueError(f"pass@k needs 1 <= k <= n, got k={k}, n={n}")
    total = 0.0
    for c in correct_per_prompt:
        if not 0 <= c <= n:
            raise ValueError(f"a prompt has {c} correct of {n} responses")
        # C(n - c, k) counts the k-subsets with no correct response.
        total += 1.0 - comb(n - c, k) / comb(n, k)
    return total
