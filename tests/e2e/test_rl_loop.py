"""End to end: the README's main road on CPU in EP2 (R2 + RSPO) and TP2 (R3w + RSPO, sampling at
T = 0.7 with top-p 0.9, the mismatch breakdown every step and the rollouts saved for
``megatron-rl-mismatch``), and exact resume.

Each run is a real 2-process gloo world through the same entry point as the README's main
command: the shipped pretrained HF checkpoint streamed into the layout, its tokenizer and
chat template, the arithmetic prompt files, the math reward in a worker pool, a few RL
steps, HF checkpoints out. Gradient clipping is off so that a wrongly scaled gradient
after a resume cannot hide. The crash is the same command run through
``tests/fail_after_step.py``, which makes every rank fail after a given step.
"""

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from process_tree import ProcessTree

from megatron_rl.checkpoint.hf_io import INCOMPLETE_MARKER, staging_dir
from megatron_rl.train.main import main
from megatron_rl.train.metrics import read_metrics

pytestmark = pytest.mark.parallel

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "demo_cpu.yaml"
FAIL_AFTER_STEP = ROOT / "tests" / "fail_after_step.py"
SMALL = [
    "train.steps=4", "train.save_every=2", "train.eval_every=2", "train.save_hf_every=2",
    "train.progress=false", "train.mini_batches=1", "optim.clip_grad=0",
    "rollout.prompts_per_step=4", "rollout.group_size=4", "rollout.max_new_tokens=12",
    "eval.max_prompts=4", "eval.num_samples=2", "eval.pass_k=[1,2]", "reward.num_workers=1",
]
PHASE_KEYS = ["time/rollout", "time/old_logprobs", "time/update", "reward/mean", "rollout/accuracy",
              "reward/errors", "reward/timeouts", "reward/has_answer",
              "mismatch/train_rollout_abs_diff", "routing/replay_agreement", "routing/flip_rate",
              "gamma/mean", "gamma/min", "optim/grad_norm", "perf/tokens_per_s"]


SAMPLED = ["train.routing_replay=R3w", "rollout.temperature=0.7", "rollout.top_p=0.9",
           "train.mismatch.breakdown=true", "train.mismatch.save_rollouts=true"]
"""The TP2 run: R3w, a sampling temperature and top-p, the breakdown, rollouts saved."""


def _run(run_dir, *extra):
    assert main(["--config", str(CONFIG), *SMALL, f"train.run_dir={run_dir}", *extra]) == 0
    return {row["step"]: row for row in read_metrics(Path(run_dir) / "metrics.jsonl")}


@pytest.fixture(scope="module")
def ep2_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("ep2")
    return run_dir, _run(run_dir)


@pytest.fixture(scope="module")
def tp2_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("tp2")
    return run_dir, _run(run_dir, "parallel.expert_model_parallel_size=1",
                         "parallel.tensor_model_parallel_size=2", *SAMPLED)


@pytest.mark.parametrize("which", ["ep2_run", "tp2_run"])
def test_every_phase_ran_with_finite_metrics_and_files(which, request):
    run_dir, rows = request.getfixturevalue(which)
    assert sorted(rows) == [0, 1, 2, 3, 4]
    for step in (0, 2, 4):
        assert {"eval/accuracy", "eval/pass@1", "eval/pass@2", "eval/accuracy_greedy"} <= set(rows[step]), step
    assert rows[0]["data/prompts_over_length"] == 0 and rows[0]["data/train_prompts"] > 100
    for step in (1, 2, 3, 4):
        missing = [k for k in PHASE_KEYS if k not in rows[step]]
        assert not missing, (step, missing)
        bad = {k: v for k, v in rows[step].items() if v is None or not math.isfinite(v)}
        assert not bad, (step, bad)
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    plots = {p.name for p in (run_dir / "plots").glob("*.png")}
    assert {"reward.png", "entropy.png", "clip_fraction.png", "rspo_gamma.png"} <= plots
    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    assert latest == "step_000004"
    state = json.loads((run_dir / "checkpoints" / latest / "trainer_state.json").read_text())
    assert state["step"] == 4 and state["data_position"] >= 16
    assert sorted(p.name for p in (run_dir / "hf").iterdir()) == ["step_000002", "step_000004"]
    exported = run_dir / "hf" / "step_000004"
    assert {"config.json", "tokenizer.json", "generation_config.json", "model.safetensors"} <= {
        p.name for p in exported.iterdir()}


