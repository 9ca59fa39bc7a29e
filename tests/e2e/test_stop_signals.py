"""Stopping a run: SIGTERM/SIGINT end every rank (and reward worker) with one line and 128 + signal,
SIGKILL of the main process takes the ranks along, a second run into a live run's directory is
refused, and whatever the stop, the run directory resumes from its last complete checkpoint.

Each run is ``megatron-rl-train`` as a user starts it (a subprocess spawning a 2-rank gloo
world), on the built-in task with a tiny model that saves after every step.
"""

import contextlib
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

pytestmark = pytest.mark.parallel

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "demo_task.yaml"
TINY = ["train.sft_steps=2", "rollout.prompts_per_step=4", "rollout.group_size=2", "train.save_every=1",
        "train.eval_every=1000", "train.progress=false", "data.task.num_train_prompts=64",
        "data.task.num_eval_prompts=8"]
ENTRY = Path(sys.executable).with_name("megatron-rl-train")


def _start(run_dir: Path, log: Path, steps: int = 50, *extra: str) -> subprocess.Popen:
    # Output to files: a pipe nobody reads would block the run once full.
    command = [str(ENTRY)] if ENTRY.exists() else [sys.executable, "-m", "megatron_rl.train.main"]
    with open(log.with_suffix(".out"), "w") as out, open(log.with_suffix(".err"), "w") as err:
        return subprocess.Popen([*command, "--config", str(CONFIG), *TINY, f"train.steps={steps}",
                                 f"train.run_dir={run_dir}", *extra], stdout=out, stderr=err, cwd=ROOT)


def _output(log: Path) -> tuple[str, str]:
    return log.with_suffix(".out").read_text(), log.with_suffix(".err").read_text()


def _latest_step(run_dir: Path) -> int | None:
    pointer = run_dir / "checkpoints" / "latest"
    return int(pointer.read_text().strip().split("_")[-1]) if pointer.exists() else None


def _wait_for(condition, proc: subprocess.Popen, log: Path, timeout_s: float = 900.0, poll_s: float = 0.2):
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert proc.poll() is None, f"run exited with {proc.returncode} early:\n" + "\n".join(_output(log))
        assert time.monotonic() < deadline, "run made no progress:\n" + "\n".join(_output(log))
        time.sleep(poll_s)


def _descendants(proc: subprocess.Popen) -> list[psutil.Process]:
    kids = psutil.Process(proc.pid).children(recursive=True)
    assert len(kids) >= 2, kids  # the two ranks at least
    return kids


def _alive(procs: list[psutil.Process]) -> list[psutil.Process]:
    alive = []
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                alive.append(p)
    return alive


def _assert_all_gone(procs: list[psutil.Process], run_dir: Path, within_s: float = 5.0) -> None:
    deadline = time.monotonic() + within_s
    while _alive(procs) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = []
    for p in _alive(procs):
        with contextlib.suppress(psutil.Error):
            left.append(f"{p.pid} ({' '.join(p.cmdline())[:100]})")
    for p in procs:
        with contextlib.suppress(psutil.Error):
            p.kill()
    assert not left, f"still running: {left}"
    mentions = [p.info["pid"] for p in psutil.process_iter(["pid", "cmdline"])
                if str(run_dir) in " ".join(p.info["cmdline"] or [])]
    assert not mentions, mentions


def _stop(proc: subprocess.Popen, sig: int, run_dir: Path, log: Path) -> None:
    """Send ``sig``; the run exits with 128 + sig, one line and no traceback, leaving nothing behind."""
    kids = _descendants(proc)
    proc.send_signal(sig)
    assert proc.wait(60) == 128 + sig
    out, err = _output(log)
    name = signal.Signals(sig).name
    lines = [line for line in (out + err).splitlines() if "stopped by" in line]
    assert lines == [line for line in err.splitlines() if line.startswith(f"megatron-rl-train: stopped by {name}:")]
    assert len(lines) == 1 and "every rank ended; resume from" in lines[0], out + err
    assert "Traceback" not in out + err and "KeyboardInterrupt" not in out + err, out + err
    _assert_all_gone(kids, run_dir)


def _saving(run_dir: Path) -> bool:
    """A step directory newer than ``latest``: a checkpoint is being written."""
    latest = _latest_step(run_dir)
    steps = [int(p.name.split("_")[-1]) for p in (run_dir / "checkpoints").glob("step_*")]
    return max(steps) > latest


def _resumed(run_dir: Path, log: Path, *extra: str) -> tuple[subprocess.Popen, int]:
    """The same command into a stopped run's directory (the stopped owner left no lock behind):
    it resumes from the last complete checkpoint and saves a later one."""
    latest = _latest_step(run_dir)
    assert (run_dir / "checkpoints" / f"step_{latest:06d}" / "trainer_state.json").exists()
    proc = _start(run_dir, log, 50, *extra)
    _wait_for(lambda: _latest_step(run_dir) > latest, proc, log)
    assert f"(step {latest})" in _output(log)[0]
    return proc, latest


def test_sigterm_sigkill_mid_save_and_sigint_each_stop_every_rank_and_the_dir_resumes(tmp_path):
    """One run directory stopped three ways, each stop resumed by the next run (so that each
    world start serves two checks): SIGTERM stops a run (a second run into its directory
    refused while it lives); the resumed run (with a reward worker) is SIGKILLed mid-save, its
    main process only, and takes its ranks along; that resumed run is stopped by SIGINT (Ctrl-C)."""
    run_dir = tmp_path / "run"
    first = _start(run_dir, tmp_path / "first", 50, "reward.num_workers=1")
    try:
        _wait_for(lambda: _latest_step(run_dir) is not None, first, tmp_path / "first")
        second = _start(run_dir, tmp_path / "second", 50)
        assert second.wait(600) == 2
        out, err = _output(tmp_path / "second")
        assert err.strip().count("\n") == 0 and f"{run_dir} is in use by another run (pid {first.pid} on " in err
        assert first.poll() is None  # the owner trains on
        _stop(first, signal.SIGTERM, run_dir, tmp_path / "first")
    finally:
        first.kill()
    log = tmp_path / "killed"
    killed, _ = _resumed(run_dir, log, "reward.num_workers=1")
    try:
        kids = _descendants(killed)
        _wait_for(lambda: _saving(run_dir), killed, log, poll_s=0.01)
        killed.send_signal(signal.SIGKILL)
        killed.wait(10)
        _assert_all_gone(kids, run_dir)
    finally:
        killed.kill()
    log = tmp_path / "interrupted"
    interrupted, _ = _resumed(run_dir, log)
    try:
        _stop(interrupted, signal.SIGINT, run_dir, log)
    finally:
        interrupted.kill()
