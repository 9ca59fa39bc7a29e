"""How buckets of weights reach SGLang servers: weight-update sessions and the two transports.

A push is one **session** per server: ``POST /begin_weight_update``, the buckets, ``POST
/end_weight_update``. SGLang 0.5.23 refuses both update calls outside a session with HTTP
400 (``srt/managers/scheduler_components/weight_updater.py:192-197``, ``:234-239``); ``end``
re-packs and re-quantizes what the loads wrote (``:323-335``; FP8 serving needs it); ``begin``
is refused while a session is open (``:311-316``), which is how a trainer that died mid-push
leaves a server, so a refused ``begin`` is answered by closing the stale session and beginning
again once (:meth:`Sessions.begin`).

* :class:`TensorTransport`: ``/update_weights_from_tensor``, one serialized entry per server TP
  rank (:mod:`~megatron_rl.rollout.sglang.weight_payload`).
* :class:`DistributedTransport`: a process group of trainer rank 0 and every server rank
  (``/init_weights_update_group`` once), then per bucket ``/update_weights_from_distributed``
  announcing the tensors and a broadcast of each. A server checks its session and its group
  *before* it joins the broadcast (``weight_updater.py:192-197``, model runner's ``:270-273``),
  so a refusal would leave rank 0 alone in the broadcast, forever. Therefore the first
  announce of a session is an empty one (the same checks, no broadcast): a refusal there is
  an error naming the server before any tensor is broadcast; later, the broadcast runs
  beside the announces, and a refusal or a hung server ends the push at once, naming it.

Every control call is watched (:func:`~megatron_rl.rollout.sglang.control.watched_request`),
by ``GET /server_info``, which the server's scheduler answers between two turns of its loop:
a server whose scheduler hangs mid-push (its HTTP process may still answer ``/ping``) is
reported within ``hang_check_after_s + health_timeout_s``, provided each turn of a healthy
scheduler (one bucket's load or broadcast) takes less than ``health_timeout_s``.
Does not own gathering, naming or bucketing (:mod:`~megatron_rl.rollout.sglang.weight_sync`).
"""

from __future__ import annotations

import socket
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from megatron_rl.parallel import comm
from megatron_rl.parallel.world import rendezvous_store
from megatron_rl.rollout.sglang.control import (
    EncodedJSON,
    hung_problem,
    watched_request,
)
from megatron_rl.rollout.sglang.ledger import ServerHungError
from megatron_rl.rollout.sglang.weight_payload import (
    FlatBucket,
    NamedTensors,
    begin_weight_update_body,
    destroy_group_body,
    distributed_update_body,
    end_weight_update_body,
    flatten,
    init_group_body,
    serialize_by_reference,
    serialize_by_value,
    tensor_update_body,
)


class WeightSyncError(RuntimeError):
    """A server refused or failed a weight update; the message names the server."""


@dataclass(frozen=True)
class Limits:
    """Time limits of the control calls of a push."""

    request_s: float
    """Limit for one call (a bucket's load, forming the group)."""
    hang_check_after_s: float
    """A call unanswered this long probes the server's liveness."""
    liveness_s: float
    """A server silent on ``/server_info`` (its scheduler) this long is hung."""


SERVER_ANSWER_WAIT_S = 5.0
"""How long a failed group formation on our side waits for the servers' own answer."""


def _failures(answers: list[tuple[str, int, Any]], path: str) -> list[str]:
    return [f"{url}{path}: HTTP {status}: {str(body)[:300]}" for url, status, body in answers
            if status != 200 or (isinstance(body, dict) and body.get("success") is False)]


def call_all(urls: Sequence[str], path: str, body_of: Callable[[str], Any], limits: Limits) -> list:
    """POST to every server at once (watched); returns ``(url, status, body)`` per server."""
    def one(url: str):
        return url, *watched_request("POST", url, path, body_of(url), timeout_s=limits.request_s,
                                     hang_check_after_s=limits.hang_check_after_s, liveness_timeout_s=limits.liveness_s)

    with ThreadPoolExecutor(max_workers=max(1, len(urls))) as pool:
        return list(pool.map(one, urls))


def post_all(urls: Sequence[str], path: str, body: Any, limits: Limits) -> None:
    """POST ``body`` to every server; raise naming each that refused or failed."""
    failures = _failures(call_all(urls, path, lambda _: body, limits), path)
    if failures:
        raise WeightSyncError("weight update failed: " + "; ".join(failures))


