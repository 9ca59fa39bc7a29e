"""Weight sync from the Megatron trainer to SGLang servers, tagged with a weight version.

Owns, for one ``sync(version)`` (collective over the trainer's world):

1. gathering: every parameter is rebuilt whole from its shards (all-gather over its TP
   group, or the expert-TP group for experts, along Megatron's ``partition_dim``, undoing
   the ``partition_stride`` interleave of gated fc1 weights) and renamed to its
   layout-free name (global layer and expert numbers, so ``decoder.layers.7.mlp.experts.
   local_experts.5...`` means layer 7, expert 5 whatever the TP/EP/PP layout). Each name
   has one owner (the lowest rank holding it) that sends it to global rank 0, the only
   rank that talks to the servers;
2. naming: rank 0 turns each ``(megatron_name, tensor)`` into the server's names with an
   injected ``name_map`` (the HF table of ``megatron_rl.checkpoint.mapping`` for a real
   SGLang server; :func:`megatron_names` keeps Megatron names, which is what the CPU
   protocol server loads);
3. bucketing by bytes, and transport of each bucket by ``/update_weights_from_tensor``
   (colocated: CUDA tensors travel as IPC handles, CPU tensors by value) or by
   ``/init_weights_update_group`` once plus ``/update_weights_from_distributed`` with a
   broadcast of the bucket over that group (disaggregated; NCCL on GPUs, gloo on CPU);
4. the version: only the last bucket carries ``weight_version`` (and flushes the cache),
   so a server reports the new version only once every bucket has landed; afterwards
   rank 0 reads ``/model_info`` of every server and fails unless each reports it.

A sync first waits (``server_wait_s``) for every server to answer ``/health``, so a server
being restarted delays the push instead of failing it; ``sync(..., reconnect=True)`` (the
engine's re-push to a restarted server) also rebuilds the broadcast group, whose server
side died with the old process.

:func:`sglang_engine` wires this into the SGLang rollout engine for a trainer. Does not
own the HF name table (``megatron_rl.checkpoint.mapping``), the rollout client, or when
syncs happen (the engine and the trainer). Everything funnels through rank 0: right for
any layout, but its links bound the throughput of large syncs.
"""

from __future__ import annotations

import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, Iterator, Literal, Sequence

import torch
import torch.distributed as dist

from megatron_rl.checkpoint.megatron_io import global_parameter_names
from megatron_rl.parallel import comm
from megatron_rl.parallel.groups import ParallelGroups
from megatron_rl.parallel.schedule import unwrap
from megatron_rl.parallel.world import free_port
from megatron_rl.rollout.sglang.client import SGLangClientConfig
from megatron_rl.rollout.sglang.control import probe_servers, request_json
from megatron_rl.rollout.sglang.engine import SGLangEngine, route_shape_of
from megatron_rl.rollout.sglang.wire import serialize_named_tensors

NameMap = Callable[[str, torch.Tensor], list[tuple[str, torch.Tensor]]]
"""``(megatron_name, full_tensor) -> [(server_name, tensor), ...]``."""


@dataclass(kw_only=True)
class WeightSyncConfig:
    """How weights reach the servers."""

    mode: Literal["tensor", "distributed"] = "tensor"
    """tensor: ``/update_weights_from_tensor`` (colocated); distributed: a broadcast group."""
    bucket_bytes: int = 512 << 20
    """Largest bucket; a single tensor larger than this travels alone."""
    server_tp_size: int = 1
    """TP size of each server (tensor mode: payload entries; distributed mode: group ranks)."""
    by_reference: bool | None = None
    """Tensor mode: send CUDA IPC handles instead of bytes; None means when tensors are on CUDA."""
    backend: Literal["nccl", "gloo"] = "nccl"
    """Distributed mode: backend of the trainer-to-servers group."""
    master_address: str | None = None
    """Distributed mode: address of rank 0 the servers connect to (None: this host's name)."""
    master_port: int = 0
    """Distributed mode: rendezvous port on rank 0 (0: any free port)."""
    group_name: str = "megatron_rl_weight_sync"
    """Distributed mode: name of the group on both sides."""
    timeout_s: float = 600.0
    """Limit for one update request and for forming the group."""
    server_wait_s: float = 300.0
    """How long a sync waits for servers that do not answer ``/health`` (restarting) before
    it fails naming them."""


class WeightSyncError(RuntimeError):
    """A server refused or failed a weight update; the message names the server."""


