"""Metrics sinks: JSONL + TensorBoard logger, resume, plots, summary table, progress."""

from __future__ import annotations

import json
import math
import warnings
from fnmatch import fnmatchcase

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from megatron_rl.train.metrics import (
    DEFAULT_PLOTS,
    MetricsLogger,
    PlotSpec,
    plot_run,
    progress,
    read_metrics,
    summary_table,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _lines(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_logger_writes_jsonl_and_tensorboard(tmp_path):
    run_dir = tmp_path / "run"
    with MetricsLogger(run_dir) as logger:
        logger.log(0, {"train/reward": torch.tensor(0.25), "count/seqs": torch.tensor(8)})
        logger.log(1, {"train/reward": 0.5, "count/seqs": 16, "flag": True})
        # Flushed on every call: readable before the logger closes.
        assert [row["step"] for row in read_metrics(run_dir)] == [0, 1]
    assert _lines(run_dir) == [
        {"step": 0, "train/reward": 0.25, "count/seqs": 8},
        {"step": 1, "train/reward": 0.5, "count/seqs": 16, "flag": 1},
    ]
    assert isinstance(_lines(run_dir)[0]["count/seqs"], int)
    events = list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    assert len(events) == 1 and events[0].stat().st_size > 0
    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    scalars = [(e.step, e.value) for e in acc.Scalars("train/reward")]
    assert scalars == [(0, 0.25), (1, 0.5)]


def test_disabled_logger_touches_nothing(tmp_path):
    run_dir = tmp_path / "run"
    with MetricsLogger(run_dir, enabled=False) as logger:
        logger.log(0, {"x": 1.0})
        logger.log(0, {"x": "not checked either"})
    assert not run_dir.exists()


def test_logger_without_tensorboard(tmp_path):
    with MetricsLogger(tmp_path, tensorboard=False) as logger:
        logger.log(3, {"x": 1.5})
    assert _lines(tmp_path) == [{"step": 3, "x": 1.5}]
    assert not (tmp_path / "tensorboard").exists()


def test_nonfinite_values_become_null_and_are_counted(tmp_path):
    with MetricsLogger(tmp_path, tensorboard=False) as logger:
        with pytest.warns(RuntimeWarning, match="'loss' is nan at step 0"):
            logger.log(0, {"loss": float("nan"), "ok": 1.0})
        with warnings.catch_warnings():
            # A second non-finite value of the same name is counted without a new warning.
            warnings.simplefilter("error")
            logger.log(1, {"loss": torch.tensor(float("inf"))})
        with pytest.warns(RuntimeWarning, match="'gnorm' is -inf"):
            logger.log(2, {"gnorm": -math.inf})
        assert logger.nonfinite_counts == {"loss": 2, "gnorm": 1}
    assert _lines(tmp_path) == [
        {"step": 0, "loss": None, "ok": 1.0},
        {"step": 1, "loss": None},
        {"step": 2, "gnorm": None},
    ]


def test_bad_calls_raise_and_write_nothing(tmp_path):
    with MetricsLogger(tmp_path, tensorboard=False) as logger:
        logger.log(5, {"x": 1.0})
        with pytest.raises(ValueError, match="step 4 is before the last logged step 5"):
            logger.log(4, {"x": 1.0})
        with pytest.raises(ValueError, match='named "step"'):
            logger.log(6, {"step": 1})
        with pytest.raises(ValueError, match=r"'v' is a tensor of shape \(2,\)"):
            logger.log(6, {"v": torch.zeros(2)})
        with pytest.raises(TypeError, match="'name' must be a number or a tensor, got str"):
            logger.log(6, {"x": 2.0, "name": "abc"})
        with pytest.raises(TypeError, match="step must be an int"):
            logger.log(6.0, {"x": 1.0})
        logger.log(5, {"y": 2.0})
    with pytest.raises(RuntimeError, match="closed"):
        logger.log(7, {"x": 1.0})
    assert _lines(tmp_path) == [{"step": 5, "x": 1.0}, {"step": 5, "y": 2.0}]


def test_resume_keeps_steps_up_to_the_resume_step(tmp_path):
    with MetricsLogger(tmp_path) as logger:
        for step in range(1, 6):
            logger.log(step, {"x": float(step)})
    with MetricsLogger(tmp_path, resume_from_step=3) as logger:
        assert [row["step"] for row in read_metrics(tmp_path)] == [1, 2, 3]
        logger.log(4, {"x": 40.0})
        with pytest.raises(ValueError, match="before the last logged step 4"):
            logger.log(2, {"x": 1.0})
    assert [(row["step"], row["x"]) for row in read_metrics(tmp_path)] == [
        (1, 1.0),
        (2, 2.0),
        (3, 3.0),
        (4, 40.0),
    ]
    # A run restarted from scratch starts the file afresh.
    with MetricsLogger(tmp_path) as logger:
        logger.log(1, {"x": 100.0})
    assert _lines(tmp_path) == [{"step": 1, "x": 100.0}]


def test_resume_drops_a_line_cut_off_by_a_kill(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "x": 1.0}\n{"step": 2, "x": 2.0}\n{"step": 3, "x"')
    assert [row["step"] for row in read_metrics(tmp_path)] == [1, 2]
    with MetricsLogger(tmp_path, resume_from_step=10, tensorboard=False) as logger:
        logger.log(3, {"x": 3.0})
    assert [row["step"] for row in read_metrics(path)] == [1, 2, 3]


def test_read_metrics_rejects_corrupt_lines(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\nnot json\n{"step": 2}\n')
    with pytest.raises(ValueError, match="metrics.jsonl:2: not a JSON line"):
        read_metrics(path)
    path.write_text('{"x": 1}\n')
    with pytest.raises(ValueError, match="integer 'step'"):
        read_metrics(path)
    with pytest.raises(ValueError, match="integer 'step'"):
        MetricsLogger(tmp_path, resume_from_step=0, tensorboard=False)


# --------------------------------------------------------------------------- plots


def _write_run(run_dir, rows):
    with MetricsLogger(run_dir, tensorboard=False) as logger:
        for step, metrics in rows:
            logger.log(step, metrics)


def test_plot_run_draws_present_metrics_only(tmp_path):
    rows = []
    for step in range(6):
        metrics = {"rollout/reward_mean": step / 10, "objective/entropy/mean": 1.0 - step / 10}
        if step % 2 == 0:
            metrics["eval/accuracy"] = step / 5
        rows.append((step, metrics))
    rows.append((6, {"objective/entropy/mean": float("nan")}))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        _write_run(tmp_path, rows)
    paths = plot_run(tmp_path)
    assert [p.name for p in paths] == ["reward.png", "entropy.png"]
    for path in paths:
        assert path.parent == tmp_path / "plots"
        data = path.read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 1000
    assert not (tmp_path / "plots" / "clip_fraction.png").exists()


def test_the_reward_plot_draws_rewards_and_accuracy_not_seconds():
    names = ["time/reward", "reward/mean", "perf/phase/reward/seconds", "eval/accuracy", "reward/format_reward",
             "time/step", "rollout/reward_mean"]
    assert DEFAULT_PLOTS["reward"].matching(names) == [
        "reward/mean", "rollout/reward_mean", "reward/format_reward", "eval/accuracy"]
    assert DEFAULT_PLOTS["time"].matching(names) == ["time/reward", "time/step"]


def test_plot_run_with_custom_plots_and_out_dir(tmp_path):
    rows = [(s, {"gamma/min": 0.9, "gamma/mean": 0.95, "loss": 1.0 / (s + 1)}) for s in range(4)]
    _write_run(tmp_path, rows)
    assert [p.name for p in plot_run(tmp_path, tmp_path / "figs")] == ["rspo_gamma.png"]
    custom = {"loss": PlotSpec(title="Loss", ylabel="loss", keys=("loss",))}
    custom["missing"] = PlotSpec(title="Absent", ylabel="-", keys=("nothing/*",))
    paths = plot_run(tmp_path, tmp_path / "custom", plots=custom)
    assert paths == [tmp_path / "custom" / "loss.png"]
    assert paths[0].read_bytes().startswith(PNG_MAGIC)


def test_default_plot_patterns_match_the_project_metric_names():
    def plots_for(key):
        plots = DEFAULT_PLOTS.items()
        return [name for name, spec in plots if any(fnmatchcase(key, k) for k in spec.keys)]

    assert plots_for("eval/accuracy") == ["reward"]
    assert plots_for("rollout/reward_mean") == ["reward"]
    assert plots_for("objective/entropy/mean") == ["entropy"]
    assert plots_for("objective/clip/low_token_frac") == ["clip_fraction"]
    assert plots_for("gamma/min") == ["rspo_gamma"]
    assert plots_for("objective/weight/rspo/mean") == ["rspo_gamma"]
    assert plots_for("time/rollout") == ["time"]
    assert plots_for("time/step") == ["time"]
    assert plots_for("perf/phase/reward/seconds") == ["phases"]
    assert plots_for("perf/phase/update/host_rss_peak_gib") == ["memory"]
    assert plots_for("perf/phase/update/cuda_max_allocated_gib") == ["memory"]
    assert plots_for("optim/grad_norm") == []


# --------------------------------------------------------------------------- summary table


def test_summary_table_shows_first_middle_last_and_accuracy_change():
    rows = [{"step": s, "train/reward": s / 100, "count": s} for s in range(1, 101)]
    rows[0]["eval/accuracy"] = 0.125
    rows[49]["eval/accuracy"] = 0.5
    rows[98]["eval/accuracy"] = 0.75
    rows[99]["train/reward"] = None
    table = summary_table(rows, ["train/reward", "count", "eval/accuracy"], max_rows=5)
    lines = table.splitlines()
    assert lines[0].split() == ["step", "train/reward", "count", "eval/accuracy"]
    assert set(lines[1]) == {"-", " "}
    body = [line.split() for line in lines[2:-1]]
    assert [cells[0] for cells in body] == ["1", "26", "51", "75", "100"]
    assert body[0] == ["1", "0.01", "1", "0.125"]
    assert body[-1] == ["100", "null", "100", "-"]
    assert len({len(line) for line in lines[:-1]}) == 1
    assert lines[-1] == "held-out accuracy (eval/accuracy): 0.125 (step 1) -> 0.750 (step 99)"
    rows[9]["eval/correct_tool_use"], rows[89]["eval/correct_tool_use"] = 0.25, 0.5
    more = summary_table(rows, ["count"], max_rows=5, also=["eval/correct_tool_use", "never/logged"]).splitlines()
    assert more[-2:] == ["held-out accuracy (eval/accuracy): 0.125 (step 1) -> 0.750 (step 99)",
                         "eval/correct_tool_use: 0.250 (step 10) -> 0.500 (step 90)"]


def test_summary_table_without_accuracy_or_rows():
    rows = [{"step": 1, "x": 1.0}, {"step": 2, "x": 2.0}]
    table = summary_table(rows, ["x"])
    assert "held-out accuracy" not in table and len(table.splitlines()) == 4
    assert summary_table([], ["x"]) == "(no metrics logged)"
    with pytest.raises(ValueError, match="max_rows"):
        summary_table(rows, ["x"], max_rows=1)


# --------------------------------------------------------------------------- progress


def test_progress_is_silent_when_disabled(capsys):
    assert list(progress([3, 1, 2], "quiet", enabled=False)) == [3, 1, 2]
    bar = progress(4, "quiet", enabled=False)
    bar.set_postfix(reward=0.5)
    assert list(bar) == [0, 1, 2, 3]
    assert capsys.readouterr().err == ""
    assert list(progress(2, "loud")) == [0, 1]
    assert "loud" in capsys.readouterr().err
