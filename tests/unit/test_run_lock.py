"""One run per run directory: a second run is refused naming the owner; a dead owner frees it."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_rl.train.main import main
from megatron_rl.train.run_lock import RunDirBusy, RunDirLock

DEMO = Path(__file__).resolve().parents[2] / "configs" / "demo_task.yaml"
HOLD = "import sys, time; from megatron_rl.train.run_lock import RunDirLock; " \
       "RunDirLock(sys.argv[1]).acquire(); print('held', flush=True); time.sleep(300)"


@pytest.fixture
def holder(tmp_path):
    """Another process that owns ``tmp_path / 'run'``, as a running training would."""
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    yield run_dir, proc
    proc.kill()
    proc.wait()


def test_a_second_run_is_refused_in_one_line_naming_the_dir_and_the_owner(holder, capsys):
    run_dir, owner = holder
    # A run short enough that, were it not refused, it would finish and pass as a success.
    code = main(["--config", str(DEMO), f"train.run_dir={run_dir}", "train.progress=false", "train.steps=1",
                 "train.sft_steps=0"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and err[0].startswith("megatron-rl-train: error: train.run_dir: ")
    assert f"{run_dir} is in use by another run (pid {owner.pid} on " in err[0]
    assert not (run_dir / "checkpoints").exists() and not (run_dir / "metrics.jsonl").exists()  # no world ran
    assert owner.poll() is None


def test_a_busy_directory_is_refused_before_the_input_checks(holder, capsys, monkeypatch):
    """The lock first: the input checks read every prompt file (2.5 min for a large dataset)."""
    import megatron_rl.train.main as train_main

    def checked(cfg):
        raise AssertionError("the inputs were checked before the lock")

    monkeypatch.setattr(train_main, "check_inputs", checked)
    run_dir, owner = holder
    assert main(["--config", str(DEMO), f"train.run_dir={run_dir}"]) == 2
    assert f"{run_dir} is in use by another run (pid {owner.pid} on " in capsys.readouterr().err


def test_a_run_refused_by_its_inputs_leaves_its_directory_free(tmp_path, capsys, monkeypatch):
    import megatron_rl.train.main as train_main

    def refused(cfg):
        raise train_main.ConfigError("data.train_files: no such file")

    monkeypatch.setattr(train_main, "check_inputs", refused)
    (tmp_path / "run").mkdir()
    assert main(["--config", str(DEMO), f"train.run_dir={tmp_path / 'run'}"]) == 2
    assert capsys.readouterr().err.strip() == "megatron-rl-train: error: data.train_files: no such file"
    RunDirLock(tmp_path / "run").acquire().release()  # not held by the refused run
    assert main(["--config", str(DEMO), f"train.run_dir={tmp_path / 'fresh'}"]) == 2
    assert not (tmp_path / "fresh").exists()  # created only once the inputs pass


def test_an_owner_that_was_killed_leaves_no_stuck_lock(holder):
    run_dir, owner = holder
    with pytest.raises(RunDirBusy, match=f"pid {owner.pid}"):
        RunDirLock(run_dir).acquire()
    owner.send_signal(signal.SIGKILL)
    owner.wait()
    with RunDirLock(run_dir) as lock:
        assert f'"pid": {os.getpid()}' in lock.path.read_text()


def test_two_locks_in_one_process_also_exclude_each_other(tmp_path):
    # flock belongs to an open file, not a process: a second in-process run is refused too,
    # and releasing the first frees the directory for the next run in the same process.
    first = RunDirLock(tmp_path).acquire()
    with pytest.raises(RunDirBusy, match=str(tmp_path)):
        RunDirLock(tmp_path).acquire()
    first.release()
    RunDirLock(tmp_path).acquire().release()