def megatron_names(name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """The identity :data:`NameMap`: layout-free Megatron names (the protocol server's)."""
    return [(name, tensor)]


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
    """The whole tensor from the TP shards (stride s: each shard holds s interleaved blocks)."""
    local = shard.param.detach()
    if shard.group is None:
        return local.clone()
    whole = comm.all_gather_cat(local, shard.group, dim=shard.dim)
    if shard.stride == 1:
        return whole
    # Gated fc1 on each rank is [gate_r; up_r]: whole = [gate_0..gate_n; up_0..up_n].
    size = comm.size(shard.group)
    blocks = [p.chunk(shard.stride, dim=shard.dim) for p in whole.chunk(size, dim=shard.dim)]
    return torch.cat([blocks[r][s] for s in range(shard.stride) for r in range(size)], dim=shard.dim)


def _natural_key(name: str) -> tuple:
    return tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in name.split("."))


def gather_full_params(
    model: torch.nn.Module, groups: ParallelGroups, *, everywhere: bool = False
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every parameter, whole and under its layout-free name, yielded on global rank 0.

    A collective over the world: every rank must iterate it to the end (other ranks yield
    nothing). Rank 0 holds one whole tensor at a time.

    Args:
        model: this rank's model stage (bare or DDP-wrapped).
        groups: this rank's parallel groups.
        everywhere: yield on every rank instead (the owner broadcasts each whole tensor
            over the world): each rank then holds one whole tensor at a time (the HF engine's
            per-rank replicas).
    """
    shards = _local_shards(model, groups)
    world = groups.world
    rank = comm.rank(world)
    listing = [(n, s.full_shape, str(s.param.dtype)) for n, s in shards.items()]
    everyone = comm.all_gather_objects(listing, world)
    holders: dict[str, list[int]] = {}
    meta: dict[str, tuple] = {}
    for r, entries in enumerate(everyone):
        for name, shape, dtype in entries:
            holders.setdefault(name, []).append(r)
            meta[name] = (shape, dtype)
    device = next(iter(shards.values())).param.device if shards else torch.device("cpu")
    for name in sorted(holders, key=_natural_key):
        owner = min(holders[name])
        mine = shards.get(name)
        full = None
        # The owner's whole TP group gathers; everyone else holding the name skips it.
        group = mine.group if mine is not None else None
        in_owner_group = group is not None and owner in comm.global_ranks(group)
        if mine is not None and (rank == owner or in_owner_group):
            full = _gather(mine)
        if everywhere:
            if full is None:
                shape, dtype = meta[name]
                full = torch.empty(shape, dtype=getattr(torch, dtype.removeprefix("torch.")), device=device)
            comm.broadcast(full, owner, world)
            yield name, full
            continue
        if owner != 0:
            if rank == owner:
                comm.send(full, 0, world)
            elif rank == 0:
                shape, dtype = meta[name]
                full = torch.empty(shape, dtype=getattr(torch, dtype.removeprefix("torch.")), device=device)
                comm.recv(full, owner, world)
        if rank == 0:
            yield name, full


# --------------------------------------------------------------------------- transport


def _post_all(urls: Sequence[str], path: str, payload: dict, timeout_s: float) -> None:
    """POST ``payload`` to every server at once; raise naming each server that failed."""
    with ThreadPoolExecutor(max_workers=len(urls)) as pool:
        answers = list(pool.map(lambda u: (u, *request_json("POST", u + path, payload, timeout_s=timeout_s)), urls))
    _check(answers, path)


def _background(fn, *args, **kwargs) -> dict:
    """Start ``fn`` on a daemon thread; the returned dict gets "result" or "error" when it ends."""
    box: dict = {}

    def run() -> None:
        try:
            box["result"] = fn(*args, **kwargs)
        except BaseException as err:  # noqa: BLE001 - handed to the waiting caller
            box["error"] = err

    threading.Thread(target=run, daemon=True).start()
    return box


def _check(answers, path: str) -> None:
    failures = [f"{url}{path}: HTTP {status}: {str(body)[:300]}" for url, status, body in answers
                if status != 200 or (isinstance(body, dict) and body.get("success") is False)]
    if failures:
        raise WeightSyncError("weight update failed: " + "; ".join(failures))


def init_custom_group(backend: str, address: str, port: int, world_size: int, rank: int, group_name: str,
                      timeout: timedelta) -> dist.ProcessGroup:
    """A process group outside the default world (both sides of a weight-update group).

    The same construction as SGLang's ``init_custom_process_group``: a TCP rendezvous at
    ``address:port`` (rank 0 hosts it), a store prefixed by ``group_name``, and torch's
    process-group factory, so the key layout matches what a SGLang server builds.
    """
    from torch.distributed.distributed_c10d import (
        Backend,
        PrefixStore,
        _new_process_group_helper,
        _world,
        rendezvous,
    )

    store, rank, world_size = next(rendezvous(f"tcp://{address}:{port}", rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    group, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), PrefixStore(group_name, store),
                                         group_name=group_name, timeout=timeout)
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


class TensorTransport:
    """Buckets through ``/update_weights_from_tensor``."""

    def __init__(self, urls: Sequence[str], cfg: WeightSyncConfig) -> None:
        self.urls, self.cfg = list(urls), cfg

    def send(self, bucket: list[tuple[str, torch.Tensor]], *, version: str | None) -> None:
        """Send one bucket; ``version`` (last bucket only) also sets the servers' version."""
        by_reference = self.cfg.by_reference
        if by_reference is None:
            by_reference = bucket[0][1].is_cuda
        entry = serialize_named_tensors(bucket, by_reference=by_reference)
        payload = {"serialized_named_tensors": [entry] * self.cfg.server_tp_size, "load_format": None,
                   "flush_cache": version is not None, "abort_all_requests": False, "weight_version": version}
        _post_all(self.urls, "/update_weights_from_tensor", payload, self.cfg.timeout_s)

    def reset(self) -> None:
        """Nothing to rebuild: every request stands alone."""

    def close(self) -> None:
        """Nothing to release."""


class DistributedTransport:
    """Buckets broadcast over a group of rank 0 and every server rank."""

    def __init__(self, urls: Sequence[str], cfg: WeightSyncConfig) -> None:
        self.urls, self.cfg = list(urls), cfg
        self.group: dist.ProcessGroup | None = None

    def _open(self) -> None:
        """Form the group: rank 0 hosts the rendezvous while every server is asked to join.

        Both sides block until everyone has joined, so each runs on a daemon thread and a
        refusal from any server (or a failure here) is raised at once instead of after the
        rendezvous timeout.
        """
        cfg, path = self.cfg, "/init_weights_update_group"
        address = cfg.master_address or socket.gethostname()
        port = cfg.master_port or free_port()
        world_size = 1 + len(self.urls) * cfg.server_tp_size
        joins = [_background(request_json, "POST", url + path, {
            "master_address": address, "master_port": port, "rank_offset": 1 + i * cfg.server_tp_size,
            "world_size": world_size, "group_name": cfg.group_name, "backend": cfg.backend,
        }, timeout_s=cfg.timeout_s) for i, url in enumerate(self.urls)]
        forming = _background(init_custom_group, cfg.backend, address, port, world_size, 0, cfg.group_name,
                              timedelta(seconds=cfg.timeout_s))
        deadline = time.monotonic() + cfg.timeout_s
        while True:
            answers = [(url, *box["result"]) for url, box in zip(self.urls, joins) if "result" in box]
            _check(answers, path)
            if "error" in forming:
                raise WeightSyncError(f"rank 0 could not form the weight-update group: {forming['error']}")
            if "result" in forming and len(answers) == len(self.urls):
                self.group = forming["result"]
                return
            if time.monotonic() > deadline:
                raise WeightSyncError(f"the weight-update group did not form within {cfg.timeout_s:g}s")
            time.sleep(0.05)

    def send(self, bucket: list[tuple[str, torch.Tensor]], *, version: str | None) -> None:
        """Announce one bucket to every server, then broadcast its tensors in order."""
        if self.group is None:
            self._open()
        payload = {"names": [n for n, _ in bucket], "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in bucket],
                   "shapes": [list(t.shape) for _, t in bucket], "group_name": self.cfg.group_name,
                   "flush_cache": version is not None, "abort_all_requests": False, "weight_version": version}
        def announce(url: str):
            return url, *request_json("POST", url + "/update_weights_from_distributed", payload,
                                      timeout_s=self.cfg.timeout_s)

        with ThreadPoolExecutor(max_workers=len(self.urls)) as pool:
            futures = [pool.submit(announce, url) for url in self.urls]
            for _, tensor in bucket:
                comm.broadcast(tensor.contiguous(), 0, self.group)
            answers = [f.result() for f in futures]
        _check(answers, "/update_weights_from_distributed")

    def reset(self) -> None:
        """Drop the group so the next send forms a new one with every server.

        A restarted server lost its side, and the others must leave theirs before they can
        join a group of the same name; a refusal (a server without the group) is expected.
        """
        if self.group is None:
            return
        payload = {"group_name": self.cfg.group_name}
        with ThreadPoolExecutor(max_workers=len(self.urls)) as pool:
            list(pool.map(lambda u: request_json("POST", u + "/destroy_weights_update_group", payload,
                                                 timeout_s=self.cfg.timeout_s), self.urls))
        dist.destroy_process_group(self.group)
        self.group = None

    def close(self) -> None:
        """Leave the group on both sides."""
        if self.group is None:
            return
        _post_all(self.urls, "/destroy_weights_update_group", {"group_name": self.cfg.group_name}, self.cfg.timeout_s)
        dist.destroy_process_group(self.group)
        self.group = None


class WeightSync:
    """Push the trainer's weights to SGLang servers (construct and call on every rank).

    Args:
        model: this rank's model stage.
        groups: this rank's parallel groups.
        urls: server base URLs.
        cfg: transport settings.
        name_map: Megatron name and whole tensor to the servers' names and tensors.
    """

    def __init__(self, model: torch.nn.Module, groups: ParallelGroups, urls: Sequence[str], cfg: WeightSyncConfig,
                 *, name_map: NameMap = megatron_names) -> None:
        self.model, self.groups, self.cfg, self.name_map = model, groups, cfg, name_map
        self.urls = [u.rstrip("/") for u in urls]
        self.transport = None
        if comm.rank(groups.world) == 0:
            self.transport = (TensorTransport if cfg.mode == "tensor" else DistributedTransport)(self.urls, cfg)

    def sync(self, version: int, *, reconnect: bool = False) -> None:
        """Wait for the servers, gather, send and verify; a collective that raises on every
        rank if rank 0 failed (rank 0 its own error, the others
        :class:`~megatron_rl.parallel.comm.RankFailed`).

        Every rank runs the gather to its end even after rank 0 failed to send, so that no
        rank is left waiting in a collective; the failure is then agreed on.

        Args:
            version: the version the servers report once every bucket has landed.
            reconnect: servers restarted since the last sync: rebuild the transport first.
        """
        error, bucket, size = None, [], 0
        if self.transport is not None:
            try:
                probe_servers(self.urls, timeout_s=10.0, wait_s=self.cfg.server_wait_s)
                if reconnect:
                    self.transport.reset()
            except Exception as err:  # noqa: BLE001 - reported to every rank below
                error = err
        with torch.no_grad():
            for name, tensor in gather_full_params(self.model, self.groups):
                if self.transport is None or error is not None:
                    continue
                try:
                    for server_name, server_tensor in self.name_map(name, tensor):
                        nbytes = server_tensor.numel() * server_tensor.element_size()
                        if bucket and size + nbytes > self.cfg.bucket_bytes:
                            self.transport.send(bucket, version=None)
                            bucket, size = [], 0
                        bucket.append((server_name, server_tensor))
                        size += nbytes
                except Exception as err:  # noqa: BLE001 - reported to every rank below
                    error = err
            if self.transport is not None and error is None:
                try:
                    self.transport.send(bucket, version=str(version))
                    self._verify(str(version))
                except Exception as err:  # noqa: BLE001 - reported to every rank below
                    error = err
        comm.raise_first_failure(error, self.groups.world, f"weight sync to version {version}")

    def _verify(self, version: str) -> None:
        for url in self.urls:
            status, info = request_json("GET", url + "/model_info", timeout_s=self.cfg.timeout_s)
            served = info.get("weight_version") if isinstance(info, dict) else None
            if status != 200 or served != version:
                raise WeightSyncError(f"{url} serves weight version {served!r} after the sync, expected {version!r}")

    def close(self) -> None:
        """Release the transport (rank 0; the distributed group on both sides)."""
        if self.transport is not None:
            self.transport.close()


def sglang_engine(model: torch.nn.Module, groups: ParallelGroups, client: SGLangClientConfig,
                  sync: WeightSyncConfig | None, *, name_map: NameMap = megatron_names) -> SGLangEngine:
    """The SGLang rollout engine for a trainer's model, with weight sync when ``sync`` is set.

    Call on every rank (parallel state initialized); ``sync=None`` leaves the servers'
    weights to someone else and skips version checks.
    """
    weight_sync = None
    if sync is not None:
        weight_sync = WeightSync(model, groups, client.urls, sync, name_map=name_map)
    return SGLangEngine(client, route_shape_of(model), groups=groups, weight_sync=weight_sync)
