"""Host-side collectives of the parallel layer on a two-rank gloo world."""

import functools

import torch
import torch.distributed as dist

from megatron_rl.parallel.world import run_world


def _gather_varlen():
    from megatron_rl.parallel.comm import all_gather_varlen

    group = dist.group.WORLD
    rank = dist.get_rank()
    rows = [3, 0][rank]
    floats = torch.arange(rows * 2, dtype=torch.float32).reshape(rows, 2) + 10 * rank
    flags = torch.tensor([True, False, True])[:rows]
    return {
        "floats": all_gather_varlen(floats, group),
        "flags": all_gather_varlen(flags, group, sizes=[3, 0]),
        "empty": all_gather_varlen(torch.zeros(0, 4, dtype=torch.int64), group),
        "second_longer": all_gather_varlen(torch.full((rank + 1,), rank, dtype=torch.int64), group),
        **_exchange_and_rebalance(group, rank),
    }


def _exchange_and_rebalance(group, rank):
    """Checks of the object all-to-all and the DP group re-dealing, in the same world."""
    from types import SimpleNamespace

    from megatron_rl.parallel.comm import exchange_objects
    from megatron_rl.train.dp_balance import rebalance_over_dp

    received = exchange_objects([[f"{rank}->0", torch.tensor([rank])], [f"{rank}->1"] * (rank + 2)], group)
    groups = SimpleNamespace(dp=group, dp_size=2, dp_rank=rank)
    # Rank 0 holds the long groups, rank 1 the short ones; two mini-batches of two groups.
    tokens = [[900, 800, 700, 600], [10, 20, 30, 40]][rank]
    items = [f"r{rank}g{i}" for i in range(4)]
    mine, metrics = rebalance_over_dp(items, tokens, groups, mini_batches=2)
    return {"received": received, "mine": mine, "balance": metrics}


@functools.lru_cache(maxsize=1)
def _world():
    """One two-rank world for every check of this module."""
    return run_world(_gather_varlen, 2, timeout_s=60)


def test_all_gather_varlen_concatenates_rows_of_different_counts_in_rank_order():
    for out in _world():
        assert torch.equal(out["floats"], torch.arange(6, dtype=torch.float32).reshape(3, 2))
        assert out["flags"].dtype == torch.bool
        assert out["flags"].tolist() == [True, False, True]
        assert out["empty"].shape == (0, 4) and out["empty"].dtype == torch.int64
        assert out["second_longer"].tolist() == [0, 1, 1]


def test_exchange_objects_and_dp_rebalancing():
    outs = _world()
    for rank, out in enumerate(outs):
        from_0, from_1 = out["received"]
        if rank == 0:
            assert from_0[0] == "0->0" and torch.equal(from_0[1], torch.tensor([0]))
            assert from_1[0] == "1->0" and torch.equal(from_1[1], torch.tensor([1]))
        else:
            assert from_0 == ["0->1"] * 2 and from_1 == ["1->1"] * 3
    # Mini-batch 0 = {r0g0: 900, r0g1: 800, r1g0: 10, r1g1: 20}: each rank gets one long and
    # one short group; mini-batch 1 likewise. Every group lands exactly once, in its slice.
    held = outs[0]["mine"] + outs[1]["mine"]
    assert sorted(held) == sorted(f"r{r}g{i}" for r in range(2) for i in range(4))
    for out in outs:
        assert len(out["mine"]) == 4
        assert {g[-1] for g in out["mine"][:2]} <= {"0", "1"} and {g[-1] for g in out["mine"][2:]} <= {"2", "3"}
        assert sum(g.startswith("r0") for g in out["mine"][:2]) == 1
        assert sum(g.startswith("r0") for g in out["mine"][2:]) == 1
        assert float(out["balance"]["balance/dp_tokens_max_over_mean_before"]) > 1.9
        assert float(out["balance"]["balance/dp_tokens_max_over_mean"]) < 1.1
