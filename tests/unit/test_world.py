"""The gloo world harness: per-rank results, per-rank tracebacks, and hang timeouts."""

import time

import pytest
import torch
import torch.distributed as dist

from megatron_rl.parallel.world import WorldError, WorldTimeout, run_world


def _all_reduce_rank(scale):
    value = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(value)
    return {"rank": dist.get_rank(), "sum": value * scale}


def _fail_on_rank_one():
    if dist.get_rank() == 1:
        raise ValueError("rank one is broken on purpose")
    dist.barrier()  # rank 0 blocks here: its peer never arrives
    return "unreachable"


def _hang():
    time.sleep(60)
    return "done"


def test_results_come_back_in_rank_order():
    results = run_world(_all_reduce_rank, 2, 10.0, timeout_s=60)
    assert [r["rank"] for r in results] == [0, 1]
    assert all(float(r["sum"]) == 30.0 for r in results)


def test_failure_on_one_rank_carries_its_traceback():
    with pytest.raises(WorldError) as err:
        run_world(_fail_on_rank_one, 2, timeout_s=60)
    message = str(err.value)
    assert "--- rank 1 failed ---" in message
    assert "ValueError: rank one is broken on purpose" in message


def test_hanging_world_is_killed_with_a_clear_message():
    # Every rank hangs, so the ranks named are the same however long the ranks take to start
    # on a busy machine (a rank that finishes early would race the 8 s limit).
    start = time.monotonic()
    with pytest.raises(WorldTimeout, match=r"did not finish in 8s; ranks still running: \[0, 1\]"):
        run_world(_hang, 2, timeout_s=8)
    assert time.monotonic() - start < 40