class Sessions:
    """``begin_weight_update`` / ``end_weight_update`` on every server."""

    def __init__(self, urls: Sequence[str], limits: Limits) -> None:
        self.urls, self.limits = list(urls), limits

    def begin(self) -> None:
        """Open a session on every server; a refused ``begin`` (a session left open by a trainer
        that died mid-push, or a push cut short) is answered by ``end`` and one more ``begin``."""
        path = "/begin_weight_update"
        answers = call_all(self.urls, path, lambda _: begin_weight_update_body(), self.limits)
        stale = [url for url, status, body in answers if _failures([(url, status, body)], path)]
        if not stale:
            return
        print(f"SGLang servers with a weight-update session still open (a push cut short?): {', '.join(stale)}; "
              "closing it and beginning again", flush=True)
        call_all(stale, "/end_weight_update", lambda _: end_weight_update_body(), self.limits)
        post_all(stale, path, begin_weight_update_body(), self.limits)

    def end(self) -> None:
        """Close the session on every server (re-packs and re-quantizes what was loaded)."""
        post_all(self.urls, "/end_weight_update", end_weight_update_body(), self.limits)


class TensorTransport:
    """Flattened buckets through ``/update_weights_from_tensor``.

    Args:
        urls: server base URLs.
        tp_size: TP ranks of every server (entries per request).
        by_reference: CUDA IPC handles, the server being colocated; False: the bytes, base64 in
            the request; None: handles for a bucket on CUDA, bytes for one on the CPU.
        limits: time limits.
    """

    def __init__(self, urls: Sequence[str], tp_size: int, by_reference: bool | None, limits: Limits) -> None:
        self.urls, self.tp_size, self.by_reference, self.limits = list(urls), tp_size, by_reference, limits
        self.flush_cache = True
        """The last bucket flushes the servers' cache (not while paused in place: SGLang refuses)."""

    def start(self) -> None:
        """Nothing to prepare: every request stands alone."""

    def buffer(self, nbytes: int, device: torch.device) -> None:
        """None: every bucket gets a buffer of its own. Bytes are pickled from a storage of exactly
        the bucket's size (pickling writes the whole storage); a CUDA buffer may still be read by
        the server's copies after it answered, and torch's IPC reference counts keep a fresh
        buffer from being recycled before they end."""
        return None

    def entries(self, bucket: FlatBucket) -> list[bytes]:
        """The ``serialized_named_tensors`` of one bucket, one per server TP rank."""
        if bucket.flat.is_cuda if self.by_reference is None else self.by_reference:
            return [serialize_by_reference(bucket) for _ in range(self.tp_size)]
        # Bytes carry no per-rank state (unlike IPC handles): every rank may read the same entry.
        return [serialize_by_value(bucket)] * self.tp_size

    def post(self, entries: list[bytes], *, version: str | None) -> None:
        """Load one bucket's entries on every server; ``version`` (last bucket only) also sets their version."""
        post_all(self.urls, "/update_weights_from_tensor", EncodedJSON(tensor_update_body(entries, version=version,
                                                                     flush_cache=self.flush_cache)),
                 self.limits)

    def send(self, bucket: FlatBucket, *, version: str | None) -> None:
        """Serialize and post one bucket."""
        self.post(self.entries(bucket), version=version)

    def reset(self) -> None:
        """Nothing to rebuild."""

    def close(self) -> None:
        """Nothing to release."""


