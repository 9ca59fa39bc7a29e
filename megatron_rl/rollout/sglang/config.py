"""The ``rollout.sglang`` section: the servers, the client's retry and hang limits, and weight
sync; its field rules. A leaf: the rule that the served architecture can hold the model
needs the checkpoint tables and lives in ``rollout.sglang.weight_sync``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from megatron_rl.config_loading import require


@dataclass(kw_only=True)
class SGLangConfig:
    """SGLang servers as the rollout engine (``rollout.engine: sglang``)."""

    urls: list[str] = field(default_factory=list)
    """Base URLs of running servers, e.g. ``http://node3:30000``; requests are load-balanced."""
    url_dir: str | None = None
    """Instead of ``urls``: a directory where each server's launcher writes its URL once
    healthy (``megatron_rl.rollout.sglang.server --url-file``; the SLURM path)."""
    num_servers: int = 1
    """With ``url_dir``: wait for this many URL files."""
    server_wait_s: float = 1800.0
    """With ``url_dir``: how long to wait for the servers to come up."""
    server_tp_size: int = 1
    """TP size each server was launched with (weight-sync payload layout); checked against
    each server's ``/server_info`` before the first push."""
    request_timeout_s: float = 300.0
    """Limit for one ``/generate`` attempt."""
    max_concurrency: int = 256
    """Requests in flight at once per model-parallel group (bounds client memory)."""
    retry_budget_s: float = 300.0
    """A sample keeps retrying for this long after its first failure: long enough for a
    killed server to be restarted and load its model (weight syncs wait as long for it)."""
    max_retries: int = 1000
    """Cap on retries per sample, a backstop: ``retry_budget_s`` is the limit that normally
    applies (at the default backoff it spends 40 to 75 retries)."""
    retry_backoff_s: float = 0.5
    """First retry delay; doubles per retry, with jitter."""
    retry_backoff_max_s: float = 8.0
    """Longest retry delay."""
    hang_check_after_s: float = 15.0
    """A request or weight-update call unanswered this long makes the client probe the
    server's liveness (``GET /server_info``, answered by its scheduler between two batches)."""
    health_timeout_s: float = 10.0
    """A server silent on ``/server_info`` (or ``/model_info``) this long is hung: the step or
    the weight push fails naming it, within ``hang_check_after_s + health_timeout_s`` of the
    hang; so each turn of a healthy scheduler's loop (a batch, a bucket's load) must take less.
    The startup probe uses it too."""
    deterministic_inference: bool = False
    """Seeded sampling: the servers must run with ``--enable-deterministic-inference``
    (``python -m megatron_rl.rollout.sglang.server --deterministic-inference``), checked in
    their ``/server_info`` before the first rollout; without it SGLang ignores the seeds."""
    max_resyncs: int = 2
    """Weight re-pushes per rollout call to servers that came back behind the trainer's version."""
    weight_sync: Literal["tensor", "distributed", "none"] = "tensor"
    """tensor: /update_weights_from_tensor (colocated); distributed: NCCL broadcast group
    (disaggregated); none: the servers' weights are managed elsewhere (no version check)."""
    weight_sync_bucket_mb: int = 512
    """Largest weight-sync bucket in MiB."""
    weight_sync_backend: Literal["nccl", "gloo"] = "nccl"
    """Backend of the distributed weight-sync group."""
    weight_sync_master_address: str | None = None
    """Address the servers reach trainer rank 0 at for the distributed group (None: its host name)."""
    hf_architecture: str = "qwen3_moe"
    """HF architecture whose parameter names the servers load (megatron_rl.checkpoint.mapping)."""


def check_sglang_section(s: SGLangConfig, prefix: str = "rollout.sglang") -> None:
    """The section's own rules (checked when SGLang is the engine); the served architecture's
    rule is ``megatron_rl.config.check_served_architecture``."""
    require(bool(s.urls) != (s.url_dir is not None), f"{prefix}.urls",
             "rollout.engine is sglang: give either server URLs or url_dir (exactly one)")
    require(s.num_servers >= 1, f"{prefix}.num_servers", "must be >= 1")
    require(s.server_wait_s > 0, f"{prefix}.server_wait_s", "must be > 0")
    for i, url in enumerate(s.urls):
        require(
            isinstance(url, str) and url.startswith(("http://", "https://")) and len(url.split("://", 1)[1]) > 0,
            f"{prefix}.urls[{i}]", f"{url!r} is not an http(s) base URL",
        )
    require(len(set(s.urls)) == len(s.urls), f"{prefix}.urls", "lists a server twice")
    for key in ("server_tp_size", "max_concurrency", "weight_sync_bucket_mb"):
        require(getattr(s, key) >= 1, f"{prefix}.{key}", "must be >= 1")
    require(s.max_retries >= 0, f"{prefix}.max_retries", "must be >= 0")
    require(s.request_timeout_s > 0, f"{prefix}.request_timeout_s", "must be > 0")
    require(s.retry_backoff_s >= 0, f"{prefix}.retry_backoff_s", "must be >= 0")
    for key in ("retry_budget_s", "retry_backoff_max_s", "max_resyncs"):
        require(getattr(s, key) >= 0, f"{prefix}.{key}", "must be >= 0")
    for key in ("hang_check_after_s", "health_timeout_s"):
        require(getattr(s, key) > 0, f"{prefix}.{key}", "must be > 0")
