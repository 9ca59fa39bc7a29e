"""Weight sync from the Megatron trainer to SGLang servers, tagged with a weight version.

Owns, for one ``sync(version)`` (collective over the trainer's world), the stages of a
push, each its own step so it can be timed alone:

1. **plan**: every rank lists the parameters it holds (name, shape, dtype); rank 0 then knows
   the whole push before any tensor moves: the servers' names and shapes (the HF table of
   ``megatron_rl.checkpoint.mapping`` applied to shape-only tensors), which it checks against
   what the served architecture loads (every name known, each once: SGLang would skip an
   unknown one without a word, :mod:`~megatron_rl.rollout.sglang.loader_rules`), the
   payload's dtypes (:mod:`~megatron_rl.rollout.sglang.weight_payload`), and the buckets;
2. **servers**: every server is live (``/server_info``; a restarting one is waited for
   ``server_wait_s``, a hung one fails at once); before the first push and after a
   reconnect, ``/server_info`` must show ``tp_size == server_tp_size`` and ``dp_size == 1``;
   then a weight-update session opens on every server (:class:`~megatron_rl.rollout.sglang.
   weight_transport.Sessions`);
3. **gather**: each parameter is rebuilt whole from its shards (all-gather over its TP group,
   or the expert-TP group for experts, along Megatron's ``partition_dim``, undoing the
   ``partition_stride`` interleave of gated fc1 weights) under its layout-free name (global
   layer and expert numbers); its owner (the lowest rank holding it) sends it to global rank
   0, the only rank that talks to the servers;
4. **rename** to the servers' HF names, and **bucket** by bytes without splitting a group
   SGLang loads together (:class:`~megatron_rl.rollout.sglang.loader_rules.Bucketer`);
5. **serialize and send** each bucket (tensor or distributed transport), the **load** being the
   server's answer; only the last bucket carries ``weight_version`` and flushes the cache;
6. the session closes (the server re-packs and re-quantizes), and rank 0 reads ``/model_info``
   of every server and fails unless each reports the version.

``sync(..., reconnect=True)`` (the engine's re-push to a restarted server) also rebuilds the
broadcast group, whose server side died with the old process. :func:`sglang_engine` wires
this into the SGLang rollout engine for a trainer. Does not own the HF name table, the
rollout client, or when syncs happen (the engine and the trainer). Everything funnels
through rank 0: right for any layout, but its links bound the throughput of large syncs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator, Literal, Sequence

import torch
import torch.distributed as dist

from megatron_rl.checkpoint.mapping import ARCHITECTURES, hf_name_map, hf_tensor_shapes, unshard_sections
from megatron_rl.checkpoint.megatron_io import global_parameter_names
from megatron_rl.parallel import comm
from megatron_rl.parallel.groups import ParallelGroups
from megatron_rl.parallel.schedule import unwrap
from megatron_rl.rollout.sglang.client import SGLangClientConfig
from megatron_rl.rollout.sglang.control import (
    probe_servers,
    server_facts,
    watched_request,
)
from megatron_rl.rollout.sglang.engine import SGLangEngine, route_shape_of
from megatron_rl.rollout.sglang.loader_rules import Bucketer, load_group, loader_rules
from megatron_rl.rollout.sglang.memory import ServerMemory
from megatron_rl.rollout.sglang.pause import GenerationPause
from megatron_rl.rollout.sglang.weight_transport import (
    BucketStream,
    DistributedTransport,
    Limits,
    Sessions,
    TensorTransport,
    WeightSyncError,
)
from megatron_rl.sections import ModelConfig

__all__ = ["WeightSyncConfig", "WeightSync", "WeightSyncError", "gather_full_params", "plan_gather", "sglang_engine"]


@dataclass(kw_only=True)
class WeightSyncConfig:
    """How weights reach the servers."""

    mode: Literal["tensor", "distributed"] = "tensor"
    """tensor: ``/update_weights_from_tensor`` (colocated); distributed: a broadcast group."""
    bucket_bytes: int = 512 << 20
    """Largest bucket; a single tensor (or load group) larger than this travels alone."""
    server_tp_size: int = 1
    """TP size each server must report in ``/server_info`` (tensor mode: payload entries;
    distributed mode: group ranks)."""
    by_reference: bool | None = None
    """Tensor mode: send CUDA IPC handles instead of bytes; None means when tensors are on CUDA."""
    backend: Literal["nccl", "gloo"] = "nccl"
    """Distributed mode: backend of the trainer-to-servers group."""
    master_address: str | None = None
    """Distributed mode: address of rank 0 the servers connect to (None: this host's name)."""
    master_port: int = 0
    """Distributed mode: rendezvous port on rank 0 (0: one the kernel picks as rank 0 binds it)."""
    group_name: str = "megatron_rl_weight_sync"
    """Distributed mode: name of the group on both sides."""
    timeout_s: float = 600.0
    """Limit for one update request and for forming the group."""
    server_wait_s: float = 300.0
    """How long a push waits for servers that are down or starting (restarting) before it
    fails naming them."""
    hang_check_after_s: float = 15.0
    """A control call unanswered this long probes the server's ``/ping``."""
    health_timeout_s: float = 10.0
    """A server silent on ``/ping`` this long is hung: the push fails naming it."""


# --------------------------------------------------------------------------- gathering

@dataclass
class _Shard:
    """This rank's piece of one parameter and how to make it whole."""

    param: torch.Tensor
    """The local parameter."""
    group: dist.ProcessGroup | None
    """Group its TP shards live in (None: this rank holds it whole)."""
    dim: int
    """Megatron's ``partition_dim``."""
    stride: int
    """Megatron's ``partition_stride`` (2 for gated fc1: gate and up are split separately)."""
    full_shape: tuple[int, ...]
    """Shape of the whole parameter."""
    sections: tuple[int, ...] | None = None
    """Whole sizes of its sections along ``dim``, each split over TP (a Gated DeltaNet's in_proj)."""


def _local_shards(model, groups: ParallelGroups) -> dict[str, _Shard]:
    gpt = unwrap(model)
    names = global_parameter_names(gpt)
    gated = bool(getattr(gpt.config, "gated_linear_unit", False))
    shards = {}
    for module_name, module in gpt.named_modules():
        # Persistent buffers a checkpoint holds (the routers' expert bias) travel too, so HF
        # exports are complete; they are never split over TP.
        tensors = [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]
        for param_name, param in tensors:
            local = f"{module_name}.{param_name}" if module_name else param_name
            if local not in names:
                continue  # a tied parameter listed under its first name, or a non-checkpoint buffer
            # Expert weights are sharded over expert-TP, everything else over TP.
            expert = ".mlp.experts." in local
            group, size = (groups.etp, groups.etp_size) if expert else (groups.tp, groups.tp_size)
            split = _split_of(module, local, param, expert, gated) if size > 1 else None
            shape = list(param.shape)
            if split is not None:
                shape[split[0]] *= size
            shards[names[local]] = _Shard(
                param=param, group=group if split else None, dim=split[0] if split else 0,
                stride=split[1] if split else 1, full_shape=tuple(shape),
                sections=getattr(param, "tp_sections", None) if split else None,
            )
    return shards


def _split_of(module, name: str, param, expert: bool, gated: bool) -> tuple[int, int] | None:
    """(partition dim, stride) of a parameter split over its TP group; None if replicated.

    Megatron's modules flag their splits on the parameters. Transformer Engine's linears
    flag every weight as split (dim 1 for parallel_mode "row", else 0; stride 1), also
    when Megatron runs them with parallel_mode None: a duplicated ``TELinear`` (MLA's down
    projections), which is not split, and grouped experts under explicit expert
    communication, which Megatron splits itself: fc1 by columns (gate and up separately
    when gated, as ``apply_swiglu_sharded_factory`` stores them), fc2 by rows.
    """
    if name.endswith(".softmax_offset"):
        # Attention sinks: one per head, split over TP with the heads (TE's carry no TP flags).
        return 0, 1
    if not getattr(param, "tensor_model_parallel", False):
        return None
    if not ("parallel_mode" in vars(module) and module.parallel_mode is None):
        return getattr(param, "partition_dim", 0), getattr(param, "partition_stride", 1)
    if expert and ".linear_fc1." in name:
        return 0, 2 if gated else 1
    if expert and ".linear_fc2.weight" in name:
        return 1, 1
    return None


def _gather(shard: _Shard) -> torch.Tensor:
    """The whole tensor from the TP shards (stride s: each shard holds s interleaved blocks); the
    parameter itself when this rank holds it whole."""
    local = shard.param.detach()
    if shard.group is None:
        return local
    whole = comm.all_gather_cat(local, shard.group, dim=shard.dim)
    if shard.sections is not None:
        return unshard_sections(list(whole.chunk(comm.size(shard.group), dim=0)), list(shard.sections))
    if shard.stride == 1:
        return whole
    # Gated fc1 on each rank is [gate_r; up_r]: whole = [gate_0..gate_n; up_0..up_n].
    size = comm.size(shard.group)
    blocks = [p.chunk(shard.stride, dim=shard.dim) for p in whole.chunk(size, dim=shard.dim)]
    return torch.cat([blocks[r][s] for s in range(shard.stride) for r in range(size)], dim=shard.dim)


def _natural_key(name: str) -> tuple:
    return tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in name.split("."))




