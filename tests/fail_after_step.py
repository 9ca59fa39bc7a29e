"""Test-only failure injection: every rank of a run fails right after a given RL step.

:func:`fail_after` wraps a trainer's (or the class's) ``rl_step`` so that asking for step
``last_step + 1`` raises: step ``last_step`` has been logged, evaluated and checkpointed as
usual, nothing of the next step has started.

As a command it is ``megatron-rl-train`` with that failure:
``python tests/fail_after_step.py 3 --config ... [key=value ...]``. The patch is made at
import, not under ``__main__``: the entry point starts its ranks with the rank function of
this module (:func:`rank_with_failure`), so ``run_world`` lets each rank run this script again
(as ``__mp_main__``, with the parent's ``sys.argv``) before it unpickles the function (for any
other function it hides its main module), and every rank's ``Trainer`` carries the patch.
"""

from __future__ import annotations

import sys

import megatron_rl.train.main as train_main
from megatron_rl.parallel import world
from megatron_rl.train.main import main
from megatron_rl.train.trainer import Trainer

MESSAGE = "injected failure after step {}"
"""The failure's message, formatted with the last step that ran."""


def fail_after(owner, last_step: int) -> None:
    """Make ``owner.rl_step`` (a :class:`Trainer` or the class itself) raise ``RuntimeError``
    instead of running any step after ``last_step``."""
    rl_step = owner.rl_step

    def rl_step_or_fail(*args):
        *_, step, _state = args  # ([trainer,] step, state): called on the class or on one trainer
        if step > last_step:
            raise RuntimeError(MESSAGE.format(last_step))
        return rl_step(*args)

    owner.rl_step = rl_step_or_fail


def rank_with_failure(*args):
    """The trainer's rank function, as a function of this module (see the module docstring)."""
    return train_main.run_rank(*args)


def _run_world_here(fn, *args, **kwargs):
    assert fn is train_main.run_rank, fn
    return world.run_world(rank_with_failure, *args, **kwargs)


if __name__ in ("__main__", "__mp_main__"):
    fail_after(Trainer, int(sys.argv[1]))

if __name__ == "__main__":
    train_main.run_world = _run_world_here
    sys.exit(main(sys.argv[2:]))
