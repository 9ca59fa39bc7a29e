"""Two torchrun "nodes" on loopback: two launchers, one agent each, a c10d rendezvous.

One run trains the tiny CPU config for two RL steps through the launcher exactly as two
cluster nodes would run it (world 2 = 2 nodes x 1 process, EP2), each node with its own
SGLang stand-in (``--sglang``): the first test checks the launch and the training, the last
the servers. The second makes one worker fail and checks that both nodes' launchers exit
non-zero.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from ports import PortTaken, on_a_fresh_port, was_taken

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
FAILING_ENTRY = """
import torch.distributed as dist

dist.init_process_group("gloo")
dist.barrier()
if dist.get_rank() == 1:
    raise RuntimeError("injected failure on rank 1")
dist.barrier()  # rank 0 waits here for a peer that is gone
"""


WORKERS_RAN = ("ChildFailedError", "[rank0]:", "[rank1]:")
"""What a launcher prints once its workers ran: torchrun's failure summary, a worker's prefixed lines."""


def _two_nodes(tmp_path, *extra, timeout=300, per_node=lambda node: []):
    """Start two launchers (node ranks 0 and 1) against one rendezvous; returns their exit codes
    and outputs. torchrun takes the rendezvous port as a number: one taken before its agent
    bound it (the agents then wait on whatever holds it) means a fresh port."""
    return on_a_fresh_port(lambda port: _two_nodes_at(port, tmp_path, *extra, timeout=timeout, per_node=per_node))


def _two_nodes_at(port, tmp_path, *extra, timeout, per_node):
    # Two "nodes" share this machine's cores: one thread per worker, as on a 1-core node.
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "megatron_rl.launcher", "--config", str(CONFIG), "--nnodes", "2",
             "--nproc-per-node", "1", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"loopback-{port}",
             "--node-rank", str(node), *per_node(node), *extra],
            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for node in (0, 1)
    ]
    try:
        outputs = [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return _unless_port_taken([p.returncode for p in procs], outputs)


def _unless_port_taken(codes: list[int], outputs: list[str]) -> tuple[list[int], list[str]]:
    """The launchers' exit codes and outputs; :class:`PortTaken` when the rendezvous port was
    taken by another process before torchrun's agent bound it."""
    # Workers start only once the rendezvous completed, and then its port was ours. After that,
    # an agent whose peer ended first (a failed run) can fail its rendezvous' keep-alive or
    # shutdown with the same error type as a taken port; that run must not be started again.
    if 0 in codes or any(mark in o for o in outputs for mark in WORKERS_RAN):
        return codes, outputs
    # The agent that finds the port taken joins as a client of whatever holds it, and its
    # rendezvous fails to connect.
    lost = [o for code, o in zip(codes, outputs) if code and (was_taken(o) or "RendezvousConnectionError" in o)]
    if lost:
        raise PortTaken(lost[0][-500:])
    return codes, outputs


@pytest.fixture(scope="module")
def sglang_run(tmp_path_factory):
    """One two-node training run, ``--sglang`` on both nodes (each launcher starts the CPU
    stand-in); the launch and training checks and the server checks below read it. The
    launcher's path is the same with or without ``--sglang`` up to the server step, so one
    run serves both (a full run costs ~60 CPU-s, most of it the ranks' start-up)."""
    tmp_path = tmp_path_factory.mktemp("two_nodes")
    run_dir = tmp_path / "run"
    def server(node):  # port 0: the wrapper binds one, hands it to its stand-in and publishes its URL
        return ["--sglang", f"--stand-in {CONFIG} --host 127.0.0.1 --port 0 -- --threads 1"]

    codes, outputs = _two_nodes(tmp_path, *SMALL, f"train.run_dir={run_dir}", per_node=server, timeout=400)
    assert codes == [0, 0], "\n".join(o[-3000:] for o in outputs)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return run_dir, outputs, rows


def test_two_loopback_nodes_train_the_tiny_config(sglang_run):
    run_dir, outputs, rows = sglang_run
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert "eval/accuracy" in rows[-1] and "reward/mean" in rows[-1]
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_000002"
    for node, output in enumerate(outputs):
        log = (run_dir / "logs" / f"node{node}.log").read_text()
        assert "2 node(s) x 1 process(es) = world 2, c10d rendezvous 127.0.0.1:" in log
        assert log.rstrip().endswith(f"launch: node{node} finished with exit code 0")
        assert output.rstrip().endswith(f"launch: node{node} finished with exit code 0")
    # Whichever node the rendezvous made global rank 0 prints the run summary.
    summaries = [o for o in outputs if f"metrics: {run_dir / 'metrics.jsonl'}" in o]
    assert len(summaries) == 1


def test_a_failing_worker_fails_both_nodes(tmp_path):
    entry = tmp_path / "failing_entry.py"
    entry.write_text(FAILING_ENTRY)
    logs = tmp_path / "logs"
    # Generous: under a load of ~100 the two launchers took 2 minutes just to start.
    codes, outputs = _two_nodes(tmp_path, "--entry", str(entry), "--log-dir", str(logs), timeout=400)
    assert all(code != 0 for code in codes), (codes, outputs)
    texts = [(logs / f"node{node}.log").read_text() for node in (0, 1)]
    assert sum("injected failure on rank 1" in t for t in texts) == 1
    for node, text in enumerate(texts):
        assert f"launch: node{node} finished with exit code {codes[node]}" in text


def test_a_port_is_taken_only_when_no_worker_ran():
    """Seen under load: after the injected failure, node 1's agent failed its rendezvous'
    keep-alive (``get_state``) with the error a taken port gives, and the run was started again."""
    failed = "[rank1]: RuntimeError: injected failure on rank 1\nChildFailedError:\n"
    keep_alive = "RendezvousConnectionError: The connection to the C10d store has failed (get_state)\n"
    assert _unless_port_taken([1, 1], [failed, keep_alive]) == ([1, 1], [failed, keep_alive])
    with pytest.raises(PortTaken):
        _unless_port_taken([1, 1], [keep_alive, "launch: node1 finished with exit code 1"])
    with pytest.raises(PortTaken):
        _unless_port_taken([1, 1], ["torch.distributed.DistNetworkError: EADDRINUSE", keep_alive])


def test_each_node_serves_rollouts_from_its_own_sglang_server(sglang_run):
    """``--sglang``: every node's launcher starts a server (here the CPU stand-in), the trainer
    finds both through the launch's URL directory, spreads requests over them and syncs
    weights into both; the servers are stopped and their URLs withdrawn at the end."""
    run_dir, _outputs, rows = sglang_run
    assert [r["step"] for r in rows] == [0, 1, 2]
    # Rollout log-probs came from the servers, which served each step's synced weights.
    assert all(r["mismatch/train_rollout_abs_diff"] < 1e-4 for r in rows[1:]), rows
    for node in (0, 1):
        node_log = (run_dir / "logs" / f"node{node}.log").read_text()
        assert "launch: SGLang server:" in node_log and "rollout.engine=sglang" in node_log
        assert "rollout.sglang.num_servers=2" in node_log
        server_log = (run_dir / "logs" / f"sglang-node{node}.log").read_text()
        # Both servers took requests (load balancing) and every step's weights (version 2).
        done = re.search(r"stopped: (\d+) generate requests, \d+ batches, (\d+) weight updates, weight version (\S+)",
                         server_log)
        assert done and int(done[1]) > 0 and int(done[2]) >= 3 and done[3] == "2", server_log[-2000:]
    assert not [p for p in (run_dir / "sglang_urls").rglob("*") if p.is_file()]