@pytest.mark.parametrize("which", ["ep2_run", "tp2_run"])
def test_replay_and_rspo_were_active(which, request):
    _, rows = request.getfixturevalue(which)
    for step in (1, 2, 3, 4):
        assert rows[step]["routing/replayed_micro_batches"] > 0, step
        assert 0 < rows[step]["gamma/min"] <= rows[step]["gamma/mean"] <= 1.0, step
        assert "objective/weight/rspo/mean" in rows[step]


def test_sampled_policy_run_breaks_its_gap_down_and_the_tool_reads_its_rollouts(tp2_run, capsys):
    """Every step of the TP2 run (R3w at T = 0.7, top-p 0.9) logs the breakdown, whose parts sum to
    the gap, and what top-p leaves out; ``megatron-rl-mismatch`` reruns it from the saved rollouts
    of step 1 and 3 (weights of checkpoints 0 and 2) and skips step 2 (version 1: no checkpoint)."""
    from megatron_rl.mismatch_cli import main as mismatch

    run_dir, rows = tp2_run
    for step in (1, 2, 3, 4):
        row = rows[step]
        parts = sum(row[f"mismatch/breakdown/gap/{s}"] for s in ("expert_choice", "gate_weights", "other"))
        assert abs(parts - row["mismatch/breakdown/gap"]) <= 1e-6 + 1e-4 * row["mismatch/breakdown/gap"], step
        assert abs(row["mismatch/breakdown/gap"] - row["mismatch/train_rollout_abs_diff"]) <= 1e-7, step
        assert 0 < row["rollout/truncated_mass"] < 0.1 + 1e-6, step
        assert (run_dir / "mismatch" / f"step_{step:06d}.txt").read_text().startswith(f"step {step}: mean")
    assert (run_dir / "plots" / "mismatch.png").exists()
    assert mismatch([str(run_dir), "--steps", "1", "2", "3", "--worst", "2"]) == 0
    report = capsys.readouterr().out
    assert "step_000002: skipped, weight version(s) [1] not in a checkpoint" in report
    for step, weights in ((1, 0), (3, 2)):
        assert f"step_{step:06d} (weights step_{weights:06d}, 16 samples): mean |log-prob gap|" in report
    saved = {row["step"]: row for row in map(json.loads, (run_dir / "mismatch" / "breakdown.jsonl").read_text().splitlines())}
    assert sorted(saved) == [1, 3]
    for row in saved.values():  # fp32 hf replica and the checkpointed weights that fed it: numerics only
        assert row["mismatch/breakdown/gap"] < 1e-5 and row["mismatch/breakdown/share/expert_choice"] == 0.0
    # Step 1 (the starting weights), rerun in one process, is the gap the run logged. (From step 2 on,
    # the live TP2 trainer's replicated experts drift apart from the weights it saves and pushes:
    # expert weights of an EP1 run are all-reduced over DP only, not over the TP ranks whose
    # sequence-parallel shards they saw; the rerun shows the pushed weights' gap, ~1e-7.)
    assert abs(saved[1]["mismatch/breakdown/gap"] - rows[1]["mismatch/breakdown/gap"]) <= 1e-6
    assert (run_dir / "plots" / "mismatch_layers.png").exists()


def _cut_back_to_step_2(run_dir: Path, to: Path) -> Path:
    """A copy of the EP2 run's directory as the run left it after step 2 (checkpoint and export 2
    published, rows 0-2 logged): what a run crashed during step 3 resumes from."""
    cut = Path(shutil.copytree(run_dir, to))
    shutil.rmtree(cut / "checkpoints" / "step_000004")
    shutil.rmtree(cut / "hf" / "step_000004")
    (cut / "checkpoints" / "latest").write_text("step_000002")
    rows = (cut / "metrics.jsonl").read_text().splitlines()
    (cut / "metrics.jsonl").write_text("".join(row + "\n" for row in rows if json.loads(row)["step"] <= 2))
    return cut


