"""The one exception every checkpoint tool raises when a checkpoint does not fit.

Owns: :class:`CheckpointMismatchError`. A conversion or export that meets a missing,
unknown or misshapen tensor, or a config key it cannot honour, stops with this error and
names the tensor or key; the tools never skip, pad or guess.
"""

from __future__ import annotations


class CheckpointMismatchError(ValueError):
    """A checkpoint's tensors or config disagree with the architecture's mapping.

    The message names every culprit (tensor names, config keys) it found, so one run
    reports the whole problem instead of the first symptom.
    """


def format_names(names, limit: int = 20) -> str:
    """``a, b, c`` for error messages, elided after ``limit`` names with a count."""
    names = sorted(names)
    shown = ", ".join(names[:limit])
    if len(names) > limit:
        shown += f", ... ({len(names) - limit} more)"
    return shown
