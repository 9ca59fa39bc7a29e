"""Host-side collectives of the parallel layer on a two-rank gloo world."""

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
    }


def test_all_gather_varlen_concatenates_rows_of_different_counts_in_rank_order():
    for out in run_world(_gather_varlen, 2, timeout_s=60):
        assert torch.equal(out["floats"], torch.arange(6, dtype=torch.float32).reshape(3, 2))
        assert out["flags"].dtype == torch.bool
        assert out["flags"].tolist() == [True, False, True]
        assert out["empty"].shape == (0, 4) and out["empty"].dtype == torch.int64
        assert out["second_longer"].tolist() == [0, 1, 1]
