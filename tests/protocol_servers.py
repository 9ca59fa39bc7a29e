"""A protocol server (the CPU SGLang stand-in with the tests' fault injection,
``standin_faults.py``) in its own process, for the e2e tests that need one running for a
whole module."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

from megatron_rl.rollout.sglang.server import ManagedServer

DEMO_TASK = Path(__file__).resolve().parents[1] / "configs" / "demo_task.yaml"
STANDIN_FAULTS = Path(__file__).resolve().parent / "standin_faults.py"


def protocol_server_command(port: int, *extra: str, config: Path = DEMO_TASK) -> list[str]:
    """The server's command line: one torch thread, then ``extra`` arguments."""
    return [sys.executable, str(STANDIN_FAULTS), "--config", str(config),
            "--port", str(port), "--threads", "1", *extra]


def protocol_server(log_dir: Path, *extra: str, config: Path = DEMO_TASK,
                    env: dict[str, str] | None = None) -> ManagedServer:
    """A server not yet started (warnings off, log in ``log_dir``); ``env``: more environment
    (``server.SERVER_ENV`` launches it as the wrapper does: raw log-probs). It serves on a socket
    bound as it starts, on a port the kernel picks (its ``url`` names it once started), kept by a
    restart."""
    return ManagedServer(protocol_server_command(0, *extra, config=config), "http://127.0.0.1:0",
                         env={"PYTHONWARNINGS": "ignore", **(env or {})}, log_path=log_dir / "server.log",
                         listen="127.0.0.1")


def running_protocol_server(log_dir: Path, *extra: str) -> Iterator[ManagedServer]:
    """Yields a healthy server (warnings off, log in ``log_dir``, SGLang's default temperature-
    scaled log-probs) and stops it afterwards; a module fixture's body:
    ``yield from running_protocol_server(...)``."""
    srv = protocol_server(log_dir, *extra)
    srv.start()
    srv.wait_healthy(timeout_s=180, poll_s=0.2)
    yield srv
    srv.stop()
