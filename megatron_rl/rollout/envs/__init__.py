"""Environments for multi-turn rollouts: the interface (``base``), the built-ins (a calculator
tool, answer-with-feedback, a remote HTTP environment), resolving ``rollout.env`` (``load``)
and its config section (``config``)."""
