"""Asynchronous rollouts (``rollout.max_staleness: 1``) end to end, in the deterministic mode.

A protocol server (transformers numerics, its own process) answers each request on its own
(``--max-batch 1``), so a sample depends on its seed and the served weights only and runs
can be compared exactly. The trainer runs in a 2-process gloo world (EP2); one world runs:

* run A: steps 1-3, the server SIGKILLed (and restarted by this process) while step 2's
  batch is being generated in the background during step 1, and the trainer failing
  after step 3 (checkpoint at step 2, holding step 3's batch generated ahead);
* run B: a fresh trainer resuming that checkpoint, steps 3-4;
* run C: the finished run extended (``train.steps`` 5, same directory): step 5 trains the
  batch B generated during step 4, as an uninterrupted 5-step run would (version 3).

Checked for every trained sample: its weight version (within one of the trainer's, and
the restarted server's samples re-asked at the version pushed again); the behaviour
log-probs the loss used (``rollout_logprobs_T``) are the served model's at exactly that
version (and measurably not the next one's); the proximal "old" log-probs are the
trainer's own at the start of the step, exactly; every prompt of the training order is
trained once, none twice, none skipped, across the kill and the restart; B's step 3 is A's
step 3 bit for bit (A scored its rewards in the generation thread, B after loading them).
"""

import dataclasses
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch
from fail_after_step import fail_after
from protocol_servers import running_protocol_server

from megatron_rl.config import RunConfig, load_config
from megatron_rl.config_loading import to_dict
from megatron_rl.parallel.world import run_world
from megatron_rl.rollout.sglang.control import request_json

pytestmark = pytest.mark.parallel

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "demo_task.yaml"
SMALL = [
    "train.steps=4", "train.sft_steps=20", "train.save_every=2", "train.eval_every=100", "train.progress=false",
    "train.mini_batches=1", "train.routing_replay=R3", "optim.lr=3e-3", "optim.clip_grad=0",
    "rollout.prompts_per_step=4", "rollout.group_size=4", "rollout.max_new_tokens=3", "rollout.max_sampling_rounds=1",
    "objective.dynamic_sampling=false", "objective.mismatch=tis", "eval.temperature=0.0", "eval.max_prompts=4",
    "eval.greedy=false", "data.task.num_train_prompts=24", "data.task.num_eval_prompts=12",
    "data.task.max_operand=5", "rollout.engine=sglang", "rollout.max_staleness=1",
    "rollout.sglang.retry_backoff_max_s=1.0",
]
PER_RANK = 2 * 4
"""Requests per rank and step: 2 prompts (4 per step over 2 data-parallel ranks) x group size 4."""


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from running_protocol_server(tmp_path_factory.mktemp("server"), "--max-batch", "1")


class _Recorder:
    """Wraps a trainer's step and batch: per step the weights it started from (its version)
    and what the loss got."""

    def __init__(self, trainer, snapshots: dict):
        self.trainer, self.snapshots, self.steps = trainer, snapshots, {}
        rl_step, batch = trainer.rl_step, trainer._batch

        def recording_step(step, state):
            self.step = step
            snapshots[state.weight_version] = [p.detach().clone() for p in trainer.ddp.parameters()]
            return rl_step(step, state)

        def recording_batch(chosen, metrics):
            out = batch(chosen, metrics)
            samples = [s for group in chosen.samples for s in group]
            self.steps[self.step] = {
                "ids": sorted(p.sample_id for p in chosen.problems), "versions": [s.weight_version for s in samples],
                "sequences": out.sequences, "prompt_lengths": out.prompt_lengths,
                "rollout_lp": out.rollout_logprobs_T.clone(), "old_lp": out.old_logprobs_T.clone(),
            }
            return out

        trainer.rl_step, trainer._batch = recording_step, recording_batch


def _kill_during_background_generation(trainer, url: str, pid: int) -> None:
    """Once step 2's batch is launched and all its requests (both ranks') sit in the server,
    rank 0 kills it; the delay armed before either rank launches keeps them there."""
    import torch.distributed as dist

    launch = trainer.ahead.launch

    def launch_then_kill(step, state):
        if step == 2:
            if dist.get_rank() == 0:
                before = request_json("GET", url + "/_test/stats")[1]["generate_requests"]
                request_json("POST", url + "/_test/fault", {"kind": "delay", "times": 2 * PER_RANK, "delay_s": 3.0})
            dist.barrier()
        launch(step, state)
        if step == 2 and dist.get_rank() == 0:
            deadline = time.monotonic() + 30
            while (request_json("GET", url + "/_test/stats")[1]["generate_requests"] - before < 2 * PER_RANK
                   and time.monotonic() < deadline):
                time.sleep(0.05)
            os.killpg(pid, signal.SIGKILL)

    trainer.ahead.launch = launch_then_kill


