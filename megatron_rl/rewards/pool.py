"""Scoring a batch of responses: in the calling process or in a pool of worker processes.

Owns :class:`RewardScorer`: the process pool, the per-response timeout, replacing a pool
whose worker is stuck or died, keeping results in input order, and the error policy
(count and log, or raise :class:`RewardError`). It does not own what a reward returns or
how it is checked (``megatron_rl.rewards.core``).

How timeouts work. A running task of a ``ProcessPoolExecutor`` cannot be cancelled, so the
scorer keeps at most ``num_workers`` responses in flight: every task it submits finds an
idle worker and starts at once, so submit time + ``timeout_s`` is that response's deadline.
When a deadline passes, the response is an error result, the pool's workers are killed
(they are this process's children, found by the pids they reported at start-up), a fresh
pool is started, and the other responses that were in flight are submitted again. A reward
that hangs therefore costs one pool start-up (forks of the forkserver, a tenth of a second:
``python tools/bench_reward_restart.py``) and never hangs the run. A response that runs out of
time (this deadline, or the function's own limit: a :class:`TimeoutError`) is tried once more
before it is scored ``error_score``, and its result says it timed out (``reward/timeouts``). A
worker that dies (segfault, ``os._exit``) breaks the pool the same way: it is replaced and the
responses in flight are tried once more, then scored as errors.

A reward with a ``prepare`` (:func:`~megatron_rl.rewards.core.ground_truth_preparer`; the
``math`` reward parses the ground truth) has it run once per distinct ground truth of a batch,
as its own task with its own deadline and retry, before the responses; a ground truth that
fails fails its responses with that error, unscored. A reward with a ``warm_up`` has it run by
each worker as it starts, before the pool counts as ready.

In-process scoring (``num_workers=0``) cannot interrupt a function; a response that took
longer than ``timeout_s`` is still scored as an error afterwards, so both modes agree.

Workers are started with "forkserver" (else "spawn"), never "fork": the scorer lives in
torch.distributed rank processes whose gloo threads a fork would copy mid-flight. Workers
resolve ``reward.function`` by its string, with the parent's ``sys.path``, and import
nothing else of the parent's: not its main module
(:func:`~megatron_rl.parallel.main_module.parent_main_hidden`), which in a trainer rank is
the entry point with torch and Megatron behind it, seconds per worker and per replacement
pool. The forkserver preloads this module and the reward's, so a
worker is a fork that has them already.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import sys
import threading
import time
from collections import deque
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from typing import Any, Callable

from megatron_rl.parallel.main_module import parent_main_hidden
from megatron_rl.rewards.core import (
    RewardConfig,
    RewardError,
    RewardInput,
    RewardResult,
    call_preparer,
    call_reward,
    check_reward_config,
    error_result,
    ground_truth_preparer,
    one_line_error,
    resolve_reward,
)

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 120.0
"""Longest wait for a fresh pool's workers to import the reward and report ready."""
CLOSE_GRACE_S = 5.0
"""How long close() lets workers finish before it kills them."""
_ATTEMPTS_ON_CRASH = 2
_ATTEMPTS_ON_TIMEOUT = 2
_IDS_IN_LOG = 8

# Worker-process state, set once by _init_worker.
_worker_fn: Callable | None = None
_worker_error_score = 0.0
_worker_ready: Any = None


def _init_worker(function: str, error_score: float, sys_path: list[str], ready) -> None:
    global _worker_fn, _worker_error_score, _worker_ready
    sys.path[:] = sys_path
    _worker_fn = resolve_reward(function)
    _worker_error_score = error_score
    _worker_ready = ready
    warm_up = getattr(_worker_fn, "warm_up", None)
    if callable(warm_up):
        warm_up()  # before this worker counts as ready: no response pays for it


def _report_ready(timeout_s: float) -> int:
    # Every worker blocks here until all have arrived, so each takes exactly one of these
    # tasks and the pool is complete (and its pids known) before any deadline starts.
    _worker_ready.wait(timeout_s)
    return os.getpid()


def _score_in_worker(item: tuple) -> RewardResult:
    return call_reward(_worker_fn, item, _worker_error_score)


def _prepare_in_worker(ground_truth: str) -> Any:
    return call_preparer(ground_truth_preparer(_worker_fn), ground_truth, _worker_error_score)


def _start_method() -> str:
    return "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"


