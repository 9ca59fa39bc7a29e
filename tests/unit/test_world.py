"""The gloo world harness: per-rank results, per-rank tracebacks, and hang timeouts."""

import importlib.util
import os
import signal
import socket
import subprocess
import sys
import time
from multiprocessing import forkserver as mp_forkserver
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from process_tree import ProcessTree

from megatron_rl.parallel import world
from megatron_rl.parallel.world import (
    WorldError,
    WorldTimeout,
    gone_on_this_host,
    rank_processes,
    run_world,
)

DEMO = Path(__file__).resolve().parents[2] / "configs" / "demo_cpu.yaml"


def _all_reduce_rank(scale):
    value = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(value)
    # The caller's main module (pytest's script here; the entry point in a run), had the
    # rank re-run it: every process a rank spawns would re-run it too (seconds each).
    main_file = getattr(sys.modules["__main__"], "__file__", None)
    from megatron.core.transformer.moe.router import TopKRouter

    # Megatron's jit_fuser is torch.compile; a function it decorated as the forkserver imported it.
    compiled = hasattr(TopKRouter._apply_expert_bias, "_torchdynamo_orig_callable")
    return {"rank": dist.get_rank(), "sum": value * scale, "main_file": main_file,
            "omp_wait": os.environ.get("OMP_WAIT_POLICY"), "megatron_compiles": compiled}


def _fail_on_rank_one():
    if dist.get_rank() == 1:
        raise ValueError("rank one is broken on purpose")
    dist.barrier()  # rank 0 blocks here: its peer never arrives
    return "unreachable"


def _hang():
    time.sleep(60)
    return "done"


def test_results_come_back_in_rank_order(monkeypatch):
    # Another process holds the port a free-port pick returns by the time rank 0 would bind it
    # (EADDRINUSE); the world must not depend on such a pick.
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        monkeypatch.setattr(world, "free_port", lambda: taken.getsockname()[1], raising=False)
        monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)  # tests/conftest.py sets it
        results = run_world(_all_reduce_rank, 2, 10.0, timeout_s=60)
    assert [r["rank"] for r in results] == [0, 1]
    assert all(float(r["sum"]) == 30.0 for r in results)
    assert [r["main_file"] for r in results] == [None, None]
    # Ranks' OpenMP threads sleep when they wait, the caller's environment left as it was.
    assert [r["omp_wait"] for r in results] == ["PASSIVE", "PASSIVE"] and "OMP_WAIT_POLICY" not in os.environ
    # Without CUDA, Megatron's fusions are the plain functions in the ranks (cpu_platform.EAGER_WITHOUT_CUDA).
    assert [r["megatron_compiles"] for r in results] == [torch.cuda.is_available()] * 2
    assert "TORCHDYNAMO_DISABLE" not in os.environ


def test_the_callers_openmp_wait_policy_wins(monkeypatch):
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    with world._environment_default(world.OPENMP_WAIT):
        assert os.environ["OMP_WAIT_POLICY"] == "ACTIVE"
    assert os.environ["OMP_WAIT_POLICY"] == "ACTIVE"
    monkeypatch.delenv("OMP_WAIT_POLICY")
    with world._environment_default(world.OPENMP_WAIT):
        assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE"  # as the forkserver and spawned ranks start
    assert "OMP_WAIT_POLICY" not in os.environ


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


def _killed_mid_collective(gone_file):
    processes = rank_processes(dist.group.WORLD)
    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        dist.barrier()  # rank 0: gloo reports only the connection its peer reset
    except Exception:
        # What a torchrun worker can tell: which peer on its node is gone.
        Path(gone_file).write_text(str(gone_on_this_host(processes)))
        raise
    return "unreachable"


def _killed_while_peer_works():
    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(2.0)  # rank 0 is busy (scoring rewards, say) when its peer dies
    dist.barrier()
    return "unreachable"


def test_a_killed_rank_is_named_with_its_signal_before_its_peers_errors(tmp_path):
    with pytest.raises(WorldError) as err:
        run_world(_killed_mid_collective, 2, str(tmp_path / "gone"), timeout_s=60)
    assert err.value.lost == {1: -signal.SIGKILL}
    assert [rank for rank, _ in err.value.failures] == [0]
    assert err.value.cause() == "rank 1 was killed by SIGKILL; ranks [0] failed after"
    assert (tmp_path / "gone").read_text() == "[1]"