@pytest.fixture(scope="module")
def crashed_then_resumed(ep2_run, tmp_path_factory):
    """The EP2 run cut back to step 2, run again to crash after step 3 (every rank fails), and the
    same command resumed. Before the resume, step 2's HF export is taken away and only a stopped
    export's staging directory, marked incomplete, is left in its place (what a run from before
    exports preceded publishing left after SIGTERM): the resume owes that export.
    (Starting from the EP2 run's checkpoint 2 rather than from scratch: the same config, so the
    same checkpoint, without training steps 0-2 again.)"""
    run_dir, _ = ep2_run
    tmp = tmp_path_factory.mktemp("crashed")
    crashed_dir = _cut_back_to_step_2(run_dir, tmp / "crashed")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    with open(tmp / "out", "w") as out, open(tmp / "err", "w") as errors:
        crashed = subprocess.Popen([sys.executable, str(FAIL_AFTER_STEP), "3", "--config", str(CONFIG), *SMALL,
                                    f"train.run_dir={crashed_dir}"], stdout=out, stderr=errors, env=env, cwd=ROOT)
    tree = ProcessTree(crashed.pid)
    code = crashed.wait(900)
    crash = {"code": code, "err": (tmp / "err").read_text(), "left": tree.left(), "seen": len(tree.seen),
             "latest": (crashed_dir / "checkpoints" / "latest").read_text().strip(),
             "logged": [row["step"] for row in read_metrics(crashed_dir / "metrics.jsonl")]}
    if code != 1:  # a resume after no crash proves nothing
        return crashed_dir, crash, None, None
    final = crashed_dir / "hf" / "step_000002"
    shutil.rmtree(final)
    staging = staging_dir(final)
    staging.mkdir()
    (staging / INCOMPLETE_MARKER).write_text("killed\n")
    (staging / "model.safetensors").write_bytes(b"half a shard")
    return crashed_dir, crash, staging, _run(crashed_dir)


def test_resume_after_a_crash_reproduces_the_uninterrupted_run(ep2_run, crashed_then_resumed):
    _, uninterrupted = ep2_run
    _, crash, _, resumed = crashed_then_resumed
    assert crash["code"] == 1, crash["err"]
    # When the command returns, nothing of the run is left (its forkserver used to outlive it).
    assert crash["left"] == [] and crash["seen"] >= 3
    # Both ranks fail; the report is one line from the first, no traceback.
    err = [line for line in crash["err"].splitlines() if "error" in line]
    assert len(err) == 1 and "injected failure after step 3" in err[0] and "Traceback" not in err[0], err
    assert crash["latest"] == "step_000002" and crash["logged"] == [0, 1, 2, 3]
    assert sorted(resumed) == [0, 1, 2, 3, 4]  # step 3 of the crashed run was replaced
    for step in (3, 4):
        for key, value in uninterrupted[step].items():
            if key.startswith(("time/", "perf/")):
                continue
            assert resumed[step][key] == value, (step, key, resumed[step][key], value)


def test_a_run_resumed_at_step_0_holds_step_0_once(ep2_run, tmp_path):
    """What a run that failed on a full disk saving step 1 leaves: step 0 published, its row
    logged, a partial step 1. The same command resumes at step 0; step 0's row is not written
    again (it was, after the checkpoint: metrics.jsonl held step 0 twice)."""
    run_dir, _ = ep2_run
    failed = Path(shutil.copytree(run_dir, tmp_path / "failed"))
    (failed / "checkpoints" / "latest").write_text("step_000000")
    rows = (failed / "metrics.jsonl").read_text().splitlines()
    (failed / "metrics.jsonl").write_text(rows[0] + "\n")
    partial = failed / "checkpoints" / "step_000001"
    partial.mkdir(exist_ok=True)
    (partial / "__0_0.distcp").write_bytes(b"half a shard")
    assert main(["--config", str(CONFIG), *SMALL, f"train.run_dir={failed}", "train.steps=1"]) == 0
    assert [row["step"] for row in read_metrics(failed / "metrics.jsonl")] == [0, 1]
    assert (failed / "checkpoints" / "latest").read_text().strip() == "step_000001"


def test_a_resumed_run_writes_the_hf_export_its_step_owes(ep2_run, crashed_then_resumed):
    """A run directory whose last checkpoint step (2) has no HF export, only a stopped export's
    staging directory marked incomplete. The same command resumes at that step, removes the
    staging directory and writes the export, the uninterrupted run's bytes."""
    run_dir, _ = ep2_run
    resumed_dir, crash, staging, resumed = crashed_then_resumed
    assert crash["code"] == 1, crash["err"]
    assert sorted(resumed) == [0, 1, 2, 3, 4]
    assert not staging.exists()
    for step in (2, 4):
        weights = f"hf/step_{step:06d}/model.safetensors"
        assert (resumed_dir / weights).read_bytes() == (run_dir / weights).read_bytes(), step


