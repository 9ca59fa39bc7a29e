"""How a local world's processes end with their caller (:mod:`~megatron_rl.parallel.world`):
the orphans of a dead rank adopted, the processes of the ranks' groups waited for and reaped,
the forkserver stopped and reaped at the caller's exit. Owns no world.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import time
from multiprocessing import forkserver, resource_tracker, util

import psutil


def running(pid: int) -> bool:
    """Whether ``pid`` is a process that has not ended (a zombie has)."""
    try:
        return psutil.Process(pid).status() not in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)
    except psutil.NoSuchProcess:
        return False


def adopt_orphans(on: bool) -> None:
    """While on, a process of the run orphaned by its rank's death (its reward workers, say) is
    re-parented to this process rather than to PID 1, so that :func:`end_groups` can reap it:
    nothing is left as a zombie for an init that may never reap it (Linux; elsewhere a no-op)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, int(on), 0, 0, 0)


_PR_SET_CHILD_SUBREAPER = 36  # <sys/prctl.h>


def end_groups(groups: set[int], wait_s: float) -> None:
    """Wait up to ``wait_s`` until no process of the process ``groups`` runs (they were sent
    SIGKILL), reaping those that ended as this process's children (orphans it adopted)."""
    deadline = time.monotonic() + wait_s
    while True:
        left = []
        for pid in psutil.pids():
            with contextlib.suppress(psutil.Error, ProcessLookupError, PermissionError, ChildProcessError):
                if os.getpgid(pid) not in groups:
                    continue
                if running(pid):
                    left.append(pid)
                elif psutil.Process(pid).ppid() == os.getpid():
                    os.waitpid(pid, os.WNOHANG)
        if not left or time.monotonic() > deadline:
            return
        time.sleep(0.02)


def end_forkserver(wait_s: float = 5.0) -> list[str]:
    """Stop this process's forkserver (the ranks' parent) and reap it: nothing of it outlives
    the caller, not its interpreter's teardown with torch and Megatron loaded (seconds, holding
    the command's output pipes), nor a zombie left to PID 1. Live descendants (a rank that
    survived :func:`~megatron_rl.parallel.world.run_world`'s stop) and a forkserver still
    running ``wait_s`` after SIGTERM are SIGKILLed. Returns what had to be killed, named, empty
    when nothing did. Registered at exit by the first world of a process.
    """
    server = forkserver._forkserver
    with server._lock:
        pid = server._forkserver_pid
        if pid is None:
            return []
        killed = []
        with contextlib.suppress(psutil.Error):
            for child in live(psutil.Process(pid).children(recursive=True)):
                child.kill()
                killed.append(f"a rank or its child (pid {child.pid})")
        os.close(server._forkserver_alive_fd)  # how it is asked to stop; SIGTERM skips its teardown
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
        killed += _reaped(pid, wait_s, "the ranks' forkserver")
        address = server._forkserver_address
        if address and not util.is_abstract_socket_namespace(address):
            with contextlib.suppress(FileNotFoundError):  # in multiprocessing's temporary directory, removed
                os.unlink(address)
        server._forkserver_pid = server._forkserver_alive_fd = server._forkserver_address = None
        return killed


def end_resource_tracker(wait_s: float = 5.0) -> list[str]:
    """Stop multiprocessing's resource tracker (the world's queue started it) as it asks to be
    stopped (its pipe closed: it unlinks what leaked, then exits) and reap it; killed after
    ``wait_s``. Returns what had to be killed."""
    tracker = resource_tracker._resource_tracker
    with tracker._lock:
        if tracker._fd is None:
            return []
        os.close(tracker._fd)
        pid, tracker._fd, tracker._pid = tracker._pid, None, None
        return _reaped(pid, wait_s, "multiprocessing's resource tracker")


def _reaped(pid: int, wait_s: float, name: str) -> list[str]:
    """Wait up to ``wait_s`` for child ``pid`` to exit, then SIGKILL it; reaped either way.
    Returns ``[name (pid)]`` when it had to be killed."""
    deadline = time.monotonic() + wait_s
    while os.waitpid(pid, os.WNOHANG) == (0, 0):
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return [f"{name} (pid {pid})"]
        time.sleep(0.02)
    return []


def end_forkserver_at_exit() -> None:
    """:func:`end_forkserver`, then :func:`end_resource_tracker` (the forkserver holds its pipe
    too), naming in one line what had to be killed."""
    killed = end_forkserver() + end_resource_tracker()
    if killed:
        print(f"{os.path.basename(sys.argv[0]) or 'python'}: killed what was left of the run's processes at "
              f"exit: {', '.join(killed)}", file=sys.stderr, flush=True)


def live(processes: list[psutil.Process]) -> list[psutil.Process]:
    """Those of ``processes`` that have not ended."""
    return [p for p in processes if running(p.pid)]