class RewardScorer:
    """Scores batches of responses with ``cfg.function``; owns its worker pool.

    Use as a context manager, or call :meth:`close`. The pool starts in ``__init__`` (the
    first one in a process also starts the forkserver, which imports the reward's module:
    about a second for ``math``, sympy) and is reused by every :meth:`score` call. Calls from several threads (the
    trainer's, and the thread that scores a batch generated ahead) run one at a time.
    """

    def __init__(self, cfg: RewardConfig) -> None:
        check_reward_config(cfg)
        self.cfg = cfg
        self._fn = resolve_reward(cfg.function)
        self._context = multiprocessing.get_context(_start_method())
        if self._context.get_start_method() == "forkserver":
            # Imported once by the forkserver (when this process starts it), so that each
            # worker, first pool or replacement, is a fork that has them already.
            self._context.set_forkserver_preload([__name__, *filter(None, [getattr(self._fn, "__module__", None)])])
        self._executor: ProcessPoolExecutor | None = None
        self._pids: set[int] = set()
        self._closed = False
        self._one_at_a_time = threading.Lock()
        self.pool_starts = 0
        """How many pools this scorer started (more than one: workers hung or died)."""
        if cfg.num_workers > 0:
            self._start_pool()

    def __enter__(self) -> RewardScorer:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def close(self) -> None:
        """Stop the workers; the scorer cannot score afterwards. Safe to call twice."""
        # A score() in another thread may still run (a run stopping mid-step): wait for it a
        # while, then stop the pool under it (that call then fails, and nobody waits for it).
        waited = self._one_at_a_time.acquire(timeout=CLOSE_GRACE_S)
        try:
            self._closed = True
            if self._executor is not None:
                self._stop_pool(grace_s=CLOSE_GRACE_S)
        finally:
            if waited:
                self._one_at_a_time.release()

    def score(self, items: list[RewardInput]) -> list[RewardResult]:
        """One result per item, in input order; raises RewardError if fatal_errors is set."""
        with self._one_at_a_time:
            if self._closed:
                raise RuntimeError("RewardScorer.score called after close()")
            prepared = self._prepare(items)
            failed = {i: p for i, p in enumerate(prepared) if isinstance(p, RewardResult)}
            calls = [(_score_in_worker, (item.prompt, item.response, truth, item.metadata))
                     for item, truth in zip(items, prepared)]
            todo = [i for i in range(len(items)) if i not in failed]
            scored = dict(zip(todo, self._run([calls[i] for i in todo])))
            results = [failed[i] if i in failed else scored[i] for i in range(len(items))]
            self._report_errors(items, results)
            return results

    def _prepare(self, items: list[RewardInput]) -> list:
        """Per item, its ground truth as the reward gets it: prepared once per distinct ground
        truth when the reward has a ``prepare``, or the error result of a failed one."""
        prepare = ground_truth_preparer(self._fn)
        if prepare is None:
            return [item.ground_truth for item in items]
        distinct = list(dict.fromkeys(item.ground_truth for item in items))
        done = dict(zip(distinct, self._run([(_prepare_in_worker, truth) for truth in distinct])))
        return [done[item.ground_truth] for item in items]

    def _run(self, calls: list[tuple[Callable, Any]]) -> list:
        """Each call's result (a worker function and its argument), in order."""
        if self.cfg.num_workers > 0:
            return self._run_in_pool(calls)
        return [self._run_in_process(*call) for call in calls]

    def _run_in_process(self, task: Callable, arg: Any) -> Any:
        for attempt in range(1, _ATTEMPTS_ON_TIMEOUT + 1):
            start = time.monotonic()
            result = (call_reward(self._fn, arg, self.cfg.error_score) if task is _score_in_worker
                      else call_preparer(ground_truth_preparer(self._fn), arg, self.cfg.error_score))
            if not _timed_out(result) and time.monotonic() - start > self.cfg.timeout_s:
                result = self._timeout_result()
            if not _timed_out(result) or attempt == _ATTEMPTS_ON_TIMEOUT:
                return _as_final(result, attempt)
        raise AssertionError("unreachable")

    def _timeout_result(self) -> RewardResult:
        return error_result(f"TimeoutError: scoring took longer than reward.timeout_s={self.cfg.timeout_s}s",
                            self.cfg.error_score, timed_out=True)

    def _start_pool(self) -> None:
        workers = self.cfg.num_workers
        ready = self._context.Barrier(workers)
        self._executor = ProcessPoolExecutor(
            max_workers=workers,
            mp_context=self._context,
            initializer=_init_worker,
            initargs=(self.cfg.function, self.cfg.error_score, list(sys.path), ready),
        )
        # The executor starts a worker per submit while none is idle, so these tasks start
        # all of them (and no later submit starts one); each blocks on the barrier until
        # every worker holds one.
        with parent_main_hidden():
            futures = [self._executor.submit(_report_ready, STARTUP_TIMEOUT_S) for _ in range(workers)]
        try:
            self._pids = {future.result(timeout=STARTUP_TIMEOUT_S + 5) for future in futures}
        except Exception as exc:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None
            raise RuntimeError(
                f"reward workers for {self.cfg.function!r} did not start: {exc!r}"
            ) from exc
        self.pool_starts += 1

    def _stop_pool(self, grace_s: float) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
        # Idle workers exit on shutdown; one still busy after grace_s is killed so that
        # neither this call nor interpreter exit (which joins the pool) can hang. Only
        # live children of this process are matched, so a reused pid is never hit.
        give_up = time.monotonic() + grace_s
        for process in multiprocessing.active_children():
            if process.pid in self._pids:
                process.join(timeout=max(0.0, give_up - time.monotonic()))
                if process.is_alive():
                    process.kill()
                    process.join(timeout=5)
        self._executor.shutdown(wait=True)
        self._executor = None
        self._pids = set()

    def _replace_pool(self) -> None:
        self._stop_pool(grace_s=0.0)
        self._start_pool()

    def _run_in_pool(self, calls: list[tuple[Callable, Any]]) -> list:
        """Length: one scheduling loop (submit, wait, collect, expire), read top to bottom."""
        results: list = [None] * len(calls)
        crashes, timeouts = [0] * len(calls), [0] * len(calls)
        queue = deque(range(len(calls)))
        in_flight: dict[Future, tuple[int, float]] = {}
        while queue or in_flight:
            while queue and len(in_flight) < self.cfg.num_workers:
                index = queue.popleft()
                future = self._executor.submit(*calls[index])
                in_flight[future] = (index, time.monotonic() + self.cfg.timeout_s)
            next_deadline = min(deadline for _, deadline in in_flight.values())
            wait_s = max(0.0, next_deadline - time.monotonic())
            done, _ = wait(in_flight, timeout=wait_s, return_when=FIRST_COMPLETED)
            broken = any(isinstance(f.exception(), BrokenProcessPool) for f in done)
            if broken:
                self._retry_after_crash(in_flight, results, crashes, queue)
                continue
            for future in done:
                index = in_flight.pop(future)[0]
                self._collect(future, index, results)
                if _timed_out(results[index]):  # the function's own limit: once more
                    self._after_timeout(index, results, timeouts, queue, results[index])
            now = time.monotonic()
            expired = [f for f, (_, end) in in_flight.items() if end <= now and not f.done()]
            if expired:
                for future in expired:
                    index = in_flight.pop(future)[0]
                    self._after_timeout(index, results, timeouts, queue, self._timeout_result())
                self._requeue(in_flight, results, queue)
                self._replace_pool()
        return results

    def _after_timeout(self, index: int, results: list, timeouts: list, queue: deque, result: RewardResult) -> None:
        """A call that ran out of time is queued once more, then its timeout is its result."""
        timeouts[index] += 1
        if timeouts[index] < _ATTEMPTS_ON_TIMEOUT:
            results[index] = None
            queue.append(index)
        else:
            results[index] = _as_final(result, timeouts[index])

    def _collect(self, future: Future, index: int, results: list) -> None:
        exc = future.exception()
        if exc is None:
            results[index] = future.result()
        else:
            # Not the reward's own failure (call_reward catches those) but sending the item
            # or its result across processes, e.g. unpicklable metadata.
            results[index] = error_result(one_line_error(exc), self.cfg.error_score)

    def _requeue(self, in_flight: dict, results: list, queue: deque) -> None:
        """Keep finished results of in-flight tasks; queue the rest again, in order, first."""
        unfinished = []
        for future, (index, _) in in_flight.items():
            if future.done() and not isinstance(future.exception(), BrokenProcessPool):
                self._collect(future, index, results)
            else:
                unfinished.append(index)
        queue.extendleft(sorted(unfinished, reverse=True))
        in_flight.clear()

    def _retry_after_crash(
        self, in_flight: dict, results: list, crashes: list, queue: deque
    ) -> None:
        # Which in-flight response killed the worker is unknown, so each gets one more try.
        for future, (index, _) in list(in_flight.items()):
            if future.done() and not isinstance(future.exception(), BrokenProcessPool):
                continue
            crashes[index] += 1
            if crashes[index] >= _ATTEMPTS_ON_CRASH:
                results[index] = error_result(
                    "BrokenProcessPool: a reward worker died while scoring this response",
                    self.cfg.error_score,
                )
                del in_flight[future]
        self._requeue(in_flight, results, queue)
        self._replace_pool()

    def _report_errors(self, items: list[RewardInput], results: list[RewardResult]) -> None:
        failed = [(item.sample_id, res.error) for item, res in zip(items, results) if res.error]
        if not failed:
            return
        first_id, first_error = failed[0]
        if self.cfg.fatal_errors:
            raise RewardError(
                f"reward function {self.cfg.function!r} failed on sample {first_id!r}: "
                f"{first_error}"
                + (f" (and {len(failed) - 1} more in this batch)" if len(failed) > 1 else "")
            )
        ids = [sample_id for sample_id, _ in failed[:_IDS_IN_LOG]]
        logger.warning(
            "reward %r failed on %d of %d responses (scored %s), sample ids %s%s; first: %s",
            self.cfg.function,
            len(failed),
            len(items),
            self.cfg.error_score,
            ids,
            " ..." if len(failed) > _IDS_IN_LOG else "",
            first_error,
        )


def _timed_out(result: Any) -> bool:
    return isinstance(result, RewardResult) and result.timed_out


def _as_final(result: Any, attempts: int) -> Any:
    """A timed-out result after its last attempt says how many there were."""
    if _timed_out(result) and attempts > 1:
        return error_result(f"{result.error} ({attempts} attempts)", result.score, timed_out=True)
    return result
