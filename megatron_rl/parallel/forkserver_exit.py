"""Imported last by the ranks' forkserver (its preload, :func:`megatron_rl.parallel.world._rank_context`),
and by nothing else: the forkserver then exits at once when it is told to, skipping its
interpreter's teardown.

A forkserver whose caller died (SIGKILL, the OOM killer) sees its pipe at EOF and raises
``SystemExit``; with torch and Megatron-Core loaded, the teardown that follows took 13 s on a
loaded 2-core machine (seconds on a quiet one), the run's forkserver outliving the command that
started it. An exit handler registered after those modules' own runs before them, flushes the
standard streams and leaves with ``os._exit`` (1.7 s on the same machine). Only the process
that imported this module leaves that way (its forked ranks inherit the handler: they end by
``os._exit`` as multiprocessing's children do, and any child of theirs keeps its own exit).
The status is 0: the forkserver's only exit is ``SystemExit`` at its pipe's EOF.
"""

from __future__ import annotations

import atexit
import os
import sys


def exit_now(pid: int) -> None:
    """In process ``pid`` (the forkserver), end without the interpreter's teardown."""
    if os.getpid() != pid:
        return
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):  # closed or replaced: nothing to flush
            pass
    os._exit(0)


atexit.register(exit_now, os.getpid())