@dataclass
class GatherPlan:
    """What a gather will yield, known on every rank before any tensor moves."""

    shards: dict[str, _Shard]
    """This rank's pieces, by layout-free name."""
    order: list[str]
    """Every name of the model, in the order the gather yields them."""
    meta: dict[str, tuple[tuple[int, ...], torch.dtype]]
    """Whole shape and dtype of each name."""
    owner: dict[str, int]
    """The global rank that gathers each name (the lowest holding it)."""
    device: torch.device
    """Where the whole tensors are built."""


def plan_gather(model: torch.nn.Module, groups: ParallelGroups) -> GatherPlan:
    """Every rank's listing of what it holds, exchanged (a collective over the world)."""
    shards = _local_shards(model, groups)
    listing = [(n, s.full_shape, str(s.param.dtype)) for n, s in shards.items()]
    holders: dict[str, list[int]] = {}
    meta: dict[str, tuple] = {}
    for r, entries in enumerate(comm.all_gather_objects(listing, groups.world)):
        for name, shape, dtype in entries:
            holders.setdefault(name, []).append(r)
            meta[name] = (tuple(shape), getattr(torch, dtype.removeprefix("torch.")))
    device = next(iter(shards.values())).param.device if shards else torch.device("cpu")
    return GatherPlan(shards=shards, order=sorted(holders, key=_natural_key), meta=meta,
                      owner={n: min(r) for n, r in holders.items()}, device=device)