class BucketStream:
    """Rank 0's pipeline of one push: each bucket is flattened on the calling thread (the one
    that gathers; the bucket's one copy) and sent on a worker thread, so bucket k travels while
    bucket k + 1 is gathered. At most two buckets are in flight, each in its own buffer.

    Args:
        transport: sends the buckets (:class:`TensorTransport` or :class:`DistributedTransport`).
        buffer_bytes: the largest bucket's bytes.
        device: where the gathered tensors are (and the buffers).
        buckets: how many buckets the push sends (the last sets the version).
        version: the version the last bucket sets.
    """

    def __init__(self, transport, buffer_bytes: int, device: torch.device, buckets: int, version: str) -> None:
        self.transport, self.device, self.buckets, self.version = transport, device, buckets, version
        self.buffers = [transport.buffer(buffer_bytes, device) for _ in range(2)]
        self.in_flight: list[Future | None] = [None, None]
        self.sent = 0
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="weight-sync-send")

    def put(self, named: NamedTensors) -> None:
        """Flatten one bucket into a free buffer and hand it to the worker; raises the error of a
        send that failed."""
        for future in self.in_flight:
            if future is not None and future.done():
                future.result()
        slot = self.sent % 2
        self._settle(slot)
        bucket = flatten(named, self.buffers[slot], self.device)
        if bucket.flat.is_cuda:  # the server (another process) reads the buffer
            torch.cuda.current_stream(bucket.flat.device).synchronize()
        version = self.version if self.sent == self.buckets - 1 else None
        self.in_flight[slot] = self.worker.submit(self.transport.send, bucket, version=version)
        self.sent += 1

    def _settle(self, slot: int) -> None:
        future, self.in_flight[slot] = self.in_flight[slot], None
        if future is not None:
            future.result()

    def finish(self) -> None:
        """Wait for every bucket to land; raises the first failure."""
        self._settle(self.sent % 2)  # the older of the two in flight first
        self._settle((self.sent + 1) % 2)
        if self.sent != self.buckets:
            raise WeightSyncError(f"weight sync sent {self.sent} buckets, its plan had {self.buckets}")

    def close(self) -> None:
        """Wait for what is still in flight (its errors are the caller's already) and free the buffers."""
        wait([f for f in self.in_flight if f is not None])
        self.worker.shutdown(wait=True)
        self.in_flight, self.buffers = [None, None], [None, None]


def init_custom_group(backend: str, address: str, port: int, world_size: int, rank: int, group_name: str,
                      timeout: timedelta, store: dist.Store | None = None) -> dist.ProcessGroup:
    """A process group outside the default world (both sides of a weight-update group).

    The same construction as SGLang's ``init_custom_process_group`` (``srt/utils/common.py:
    2859-2925``): a TCP rendezvous at ``address:port`` (rank 0 hosts it), a store prefixed by
    ``group_name``, and torch's process-group factory, so the key layout matches a server's.
    ``store``: rank 0's store, already listening on ``port`` (:func:`~megatron_rl.parallel.world.
    rendezvous_store`), instead of one created here.
    """
    from torch.distributed.distributed_c10d import (
        Backend,
        PrefixStore,
        _new_process_group_helper,
        _world,
        rendezvous,
    )

    if store is None:
        store, rank, world_size = next(rendezvous(f"tcp://{address}:{port}", rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    group, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), PrefixStore(group_name, store),
                                         group_name=group_name, timeout=timeout)
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


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