def _async_rank(cfg_dict: dict, url: str, pid: int) -> dict:
    from megatron_rl.config_loading import from_dict
    from megatron_rl.parallel.cpu_platform import cpu_platform
    from megatron_rl.parallel.groups import model_parallel
    from megatron_rl.parallel.logprobs import compute_logprobs
    from megatron_rl.train.trainer import Trainer

    cfg = from_dict(RunConfig, cfg_dict)
    snapshots: dict[int, list] = {}
    with cpu_platform(), model_parallel(cfg.parallel, cfg.seed) as groups:
        a = Trainer(cfg, groups)
        rec_a = _Recorder(a, snapshots)
        _kill_during_background_generation(a, url, pid)
        fail_after(a, 3)
        try:
            a.run()
            raise AssertionError("the injected failure did not happen")
        except RuntimeError as err:
            assert "injected failure after step 3" in str(err), err
        finally:
            a.scorer.close()
        rows_a = {row["step"]: row for row in _metrics(cfg)}
        b = Trainer(cfg, groups)
        rec_b = _Recorder(b, snapshots)
        rows_b = {row["step"]: row for row in b.run()}
        c = Trainer(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, steps=5)), groups)
        rec_c = _Recorder(c, snapshots)
        rows_c = {row["step"]: row for row in c.run()}

        def logprobs_under(version, record):
            with torch.no_grad():
                for p, w in zip(b.ddp.parameters(), snapshots[version]):
                    p.copy_(w)
            return compute_logprobs(b.ddp, groups, record["sequences"], record["prompt_lengths"], record_routing=True,
                                    **b._packing()).logprobs_T

        checks = {}
        for run, rec in (("A", rec_a), ("B", rec_b), ("C", rec_c)):
            for step, record in sorted(rec.steps.items()):
                lengths = [len(s) - p for s, p in zip(record["sequences"], record["prompt_lengths"])]
                under = {v: logprobs_under(v, record).split(lengths) for v in {step - 2, step - 1} if v >= 0}
                behaviour = record["rollout_lp"].split(lengths)
                checks[(run, step)] = {
                    "ids": record["ids"], "versions": record["versions"],
                    "proximal_exact": torch.equal(record["old_lp"], torch.cat(under[step - 1])),
                    "behaviour_diff_own": max(float((b_ - under[v][i]).abs().max())
                                              for i, (b_, v) in enumerate(zip(behaviour, record["versions"]))),
                    "behaviour_diff_next": max((float((b_ - under[v + 1][i]).abs().max())
                                               for i, (b_, v) in enumerate(zip(behaviour, record["versions"]))
                                               if v + 1 == step - 1), default=None),
                    "rollout_lp": record["rollout_lp"], "old_lp": record["old_lp"],
                }
        order = [p.sample_id for p in b.rollouts.problems_at(0, 4 * (cfg.train.steps + 1))]
        return {"checks": checks, "rows_a": rows_a, "rows_b": rows_b, "rows_c": rows_c, "order": order}


def _metrics(cfg) -> list[dict]:
    from megatron_rl.train.metrics import read_metrics

    return read_metrics(Path(cfg.train.run_dir) / "metrics.jsonl")