def gather_full_params(
    model: torch.nn.Module, groups: ParallelGroups, *, everywhere: bool = False, plan: GatherPlan | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every parameter, whole and under its layout-free name, yielded on global rank 0.

    A collective over the world: every rank must iterate it to the end (other ranks yield
    nothing). Rank 0 holds one whole tensor at a time. A tensor its rank holds whole is the
    parameter itself (not a copy): read it, do not write it.

    Args:
        model: this rank's model stage (bare or DDP-wrapped).
        groups: this rank's parallel groups.
        everywhere: yield on every rank instead (the owner broadcasts each whole tensor
            over the world): each rank then holds one whole tensor at a time (the HF engine's
            per-rank replicas).
        plan: :func:`plan_gather` of this model, when the caller made it already.
    """
    plan = plan_gather(model, groups) if plan is None else plan
    world = groups.world
    rank = comm.rank(world)
    for name in plan.order:
        owner, mine, full = plan.owner[name], plan.shards.get(name), None
        # The owner's whole TP group gathers; everyone else holding the name skips it.
        group = mine.group if mine is not None else None
        in_owner_group = group is not None and owner in comm.global_ranks(group)
        if mine is not None and (rank == owner or in_owner_group):
            full = _gather(mine)
        if everywhere:
            if full is None:
                full = torch.empty(plan.meta[name][0], dtype=plan.meta[name][1], device=plan.device)
            comm.broadcast(full, owner, world)
            yield name, full
            continue
        if owner != 0:
            if rank == owner:
                comm.send(full, 0, world)
            elif rank == 0:
                full = torch.empty(plan.meta[name][0], dtype=plan.meta[name][1], device=plan.device)
                comm.recv(full, owner, world)
        if rank == 0:
            yield name, full


# --------------------------------------------------------------------------- the push


@dataclass
class PushPlan:
    """Rank 0's view of one push before any tensor moves."""

    buckets: int
    """Buckets the push sends (the last carries the version)."""
    group_sizes: dict[str, int]
    """Members of each load group."""
    largest_bucket: int
    """Bytes of the largest bucket (the size of the stream's buffers)."""


def restarted_servers(started_at: dict[str, Any], server_info: dict[str, dict]) -> list[str]:
    """The servers whose ``/server_info`` ``startup_time`` (SGLang's, set as a server starts:
    ``srt/entrypoints/http_server.py:284``, ``:886``) differs from the one in ``started_at``,
    which is updated; a server seen for the first time is not counted."""
    restarted = []
    for url, info in server_info.items():
        now = info.get("startup_time") if isinstance(info, dict) else None
        if url in started_at and now != started_at[url]:
            restarted.append(url)
        started_at[url] = now
    return restarted


class WeightSync:
    """Push the trainer's weights to SGLang servers (construct and call on every rank).

    Args:
        model: this rank's model stage.
        groups: this rank's parallel groups.
        urls: server base URLs.
        cfg: transport settings.
        architecture: HF ``model_type`` the servers serve: its table names the tensors, its
            loader rules group them.
        model_config: the trained model's config (the table's shapes).
    """

    def __init__(self, model: torch.nn.Module, groups: ParallelGroups, urls: Sequence[str], cfg: WeightSyncConfig,
                 *, architecture: str, model_config: ModelConfig) -> None:
        self.model, self.groups, self.cfg, self.model_config = model, groups, cfg, model_config
        self.urls = [u.rstrip("/") for u in urls]
        table = ARCHITECTURES.get(architecture)
        self.name_map = hf_name_map(table, model_config, copy=False)  # the bucket's flattening copies them
        self.served = hf_tensor_shapes(table, model_config)
        self.rules = loader_rules(architecture)
        self.limits = Limits(cfg.timeout_s, cfg.hang_check_after_s, cfg.health_timeout_s)
        self.servers_checked = False
        self.started_at: dict[str, Any] = {}
        """Rank 0: each server's ``startup_time`` (its ``/server_info``) at the last push."""
        self.restarts = 0
        """Rank 0: servers found restarted at a push's probe (their ``startup_time`` changed),
        counted until the engine takes them into a step's metrics."""
        self.transport = self.sessions = None
        if comm.rank(groups.world) == 0:
            self.sessions = Sessions(self.urls, self.limits)
            if cfg.mode == "tensor":
                self.transport = TensorTransport(self.urls, cfg.server_tp_size, cfg.by_reference, self.limits)
            else:
                self.transport = DistributedTransport(self.urls, cfg.server_tp_size, cfg.backend, cfg.master_address,
                                                      cfg.master_port, cfg.group_name, self.limits)

    def _group(self, name: str) -> str | None:
        return load_group(self.rules, self.model_config, name)

    def plan(self, gather: GatherPlan) -> PushPlan:
        """Rank 0: the servers' tensors of the whole push, checked, and its bucket count.

        Raises:
            WeightSyncError: a name the served architecture does not load, one sent twice or
                not at all, or a shape the server does not have.
        """
        named = [pair for name in gather.order for pair in
                 self.name_map(name, torch.empty(gather.meta[name][0], dtype=gather.meta[name][1], device="meta"))]
        counts: dict[str, int] = {}
        for name, _ in named:
            counts[name] = counts.get(name, 0) + 1
        problems = [f"{n}: not loaded by an SGLang {self.rules.architecture} server (it would skip it silently)"
                    for n in counts if n not in self.served]
        problems += [f"{n}: sent {c} times" for n, c in counts.items() if c > 1]
        problems += [f"{n}: never sent (the server would keep its old value)" for n in self.served if n not in counts]
        problems += [f"{n}: shape {tuple(t.shape)}, the server's is {self.served[n]}" for n, t in named
                     if n in self.served and tuple(t.shape) != self.served[n]]
        if problems:
            raise WeightSyncError(f"weight sync: {len(problems)} tensors do not match the served architecture "
                                  f"{self.rules.architecture!r}: " + "; ".join(problems[:5]))
        group_sizes: dict[str, int] = {}
        for name, _ in named:
            if (group := self._group(name)) is not None:
                group_sizes[group] = group_sizes.get(group, 0) + 1
        bucketer = Bucketer(self.cfg.bucket_bytes, self._group, group_sizes)
        buckets = [b for n, t in named for b in bucketer.add(n, t)] + bucketer.finish()
        return PushPlan(buckets=len(buckets), group_sizes=group_sizes,
                        largest_bucket=max((sum(t.numel() * t.element_size() for _, t in b) for b in buckets), default=0))

    def _open(self, reconnect: bool) -> None:
        """Rank 0: the servers are live (and right), a session is open on each."""
        cfg = self.cfg
        restarted = restarted_servers(self.started_at, probe_servers(self.urls, timeout_s=cfg.health_timeout_s,
                                                                     wait_s=cfg.server_wait_s))
        if restarted:
            # Between two pushes (a rollout may have seen nothing): it lost its weights and its groups.
            print(f"SGLang servers restarted since the last push: {', '.join(restarted)}", flush=True)
            self.restarts += len(restarted)
            reconnect = True
        if reconnect or not self.servers_checked:
            self._check_servers()
            self.servers_checked = True
        if reconnect:
            self.transport.reset()
        self.sessions.begin()
        self.transport.start()

    def take_restarts(self) -> int:
        """:attr:`restarts`, reset (a step's count)."""
        restarts, self.restarts = self.restarts, 0
        return restarts

    def _check_servers(self) -> None:
        """``/server_info``: the TP size payloads and groups are built for, and no data parallelism
        (SGLang's weight updates assert ``dp_size == 1``, tokenizer_control_mixin.py:451, :509, :569)."""
        facts = server_facts(self.urls, timeout_s=self.cfg.health_timeout_s,
                             hang_check_after_s=self.cfg.hang_check_after_s)
        for url, info in facts.items():
            if info.get("tp_size") != self.cfg.server_tp_size:
                raise WeightSyncError(f"rollout.sglang.server_tp_size is {self.cfg.server_tp_size}, but SGLang server "
                                      f"{url} runs with tp_size {info.get('tp_size')!r} (its /server_info)")
            if info.get("dp_size", 1) != 1:
                raise WeightSyncError(f"SGLang server {url} runs with dp_size {info['dp_size']}: SGLang's weight "
                                      "updates need dp_size 1 (one server per data-parallel replica)")

    def sync(self, version: int, *, reconnect: bool = False, flush_cache: bool = True) -> None:
        """Plan, open, gather, send and verify; a collective that raises on every rank if rank 0
        failed (rank 0 its own error, the others :class:`~megatron_rl.parallel.comm.RankFailed`).

        Rank 0 streams: a bucket is sent (serialized, posted, broadcast) on a worker thread
        while the next one is gathered (:class:`~megatron_rl.rollout.sglang.weight_transport.
        BucketStream`). Every rank runs the gather to its end even after rank 0 failed, so that
        no rank is left waiting in a collective; the failure is then agreed on.

        Args:
            version: the version the servers report once every bucket has landed.
            reconnect: servers restarted since the last sync: check them and rebuild the transport.
            flush_cache: the last bucket flushes the servers' cache (False while they are paused
                in place with requests holding KV: SGLang fails such an update).
        """
        error, stream, bucketer = None, None, None
        gather = plan_gather(self.model, self.groups)
        if self.transport is not None:
            self.transport.flush_cache = flush_cache
            try:
                push = self.plan(gather)
                bucketer = Bucketer(self.cfg.bucket_bytes, self._group, push.group_sizes)
                self._open(reconnect)
                stream = BucketStream(self.transport, push.largest_bucket, gather.device, push.buckets, str(version))
            except Exception as err:  # noqa: BLE001 - reported to every rank below
                error = err
        with torch.no_grad():
            for name, tensor in gather_full_params(self.model, self.groups, plan=gather):
                if stream is None or error is not None:
                    continue
                try:
                    for server_name, server_tensor in self.name_map(name, tensor):
                        for bucket in bucketer.add(server_name, server_tensor):
                            stream.put(bucket)
                except Exception as err:  # noqa: BLE001 - reported to every rank below
                    error = err
            if stream is not None:
                try:
                    if error is None:
                        for bucket in bucketer.finish():
                            stream.put(bucket)
                        stream.finish()
                        self.sessions.end()
                        self._verify(str(version))
                except Exception as err:  # noqa: BLE001 - reported to every rank below
                    error = err
                finally:
                    stream.close()
        comm.raise_first_failure(error, self.groups.world, f"weight sync to version {version}")

    def _verify(self, version: str) -> None:
        for url in self.urls:
            status, info = watched_request("GET", url, "/model_info", timeout_s=self.cfg.timeout_s,
                                           hang_check_after_s=self.cfg.hang_check_after_s,
                                           liveness_timeout_s=self.cfg.health_timeout_s)
            served = info.get("weight_version") if isinstance(info, dict) else None
            if status != 200 or served != version:
                raise WeightSyncError(f"{url} serves weight version {served!r} after the sync, expected {version!r}")

    def close(self) -> None:
        """Release the transport (rank 0; the distributed group on both sides)."""
        if self.transport is not None:
            self.transport.close()


def sglang_engine(model: torch.nn.Module, groups: ParallelGroups, client: SGLangClientConfig,
                  sync: WeightSyncConfig | None, *, architecture: str, model_config: ModelConfig,
                  memory: ServerMemory | None = None, pause_mode: str | None = None) -> SGLangEngine:
    """The SGLang rollout engine for a trainer's model, with weight sync when ``sync`` is set.

    Call on every rank (parallel state initialized); ``sync=None`` leaves the servers'
    weights to someone else and skips version checks; ``memory``: the servers' memory of a
    colocated run; ``pause_mode``: partial rollouts, the servers paused in that mode around
    a push with requests in flight (needs ``sync``).
    """
    weight_sync = None
    if sync is not None:
        weight_sync = WeightSync(model, groups, client.urls, sync, architecture=architecture,
                                 model_config=model_config)
    pause = None
    if pause_mode is not None:  # on every rank: whether a push pauses is decided alike everywhere
        pause = GenerationPause(client.urls, pause_mode, Limits(sync.timeout_s, sync.hang_check_after_s,
                                                                  sync.health_timeout_s), sync.server_wait_s)
    return SGLangEngine(client, route_shape_of(model), groups=groups, weight_sync=weight_sync, memory=memory,
                        pause=pause)
