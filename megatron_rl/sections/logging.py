"""The ``logging`` and ``profile`` sections: where a run's metrics go besides its run directory
(Weights & Biases, MLflow) and which steps the torch profiler records. A leaf: the trackers
live in ``train.sinks``, the profiler and the phase breakdown in ``train.phases``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass(kw_only=True)
class WandbConfig:
    """Weights & Biases (the ``wandb`` extra); the API key and server come from wandb's own
    login or ``WANDB_API_KEY`` / ``WANDB_BASE_URL``."""

    mode: Literal["disabled", "online", "offline"] = "disabled"
    """online: log to the server (offline files are kept if it cannot be reached); offline:
    write ``<run_dir>/wandb/offline-run-*`` for a later ``wandb sync``; disabled: no W&B."""
    project: str = "megatron-rl"
    """W&B project."""
    entity: str | None = None
    """W&B user or team (None: the account's default)."""
    name: str | None = None
    """Run name shown in W&B (None: the run directory's name)."""
    group: str | None = None
    """W&B run group."""
    tags: list[str] = field(default_factory=list)
    """W&B run tags."""
    init_timeout_s: float = 60.0
    """How long the online run may take to start before the run logs offline instead."""
    upload_checkpoints: bool = False
    """Upload the HF checkpoints as artifact files (default: artifacts that reference their paths)."""


@dataclass(kw_only=True)
class MlflowConfig:
    """MLflow tracking (the ``mlflow`` extra)."""

    enabled: bool = False
    """Log to MLflow."""
    tracking_uri: str | None = None
    """Tracking server or store, e.g. ``http://mlflow:5000`` or ``file:///data/mlruns`` (MLflow 3
    wants ``MLFLOW_ALLOW_FILE_STORE=true`` for a file store); None: ``MLFLOW_TRACKING_URI``."""
    experiment: str = "megatron-rl"
    """Experiment name (created when missing)."""
    run_name: str | None = None
    """Run name (None: the run directory's name)."""
    start_timeout_s: float = 60.0
    """How long the tracking server may take to answer when the run starts before MLflow logging is given up."""
    upload_checkpoints: bool = False
    """Upload the HF checkpoints as run artifacts (default: a tag with each checkpoint's path)."""


@dataclass(kw_only=True)
class LoggingConfig:
    """External trackers; ``<run_dir>/metrics.jsonl`` and TensorBoard are always written."""

    wandb: WandbConfig = field(default_factory=WandbConfig)
    """Weights & Biases."""
    mlflow: MlflowConfig = field(default_factory=MlflowConfig)
    """MLflow."""
    close_timeout_s: float = 60.0
    """At the end of the run, how long to wait for a tracker to deliver what it still holds."""


@dataclass(kw_only=True)
class ProfileConfig:
    """The torch profiler on chosen RL steps (a Chrome trace per step and rank)."""

    steps: list[int] = field(default_factory=list)
    """RL steps to profile; each writes ``<run_dir>/profile/step_NNNNNN/rank<r>.pt.trace.json``."""
    record_shapes: bool = False
    """Record operator input shapes (larger traces)."""
    with_stack: bool = False
    """Record Python stacks of operators (much larger traces)."""


def check_logging_config(logging: LoggingConfig, profile: ProfileConfig) -> list[tuple[str, str]]:
    """Violated rules as ``(key, rule)`` pairs (empty when valid)."""
    problems = []
    for key, value in (("logging.wandb.init_timeout_s", logging.wandb.init_timeout_s),
                       ("logging.mlflow.start_timeout_s", logging.mlflow.start_timeout_s),
                       ("logging.close_timeout_s", logging.close_timeout_s)):
        if not value > 0:
            problems.append((key, "must be > 0"))
    bad = [s for s in profile.steps if s < 1]
    if bad:
        problems.append(("profile.steps", f"RL steps start at 1; got {bad}"))
    if len(set(profile.steps)) != len(profile.steps):
        problems.append(("profile.steps", f"lists a step twice: {profile.steps}"))
    return problems
