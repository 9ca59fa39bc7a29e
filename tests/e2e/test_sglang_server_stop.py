"""The server wrapper (``python -m megatron_rl.rollout.sglang.server``) never leaves its server
behind: SIGTERM stops it and frees the port, SIGKILL of the wrapper takes it along, and a
wrapper refuses a port that something already answers on instead of calling that "healthy".

The wrapper runs in ``--stand-in`` mode: the CPU protocol server as the child.
"""

import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "demo_task.yaml"


def _wrapper(port: int, log: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "megatron_rl.rollout.sglang.server", "--stand-in", str(CONFIG),
                             "--host", "127.0.0.1", "--port", str(port), "--log-file", str(log),
                             "--", "--threads", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)


def _child(wrapper: subprocess.Popen, timeout_s: float = 30.0) -> psutil.Process:
    deadline = time.monotonic() + timeout_s
    while not (kids := psutil.Process(wrapper.pid).children()):
        assert wrapper.poll() is None and time.monotonic() < deadline, wrapper.communicate()
        time.sleep(0.05)
    return kids[0]


def _gone(proc: psutil.Process, within_s: float = 5.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            if proc.status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    proc.kill()
    return False


def _port_free(port: int) -> bool:
    """Nothing listens on the port (SO_REUSEADDR, as servers bind: connections the stopped
    server left in TIME_WAIT do not count)."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def test_sigterm_stops_the_server_and_a_taken_port_is_refused(tmp_path):
    first = _wrapper(0, tmp_path / "first.log")  # port 0: the wrapper binds one and hands it over
    try:
        server = _child(first)
        line = first.stdout.readline()  # blocks until /health answered 200
        assert "healthy" in line, (line, first.poll(), first.stderr.read() if first.poll() is not None else "")
        port = int(line.split("healthy at http://127.0.0.1:")[1].split()[0])
        second = _wrapper(port, tmp_path / "second.log")
        out, err = second.communicate(timeout=60)
        assert second.returncode == 1 and "healthy" not in out, out + err
        assert f"port {port} is already in use" in err and "Traceback" not in err, err
        first.send_signal(signal.SIGTERM)
        assert first.wait(60) == 128 + signal.SIGTERM
        assert "stopped by SIGTERM; server stopped" in first.stderr.read()
        assert _gone(server) and _port_free(port)
    finally:
        first.kill()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_stopping_the_wrapper_while_its_server_starts_takes_the_server_along(sig, tmp_path):
    # Before the server is healthy: a SIGTERM must not wait out the startup, and a SIGKILL
    # leaves the wrapper no chance to act at all.
    wrapper = _wrapper(0, tmp_path / "server.log")
    try:
        server = _child(wrapper)
        wrapper.send_signal(sig)
        assert wrapper.wait(10) == (128 + sig if sig != signal.SIGKILL else -sig)
        assert _gone(server)
    finally:
        wrapper.kill()
