"""What a command started, for checking that none of it outlives the command: a thread
records every descendant of a process while it runs (the ranks, their forkserver, reward
workers), and :meth:`ProcessTree.left` names those still there when it has returned."""

from __future__ import annotations

import contextlib
import threading

import psutil


class ProcessTree:
    """Descendants of ``pid``, recorded every ``poll_s`` until :meth:`left` is called."""

    def __init__(self, pid: int, poll_s: float = 0.05) -> None:
        self.root, self.seen = psutil.Process(pid), {}
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._record, args=(poll_s,), daemon=True)
        self._thread.start()

    def _record(self, poll_s: float) -> None:
        while not self._done.wait(poll_s):
            with contextlib.suppress(psutil.Error):
                for child in self.root.children(recursive=True):
                    self.seen.setdefault(child.pid, child)

    def left(self) -> list[str]:
        """The recorded processes that still exist, zombies included (a zombie left to PID 1
        is an entry the command did not reap), each as ``"pid (status, cmdline)"``."""
        self._done.set()
        self._thread.join()
        out = []
        for pid, process in sorted(self.seen.items()):
            with contextlib.suppress(psutil.Error):
                if process.is_running():
                    out.append(f"{pid} ({process.status()}, {' '.join(process.cmdline())[:80]})")
        return out
