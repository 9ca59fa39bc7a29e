"""One run per run directory: an exclusive ``flock`` on ``<run_dir>/run.lock``.

Owns :class:`RunDirLock`. The entry point takes it before any rank exists (under torchrun:
global rank 0, which tells the others) and holds it for the whole run; a second run into
the same directory is refused with :class:`RunDirBusy`, naming the directory and the
owner. Two runs in one directory would otherwise both succeed while their metrics,
summaries and checkpoint shards overwrite each other.

The kernel drops an flock when the last descriptor of its open file is closed, which
includes every way a process can die (SIGKILL, OOM killer), so a crash never leaves the
directory locked and there is no stale-lock cleanup. The owner's pid, host and start time
are written into the file only to name the owner in a refusal. The file is never deleted:
removing it would let a second run lock a fresh file while the first still holds the old
one. Does not own what runs under the lock. Imports no torch.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path

from megatron_rl.config_loading import ConfigError

LOCK_NAME = "run.lock"
"""The lock file inside the run directory."""


class RunDirBusy(ConfigError):
    """Another live process holds the run directory."""


class RunDirLock:
    """Exclusive ownership of a run directory for as long as this process holds it.

    Args:
        run_dir: the run's ``train.run_dir`` (created if missing).
    """

    def __init__(self, run_dir: str | Path) -> None:
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_NAME
        self._fd: int | None = None

    def acquire(self) -> "RunDirLock":
        """Take the lock without waiting.

        Raises:
            RunDirBusy: another process holds it; the message names the directory and the owner.
        """
        self.run_dir.mkdir(parents=True, exist_ok=True)
        # O_CLOEXEC (Python's default, spelled out): a spawned rank or server must not
        # inherit the descriptor, or the lock would outlive this process.
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = _read_owner(fd)
            os.close(fd)
            raise RunDirBusy(f"train.run_dir: {self.run_dir} is in use by another run ({owner}); wait for "
                             "it to finish, stop it, or choose another train.run_dir") from None
        owner = {"pid": os.getpid(), "host": socket.gethostname(),
                 "started": time.strftime("%Y-%m-%d %H:%M:%S %z")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(owner) + "\n").encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        """Give the directory up (closing the descriptor drops the flock)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> "RunDirLock":
        return self.acquire() if self._fd is None else self

    def __exit__(self, *exc) -> None:
        self.release()


def _read_owner(fd: int, wait_s: float = 1.0) -> str:
    """The holder's pid, host and start time, as one phrase."""
    deadline = time.monotonic() + wait_s
    while True:
        raw = os.pread(fd, 4096, 0)
        # The holder writes its name just after it locks: a refusal in between sees an
        # empty file for a moment.
        if raw.strip() or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    try:
        owner = json.loads(raw)
        return f"pid {owner['pid']} on {owner['host']}, started {owner['started']}"
    except (ValueError, KeyError, TypeError):
        return "owner unknown"
