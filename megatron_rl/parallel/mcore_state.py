"""Megatron-Core's parallel state as a value: the half of :mod:`~megatron_rl.parallel.mcore_compat`
that names ``parallel_state``'s module globals.

Megatron keeps the groups of *one* layout in module globals of ``megatron.core.parallel_state``
(the TP, PP, DP, EP, ETP, CP groups, their ranks, sizes and rank lists, and its memory
buffers), which ``initialize_model_parallel`` refuses to set twice. A second layout over the
same processes (a distillation teacher with its own TP / EP / PP,
:mod:`megatron_rl.parallel.layouts`) is made by saving the policy's globals, clearing them,
initializing the second layout and saving its globals in turn, then restoring the policy's;
the second layout is made current only inside a context that restores the policy's after
(house rule: global state only behind a context manager that restores it).

The state is every upper-case underscore module global of ``parallel_state`` (:func:`state_names`:
51 in 0.16.1, all of them groups, ranks, sizes, rank lists or buffers; a dict-valued one
starts empty, the others None, as ``initialize_model_parallel`` expects them). Models
built while a layout is current keep references to its groups (their ``pg_collection``,
``tp_group``, ...), so they run under that layout whichever is current; their forward is
still run with it current, for the code paths that read the globals
(``tests/parallel/test_layout_invariance.py`` checks a teacher built and run this way against
the one-process run, and that every global ``initialize_model_parallel`` sets is one of
these names). Does not own creating or destroying process groups (``parallel_state`` does).
"""

from __future__ import annotations

import re
from typing import Any

from megatron.core import parallel_state

_STATE_NAME = re.compile(r"_[A-Z][A-Z0-9_]*")


def state_names() -> list[str]:
    """The module globals of ``parallel_state`` that make up one layout's state."""
    return sorted(name for name in vars(parallel_state) if _STATE_NAME.fullmatch(name))


def save() -> dict[str, Any]:
    """The current layout's state (the objects themselves: groups are shared, not copied)."""
    return {name: getattr(parallel_state, name) for name in state_names()}


def clear() -> None:
    """No layout: every name as ``parallel_state`` starts (empty dicts, else None)."""
    for name, value in save().items():
        setattr(parallel_state, name, {} if isinstance(value, dict) else None)


def restore(saved: dict[str, Any]) -> None:
    """Make ``saved`` (from :func:`save`) the current layout's state."""
    unknown = set(saved) ^ set(state_names())
    if unknown:
        raise RuntimeError(f"megatron parallel_state globals changed while saved: {sorted(unknown)}")
    for name, value in saved.items():
        setattr(parallel_state, name, value)
