"""Token-balanced partitions: micro-batches under a token budget, samples over ranks.

Pure functions on lengths (no collectives, no tensors of the model). Two uses:

- :func:`plan_micro_batches` cuts one rank's samples into micro-batches of at most
  ``max_tokens`` tokens each (under context parallelism the caller passes each sample's
  slot length and a row's capacity, the budget per CP rank x CP), as few as fit and with their token counts as equal as the
  Karmarkar-Karp differencing heuristic makes them (equal micro-batches keep every pipeline
  stage and every expert-parallel peer busy for the same time).
- :func:`balanced_partition` splits items (samples or whole groups) over data-parallel
  ranks so that their token totals are balanced, optionally with equal item counts.

Every result is deterministic: ties break on the item index, parts are returned sorted by
their smallest item, and the items of a part in ascending order.
"""

from __future__ import annotations

import heapq
import math
from typing import Sequence


def karmarkar_karp(weights: Sequence[int], num_parts: int, equal_size: bool = False) -> list[list[int]]:
    """Partition item indices into ``num_parts`` parts with near-equal weight sums.

    The largest differencing method for k-way partitioning: every item (or, with
    ``equal_size``, every run of ``num_parts`` consecutive items by weight) starts as a
    partial solution; the two partial solutions with the largest spread are merged, the
    heaviest part of one with the lightest of the other, until one remains.

    Args:
        weights: non-negative weight of each item.
        num_parts: number of parts (>= 1).
        equal_size: give every part the same number of items (needs ``len(weights)``
            divisible by ``num_parts``).
    """
    if num_parts < 1:
        raise ValueError(f"karmarkar_karp: num_parts must be >= 1, got {num_parts}")
    n = len(weights)
    if equal_size and n % num_parts:
        raise ValueError(f"karmarkar_karp: {n} items do not split into {num_parts} equal parts")
    order = sorted(range(n), key=lambda i: (weights[i], i))
    # A partial solution: num_parts (sum, items) pairs sorted by sum, heaviest first.
    heap: list[tuple[int, int, list[tuple[int, list[int]]]]] = []
    counter = 0

    def push(parts: list[tuple[int, list[int]]]) -> None:
        nonlocal counter
        parts.sort(key=lambda p: (-p[0], p[1][:1]))
        heapq.heappush(heap, (-(parts[0][0] - parts[-1][0]), counter, parts))
        counter += 1

    if equal_size:
        for start in range(0, n, num_parts):
            push([(weights[i], [i]) for i in order[start : start + num_parts]])
    else:
        for i in order:
            push([(weights[i], [i])] + [(0, []) for _ in range(num_parts - 1)])
    if not heap:
        return [[] for _ in range(num_parts)]
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        merged = [(wa + wb, ia + ib) for (wa, ia), (wb, ib) in zip(a, reversed(b))]
        push(merged)
    parts = [sorted(items) for _, items in heap[0][2]]
    return sorted(parts, key=lambda p: (not p, p[:1]))


def first_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Bins of at most ``capacity`` total length, longest items first (always feasible)."""
    bins: list[tuple[int, list[int]]] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        for b, (used, items) in enumerate(bins):
            if used + lengths[i] <= capacity:
                bins[b] = (used + lengths[i], items + [i])
                break
        else:
            bins.append((lengths[i], [i]))
    return sorted((sorted(items) for _, items in bins), key=lambda p: p[:1])


def _fits(parts: list[list[int]], lengths: Sequence[int], max_tokens: int) -> bool:
    return all(sum(lengths[i] for i in p) <= max_tokens for p in parts)


def plan_micro_batches(
    lengths: Sequence[int], max_tokens: int, num_micro_batches: int | None = None
) -> list[list[int]]:
    """Sample indices of each micro-batch: every micro-batch holds at most ``max_tokens`` tokens.

    Args:
        lengths: tokens of each sample (prompt + response).
        max_tokens: the token budget of a micro-batch.
        num_micro_batches: produce exactly this many (>= the minimum; extra ones stay
            balanced and, only when the heuristic cannot spread the samples, empty).
            None: the fewest that the planner fits.

    Raises:
        ValueError: a sample longer than the budget, or fewer micro-batches than needed.
    """
    for i, n in enumerate(lengths):
        if n > max_tokens:
            raise ValueError(f"sample {i} has {n} tokens, more than the micro-batch token budget {max_tokens}")
    if not lengths:
        return [[] for _ in range(num_micro_batches or 0)]
    fallback = first_fit_decreasing(lengths, max_tokens)
    lower = max(1, math.ceil(sum(lengths) / max_tokens))
    if num_micro_batches is not None:
        if num_micro_batches < lower:
            raise ValueError(
                f"{sum(lengths)} tokens do not fit in {num_micro_batches} micro-batches of {max_tokens}"
            )
        parts = karmarkar_karp(lengths, num_micro_batches)
        if _fits(parts, lengths, max_tokens):
            return parts
        for count in range(lower, num_micro_batches + 1):
            parts = karmarkar_karp(lengths, count)
            if _fits(parts, lengths, max_tokens):
                break
        else:
            parts = fallback
        if len(parts) > num_micro_batches:
            raise ValueError(f"the samples need more than {num_micro_batches} micro-batches of {max_tokens} tokens")
        return [p for p in parts if p] + [[] for _ in range(num_micro_batches - sum(1 for p in parts if p))]
    for count in range(lower, len(fallback)):
        parts = karmarkar_karp(lengths, count)
        if _fits(parts, lengths, max_tokens):
            return [p for p in parts if p]
    return fallback


def balanced_partition(weights: Sequence[int], num_parts: int, equal_size: bool = True) -> list[list[int]]:
    """Item indices of each of ``num_parts`` ranks, weight totals balanced (Karmarkar-Karp).

    Unlike :func:`karmarkar_karp`'s result, part ``r`` is meant for rank ``r``: parts are
    ordered by their smallest item, so the assignment is the same on every rank.
    """
    return karmarkar_karp(weights, num_parts, equal_size=equal_size)