class DistributedTransport:
    """Buckets broadcast over a group of trainer rank 0 and every server rank.

    Args:
        urls: server base URLs.
        tp_size: TP ranks of every server (group ranks per server).
        backend: ``nccl`` (GPUs) or ``gloo``.
        address: where the servers reach rank 0 (None: this host's name).
        port: rendezvous port (0: any free one).
        group_name: the group's name on both sides.
        limits: time limits.
    """

    def __init__(self, urls: Sequence[str], tp_size: int, backend: str, address: str | None, port: int,
                 group_name: str, limits: Limits) -> None:
        self.urls, self.tp_size, self.backend, self.limits = list(urls), tp_size, backend, limits
        self.address, self.port, self.group_name = address, port, group_name
        self.group: dist.ProcessGroup | None = None
        self.flush_cache = True
        """The last bucket flushes the servers' cache (not while paused in place: SGLang refuses)."""
        self.abandoned = False
        """A broadcast of the group is still pending (a push failed mid-bucket)."""

    def _open(self) -> None:
        """Form the group: rank 0 hosts the rendezvous while every server is asked to join.

        Both sides block until everyone has joined, so each runs on a daemon thread, and a
        refusal or a hung server is reported at once instead of after the rendezvous timeout.
        """
        path = "/init_weights_update_group"
        address = self.address or socket.gethostname()
        world_size = 1 + len(self.urls) * self.tp_size
        timeout = timedelta(seconds=self.limits.request_s)
        # A port of our own choosing is bound before the servers are told it (none can take it between).
        store = None if self.port else rendezvous_store(world_size, timeout)
        port = self.port or store.port
        ranks = {url: 1 + i * self.tp_size for i, url in enumerate(self.urls)}
        body = {url: init_group_body(address=address, port=port, rank_offset=ranks[url], world_size=world_size,
                                     group_name=self.group_name, backend=self.backend) for url in self.urls}
        joins = _background(call_all, self.urls, path, body.get, self.limits)
        forming = _background(init_custom_group, self.backend, address, port, world_size, 0, self.group_name,
                              timeout, store)
        deadline = time.monotonic() + self.limits.request_s
        answer_wait = None
        while "result" not in forming or "result" not in joins:
            if "error" in joins:
                raise joins["error"]
            if "error" in forming:
                # Our side failed at once (e.g. no NCCL here); a server's refusal, if it comes
                # within a few seconds, names the cause better (a backend it does not join).
                answer_wait = answer_wait or time.monotonic() + SERVER_ANSWER_WAIT_S
                if "result" not in joins and time.monotonic() < min(answer_wait, deadline):
                    time.sleep(0.05)
                    continue
                if "result" in joins and _failures(joins["result"], path):
                    break
                raise forming["error"]
            if "result" in joins and _failures(joins["result"], path):
                raise WeightSyncError("weight update failed: " + "; ".join(_failures(joins["result"], path)))
            if time.monotonic() > deadline:
                raise WeightSyncError(f"the weight-update group did not form within {self.limits.request_s:g}s")
            time.sleep(0.05)
        if _failures(joins["result"], path):
            raise WeightSyncError("weight update failed: " + "; ".join(_failures(joins["result"], path)))
        self.group = forming["result"]

    def start(self) -> None:
        """Before a session's first bucket: form the group if needed, then an empty announce,
        which every server answers after checking its session and group, without a broadcast."""
        if self.abandoned:
            self.reset()
        if self.group is None:
            self._open()
        post_all(self.urls, "/update_weights_from_distributed",
                 distributed_update_body(None, group_name=self.group_name, version=None), self.limits)

    def buffer(self, nbytes: int, device: torch.device) -> torch.Tensor:
        """A bucket buffer to reuse: a broadcast has ended when it returns (NCCL's on the stream
        the next bucket's copies run on)."""
        return torch.empty(nbytes, dtype=torch.uint8, device=device)

    def send(self, bucket: FlatBucket, *, version: str | None) -> None:
        """Announce one bucket to every server and broadcast its buffer, watching both."""
        path = "/update_weights_from_distributed"
        body = distributed_update_body(bucket, group_name=self.group_name, version=version,
                                       flush_cache=self.flush_cache)
        announces = _background(call_all, self.urls, path, lambda _: body, self.limits)
        broadcast = _background(comm.broadcast, bucket.flat, 0, self.group)
        try:
            self._watch(announces, broadcast, path)
        except BaseException:
            # A broadcast some server never joins cannot be cancelled: leave the group behind.
            self.abandoned = "result" not in broadcast
            raise
        failures = _failures(announces["result"], path)
        if failures:
            raise WeightSyncError("weight update failed: " + "; ".join(failures))

    def _watch(self, announces: dict, broadcast: dict, path: str) -> None:
        """Wait for the announces and the broadcast; a refusal or a hung server ends the wait."""
        started = last_probe = time.monotonic()
        while "result" not in announces or "result" not in broadcast:
            for box in (announces, broadcast):
                if "error" in box:
                    raise box["error"]
            if "result" in announces and _failures(announces["result"], path):
                raise WeightSyncError("weight update failed (the broadcast is abandoned): "
                                      + "; ".join(_failures(announces["result"], path)))
            if time.monotonic() - last_probe >= self.limits.hang_check_after_s:
                last_probe = time.monotonic()
                for url in self.urls:
                    problem = hung_problem(url, self.limits.liveness_s)
                    if problem is not None:
                        raise ServerHungError(f"{problem}, while a bucket's broadcast was pending for "
                                              f"{last_probe - started:.0f}s")
            time.sleep(0.01)

    def reset(self) -> None:
        """Drop the group so the next push forms a new one with every server.

        A restarted server lost its side, and the others must leave theirs before they can
        join a group of the same name; a refusal (a server without the group) is expected.
        """
        if self.group is None:
            return
        call_all(self.urls, "/destroy_weights_update_group", lambda _: destroy_group_body(self.group_name),
                 self.limits)
        self._drop()

    def _drop(self) -> None:
        if not self.abandoned:
            dist.destroy_process_group(self.group)
        self.group, self.abandoned = None, False

    def close(self) -> None:
        """Leave the group on both sides."""
        if self.group is None:
            return
        post_all(self.urls, "/destroy_weights_update_group", destroy_group_body(self.group_name), self.limits)
        self._drop()

