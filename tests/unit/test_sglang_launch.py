"""The server launcher's URL hand-off (SLURM path) and its stand-in mode, without servers."""

import subprocess
import sys
import threading
import time

import pytest

from megatron_rl.rollout.sglang.server import read_url_files, write_url_file


def test_url_files_are_read_in_name_order_once_all_servers_published(tmp_path):
    write_url_file(tmp_path / "node1", "http://node1:30000")
    # The second server publishes a little later: the reader waits for it.
    late = threading.Timer(0.3, write_url_file, (tmp_path / "node0", "http://node0:30000"))
    late.start()
    started = time.monotonic()
    assert read_url_files(tmp_path, 2, timeout_s=10, poll_s=0.05) == ["http://node0:30000", "http://node1:30000"]
    assert time.monotonic() - started >= 0.25
    assert not list(tmp_path.glob(".*"))  # the atomic write leaves no temporary file behind


def test_missing_extra_and_bad_url_files_are_named(tmp_path):
    write_url_file(tmp_path / "node0", "http://node0:30000")
    with pytest.raises(TimeoutError, match=r"1 of 2 SGLang servers published a URL within 0.2s \(\['node0'\]\)"):
        read_url_files(tmp_path, 2, timeout_s=0.2, poll_s=0.05)
    write_url_file(tmp_path / "node1", "http://node1:30000")
    with pytest.raises(ValueError, match="2 URL files but 1 servers expected"):
        read_url_files(tmp_path, 1, timeout_s=1)
    (tmp_path / "node1").write_text("node1:30000\n")
    with pytest.raises(ValueError, match="node1: 'node1:30000' is not an http"):
        read_url_files(tmp_path, 2, timeout_s=1)


def test_stand_in_mode_runs_the_protocol_server_and_model_path_is_required():
    out = subprocess.run([sys.executable, "-m", "megatron_rl.rollout.sglang.server", "--stand-in", "configs/x.yaml",
                          "--port", "31001", "--print-command", "--", "--threads", "1"],
                         capture_output=True, text=True, check=True).stdout.split()
    assert out[1:3] == ["-m", "megatron_rl.sglang_standin.server"]
    assert out[out.index("--config") + 1] == "configs/x.yaml" and out[out.index("--port") + 1] == "31001"
    assert out[-2:] == ["--threads", "1"]
    missing = subprocess.run([sys.executable, "-m", "megatron_rl.rollout.sglang.server", "--port", "1"],
                             capture_output=True, text=True)
    assert missing.returncode == 2 and "--model-path is required" in missing.stderr


def test_a_launcher_that_failed_stops_the_wait_at_once(tmp_path):
    write_url_file(tmp_path / "node0", "http://node0:30000")
    write_url_file(tmp_path / "node1.failed", "server exited with code 2 before it was healthy (log: x.log)")
    with pytest.raises(RuntimeError, match="failed to start: node1: server exited with code 2"):
        read_url_files(tmp_path, 2, timeout_s=60)


def test_the_launcher_reports_a_server_that_cannot_start(tmp_path):
    # A stand-in config that does not exist: the protocol server exits before it is healthy.
    url_file = tmp_path / "urls" / "node0"
    done = subprocess.run([sys.executable, "-m", "megatron_rl.rollout.sglang.server", "--stand-in",
                           str(tmp_path / "missing.yaml"), "--host", "127.0.0.1", "--port", "1",
                           "--url-file", str(url_file), "--log-file", str(tmp_path / "server.log")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "exited with code" in done.stderr
    with pytest.raises(RuntimeError, match=r"node0: server for http://127.0.0.1:1 exited with code \d+"):
        read_url_files(url_file.parent, 1, timeout_s=1)
