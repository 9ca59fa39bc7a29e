"""The rollout engine a run's config names, and the SGLang servers it needs, probed first.

Owns choosing and building the engine (``rollout.engine``: the embedded Megatron engine,
the HF replica, or SGLang servers with weight sync) and finding the servers (``urls`` or
``url_dir``) and checking that every one answers before the model is built; in colocated runs
(``rollout.placement: colocated``) the servers then release their memory, so that the
trainer's model has the GPUs. It does not own generation itself (``megatron_rl.rollout``)
nor when the trainer calls it (``megatron_rl.train.colocate`` orders the colocated turns).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from megatron_rl.parallel.comm import raise_first_failure, rank

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from megatron_rl.checkpoint.init_source import InitSource
    from megatron_rl.config import RunConfig
    from megatron_rl.parallel.groups import ParallelGroups


def rollout_urls(cfg: RunConfig, group: ProcessGroup) -> list[str]:
    """The SGLang servers' URLs, each checked to answer ``/ping`` (none for the local engines),
    their memory released when they share the trainer's GPUs; collective over ``group``
    (every rank: ``ParallelGroups.world``)."""
    if cfg.rollout.engine != "sglang":
        return []
    from megatron_rl.rollout.sglang.server import read_url_files

    s = cfg.rollout.sglang
    urls = list(s.urls) or read_url_files(s.url_dir, s.num_servers, s.server_wait_s)
    probe_rollout_servers(cfg, urls, group)
    if cfg.rollout.placement == "colocated":
        from megatron_rl.rollout.sglang.memory import release_servers

        error = None
        if rank(group) == 0:
            try:
                release_servers(urls, _control_limits(cfg))
            except Exception as err:  # noqa: BLE001 - reported to every rank below
                error = err
        raise_first_failure(error, group, "releasing the colocated SGLang servers' memory")
    return urls


def _control_limits(cfg: RunConfig):
    """Time limits of the servers' control calls (memory release and resume)."""
    from megatron_rl.rollout.sglang.weight_transport import Limits

    s = cfg.rollout.sglang
    return Limits(request_s=s.request_timeout_s, hang_check_after_s=s.hang_check_after_s,
                  liveness_s=s.health_timeout_s)


def probe_rollout_servers(cfg: RunConfig, urls: list[str], group: ProcessGroup) -> None:
    """Collective over ``group`` (every rank): every rank probes (each model-parallel leader
    will send requests) and all fail together, a failed rank with one line per unreachable
    server, the others naming the first failed rank."""
    from megatron_rl.rollout.sglang.control import probe_servers
    from megatron_rl.rollout.sglang.ledger import RolloutRequestError

    error = None
    try:
        probe_servers(urls, timeout_s=cfg.rollout.sglang.health_timeout_s)
    except RolloutRequestError as err:
        error = err
    raise_first_failure(error, group, "probing the rollout servers")


def hf_architecture(cfg: RunConfig, init: InitSource | None) -> str:
    """The policy's HF ``model_type``: the starting checkpoint's, else ``rollout.sglang.hf_architecture``."""
    return init.hf.architecture if init is not None else cfg.rollout.sglang.hf_architecture


def build_engine(cfg: RunConfig, ddp, groups: ParallelGroups, urls: list[str], architecture: str):
    """The rollout engine the config names over the trained model ``ddp`` (collective: weight
    sync spans every rank); ``urls``: from :func:`rollout_urls`."""
    if cfg.rollout.engine == "megatron":
        from megatron_rl.rollout.local.embedded import EmbeddedEngine

        return EmbeddedEngine(ddp, groups, cfg.train.micro_batch_sequences, cfg.train.micro_batch_tokens)
    if cfg.rollout.engine == "hf":
        from megatron_rl.rollout.local.hf_engine import HFEngine

        return HFEngine(ddp, groups, architecture=architecture, model_config=cfg.model, dtype=cfg.rollout.hf_dtype,
                        prefix_cache=cfg.rollout.env.name is not None,
                        pause_mode=cfg.rollout.partial_mode if cfg.rollout.partial else None)
    # Imported here so that runs with a local engine need no HTTP client.
    from megatron_rl.rollout.sglang.client import SGLangClientConfig
    from megatron_rl.rollout.sglang.weight_sync import WeightSyncConfig, sglang_engine

    s = cfg.rollout.sglang
    client = SGLangClientConfig(urls=urls, request_timeout_s=s.request_timeout_s,
                                max_concurrency=s.max_concurrency, retry_budget_s=s.retry_budget_s,
                                max_retries=s.max_retries, backoff_s=s.retry_backoff_s,
                                backoff_max_s=s.retry_backoff_max_s, hang_check_after_s=s.hang_check_after_s,
                                health_timeout_s=s.health_timeout_s, max_resyncs=s.max_resyncs,
                                deterministic_inference=s.deterministic_inference, partial=cfg.rollout.partial)
    sync = None
    if s.weight_sync != "none":
        # A sync waits for a restarting server as long as a sample would.
        sync = WeightSyncConfig(mode=s.weight_sync, bucket_bytes=s.weight_sync_bucket_mb << 20,
                                server_tp_size=s.server_tp_size, backend=s.weight_sync_backend,
                                master_address=s.weight_sync_master_address, server_wait_s=s.retry_budget_s,
                                hang_check_after_s=s.hang_check_after_s, health_timeout_s=s.health_timeout_s)
    memory = None
    if cfg.rollout.placement == "colocated":
        from megatron_rl.rollout.sglang.memory import ServerMemory

        memory = ServerMemory(urls, _control_limits(cfg), released=True)  # by rollout_urls
    return sglang_engine(ddp, groups, client, sync, architecture=architecture, model_config=cfg.model, memory=memory,
                         pause_mode=cfg.rollout.partial_mode if cfg.rollout.partial else None)
