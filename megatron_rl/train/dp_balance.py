"""Move whole rollout groups between data-parallel ranks so that tokens per rank are balanced.

Each data-parallel rank generates the responses of its own prompts, so after rollouts the
ranks hold very different token counts when response lengths are skewed, and every
collective of the log-prob passes and the updates waits for the most loaded rank. Before the
old-policy pass the trainer re-deals the step's groups: for each mini-batch, the groups
that all ranks hold for it are split over the ranks by Karmarkar-Karp on their token
totals, with the same number of groups per rank, and each group travels (once) to its
new rank. Groups stay whole, so group-relative advantages are computed exactly as before;
loss normalisation is over the global mini-batch, so the gradient does not depend on which
rank holds which group. With context parallelism in the world the exchange runs over the DP
group of each CP rank: the CP ranks of a replica hold the same groups, see the same gathered
token counts and make the same plan, so they end with the same groups again.
"""

from __future__ import annotations

from typing import Sequence, TypeVar

import torch

from megatron_rl.parallel.balance import balanced_partition
from megatron_rl.parallel.comm import all_gather_cat, exchange_objects
from megatron_rl.parallel.groups import ParallelGroups

Item = TypeVar("Item")


def rebalance_over_dp(
    items: Sequence[Item], tokens: Sequence[int], groups: ParallelGroups, mini_batches: int
) -> tuple[list[Item], dict[str, torch.Tensor]]:
    """This rank's items after balancing every mini-batch's items over the DP ranks.

    Args:
        items: this rank's items (rollout groups), mini-batch ``m`` holding the m-th
            contiguous slice; every rank holds the same number.
        tokens: token total of each item.
        groups: parallel groups (the DP group is used).
        mini_batches: number of contiguous mini-batch slices.

    Returns:
        The items now on this rank (mini-batch slices in order, same count as before) and
        ``balance/dp_tokens_max_over_mean`` before and after (1.0 is perfect balance).
    """
    dp = groups.dp_size
    per_mb = len(items) // mini_batches
    if per_mb * mini_batches != len(items):
        raise ValueError(f"{len(items)} groups do not split into {mini_batches} mini-batches")
    all_tokens_RN = all_gather_cat(torch.tensor([list(tokens)], dtype=torch.int64), groups.dp) if dp > 1 \
        else torch.tensor([list(tokens)], dtype=torch.int64)
    before = all_tokens_RN.sum(dim=1).double()
    after = torch.zeros(dp, dtype=torch.float64)
    # destination[r][i]: where rank r's item i goes, and its position in the new order.
    plan: list[list[tuple[int, int]]] = [[(r, i) for i in range(len(items))] for r in range(dp)]
    for m in range(mini_batches):
        local = range(m * per_mb, (m + 1) * per_mb)
        owners = [(r, i) for r in range(dp) for i in local]
        weights = [int(all_tokens_RN[r, i]) for r, i in owners]
        for dest, part in enumerate(balanced_partition(weights, dp, equal_size=True)):
            for slot, k in enumerate(part):
                r, i = owners[k]
                plan[r][i] = (dest, m * per_mb + slot)
                after[dest] += weights[k]
    outgoing: list[list] = [[] for _ in range(dp)]
    for i, item in enumerate(items):
        dest, slot = plan[groups.dp_rank][i]
        outgoing[dest].append((slot, item))
    received = exchange_objects(outgoing, groups.dp) if dp > 1 else outgoing
    placed = sorted((pair for chunk in received for pair in chunk), key=lambda pair: pair[0])
    if [slot for slot, _ in placed] != list(range(len(items))):
        raise RuntimeError(f"DP rebalancing delivered slots {[slot for slot, _ in placed]} to rank {groups.dp_rank}")
    mine = [item for _, item in placed]
    metrics = {
        "balance/dp_tokens_max_over_mean_before": (before.max() / before.mean().clamp_min(1)).float(),
        "balance/dp_tokens_max_over_mean": (after.max() / after.mean().clamp_min(1)).float(),
    }
    return mine, metrics