KILLED_RANK_RUN = """
import sys
import megatron_rl.train.main as train_main
import test_world
from megatron_rl.parallel.world import run_world
train_main.run_world = lambda *args, **kwargs: run_world(test_world._killed_while_peer_works, 2, timeout_s=60)
sys.exit(train_main.main(sys.argv[1:]))
"""


def test_train_names_a_rank_killed_while_its_peer_was_busy_and_leaves_no_process(tmp_path):
    """The command with its world's rank 1 SIGKILLed: before any peer fails, the world has only
    the dead rank to report (one line, exit 1), and when the command returns, nothing of the
    run is left: not the ranks, not their forkserver (it used to outlive the command by 3-20 s,
    holding its output pipes, then stay a zombie of PID 1)."""
    here = Path(__file__).parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(here), str(here.parent), os.environ.get("PYTHONPATH", "")])}
    with open(tmp_path / "out", "w") as out, open(tmp_path / "err", "w") as err:
        command = subprocess.Popen([sys.executable, "-c", KILLED_RANK_RUN, "--config", str(DEMO),
                                    f"train.run_dir={tmp_path / 'run'}"], stdout=out, stderr=err, env=env)
    tree = ProcessTree(command.pid)
    assert command.wait(300) == 1
    assert tree.left() == [] and len(tree.seen) >= 3  # the forkserver and two ranks, all gone
    assert (tmp_path / "err").read_text().strip() == (
        "megatron-rl-train: error: rank 1 was killed by SIGKILL (MEGATRON_RL_TRACEBACK=1 prints every rank's "
        "traceback)")


FORKSERVER_EXIT_RUN = """
import atexit, os, sys
atexit.register(lambda: open(sys.argv[1], "a").write(f"{os.getpid()}\\n"))  # as torch's: before the module
import megatron_rl.parallel.forkserver_exit
print("flushed", end="")
child = os.fork()
if child == 0:
    sys.exit(3)  # a process forked from it keeps its own exit, handlers and status
_, status = os.waitpid(child, 0)
print(f" child {child} exited {os.waitstatus_to_exitcode(status)}", end="")
raise SystemExit  # what the forkserver does at its pipe's EOF
"""


def test_the_forkserver_exits_without_its_teardown(tmp_path):
    """The forkserver imports forkserver_exit last, so that on its caller's death it leaves at
    once (its teardown with torch and Megatron-Core loaded took 13 s on busy cores, the
    forkserver outliving the SIGKILLed command): handlers registered before it never run."""
    world._rank_context()
    assert mp_forkserver._forkserver._preload_modules[-1] == world.FORKSERVER_EXIT
    ran = tmp_path / "handlers_ran"
    done = subprocess.run([sys.executable, "-c", FORKSERVER_EXIT_RUN, str(ran)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    out, child = done.stdout, done.stdout.split()[2]
    assert out == f"flushed child {child} exited 3"
    assert ran.read_text() == f"{child}\n"  # the child's handler ran; the forkserver's own did not


def test_a_worlds_preload_is_imported_by_the_forkserver_before_its_exit_module():
    """``run_world(preload=...)``: the modules every rank of a run imports (the entry point's
    ``_rank_preload``) are imported once by the forkserver, not again by each rank."""
    world._rank_context("colorsys")
    assert mp_forkserver._forkserver._preload_modules[-2:] == ["colorsys", world.FORKSERVER_EXIT]
    world._rank_context()
    assert "colorsys" not in mp_forkserver._forkserver._preload_modules


def test_a_runs_preload_names_what_its_ranks_import():
    from megatron_rl.config import load_config
    from megatron_rl.train.main import _rank_preload

    root = Path(__file__).resolve().parents[2] / "configs"
    files = _rank_preload(load_config(root / "demo_cpu.yaml", []))
    task = _rank_preload(load_config(root / "demo_task.yaml", ["rollout.engine=megatron"]))
    assert {"datasets", "transformers.models.auto.tokenization_auto",
            "transformers.models.auto.modeling_auto"} <= set(files)
    assert task == ("megatron_rl.train.trainer",)  # no prompt files, no transformers replica
    for name in files:
        assert importlib.util.find_spec(name) is not None, name
