"""Run a function on every rank of a fresh local gloo world (tests, CPU smoke runs).

``run_world(fn, world_size, *args)`` spawns ``world_size`` processes, creates the default
gloo process group in each, calls ``fn(*args)`` on every rank and returns the per-rank
results in rank order. A failure on any rank raises :class:`WorldError` carrying that
rank's traceback; a world that does not finish within ``timeout_s`` is killed and raises
:class:`WorldTimeout` naming the ranks that were still running. Starting a world costs
seconds (Megatron's import alone takes ~4 s), so callers run many checks per world.

Results travel back serialized with ``torch.save`` (tensors, dicts, lists, numbers).
"""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import queue
import socket
import time
import traceback
from typing import Any, Callable

import torch


class WorldError(RuntimeError):
    """One or more ranks raised; the message holds each failing rank's traceback."""


class WorldTimeout(WorldError):
    """The world did not finish in time and was killed."""


def free_port() -> int:
    """A TCP port that is free on localhost right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _dumps(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _loads(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=False)


def _rank_main(
    rank: int,
    world_size: int,
    port: int,
    threads: int,
    fn: Callable,
    args: tuple,
    results: "mp.Queue",
) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    # Each rank gets its share of the cores; oversubscription makes gloo worlds crawl.
    torch.set_num_threads(threads)
    try:
        torch.distributed.init_process_group("gloo", rank=rank, world_size=world_size)
        value = fn(*args)
        results.put((rank, True, _dumps(value)))
    except BaseException:  # noqa: BLE001 - every failure must reach the parent
        results.put((rank, False, traceback.format_exc()))
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def run_world(
    fn: Callable,
    world_size: int,
    *args: Any,
    timeout_s: float = 600.0,
    threads_per_rank: int | None = None,
) -> list[Any]:
    """Call ``fn(*args)`` on each rank of a new gloo world; return results by rank.

    Args:
        fn: a module-level (picklable) function; it runs after the default group exists.
        world_size: number of processes.
        *args: picklable arguments passed to ``fn`` on every rank.
        timeout_s: wall-clock limit for the whole world.
        threads_per_rank: torch intra-op threads per rank; defaults to cores / world size.

    Raises:
        WorldError: a rank raised (message lists each failing rank's traceback).
        WorldTimeout: the world ran past ``timeout_s``.
    """
    if threads_per_rank is None:
        threads_per_rank = max(1, (os.cpu_count() or 1) // world_size)
    ctx = mp.get_context("spawn")
    results: mp.Queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_rank_main,
            args=(rank, world_size, port, threads_per_rank, fn, args, results),
            name=f"rank{rank}",
        )
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    outcomes: dict[int, tuple[bool, Any]] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(outcomes) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                running = [r for r in range(world_size) if r not in outcomes]
                raise WorldTimeout(
                    f"world of {world_size} ({getattr(fn, '__name__', fn)}) did not finish in "
                    f"{timeout_s:.0f}s; ranks still running: {running}"
                    + _failures(outcomes)
                )
            try:
                rank, ok, payload = results.get(timeout=min(remaining, 1.0))
                outcomes[rank] = (ok, payload)
                if not ok:
                    # Peers of a failed rank usually block in a collective: give them a
                    # moment to report their own errors, then stop waiting.
                    deadline = min(deadline, time.monotonic() + 5.0)
            except queue.Empty:
                dead = [
                    r for r, p in enumerate(procs) if r not in outcomes and p.exitcode is not None
                ]
                if dead:
                    # Give the queue a moment: a rank may have exited right after putting.
                    time.sleep(0.5)
                    while not results.empty():
                        rank, ok, payload = results.get()
                        outcomes[rank] = (ok, payload)
                    lost = [r for r in dead if r not in outcomes]
                    if lost:
                        codes = {r: procs[r].exitcode for r in lost}
                        raise WorldError(
                            f"ranks {lost} exited without reporting (exit codes {codes})"
                            + _failures(outcomes)
                        )
        if any(not ok for ok, _ in outcomes.values()):
            raise WorldError(_failures(outcomes))
        return [_loads(outcomes[r][1]) for r in range(world_size)]
    finally:
        for proc in procs:
            proc.join(timeout=10)
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join()


def _failures(outcomes: dict[int, tuple[bool, Any]]) -> str:
    parts = [
        f"\n--- rank {rank} failed ---\n{payload}"
        for rank, (ok, payload) in sorted(outcomes.items())
        if not ok
    ]
    return "".join(parts)
