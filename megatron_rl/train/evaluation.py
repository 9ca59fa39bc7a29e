"""Held-out evaluation settings and its statistics (pure Python: no torch, no I/O).

Owns: the ``eval`` section of the run config and the unbiased pass@k estimator of Chen et
al. (2021): with ``n`` samples of which ``c`` are correct, ``pass@k = 1 - C(n-c, k) / C(n, k)``,
the probability that at least one of ``k`` samples drawn without replacement from the
``n`` is correct, averaged over prompts. Does not own generation or scoring (the trainer
runs the engine and the reward scorer).
"""

from __future__ import annotations

from math import comb
from typing import Sequence


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
