"""Run a function on every rank of a fresh local gloo world (CPU runs of ``megatron-rl-train``,
local conversion worlds, the smoke run, tests and benchmarks).

``run_world(fn, world_size, *args)`` starts ``world_size`` processes, creates the default
gloo process group in each, calls ``fn(*args)`` on every rank and returns the per-rank
results in rank order. A failure on any rank raises :class:`WorldError` carrying that
rank's traceback; a world that does not finish within ``timeout_s`` is killed and raises
:class:`WorldTimeout` naming the ranks that were still running. Ranks are forks of a
forkserver that imported torch and Megatron-Core once (:func:`_rank_context`), so a world
starts in well under a second after the first.

Results travel back serialized with ``torch.save`` (tensors, dicts, lists, numbers).

Lifetime: every rank leads its own process group, so stopping a rank reaches what it
started (reward pool workers and their forkserver) and the terminal's Ctrl-C reaches only
the parent. However ``run_world`` ends (results, failure, an exception such as
:class:`Stopped`), no rank or rank child outlives it: ranks still running are sent
SIGTERM, then SIGKILL, group by group, and it returns once no process of those groups runs.
When the caller dies abruptly (SIGKILL, OOM killer) every rank kills its own group at once
(:func:`exit_with_process`); the forkserver exits when its last client has, without its
interpreter's teardown (:mod:`~megatron_rl.parallel.forkserver_exit`). A caller that
exits normally stops and reaps its forkserver first (:func:`~megatron_rl.parallel.world_end.end_forkserver`), so when a
command returns, no process of its run remains. Entry points turn
SIGTERM/SIGINT into :class:`Stopped` with :func:`raise_on_stop_signals`.

The other two ways a default process group comes to be live here too: :func:`world_of_one`
(this process alone: conversions, the CPU stand-in server) and :func:`joined_world` (a rank
that torchrun or srun started).
"""

from __future__ import annotations

import contextlib
import datetime
import io
import multiprocessing as mp
import multiprocessing.util as mp_util
import os
import queue
import select
import signal
import socket
import threading
import time
import traceback
from typing import Any, Callable, Iterator, Sequence

import psutil
import torch

from megatron_rl.parallel import comm
from megatron_rl.parallel.cpu_platform import eager_fusions_environment
from megatron_rl.parallel.main_module import parent_main_hidden
from megatron_rl.parallel.mcore_compat import RANK_IMPORTS
from megatron_rl.parallel.world_end import adopt_orphans, end_forkserver_at_exit, end_groups, running


class WorldError(RuntimeError):
    """One or more ranks raised; the message holds each failing rank's traceback."""

    failures: list[tuple[int, str]] = []
    """``(rank, traceback)`` of each failed rank in the order the failures arrived: the first
    is usually the cause, the others its peers giving up on a collective."""
    lost: dict[int, int] = {}
    """Exit code of each rank that ended without reporting, by rank (negative: the signal that
    killed it, as :attr:`multiprocessing.Process.exitcode` gives it)."""

    def cause(self) -> str:
        """The likely cause in one line: a rank that ended without reporting (SIGKILL, the OOM
        killer, ``os._exit``) before anything else, since its peers' errors are only the broken
        connection to it; else the first failed rank's last traceback line."""
        if self.lost:
            ended = "; ".join(f"rank {rank} {_how_it_ended(code)}" for rank, code in sorted(self.lost.items()))
            peers = sorted(rank for rank, _ in self.failures)
            return ended + (f"; ranks {peers} failed after" if peers else "")
        if self.failures:
            rank, trace = self.failures[0]
            last = trace.strip().splitlines()[-1] if trace.strip() else "no traceback"
            return f"rank {rank} failed: {last}"
        return str(self).strip().splitlines()[0] if str(self).strip() else type(self).__name__


def _how_it_ended(exitcode: int) -> str:
    if exitcode < 0:
        with contextlib.suppress(ValueError):
            return f"was killed by {signal.Signals(-exitcode).name}"
        return f"was killed by signal {-exitcode}"
    return f"exited with code {exitcode} without reporting"


class WorldTimeout(WorldError):
    """The world did not finish in time and was killed."""


class Stopped(BaseException):
    """SIGTERM or SIGINT arrived (see :func:`raise_on_stop_signals`); exit with ``128 + signum``.

    A BaseException, like KeyboardInterrupt, so that ``except Exception`` on the way out
    does not swallow a stop.
    """

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
"""What schedulers, supervisors (SIGTERM) and the terminal (SIGINT) send to stop a run."""