def test_resume_at_a_layout_the_optimizer_state_cannot_take_is_refused_up_front(ep2_run, capsys, monkeypatch):
    """Issue 27.1: the EP2 run's directory restarted with TP2 (EP1). Megatron's optimizer state
    of an EP>1 run is two chained optimizers and of an EP1 run one, so it cannot load: the
    command says so in one line naming both layouts, and no process world starts (before, the
    ranks crashed after 43 s with a KeyError). Seconds to fail: ``tools/bad_inputs.py``."""
    import megatron_rl.train.main as train_main

    def no_world(*args, **kwargs):
        raise AssertionError("a process world was started for a resume that cannot load")

    monkeypatch.setattr(train_main, "run_world", no_world)
    run_dir, _ = ep2_run
    latest = (run_dir / "checkpoints" / "latest").read_text()
    code = main(["--config", str(CONFIG), *SMALL, f"train.run_dir={run_dir}",
                 "parallel.expert_model_parallel_size=1", "parallel.tensor_model_parallel_size=2"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert ("parallel.expert_model_parallel_size: the run directory's checkpoint step_000004 was saved at "
            "TP1 PP1 EP2 ETP1 DP2 (2 processes), this config asks for TP2 PP1 EP1 ETP1 DP1 (2 processes)") in err, err
    assert (run_dir / "checkpoints" / "latest").read_text() == latest


ASYNCHRONOUS_METRICS = ("rollout/staleness_mean", "rollout/staleness_max", "rollout/rewards_scored_ahead",
                        "time/rollout_join")
"""What the asynchronous path (``rollout.max_staleness`` 1) logs every step, and the synchronous loop never."""

ASYNCHRONOUS_MACHINERY = ("megatron_rl.train.async_rollouts:AsyncRollouts.__init__",
                          "megatron_rl.train.rollouts:RolloutSource.start_generate",
                          "megatron_rl.train.rollouts:Background.start",
                          "megatron_rl.rollout.local.hf_engine:HFEngine.start_generate",
                          "megatron_rl.rollout.sglang.engine:SGLangEngine.start_generate")
"""The asynchronous path's buffer (``AsyncRollouts``) and every producer that starts a background
generation thread (the trainer's rollout source, the multi-turn one, the hf and SGLang engines')."""


def _synchronous_rank(cfg_dict: dict) -> list[dict]:
    """A rank of ``megatron-rl-train`` in which building the buffer of batches generated ahead,
    or starting any background generation, fails the run."""
    import importlib

    from megatron_rl.train.main import run_rank

    for target in ASYNCHRONOUS_MACHINERY:
        module, name = target.split(":")
        owner, attribute = name.split(".")

        def refuse(*args, _target=target, **kwargs):
            raise AssertionError(f"{_target} ran with rollout.max_staleness=0")

        setattr(getattr(importlib.import_module(module), owner), attribute, refuse)
    return run_rank(cfg_dict)


def test_staleness_zero_is_the_synchronous_loop_bit_for_bit(ep2_run, tmp_path, monkeypatch):
    """``rollout.max_staleness: 0`` (the default) is the synchronous loop: a run that sets the
    key explicitly builds none of the asynchronous machinery (no buffer of batches ahead, no
    background generation thread: each fails the run if called, ``_synchronous_rank``), logs
    none of its metrics, pushes every step's own weights, and is the default run bit for bit:
    steps 0-2's metrics and the exported step-2 weights. Both runs are made here, on this
    machine: floats recorded on another CPU differ in the last bits (other SIMD kernels)."""
    import megatron_rl.train.main as train_main

    world = train_main.run_world
    monkeypatch.setattr(train_main, "run_world", lambda fn, *args, **kw: world(_synchronous_rank, *args, **kw))
    run_dir, rows = ep2_run
    explicit_dir = tmp_path / "staleness0"
    explicit = _run(explicit_dir, "rollout.max_staleness=0", "train.steps=2")
    for step in (1, 2, 3, 4):
        assert not [k for k in ASYNCHRONOUS_METRICS if k in rows[step]], step
        assert "time/weight_sync" in rows[step], step
    assert sorted(explicit) == [0, 1, 2]
    for step in (0, 1, 2):
        ours = {k: v for k, v in explicit[step].items() if not k.startswith(("time/", "perf/"))}
        assert ours == {k: v for k, v in rows[step].items() if not k.startswith(("time/", "perf/"))}, step
    weights = "hf/step_000002/model.safetensors"
    assert (explicit_dir / weights).read_bytes() == (run_dir / weights).read_bytes()
