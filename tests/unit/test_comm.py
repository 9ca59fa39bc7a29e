"""The parallel layer's collectives, point-to-point transfers and failure agreement on a two-rank
gloo world."""

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
        **_point_to_point_and_agreement(group, rank),
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


def _point_to_point_and_agreement(group, rank):
    """Rank queries, send/recv, broadcasts, object gathers, and ``raise_first_failure``."""
    from megatron_rl.parallel import comm

    out = {"rank": comm.rank(group), "size": comm.size(group), "global_ranks": comm.global_ranks(group)}
    box = torch.tensor([7, 8]) if rank == 1 else torch.zeros(2, dtype=torch.int64)
    if rank == 1:
        comm.send(box, 0, group)
    else:
        comm.recv(box, 1, group)
    out["received_tensor"] = box
    out["broadcast"] = comm.broadcast(torch.tensor([float(rank + 5)]), 1, group)
    out["broadcast_object"] = comm.broadcast_object({"from": rank}, 1, group)
    out["gathered_objects"] = comm.all_gather_objects(("rank", rank), group)
    comm.barrier(group)
    comm.raise_first_failure(None, group, "a step every rank passes")
    try:
        comm.raise_first_failure(ValueError("bad shard") if rank == 1 else None, group, "loading")
        out["failure"] = None
    except comm.RankFailed as err:
        out["failure"] = ("RankFailed", err.rank, str(err))
    except ValueError as err:
        out["failure"] = ("ValueError", rank, str(err))
    return out


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


def test_point_to_point_broadcasts_and_object_gathers_name_group_ranks():
    for rank, out in enumerate(_world()):
        assert (out["rank"], out["size"], out["global_ranks"]) == (rank, 2, [0, 1])
        assert out["received_tensor"].tolist() == [7, 8]
        assert out["broadcast"].tolist() == [6.0]
        assert out["broadcast_object"] == {"from": 1}
        assert out["gathered_objects"] == [("rank", 0), ("rank", 1)]


def test_raise_first_failure_raises_the_cause_once_and_names_it_elsewhere():
    rank0, rank1 = (out["failure"] for out in _world())
    assert rank1 == ("ValueError", 1, "bad shard")
    assert rank0 == ("RankFailed", 1, "rank 1 failed loading: ValueError: bad shard")
