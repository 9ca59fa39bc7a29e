"""Continuous batching for the CPU SGLang stand-in: queued ``/generate`` requests onto one engine.

Concurrent requests with equal sampling parameters (and the same wish for routes) that
arrive within a short window are answered by one engine call, as SGLang batches requests
continuously; the first request of a batch seeds it. ``alone`` answers each request by its
own engine call, so a sample depends on its own seed and the weights only (SGLang's
deterministic inference). ``last_answer`` is when the engine last answered anything (the
stand-in's ``/health`` waits for it, as SGLang's does for any scheduler output). ``token_latency_s`` models a GPU's decode time without
its compute: after a batch is computed its answers wait that long per token of its longest
response, beside the batches after it (benchmarks on CPU, ``tools/bench_async.py``).

Owns the queue, the batch window and size, and the modelled decode time. Does not own
HTTP or request parsing (:mod:`~megatron_rl.sglang_standin.server`) or the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass
from typing import AsyncIterator, Awaitable, Callable

from megatron_rl.rollout.engine import RolloutSample, SamplingParams

GenerateFn = Callable[[list[list[int]], SamplingParams, bool, int], Awaitable[list[RolloutSample]]]
"""``(prompts, params, return_routed_experts, seed) -> one sample per prompt``, run off the event loop."""


@dataclass
class _Pending:
    """A queued request."""

    params: SamplingParams
    """Its sampling parameters (requests batch only with equal ones)."""
    prompt: list[int]
    """Prompt token ids."""
    want_routes: bool
    """``return_routed_experts``."""
    seed: int
    """``sampling_seed`` (the first request of a batch seeds it)."""
    future: asyncio.Future
    """Resolved with the request's sample (or the engine's error)."""


class ContinuousBatcher:
    """Batches submitted requests onto ``generate``; run it with :meth:`running`.

    Args:
        generate: the engine call.
        window_s: how long the first queued request waits for others to batch with.
        max_batch: most sequences per engine call.
        token_latency_s: after computing a batch, its answers wait this long per token of
            its longest response (a modelled GPU decode; 0: answered at once).
        alone: every request is its own engine call.
    """

    def __init__(self, generate: GenerateFn, *, window_s: float = 0.01, max_batch: int = 256,
                 token_latency_s: float = 0.0, alone: bool = False) -> None:
        self.generate, self.window_s, self.max_batch = generate, window_s, max_batch
        self.token_latency_s, self.alone = token_latency_s, alone
        self.last_answer = 0.0
        """``time.monotonic()`` when the engine last answered (or failed) a batch."""
        self.batches = 0
        """Engine calls made."""
        self.decoding: set[asyncio.Task] = set()
        """Batches computed and still "decoding" (``token_latency_s``), answered when done."""
        self._queue: asyncio.Queue | None = None

    async def submit(self, prompt: list[int], params: SamplingParams, want_routes: bool, seed: int) -> RolloutSample:
        """The sample for one request, once its batch is answered; raises the engine's error."""
        future = asyncio.get_running_loop().create_future()
        await self._queue.put(_Pending(params, prompt, want_routes, seed, future))
        return await future

    async def running(self, _app=None) -> AsyncIterator[None]:
        """Batches while suspended at its ``yield`` (an aiohttp ``cleanup_ctx`` entry);
        afterwards the batches still decoding are cancelled."""
        self._queue = asyncio.Queue()
        task = asyncio.create_task(self._batch_forever())
        yield
        for running in (task, *self.decoding):
            running.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await running

    async def _batch_forever(self) -> None:
        while True:
            batch = [await self._queue.get()]
            deadline = time.monotonic() + self.window_s
            while len(batch) < self.max_batch and (left := deadline - time.monotonic()) > 0:
                try:
                    batch.append(await asyncio.wait_for(self._queue.get(), left))
                except asyncio.TimeoutError:
                    break
            groups: dict[tuple, list[_Pending]] = {}
            for pending in batch:
                key = id(pending) if self.alone else (repr(pending.params), pending.want_routes)
                groups.setdefault(key, []).append(pending)
            for members in groups.values():
                await self._run(members)

    async def _run(self, members: list[_Pending]) -> None:
        first = members[0]
        self.batches += 1
        try:
            samples = await self.generate([m.prompt for m in members], first.params, first.want_routes, first.seed)
        except Exception as err:  # noqa: BLE001 - each waiting request gets the error
            self.last_answer = time.monotonic()
            for m in members:
                if not m.future.done():
                    m.future.set_exception(err)
            return
        if self.token_latency_s > 0:
            # Sleeps, not computes: the batch occupies the "GPU" for its decode steps. It sleeps
            # beside the batches after it, as SGLang's continuous batching decodes a request that
            # arrives later alongside the running ones instead of queueing it behind them.
            delay = self.token_latency_s * max(len(s.output_ids) for s in samples)
            task = asyncio.create_task(self._answer_after(delay, members, samples))
            self.decoding.add(task)
            task.add_done_callback(self.decoding.discard)
        else:
            self._answer(members, samples)

    async def _answer_after(self, delay_s: float, members: list[_Pending], samples: list[RolloutSample]) -> None:
        await asyncio.sleep(delay_s)
        self._answer(members, samples)

    def _answer(self, members: list[_Pending], samples: list[RolloutSample]) -> None:
        self.last_answer = time.monotonic()
        for m, sample in zip(members, samples):
            if not m.future.done():
                m.future.set_result(sample)