@contextlib.contextmanager
def raise_on_stop_signals() -> Iterator[None]:
    """Within the block the first SIGTERM or SIGINT raises :class:`Stopped`; later ones are
    ignored, so a second Ctrl-C cannot cut short the cleanup the first one started. The
    previous handlers are restored on exit. Main thread only (Python's signal rule)."""

    def stop(signum: int, _frame: object) -> None:
        for sig in STOP_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)
        raise Stopped(signum)

    previous = {sig: signal.signal(sig, stop) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def exit_with_parent(parent_pid: int, poll_s: float = 0.5) -> None:
    """Kill this process, with its process group when it leads one, once ``parent_pid`` is
    no longer its parent (the parent died and the process was re-parented).

    A daemon thread polls, rather than ``PR_SET_PDEATHSIG``: the kernel signal would end
    only this process, and the reward workers it started would train on headless. The
    thread runs while the main thread sits in a collective or a long kernel.
    """

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(poll_s)
        if os.getpgrp() == os.getpid():
            os.killpg(os.getpid(), signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


def exit_with_process(pid: int) -> None:
    """Kill this process, with its process group when it leads one, once process ``pid`` has
    ended: a daemon thread waits on a pidfd of it (no polling, no confusion with a later
    process that reuses the pid; kernels before 5.3 poll)."""
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        pidfd = None  # gone already
    except OSError:  # a kernel before 5.3: poll instead
        pidfd = -1

    def watch() -> None:
        if pidfd == -1:
            while psutil.pid_exists(pid):
                time.sleep(0.5)
        elif pidfd is not None:
            select.select([pidfd], [], [])
        if os.getpgrp() == os.getpid():
            os.killpg(os.getpid(), signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="exit-with-caller", daemon=True).start()


@contextlib.contextmanager
def world_of_one() -> Iterator[torch.distributed.ProcessGroup]:
    """The default process group as a gloo world of this process alone (an in-memory store:
    no port), destroyed on exit; yields it."""
    if torch.distributed.is_initialized():
        raise RuntimeError("a world of one needs torch.distributed uninitialized in this process")
    torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
    try:
        yield torch.distributed.group.WORLD
    finally:
        torch.distributed.destroy_process_group()


@contextlib.contextmanager
def joined_world() -> Iterator[torch.distributed.ProcessGroup]:
    """Join the world a launcher describes in the environment (``RANK``, ``WORLD_SIZE``,
    ``MASTER_ADDR``...): NCCL on this process's GPU (``LOCAL_RANK``) when there is one, else
    gloo; yields the default group and leaves the world on exit."""
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    torch.distributed.init_process_group(backend)
    try:
        yield torch.distributed.group.WORLD
    finally:
        torch.distributed.destroy_process_group()


def rank_processes(world: torch.distributed.ProcessGroup) -> list[tuple[str, int]]:
    """Collective: every rank's ``(host name, pid)`` in rank order, gathered at the start so
    that a rank whose peer dies later can say which one (:func:`gone_on_this_host`)."""
    return comm.all_gather_objects((socket.gethostname(), os.getpid()), world)


def gone_on_this_host(processes: list[tuple[str, int]], wait_s: float = 1.0) -> list[int]:
    """Ranks of ``processes`` (from :func:`rank_processes`) on this host whose process has
    ended. Peers on other hosts cannot be seen from here (their launcher's agent reports them).

    A killed peer's sockets close before the kernel marks it ended, so the peer that broke a
    collective may look alive for a moment: polled for up to ``wait_s``.
    """
    host = socket.gethostname()
    local = [(rank, pid) for rank, (name, pid) in enumerate(processes) if name == host and pid != os.getpid()]
    deadline = time.monotonic() + wait_s
    while True:
        gone = [rank for rank, pid in local if not running(pid)]
        if gone or time.monotonic() >= deadline:
            return gone
        time.sleep(0.05)


RENDEZVOUS_TIMEOUT = datetime.timedelta(minutes=30)
"""How long a rank's store requests wait (torch's default process-group timeout)."""


def rendezvous_store(world_size: int, timeout: datetime.timedelta = RENDEZVOUS_TIMEOUT) -> torch.distributed.TCPStore:
    """The master side of a TCP rendezvous, listening on a port the kernel picked as it bound
    (``store.port``), so no other process can take the port between its pick and its bind, as
    it can take a port picked free and bound later by rank 0 (``EADDRINUSE``)."""
    return torch.distributed.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False,
                                      timeout=timeout)


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
    caller_pid: int,
    environment: dict[str, str],
    fn: Callable,
    args: tuple,
    results: "mp.Queue",
    backend: str = "gloo",
) -> None:
    os.setpgid(0, 0)
    # Not the parent (the forkserver, which outlives the caller while any rank lives).
    exit_with_process(caller_pid)
    # The forkserver's environment is the caller's when it started; a rank gets the
    # caller's environment of now, as a spawned process would.
    os.environ.clear()
    os.environ.update(environment)
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
        if backend == "nccl":
            torch.cuda.set_device(rank)  # one GPU per rank, in rank order
        store = torch.distributed.TCPStore("127.0.0.1", port, world_size, is_master=False,
                                           timeout=RENDEZVOUS_TIMEOUT)
        torch.distributed.init_process_group(backend, store=store, rank=rank, world_size=world_size)
        value = fn(*args)
        results.put((rank, True, _dumps(value)))
    except BaseException:  # noqa: BLE001 - every failure must reach the parent
        results.put((rank, False, traceback.format_exc()))
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


