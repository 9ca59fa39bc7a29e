"""The project's sbatch scripts on a real single-node Slurm cluster started by this module.

The fixture installs Debian's slurm-wlm and munge when they are missing (root and apt-get
needed; otherwise the tests skip and say why), starts munged if no munge daemon answers,
and starts slurmctld and slurmd for this host with a slurm.conf in a temporary directory
and ports of its own; teardown stops exactly the daemons it started (by PID) and removes
any cgroup directories Slurm created. Jobs run the venv's interpreter
(MEGATRON_RL_PYTHON) and write their output where the tests read it.
"""

import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from ports import PortTaken, free_port, on_a_fresh_port, was_taken

pytestmark = pytest.mark.parallel

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "demo_task.yaml"
SMALL = [
    "train.steps=2", "train.sft_steps=1", "train.eval_every=2", "train.save_every=2", "train.progress=false",
    "rollout.prompts_per_step=4", "rollout.group_size=4", "rollout.max_new_tokens=3",
    "data.task.num_train_prompts=64", "data.task.num_eval_prompts=16", "data.task.max_operand=9",
    # Neither the greedy eval pass nor the routing diagnostics' extra forward is asserted here.
    "eval.greedy=false", "train.routing_diagnostics=false",
]
# The plain script's run: one RL step shows the job trains, evaluates and checkpoints to the end
# (the SGLang script's run keeps two: step 2's rollouts prove the weights synced after an update).
ONE_STEP = [*SMALL, "train.steps=1", "train.eval_every=1", "train.save_every=1"]
BINARIES = ["slurmctld", "slurmd", "sbatch", "scontrol", "sinfo", "scancel", "munged", "munge", "unmunge", "runuser"]
CONVERT_ENTRY = """
import os, sys
from pathlib import Path

out = Path(sys.argv[sys.argv.index("--out") + 1])
(out / f"rank{os.environ['RANK']}").write_text(os.environ["WORLD_SIZE"] + " " + " ".join(sys.argv[1:]))
"""


def _bin(name):
    """Path of a Slurm or munge binary; daemons live in /usr/sbin, which a CI PATH may lack."""
    found = shutil.which(name)
    if found is None and Path("/usr/sbin", name).exists():
        found = str(Path("/usr/sbin", name))
    return found


def _install_slurm():
    """None when Slurm and munge are usable, else why they cannot be installed here."""
    if all(_bin(b) for b in BINARIES):
        return None
    if os.geteuid() != 0:
        return "Slurm (slurm-wlm, munge) is not installed, and installing it needs root"
    if not shutil.which("apt-get"):
        return "Slurm (slurm-wlm, munge) is not installed, and there is no apt-get to install it"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", "slurm-wlm", "munge"]):
        try:
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            return f"installing Slurm timed out: {' '.join(cmd)}"
        if done.returncode != 0:
            return f"installing Slurm failed: {' '.join(cmd)} exited {done.returncode}: {done.stderr.strip()[-400:]}"
    missing = [b for b in BINARIES if not _bin(b)]
    return f"slurm-wlm and munge installed but {missing} are missing" if missing else None


def _munge_answers():
    return subprocess.run(f"{_bin('munge')} -n | {_bin('unmunge')}", shell=True, capture_output=True).returncode == 0


def _alive(pid):
    """The process exists and is not a zombie (daemons here have no parent that reaps them)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state != "Z"


def _stop(pid):
    for sig, wait_s in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait_s
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        if not _alive(pid):
            return


def _read_pid(path, timeout=60.0):  # a daemon start took seconds under a load of ~100
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and path.read_text().strip().isdigit():
            return int(path.read_text().strip())
        time.sleep(0.05)
    raise RuntimeError(f"{path} did not appear")


def _cgroup_dirs():
    return set(Path("/sys/fs/cgroup").glob("*/slurm*")) | set(Path("/sys/fs/cgroup").glob("slurm*"))


def _start_munge(started):
    if _munge_answers():
        return
    run_dir = Path("/run/munge")
    run_dir.mkdir(parents=True, exist_ok=True)
    shutil.chown(run_dir, "munge", "munge")
    subprocess.run([_bin("runuser"), "-u", "munge", "--", _bin("munged")], check=True, capture_output=True)
    started.append(_read_pid(run_dir / "munged.pid"))
    deadline = time.monotonic() + 10
    while not _munge_answers():
        if time.monotonic() > deadline:
            raise RuntimeError("munged started but munge -n | unmunge still fails")
        time.sleep(0.1)


def _write_conf(root, node, ports):
    for sub in ("state", "spool", "log"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    conf = root / "slurm.conf"
    conf.write_text(f"""\
