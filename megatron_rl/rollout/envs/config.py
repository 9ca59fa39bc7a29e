"""The ``rollout.env`` section: which environment multi-turn rollouts talk to, its limits and
what a fault costs; its field rules. A leaf: resolving the environment class and checking
its arguments (an import) is ``megatron_rl.rollout.envs.load``."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any

from megatron_rl.config_loading import require


@dataclass(kw_only=True)
class HttpEnvConfig:
    """A remote environment or sandbox served over HTTP (``rollout.env.name: http``)."""

    url: str = ""
    """Base URL of the environment server, e.g. ``http://sandbox:8000`` (see docs/agentic.md)."""
    request_timeout_s: float = 30.0
    """Limit for one HTTP attempt."""
    retries: int = 2
    """Further attempts after a connection error, a dropped connection or a 5xx answer."""
    backoff_s: float = 0.5
    """Delay before the first retry; doubles per retry."""


@dataclass(kw_only=True)
class EnvConfig:
    """Multi-turn rollouts against an environment (tools, feedback, sandboxes)."""

    name: str | None = None
    """A built-in environment ("calculator", "feedback", "http") or an import path
    "package.module:Class"; None: single-turn rollouts (one response per prompt)."""
    args: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments for the environment class (one instance per trajectory)."""
    max_turns: int = 4
    """Model turns per trajectory at most."""
    max_total_tokens: int | None = None
    """Tokens per trajectory at most (prompt, turns and observations); None: the model's
    maximum sequence length. A turn starts only when ``rollout.max_new_tokens`` more fit."""
    step_timeout_s: float = 30.0
    """Limit for one ``reset`` or ``step`` call; past it the trajectory ends (env_timeout)."""
    max_parallel: int = 64
    """Environment calls in flight at once per rank (each in its own thread)."""
    errors_fatal: bool = False
    """Stop the run when an environment raises, hangs or answers malformed output (default:
    the trajectory ends with a counted reason, scored ``reward.error_score``)."""
    max_errors_printed: int = 5
    """Environment faults printed per rollout call and rank (all are counted in ``env/*``)."""
    http: HttpEnvConfig = field(default_factory=HttpEnvConfig)
    """The remote environment (``name: http``)."""


def check_env_section(env: EnvConfig, max_position_embeddings: int, max_new_tokens: int) -> None:
    """The section's own rules (the class and its arguments are checked by ``envs.load``)."""
    if env.name is None:
        # Single-turn rollouts read no other key of the section: one that is set would be ignored.
        default = EnvConfig()
        for f in fields(EnvConfig):
            require(getattr(env, f.name) == getattr(default, f.name), f"rollout.env.{f.name}",
                    f"{getattr(env, f.name)!r} is set, but rollout.env.name is null (single-turn rollouts "
                    "use no environment); set rollout.env.name or leave the key out")
        return
    require(bool(env.name.strip()), "rollout.env.name", "must be a built-in name or 'package.module:Class'")
    require(env.max_turns >= 1, "rollout.env.max_turns", "must be >= 1")
    # An unbounded wait is the hang the limit exists to prevent (and overflows the thread timeouts).
    require(0 < env.step_timeout_s < math.inf, "rollout.env.step_timeout_s", "must be a finite number > 0")
    require(env.max_parallel >= 1, "rollout.env.max_parallel", "must be >= 1")
    require(env.max_errors_printed >= 0, "rollout.env.max_errors_printed", "must be >= 0")
    if env.max_total_tokens is not None:
        require(env.max_total_tokens <= max_position_embeddings, "rollout.env.max_total_tokens",
                f"{env.max_total_tokens} exceeds the model's maximum sequence length {max_position_embeddings}")
        require(env.max_total_tokens > max_new_tokens, "rollout.env.max_total_tokens",
                f"{env.max_total_tokens} leaves no room for a prompt before rollout.max_new_tokens {max_new_tokens}")
    if env.name == "http":
        h = env.http
        require(h.url.startswith(("http://", "https://")), "rollout.env.http.url",
                f"{h.url!r} is not an http:// or https:// URL")
        require(0 < h.request_timeout_s < math.inf, "rollout.env.http.request_timeout_s",
                "must be a finite number > 0")
        require(h.retries >= 0, "rollout.env.http.retries", "must be >= 0")
        require(0 <= h.backoff_s < math.inf, "rollout.env.http.backoff_s", "must be a finite number >= 0")
