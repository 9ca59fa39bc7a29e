"""End to end: what a run shows besides its metrics file. A W&B offline run and an MLflow
file-store run that a resumed run continues, a profiled step's trace, and the per-step phase
breakdown of time and memory with its plots.

One 2-rank world runs the demo's road twice through ``megatron_rl.train.main.run_rank`` (the
body of every rank of ``megatron-rl-train``): 2 RL steps, then the same run directory resumed
for a third, each with W&B offline and MLflow on a file store, step 2 profiled. Both
runs share one world so that the process start is paid once. The W&B runs are read back with
wandb's own reader of its offline files, the MLflow run with MLflow's client.
"""

import json
import math
import os
from pathlib import Path

import pytest

pytest.importorskip("wandb")
pytest.importorskip("mlflow")

from wandb_files import read_offline_run  # noqa: E402

from megatron_rl.config_loading import to_dict  # noqa: E402
from megatron_rl.parallel.world import run_world  # noqa: E402
from megatron_rl.train.metrics import read_metrics  # noqa: E402
from megatron_rl.config import load_config as load_run_config  # noqa: E402

pytestmark = pytest.mark.parallel

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "demo_cpu.yaml"
SMALL = [
    "train.save_every=2", "train.eval_every=2", "train.progress=false", "train.mini_batches=1",
    "rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=8", "rollout.max_sampling_rounds=1",
    "eval.max_prompts=2", "eval.num_samples=1", "eval.pass_k=[1]", "reward.num_workers=1",
]


def _two_runs(first: dict, resumed: dict) -> list[list[dict]]:
    from megatron_rl.train.main import run_rank

    return [run_rank(first), run_rank(resumed)]


@pytest.fixture(scope="module")
def logged_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("logged")
    run_dir, store = root / "run", root / "mlruns"
    logged = [f"train.run_dir={run_dir}", "logging.wandb.mode=offline", "logging.wandb.project=e2e",
              "logging.mlflow.enabled=true", f"logging.mlflow.tracking_uri={store.as_uri()}",
              "logging.mlflow.experiment=e2e"]
    first = load_run_config(CONFIG, [*SMALL, *logged, "train.steps=2", "profile.steps=[2]"])
    resumed = load_run_config(CONFIG, [*SMALL, *logged, "train.steps=3"])
    with pytest.MonkeyPatch.context() as env:
        # MLflow 3 refuses its file store unless told that this is wanted (a database is its default).
        env.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
        # Neither library reports its errors or usage anywhere from a test.
        env.setenv("WANDB_ERROR_REPORTING", "false")
        env.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
        histories = run_world(_two_runs, 2, to_dict(first), to_dict(resumed), timeout_s=900)
    rows = {row["step"]: row for row in read_metrics(run_dir)}
    return run_dir, store, rows, histories


def test_wandb_offline_runs_hold_every_step_and_the_resumed_run_continues_the_same_id(logged_run):
    run_dir, _, rows, _ = logged_run
    ids = json.loads((run_dir / "tracker_ids.json").read_text())
    offline = sorted((run_dir / "wandb").glob("offline-run-*"))
    # One directory per start: only rank 0 logs.
    assert len(offline) == 2, offline
    read = [read_offline_run(next(d.glob("run-*.wandb"))) for d in offline]
    assert [run.run_id for run in read] == [ids["wandb"], ids["wandb"]]
    assert [[h["_step"] for h in run.history] for run in read] == [[0, 1, 2], [3]]
    for run in read:
        for logged in run.history:
            row = rows[logged["_step"]]
            differ = {k: (v, logged.get(k)) for k, v in row.items() if k != "step" and v is not None and logged.get(k) != v}
            assert not differ, (logged["_step"], differ)
    # Each run's HF checkpoint: an artifact whose entries reference the checkpoint's files (nothing uploaded).
    for run, step in zip(read, (2, 3)):
        (artifact,) = run.artifacts
        exported = run_dir / "hf" / f"step_{step:06d}"
        assert sorted(entry.ref for entry in artifact.manifest.contents) == sorted(
            p.resolve().as_uri() for p in exported.iterdir())


def test_mlflow_run_holds_every_step_and_the_resumed_run_continues_it(logged_run):
    from mlflow.tracking import MlflowClient

    run_dir, store, rows, _ = logged_run
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    client = MlflowClient(tracking_uri=store.as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name("e2e").experiment_id])
    assert run.info.run_id == json.loads((run_dir / "tracker_ids.json").read_text())["mlflow"]
    assert run.info.status == "FINISHED"
    for key, name in (("reward/mean", "reward/mean"), ("time/step", "time/step"),
                      ("perf/phase/update/seconds", "perf/phase.update.seconds")):
        history = client.get_metric_history(run.info.run_id, name)
        assert [(m.step, m.value) for m in history] == [(s, rows[s][key]) for s in (1, 2, 3)], key
    assert [m.step for m in client.get_metric_history(run.info.run_id, "eval/pass_1")] == [0, 2, 3]
    assert run.data.params["train.steps"] == "2"  # the config is logged once, when the run starts
    assert run.data.tags["hf_checkpoint.step_000003"] == str((run_dir / "hf" / "step_000003").resolve())
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id, "plots")}
    assert {"plots/phases.png", "plots/memory.png", "plots/reward.png"} <= artifacts


def test_the_profiled_step_leaves_a_chrome_trace_per_rank_with_the_phase_ranges(logged_run):
    run_dir = logged_run[0]
    for rank in (0, 1):
        trace = json.loads((run_dir / "profile" / "step_000002" / f"rank{rank}.pt.trace.json").read_text())
        names = {event.get("name") for event in trace["traceEvents"]}
        expected = {f"phase/{p}" for p in ("rollout", "reward", "old_logprobs", "ref_logprobs", "update",
                                           "weight_sync", "evaluation", "checkpoint", "hf_export")}
        assert expected <= names, (rank, expected - names)
    assert sorted(p.name for p in (run_dir / "profile").iterdir()) == ["step_000002"]


def test_phase_breakdown_sums_to_the_step_time_and_is_plotted(logged_run):
    """The phases, each without the phases nested in it, and the rest ("other") add up to the
    step's wall time; the named phases cover at least 95% of the run's step time."""
    run_dir, _, rows, _ = logged_run
    other = total = 0.0
    for step in (1, 2, 3):
        row = rows[step]
        parts = {k: v for k, v in row.items() if k.startswith("perf/phase/") and k.endswith("/seconds")}
        assert all(v >= 0 for v in parts.values()), (step, parts)
        assert math.isclose(sum(parts.values()), row["time/step"], rel_tol=1e-9), step
        other, total = other + parts["perf/phase/other/seconds"], total + row["time/step"]
        every_step = ("rollout", "reward", "old_logprobs", "ref_logprobs", "update", "weight_sync")
        assert {f"perf/phase/{p}/seconds" for p in every_step} <= set(parts), step
        assert row["perf/phase/rollout/seconds"] < row["time/rollout"]  # the reward phase inside it is apart
        assert 0 < row["perf/phase/update/host_rss_peak_gib"] <= row["perf/step/host_rss_peak_gib"]
    assert {"perf/phase/checkpoint/seconds", "perf/phase/evaluation/seconds", "perf/phase/hf_export/seconds"} <= set(
        rows[2]), "steps 2 and 3 evaluate, save and export"
    assert other <= 0.05 * total, (other, total)
    assert {"phases.png", "memory.png", "time.png"} <= {p.name for p in (run_dir / "plots").glob("*.png")}
