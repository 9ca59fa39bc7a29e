"""W&B and MLflow trackers: a tracker that cannot start costs one warning line, never the run
nor a hang; W&B online falls back to offline files under the same run id; the names MLflow
accepts; nothing written when no tracker is on."""

from __future__ import annotations

import json
import socket
import time

import pytest

from megatron_rl.config import load_config
from megatron_rl.train.sinks import IDS_FILE, Trackers, mlflow_name


def test_mlflow_names_keep_one_group_and_no_refused_character():
    assert mlflow_name("eval/pass@4") == "eval/pass_4"
    assert mlflow_name("routing/flip_rate") == "routing/flip_rate"
    assert mlflow_name("routing/flip_rate/layer1") == "routing/flip_rate.layer1"
    assert mlflow_name("perf/phase/update/seconds") == "perf/phase.update.seconds"
    assert mlflow_name("loss") == "loss"


def test_no_tracker_and_no_logging_rank_write_nothing(tmp_path):
    with Trackers(load_config(None, [f"train.run_dir={tmp_path}"]), enabled=True, resumed=False) as trackers:
        trackers.log(1, {"a": 1.0})
    offline = load_config(None, [f"train.run_dir={tmp_path}", "logging.wandb.mode=offline",
                                 "logging.mlflow.enabled=true"])
    with Trackers(offline, enabled=False, resumed=False) as trackers:
        trackers.log(1, {"a": 1.0})
    assert list(tmp_path.iterdir()) == []


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_unreachable_servers_cost_one_warning_line_each_and_wandb_keeps_offline_files(tmp_path, capfd, monkeypatch):
    """W&B: nothing listens on its server's port; MLflow: a server that accepts connections and
    never answers. The trackers' one line each, and W&B's offline run under the same id."""
    pytest.importorskip("wandb")
    pytest.importorskip("mlflow")
    from wandb_files import read_offline_run

    # Neither library reports its errors or usage anywhere from a test.
    monkeypatch.setenv("WANDB_ERROR_REPORTING", "false")
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{_closed_port()}")
    monkeypatch.setenv("WANDB_API_KEY", "0" * 40)
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)  # the kernel completes the connections; nothing ever reads or answers
        mlflow_url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        cfg = load_config(None, [f"train.run_dir={tmp_path}", "logging.wandb.mode=online",
                                 "logging.wandb.init_timeout_s=2", "logging.mlflow.enabled=true",
                                 f"logging.mlflow.tracking_uri={mlflow_url}", "logging.mlflow.start_timeout_s=2",
                                 "logging.close_timeout_s=60"])
        start = time.monotonic()
        with Trackers(cfg, enabled=True, resumed=False) as trackers:
            trackers.log(1, {"a/b": 1.0})
            trackers.log(2, {"a/b": 2.0})
        assert time.monotonic() - start < 60
    lines = [line for line in capfd.readouterr().err.splitlines() if "warning" in line.lower()]
    assert len(lines) == 2, lines
    wandb_line = next(line for line in lines if "W&B" in line)
    mlflow_line = next(line for line in lines if "MLflow" in line)
    assert wandb_line.startswith("megatron-rl-train: warning: W&B: cannot start the online run (CommError: ")
    assert f"logging offline to {tmp_path / 'wandb'} instead" in wandb_line
    assert mlflow_line.startswith(f"megatron-rl-train: warning: MLflow: ConnectionError: {mlflow_url} did not "
                                  "answer within 2 s")
    assert mlflow_line.endswith("; the run goes on without it")
    run_id = json.loads((tmp_path / IDS_FILE).read_text())["wandb"]
    (wandb_file,) = (tmp_path / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb")
    assert [row["_step"] for row in read_offline_run(wandb_file).history] == [1, 2]
