"""The phase breakdown: nested phases apart, the step's remainder, memory peaks reset per
phase, the profiler's trace of a chosen step, the table and the stacked plot."""

from __future__ import annotations

import json
import math
import sys
import threading
import time

import pytest
import torch

from megatron_rl.sections.logging import ProfileConfig
from megatron_rl.train.metrics import MetricsLogger, plot_run
from megatron_rl.train.phases import StepWatch, phase_table, phase_timer

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
LINUX = sys.platform.startswith("linux")


def test_phase_timer_records_and_accumulates_seconds():
    metrics: dict = {}
    with phase_timer(metrics, "rollout"):
        time.sleep(0.02)
    first = metrics["time/rollout"]
    assert first >= 0.02
    with phase_timer(metrics, "rollout"):
        time.sleep(0.01)
    assert metrics["time/rollout"] >= first + 0.01
    with pytest.raises(KeyError), phase_timer(metrics, "train"):
        raise KeyError("boom")
    assert metrics["time/train"] >= 0.0 and metrics["perf/phase/train/seconds"] == metrics["time/train"]


def test_nested_phases_are_apart_and_the_step_sums_to_its_wall_time(tmp_path):
    metrics: dict = {}
    watch = StepWatch(ProfileConfig(), tmp_path, rank=0)
    watch.begin(1)
    with phase_timer(metrics, "rollout"):
        time.sleep(0.01)
        with phase_timer(metrics, "reward"):
            time.sleep(0.02)
        with phase_timer(metrics, "reward"):
            time.sleep(0.01)
    time.sleep(0.01)  # outside every phase
    with phase_timer(metrics, "update"):
        time.sleep(0.01)
    watch.end(1, metrics)
    parts = {k: v for k, v in metrics.items() if k.startswith("perf/phase/") and k.endswith("/seconds")}
    assert set(parts) == {f"perf/phase/{p}/seconds" for p in ("rollout", "reward", "update", "other")}
    assert math.isclose(sum(parts.values()), metrics["time/step"], rel_tol=1e-9)
    assert math.isclose(parts["perf/phase/rollout/seconds"] + metrics["time/reward"], metrics["time/rollout"],
                        rel_tol=1e-9)
    assert parts["perf/phase/reward/seconds"] == metrics["time/reward"] >= 0.03
    assert parts["perf/phase/other/seconds"] >= 0.01
    assert not (tmp_path / "profile").exists()


def test_a_phase_in_another_thread_does_not_count_against_the_step(tmp_path):
    metrics, elsewhere = {}, {}
    watch = StepWatch(ProfileConfig(), tmp_path, rank=0)
    watch.begin(1)

    def background():
        with phase_timer(elsewhere, "scoring"):
            time.sleep(0.01)

    with phase_timer(metrics, "rollout"):
        thread = threading.Thread(target=background)
        thread.start()
        thread.join()
    watch.end(1, metrics)
    assert math.isclose(metrics["perf/phase/rollout/seconds"], metrics["time/rollout"], rel_tol=1e-12)
    assert "time/scoring" in elsewhere and "time/scoring" not in metrics


@pytest.mark.skipif(not LINUX, reason="the resettable resident-memory peak is Linux's")
def test_memory_peaks_are_per_phase_and_the_enclosing_phase_keeps_its_nested_peak(tmp_path):
    size = 256 << 20
    metrics: dict = {}
    watch = StepWatch(ProfileConfig(), tmp_path, rank=0)
    watch.begin(1)
    with phase_timer(metrics, "rollout"):
        with phase_timer(metrics, "reward"):
            block = bytearray(size)  # zero-filled: every page is touched, so resident
            del block
        with phase_timer(metrics, "after"):
            pass
    with phase_timer(metrics, "update"):
        pass
    watch.end(1, metrics)
    gib = size / (1 << 30)
    peak = {p: metrics[f"perf/phase/{p}/host_rss_peak_gib"] for p in ("rollout", "reward", "after", "update")}
    assert peak["reward"] - peak["after"] >= 0.9 * gib, peak
    assert peak["rollout"] >= peak["reward"], peak
    assert peak["reward"] - peak["update"] >= 0.9 * gib, peak
    assert metrics["perf/step/host_rss_peak_gib"] >= peak["reward"]


def test_a_chosen_step_writes_a_chrome_trace_with_the_phase_ranges(tmp_path, capsys):
    watch = StepWatch(ProfileConfig(steps=[2]), tmp_path, rank=0)
    for step in (1, 2):
        metrics: dict = {}
        watch.begin(step)
        with phase_timer(metrics, "update"):
            torch.randn(64, 64) @ torch.randn(64, 64)
        watch.end(step, metrics)
    trace = tmp_path / "profile" / "step_000002" / "rank0.pt.trace.json"
    names = {event.get("name") for event in json.loads(trace.read_text())["traceEvents"]}
    assert {"phase/update", "aten::mm"} <= names
    assert not (tmp_path / "profile" / "step_000001").exists()
    assert f"profile of step 2: {trace.parent}" in capsys.readouterr().out


def test_phase_table_and_stacked_plot_of_a_run(tmp_path):
    with MetricsLogger(tmp_path, tensorboard=False) as logger:
        logger.log(0, {"eval/accuracy": 0.5})
        for step in (1, 2):
            logger.log(step, {"time/step": 2.0, "perf/phase/rollout/seconds": 1.5, "perf/phase/update/seconds": 0.4,
                              "perf/phase/other/seconds": 0.1, "perf/phase/update/host_rss_peak_gib": 1.0 + step,
                              "perf/step/host_rss_peak_gib": 3.5})
    from megatron_rl.train.metrics import read_metrics

    lines = phase_table(read_metrics(tmp_path)).splitlines()
    assert lines[0].split() == ["phase", "s/step", "share", "host_rss_peak", "GiB"]
    assert [line.split() for line in lines[2:]] == [
        ["rollout", "1.500", "75.0%", "-"], ["update", "0.400", "20.0%", "3.000"], ["other", "0.100", "5.0%", "-"],
        ["step", "2.000", "100.0%", "3.500"]]
    assert phase_table([{"step": 0}]) == "(no step timed)"
    paths = {p.name: p for p in plot_run(tmp_path)}
    assert paths["phases.png"].read_bytes().startswith(PNG_MAGIC)
    assert "memory.png" in paths