ClusterName=mrltest
SlurmctldHost={node}
SlurmctldPort={ports[0]}
SlurmdPort={ports[1]}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CryptoType=crypto/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
KillWait=5
FirstJobId={random.randrange(1000, 9000)}
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd.log
NodeName={node} CPUs={os.cpu_count()} State=UNKNOWN
PartitionName=debug Nodes={node} Default=YES MaxTime=INFINITE State=UP
""")
    return conf


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """A running one-node cluster: yields the environment that submits to it."""
    reason = _install_slurm()
    if reason is not None:
        pytest.skip(reason)
    root = tmp_path_factory.mktemp("slurm")
    node = socket.gethostname().split(".")[0]
    started, cgroups_before = [], _cgroup_dirs()
    try:
        _start_munge(started)
        # The daemons take port numbers only: ports taken before they bound them mean a fresh pair.
        env = on_a_fresh_port(lambda port: _start_daemons(root, node, (port, free_port()), started))
        yield env
    finally:
        for pid in reversed(started):
            _stop(pid)
        for path in sorted(_cgroup_dirs() - cgroups_before, key=lambda p: len(p.parts), reverse=True):
            for sub in sorted(path.rglob("*"), key=lambda p: len(p.parts), reverse=True):
                if sub.is_dir():
                    sub.rmdir()
            path.rmdir()


def _start_daemons(root, node, ports, started) -> dict:
    """slurmctld and slurmd on ``ports``, until the node is idle; returns the submitting environment.

    Raises:
        PortTaken: a daemon could not bind its port (both are stopped again).
    """
    conf = _write_conf(root, node, ports)
    env = {**os.environ, "SLURM_CONF": str(conf), "MEGATRON_RL_PYTHON": sys.executable}
    ours = []
    for daemon, pid_file in (("slurmctld", "slurmctld.pid"), ("slurmd", "slurmd.pid")):
        (root / pid_file).unlink(missing_ok=True)
        subprocess.run([_bin(daemon), "-f", str(conf)], env=env, check=True, capture_output=True)
        try:
            ours.append(_read_pid(root / pid_file))
        except RuntimeError:
            # Seen under load with a port grabber running: slurmd found its port taken and exited
            # before it wrote its pid file.
            logs = "\n".join((root / "log" / f).read_text()[-1500:] for f in ("slurmctld.log", "slurmd.log")
                             if (root / "log" / f).exists())
            for pid in reversed(ours):
                _stop(pid)
            if was_taken(logs):
                raise PortTaken(f"ports {ports}: {logs}") from None
            raise RuntimeError(f"{daemon} wrote no pid file:\n{logs}") from None
    started.extend(ours)
    deadline = time.monotonic() + 30
    while (state := _sinfo_state(env, node)) != "idle":
        if time.monotonic() > deadline:
            logs = "\n".join((root / "log" / f).read_text()[-1500:] for f in ("slurmctld.log", "slurmd.log"))
            if was_taken(logs):
                for pid in reversed(ours):
                    _stop(pid)
                    started.remove(pid)
                raise PortTaken(f"ports {ports}: {logs}")
            raise RuntimeError(f"node {node} is {state!r}, not idle, after 30 s:\n{logs}")
        time.sleep(0.1)
    return env


def _sinfo_state(env, node):
    done = subprocess.run([_bin("sinfo"), "-h", "-n", node, "-o", "%T"], env=env, capture_output=True, text=True)
    return done.stdout.strip()


def _submit(env, *args):
    done = subprocess.run([_bin("sbatch"), "--parsable", *args], cwd=REPO, env=env, capture_output=True, text=True,
                          check=True)
    return done.stdout.strip().split(";")[0]


def _wait(env, job, timeout=600.0):
    """Final (JobState, ExitCode) of a job (generous: a training job ran past 300 s under a load of ~100)."""
    deadline = time.monotonic() + timeout
    while True:
        line = subprocess.run([_bin("scontrol"), "show", "job", "-o", job], env=env, capture_output=True,
                              text=True).stdout
        fields = dict(item.split("=", 1) for item in line.split() if "=" in item)
        if fields.get("JobState") in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"):
            return fields["JobState"], fields["ExitCode"]
        if time.monotonic() > deadline:
            subprocess.run([_bin("scancel"), job], env=env)
            raise TimeoutError(f"job {job} still {fields.get('JobState')} after {timeout} s")
        time.sleep(0.5)


def test_sbatch_trains_the_tiny_config(slurm, tmp_path):
    run_dir = tmp_path / "run"
    job = _submit(slurm, "-o", str(tmp_path / "job-%j.out"), "launch/slurm/train.sbatch", str(CONFIG), *ONE_STEP,
                  f"train.run_dir={run_dir}")
    state, exit_code = _wait(slurm, job)
    output = (tmp_path / f"job-{job}.out").read_text()
    assert (state, exit_code) == ("COMPLETED", "0:0"), output[-4000:]
    assert f"metrics: {run_dir / 'metrics.jsonl'}" in output
    assert output.rstrip().endswith(f"megatron-rl: job {job} finished with exit code 0")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1] and "eval/accuracy" in rows[-1]
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_000001"
    node_log = (run_dir / "logs" / "node0.log").read_text()
    port = 20000 + int(job) % 10000
    head = socket.gethostname().split(".")[0]
    assert f"1 node(s) x 2 process(es) = world 2, c10d rendezvous {head}:{port}" in node_log
    assert f"id {job}" in node_log and "launch: node0 finished with exit code 0" in node_log


def test_convert_sbatch_runs_the_entry_on_every_rank(slurm, tmp_path):
    entry, out = tmp_path / "convert_entry.py", tmp_path / "out"
    entry.write_text(CONVERT_ENTRY)
    out.mkdir()
    job = _submit(slurm, "-o", str(tmp_path / "job-%j.out"), "launch/slurm/convert.sbatch", str(CONFIG), str(entry),
                  f"train.run_dir={tmp_path / 'run'}", "--", "--out", str(out))
    state, exit_code = _wait(slurm, job)
    output = (tmp_path / f"job-{job}.out").read_text()
    assert (state, exit_code) == ("COMPLETED", "0:0"), output[-4000:]
    for rank in (0, 1):
        assert (out / f"rank{rank}").read_text() == f"2 --config {CONFIG} train.run_dir={tmp_path / 'run'} --out {out}"


def test_multinode_sbatch_fails_the_job_on_a_rejected_config(slurm, tmp_path):
    # One node here, and no GPUs: the command line overrides the script's --nodes=2 and GPUs.
    job = _submit(slurm, "--nodes=1", "--gpus-per-node=0", "-o", str(tmp_path / "job-%j.out"),
                  "launch/slurm/train_multinode.sbatch", str(CONFIG), "parallel.world_size=3",
                  f"train.run_dir={tmp_path / 'run'}")
    state, exit_code = _wait(slurm, job)
    output = (tmp_path / f"job-{job}.out").read_text()
    assert (state, exit_code) == ("FAILED", "2:0"), output[-4000:]
    assert "megatron-rl-launch: error: parallel.expert_model_parallel_size" in output
    assert output.rstrip().endswith(f"megatron-rl: job {job} finished with exit code 2")
    assert not (tmp_path / "run" / "logs").exists()


def test_sglang_sbatch_serves_rollouts_from_a_server_step(slurm, tmp_path):
    """The SGLang job script in stand-in mode: a server step publishes its URL, the trainer
    finds it, trains over HTTP with weight sync, and the server step is stopped at the end."""
    run_dir = tmp_path / "run"
    env = {**slurm, "MEGATRON_RL_SGLANG_NODES": "0", "MEGATRON_RL_SGLANG_STAND_IN": str(CONFIG),
           "MEGATRON_RL_SGLANG_PORT": "0", "MEGATRON_RL_SGLANG_ARGS": "--threads 1"}  # the wrapper binds one
    job = _submit(env, "--nodes=1", "-o", str(tmp_path / "job-%j.out"), "launch/slurm/train_sglang.sbatch",
                  str(CONFIG), *SMALL, f"train.run_dir={run_dir}")
    state, exit_code = _wait(env, job, timeout=900)
    output = (tmp_path / f"job-{job}.out").read_text()
    assert (state, exit_code) == ("COMPLETED", "0:0"), output[-4000:]
    assert "(weight sync: tensor)" in output
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    # Rollout log-probs came from the server, under the weights of the step that used them.
    assert all(r["mismatch/train_rollout_abs_diff"] < 1e-4 for r in rows[1:]), rows
    server_log = next((run_dir / "logs").glob("sglang-*.log")).read_text()
    assert "protocol server (SGLang 0.5.23 protocol) on http://0.0.0.0:" in server_log  # the step's own server
    assert not list((run_dir / "sglang_urls").iterdir())  # the stopped server withdrew its URL