def test_staleness_one_versions_logprobs_and_exactly_once_across_a_server_kill_and_a_restart(server, tmp_path):
    cfg = load_config(CONFIG, [*SMALL, f"train.run_dir={tmp_path}", f"rollout.sglang.urls=[{server.url}]"])
    pid = server.process.pid

    def restart_when_killed():
        server.process.wait()
        server.start()
        server.wait_healthy(timeout_s=180, poll_s=0.2)

    restarter = threading.Thread(target=restart_when_killed, daemon=True)
    restarter.start()
    results = run_world(_async_rank, 2, to_dict(cfg), server.url, pid, timeout_s=900)
    restarter.join(timeout=5)
    assert server.process.pid != pid  # the server was killed and came back
    rows_a, rows_b = results[0]["rows_a"], results[0]["rows_b"]
    for key, check in sorted(results[0]["checks"].items()):
        print(f"\nrun {key[0]} step {key[1]}: versions {sorted(set(check['versions']))}, behaviour log-probs vs "
              f"their version {check['behaviour_diff_own']:.1e}, vs the next {check['behaviour_diff_next']}", end="")
    print(f"\nstep 2: retries {rows_a[2]['sglang/retries']:g}, resyncs {rows_a[2]['sglang/resyncs']:g}")
    # Step 2's batch lost its server mid-generation: retries and one re-push, no duplicate.
    assert rows_a[2]["sglang/resyncs"] == 1 and rows_a[2]["sglang/retries"] >= 2 * PER_RANK, rows_a[2]
    for rows in (rows_a, rows_b):
        assert all(row.get("sglang/duplicates", 0) == 0 for row in rows.values())
    for rank in results:
        checks = rank["checks"]
        assert sorted(checks) == [("A", 1), ("A", 2), ("A", 3), ("B", 3), ("B", 4), ("C", 5)]
        # Versions: step 1 generated synchronously (v0); step 2's batch, launched under v0, was
        # re-asked after the re-push of v1 (the trainer's weights at that join); steps 3 and 4
        # were generated one version behind the weights they trained.
        assert set(checks[("A", 1)]["versions"]) == {0}
        assert set(checks[("A", 2)]["versions"]) <= {0, 1} and 1 in checks[("A", 2)]["versions"]
        assert set(checks[("A", 3)]["versions"]) == set(checks[("B", 3)]["versions"]) == {1}
        assert set(checks[("B", 4)]["versions"]) == {2}
        # The extended run's step 5 trains the batch B's last step generated under version 3.
        assert set(checks[("C", 5)]["versions"]) == {3}
        for key, check in checks.items():
            assert len(check["versions"]) == PER_RANK, key
            assert check["proximal_exact"], key  # "old" = the trainer's pass at the step's start
            assert check["behaviour_diff_own"] < 1e-4, (key, check["behaviour_diff_own"])
        for key in (("A", 3), ("B", 4), ("C", 5)):  # stale samples: the next version's log-probs differ measurably
            assert checks[key]["behaviour_diff_next"] > 1e-3, (key, checks[key]["behaviour_diff_next"])
        # Exactly once: steps 1-2 of A, 3-4 of B and 5 of C train the training order's prompts 0..19.
        trained = [i for step in ((("A", 1), ("A", 2), ("B", 3), ("B", 4), ("C", 5))) for i in checks[step]["ids"]]
        assert sorted(trained) == sorted(rank["order"]) and len(set(trained)) == len(trained)
        # The resumed step 3 is the failed run's step 3, bit for bit.
        assert checks[("A", 3)]["ids"] == checks[("B", 3)]["ids"]
        assert torch.equal(checks[("A", 3)]["rollout_lp"], checks[("B", 3)]["rollout_lp"])
        assert torch.equal(checks[("A", 3)]["old_lp"], checks[("B", 3)]["old_lp"])
    # Rewards: scored in the generation thread where it had the samples (A's step 3, B's step 4);
    # step 2's were all re-asked at the join, and B's step 3 came from the checkpoint, so they
    # were scored at the join, by the same function on the same inputs: B's step 3 = A's.
    assert [rows_a[2]["rollout/rewards_scored_ahead"], rows_a[3]["rollout/rewards_scored_ahead"],
            rows_b[3]["rollout/rewards_scored_ahead"], rows_b[4]["rollout/rewards_scored_ahead"]] == [0, 1, 0, 1]
    for key, value in rows_a[3].items():
        if not key.startswith(("time/", "perf/", "rollout/rewards_scored_ahead")):
            assert rows_b[3][key] == value, (key, rows_b[3][key], value)
    assert [rows_a[s]["rollout/staleness_max"] for s in (1, 3)] == [0, 1] and rows_b[4]["rollout/staleness_max"] == 1
    assert rows_b[4]["rollout/staleness_mean"] == 1
    rows_c = results[0]["rows_c"]
    assert sorted(rows_c) == [5] and rows_c[5]["rollout/staleness_max"] == 1
    assert rows_c[5]["rollout/rewards_scored_ahead"] == 0  # restored from the checkpoint: scored at the join
