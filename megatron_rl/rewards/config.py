"""The ``reward`` section: which function scores responses, in how many workers, and what a
failure costs. A leaf (the scoring lives in ``rewards.core`` and ``rewards.pool``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(kw_only=True)
class RewardConfig:
    """How responses are scored."""

    function: str = "math"
    """A built-in reward name ("math", "exact_match") or an import path "package.module:function"."""
    num_workers: int = 2
    """Processes that score responses in parallel (0: score in the calling process)."""
    timeout_s: float = 10.0
    """Limit for scoring one response; a response that exceeds it scores as an error."""
    fatal_errors: bool = False
    """Stop the run when a reward function raises (default: count it, log the sample id, score 0)."""
    error_score: float = 0.0
    """Score given to a response whose reward raised, returned a bad value or timed out."""
