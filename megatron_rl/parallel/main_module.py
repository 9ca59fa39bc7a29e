"""Starting processes that do not re-run this process's ``__main__`` (imports only the standard library).

A spawned or forkserver child first re-runs its parent's main module (a script, or a ``-m``
module) unless that has neither a file nor a module name. The forkserver's own preload of
``__main__``, which would pay that once, never runs on Python 3.11:
``forkserver.ensure_running`` asks the preparation data for ``main_path``, which it stores as
``init_main_from_path`` (``multiprocessing/forkserver.py``, ``spawn.py``). For the trainer that
main module is the entry point with torch and Megatron behind it: seconds per child. Used by
the reward pool (its workers) and the local world (its ranks, and so whatever they spawn:
Megatron-Core's checkpoint writer starts a spawned ``Manager`` in each rank).
"""

from __future__ import annotations

import contextlib
import sys
import types
from typing import Iterator


@contextlib.contextmanager
def parent_main_hidden() -> Iterator[None]:
    """Processes started within do not re-run this process's ``__main__``; nothing they run
    may live there (their functions are looked up by module path). The swap lasts while
    they start."""
    parent_main = sys.modules["__main__"]
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        sys.modules["__main__"] = parent_main