FORKSERVER_EXIT = "megatron_rl.parallel.forkserver_exit"
"""The module the forkserver imports last, to exit at once (its caller dead or done)."""


def _rank_context(*preload: str) -> Any:
    """Ranks are forks of a forkserver (Python's, one per process, started by the first world
    and kept for the next) that imported torch and Megatron-Core's heavy modules
    (``mcore_compat.RANK_IMPORTS``) and ``preload`` (the first world's) once, so a rank starts
    in a tenth of a second instead of importing them (seconds per rank, every world). Like
    spawn, a rank inherits no threads, locks or CUDA state of the caller; unlike spawn, it
    does not re-run the caller's ``__main__`` unless its function lives there
    (:func:`run_world`). Where the caller started the forkserver already (a reward pool, with
    its own preload) the ranks import what the preload lacks themselves. Spawn where there
    is no forkserver."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    # ``megatron_rl`` first: it defers what Megatron-Core only probes for (deferred_imports).
    # FORKSERVER_EXIT last: its exit handler then runs first, and the forkserver exits without a teardown.
    ctx.set_forkserver_preload(["megatron_rl", "torch", "torch.distributed", *RANK_IMPORTS, *preload,
                                FORKSERVER_EXIT])
    if not _ENDS_AT_EXIT:
        # The last of multiprocessing's own exit finalizers: after those that still talk to
        # the resource tracker (a queue's semaphores), which is stopped too.
        _ENDS_AT_EXIT.append(mp_util.Finalize(None, end_forkserver_at_exit, exitpriority=-100))
    return ctx


OPENMP_WAIT = {"OMP_WAIT_POLICY": "PASSIVE"}
"""The ranks' OpenMP threads sleep as soon as they wait, unless the caller's environment says
otherwise. By default libgomp spins a while after each parallel region, and on a busy machine
the threads of a team spin on one another: in a world of one with two threads on the 2-core
test machine the second thread used as much CPU as the main one (14.6 and 15.4 CPU-s) while
the model's tiny ops gained nothing from it. libgomp reads this once, as torch loads it: in
the forkserver (which imports torch as it starts) or a spawned rank."""


def _rank_defaults() -> dict[str, str]:  # the ranks' environment where the caller's lacks the key
    return {**OPENMP_WAIT, **eager_fusions_environment()}


@contextlib.contextmanager
def _environment_default(values: dict[str, str]) -> Iterator[None]:
    """``values`` in ``os.environ`` where it has none of them, while processes start (the
    forkserver and spawned ranks take the caller's environment of then); restored after."""
    added = {key: value for key, value in values.items() if key not in os.environ}
    os.environ.update(added)
    try:
        yield
    finally:
        for key in added:
            os.environ.pop(key, None)


_ENDS_AT_EXIT: list = []
"""The exit finalizer that stops this process's forkserver, once registered."""


def run_world(
    fn: Callable,
    world_size: int,
    *args: Any,
    timeout_s: float = 600.0,
    threads_per_rank: int | None = None,
    backend: str = "gloo",
    preload: Sequence[str] = (),
) -> list[Any]:
    """Call ``fn(*args)`` on each rank of a new gloo world; return results by rank.

    Args:
        fn: a module-level (picklable) function; it runs after the default group exists.
        world_size: number of processes.
        *args: picklable arguments passed to ``fn`` on every rank.
        timeout_s: wall-clock limit for the whole world.
        threads_per_rank: torch intra-op threads per rank; defaults to cores / world size.
        backend: ``"nccl"`` for a world of GPUs (rank r on GPU r); results must be host tensors.
        preload: modules every rank imports besides torch and Megatron-Core, imported once by
            the forkserver when this world starts it (a later world's are imported by its ranks).

    Raises:
        WorldError: a rank raised (message lists each failing rank's traceback).
        WorldTimeout: the world ran past ``timeout_s``.
    """
    if threads_per_rank is None:
        threads_per_rank = max(1, (os.cpu_count() or 1) // world_size)
    ctx = _rank_context(*preload)
    defaults = _rank_defaults()
    results: mp.Queue = ctx.Queue()
    # The caller hosts the ranks' store on a port it holds from the start (:func:`rendezvous_store`).
    store = rendezvous_store(world_size)
    procs = [
        ctx.Process(
            target=_rank_main,
            args=(rank, world_size, store.port, threads_per_rank, os.getpid(), {**defaults, **os.environ}, fn,
                  args, results, backend),
            name=f"rank{rank}",
        )
        for rank in range(world_size)
    ]
    # Ranks that finished or failed get a moment to exit on their own; a stop or an
    # unexpected error ends them at once.
    wait_s = 0.0
    adopt_orphans(True)
    try:
        # A rank re-runs the caller's main module only when ``fn`` lives there: otherwise it
        # would import the entry point again (or pytest), and so would every process it spawns.
        with parent_main_hidden() if getattr(fn, "__module__", None) != "__main__" else contextlib.nullcontext(), \
                _environment_default(defaults):
            for proc in procs:
                proc.start()
        late = f"world of {world_size} ({getattr(fn, '__name__', fn)}) did not finish in {timeout_s:.0f}s"
        outcomes = _collect_outcomes(procs, results, time.monotonic() + timeout_s, late)
        wait_s = 10.0
        if any(not ok for ok, _ in outcomes.values()):
            raise _world_error(WorldError, "", outcomes)
        return [_loads(outcomes[r][1]) for r in range(world_size)]
    except WorldError:
        wait_s = 10.0
        raise
    finally:
        _end_ranks(procs, wait_s)
        adopt_orphans(False)


def _collect_outcomes(procs: list, results: "mp.Queue", deadline: float, late: str) -> dict[int, tuple[bool, Any]]:
    """Each rank's ``(ok, payload)`` as it reports.

    Raises:
        WorldTimeout: ``deadline`` passed (``late`` says which world), or 5 s passed after a
            rank failed while its peers did not report.
        WorldError: a rank exited without reporting.
    """
    outcomes: dict[int, tuple[bool, Any]] = {}
    while len(outcomes) < len(procs):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            running = [r for r in range(len(procs)) if r not in outcomes]
            raise _world_error(WorldTimeout, f"{late}; ranks still running: {running}", outcomes)
        try:
            rank, ok, payload = results.get(timeout=min(remaining, 1.0))
            outcomes[rank] = (ok, payload)
            if not ok:
                # Peers of a failed rank usually block in a collective: give them a
                # moment to report their own errors, then stop waiting.
                deadline = min(deadline, time.monotonic() + 5.0)
        except queue.Empty:
            dead = [r for r, p in enumerate(procs) if r not in outcomes and p.exitcode is not None]
            if dead:
                # Give the queue a moment: a rank may have exited right after putting.
                time.sleep(0.5)
                while not results.empty():
                    rank, ok, payload = results.get()
                    outcomes[rank] = (ok, payload)
                lost = [r for r in dead if r not in outcomes]
                if lost:
                    codes = {r: procs[r].exitcode for r in lost}
                    error = _world_error(WorldError, f"ranks {lost} exited without reporting (exit codes {codes})",
                                         outcomes)
                    error.lost = codes
                    raise error
    return outcomes


def _end_ranks(procs: list, wait_s: float, grace_s: float = 5.0) -> None:
    """Let ranks exit for up to ``wait_s``, then SIGTERM and, after ``grace_s``, SIGKILL
    each rank's process group; the groups are signalled even after their rank exited, as
    its children may not have."""
    started = [p for p in procs if p.pid is not None]
    deadline = time.monotonic() + wait_s
    for proc in started:
        proc.join(timeout=max(0.0, deadline - time.monotonic()))
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, None)):
        for proc in started:
            _signal_rank(proc, sig)
        deadline = time.monotonic() + (wait or 0.0)
        for proc in started:
            proc.join(timeout=None if wait is None else max(0.0, deadline - time.monotonic()))
    # A rank's children (its reward workers) are orphans once it is gone: SIGKILLed with its
    # group above, they may take a moment to be gone.
    end_groups({proc.pid for proc in started}, grace_s)


def _signal_rank(proc, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)
    # A rank killed before its setpgid has no group of its own yet.
    if proc.exitcode is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, sig)


def _world_error(cls: type[WorldError], message: str, outcomes: dict[int, tuple[bool, Any]]) -> WorldError:
    error = cls(message + _failures(outcomes))
    error.failures = [(rank, payload) for rank, (ok, payload) in outcomes.items() if not ok]
    return error


def _failures(outcomes: dict[int, tuple[bool, Any]]) -> str:
    parts = [
        f"\n--- rank {rank} failed ---\n{payload}"
        for rank, (ok, payload) in sorted(outcomes.items())
        if not ok
    ]
    return "".join(parts)
