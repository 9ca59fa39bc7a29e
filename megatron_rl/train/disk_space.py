"""Writes that fail because the disk is full, reported as such: the path and the cause.

Owns :class:`NoSpaceLeft` and :func:`reporting_a_full_disk`, which the run's writers
(training checkpoints, metrics, HF exports) wrap their writes in. A full disk reaches
Python in many disguises: ``OSError`` errno 28 from a plain write, but torch's zip writer
(``torch.save``, Megatron's distributed checkpoint shards) raises ``RuntimeError ...
inline_container.cc ... unexpected pos 704 vs 598`` and the errno is lost, and the
checkpoint library may wrap that again for the other ranks. So the cause is decided by the
error chain (errno 28) or by the file system itself: a failed write on a file system with
less than :data:`FULL_BELOW_BYTES` free is taken for a full disk. Any other failure passes
through unchanged.
"""

from __future__ import annotations

import contextlib
import errno
import shutil
from pathlib import Path
from typing import Iterator

FULL_BELOW_BYTES = 1 << 20
"""Free space under which a failed write is blamed on the full file system (a write that
fails for another reason leaves more than this free on any disk worth running on)."""


class NoSpaceLeft(OSError):
    """A write failed because the file system holding its path is full (errno 28)."""

    def __init__(self, message: str) -> None:
        super().__init__(errno.ENOSPC, message)

    def __str__(self) -> str:
        return self.strerror


def free_bytes(path: str | Path) -> tuple[int, int] | None:
    """``(free, total)`` bytes of the file system holding ``path`` (its nearest existing
    ancestor), or None when it cannot be measured."""
    path = Path(path).absolute()
    existing = next((p for p in (path, *path.parents) if p.exists()), None)
    if existing is None:
        return None
    try:
        usage = shutil.disk_usage(existing)
    except OSError:
        return None
    return usage.free, usage.total


def _says_no_space(err: BaseException) -> bool:
    seen: set[int] = set()
    current: BaseException | None = err
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno == errno.ENOSPC:
            return True
        current = current.__cause__ or current.__context__
    return "No space left on device" in str(err)


def _size(n: float) -> str:
    if n < 1024:
        return f"{n:.0f} B"
    for unit in ("KiB", "MiB", "GiB"):
        n /= 1024
        if n < 1024:
            return f"{n:.1f} {unit}"
    return f"{n / 1024:.1f} TiB"


def as_no_space_left(err: BaseException, path: str | Path, what: str) -> BaseException:
    """``err`` restated as :class:`NoSpaceLeft` naming ``what`` and ``path`` when the file
    system holding ``path`` is full; ``err`` itself otherwise."""
    if isinstance(err, NoSpaceLeft):
        return err
    usage = free_bytes(path)
    full = usage is not None and usage[0] < FULL_BELOW_BYTES
    if not (_says_no_space(err) or full):
        return err
    room = f" ({_size(usage[0])} free of {_size(usage[1])})" if usage is not None else ""
    return NoSpaceLeft(f"{what}: no space left on the device holding {path}{room}")


@contextlib.contextmanager
def reporting_a_full_disk(path: str | Path, what: str) -> Iterator[None]:
    """Within the block, a failure on a full file system is raised as :class:`NoSpaceLeft`
    (``what``, e.g. ``"saving checkpoint step_000003"``, and ``path`` named; the original
    error chained); anything else passes through."""
    # Here, not at the top: the entry point's process imports this module (latest_checkpoint)
    # and would pay torch's distributed checkpoint and tensor stack (seconds of CPU, sympy)
    # for nothing; the ranks that write have it loaded by Megatron-Core already.
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    # torch's distributed checkpoint reports a failed write as a BaseException, on every rank.
    except (Exception, CheckpointException) as err:
        explained = as_no_space_left(err, path, what)
        if explained is err:
            raise
        raise explained from err
