"""The CPU stand-in's generation pauses and model-update lock, by SGLang 0.5.23's rules.

Every rule is SGLang's (paths under ``sglang/srt/``); what a pause does to each request is
:mod:`~megatron_rl.sglang_standin.batching`'s:

* **The model-update lock** (``utils/aio_rwlock.py``, ``managers/tokenizer_manager.py:771``): a
  ``/generate`` holds it shared from when it enters (after any pause, ``:938-941``) until it is
  answered; a weight-update call (a session's begin and end, ``tokenizer_control_mixin.py:
  471-483``; each update, ``:503-526``, ``:563-590``) takes it exclusively unless generation is
  paused, waiting for every running request to be answered, and a writer that waits keeps
  new requests out (writer preference, ``aio_rwlock.py:44-70``).
* **Pause** (``/pause_generation``, ``entrypoints/http_server.py:1831-1841``;
  ``tokenizer_manager.py:2267-2280``; ``io_struct.py:1927-1946``): new requests wait until
  ``/continue_generation``; ``abort`` answers every request with what it has and returns once
  none holds the lock; ``retract`` and ``in_place`` return at once, their requests kept
  (``scheduler.py:5817-5932``). A mode outside the three is refused (FastAPI, 422). In every
  mode decoding stops at the scheduler's next step: paused, its event loop runs no batch
  (``scheduler.py:2031-2036``); an aborted running request runs one more decode step, whose
  token it keeps, and is answered with every token it has, ``finish_reason`` abort
  (``scheduler.py:5800-5812``; ``scheduler_components/batch_result_processor.py:1045-1049``;
  ``schedule_batch.py:2011-2013``). So the stand-in's engine call in progress is stopped at its
  next decode step (the hf engine; :mod:`~megatron_rl.sglang_standin.batching` says what its
  requests keep): a pause in mode ``abort`` waits for that step, not for the whole call (the
  megatron engine's calls still run to their end). SGLang checks the lock every 1.0 s
  (``tokenizer_manager.py:2273-2280``), the stand-in every 0.05 s: SGLang's abort pause with
  requests running takes at least a second.
* **flush_cache** (``scheduler.py:5518-5548``) succeeds only when no request runs (queued ones
  ignored while paused), else ``/flush_cache`` answers 400 (``http_server.py:1027-1040``) and
  a weight update that asked for it fails, its weights loaded (``scheduler_components/
  weight_updater.py:120-133``): after ``in_place`` the kept requests run.
* ``/continue_generation`` (``tokenizer_manager.py:2282-2286``; ``scheduler.py:5934-5957``) is
  accepted whether paused or not.

The stand-in's limit: pausing ``in_place`` needs an engine that keeps each row's KV (the hf
engine); with the megatron engine, which recomputes every position at every step, it answers
400 naming the engine instead of modelling something else. Owns the endpoints (:class:`PauseRoutes`,
a part of the stand-in's :class:`~megatron_rl.sglang_standin.server.ProtocolServer`) and the lock.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import AsyncIterator

from aiohttp import web

from megatron_rl.rollout.sglang.wire import PAUSE_MODES

FLUSH_REFUSED = ("Weights were updated, but the cache was not flushed because requests are still running or "
                 "queued. Retract or finish them, then call /flush_cache.")
"""weight_updater.py:128-132."""


class UpdateLock:
    """SGLang's ``RWLock`` (``utils/aio_rwlock.py``): shared for requests, exclusive for updates,
    a waiting writer first."""

    def __init__(self) -> None:
        self._cond = asyncio.Condition()
        self.readers = 0
        self._writer = False
        self._waiting_writers = 0

    @contextlib.asynccontextmanager
    async def reading(self) -> AsyncIterator[None]:
        async with self._cond:
            await self._cond.wait_for(lambda: not self._writer and not self._waiting_writers)
            self.readers += 1
        try:
            yield
        finally:
            async with self._cond:
                self.readers -= 1
                self._cond.notify_all()

    @contextlib.asynccontextmanager
    async def writing(self) -> AsyncIterator[None]:
        async with self._cond:
            self._waiting_writers += 1
            try:
                await self._cond.wait_for(lambda: not self._writer and not self.readers)
                self._writer = True
            finally:
                self._waiting_writers -= 1
        try:
            yield
        finally:
            async with self._cond:
                self._writer = False
                self._cond.notify_all()


class PauseRoutes:
    """The pause endpoints of the stand-in's server, which provides ``batcher`` (the
    :class:`~megatron_rl.sglang_standin.batching.ContinuousBatcher`), ``running`` (an
    ``asyncio.Event`` set unless paused), ``update_lock`` (:class:`UpdateLock`) and ``host``
    (its ``engine_kind``)."""

    def pause_routes(self) -> list:
        """The routes, to add to the application."""
        return [web.post("/pause_generation", self.pause), web.post("/continue_generation", self.resume_generation)]

    @property
    def paused(self) -> bool:
        return not self.running.is_set()

    @contextlib.asynccontextmanager
    async def updating(self) -> AsyncIterator[None]:
        """Around a weight-update call: exclusive unless generation is paused."""
        if self.paused:
            yield
            return
        async with self.update_lock.writing():
            yield

    def cache_flushable(self) -> bool:
        """Whether SGLang's scheduler would flush its cache now (no request running)."""
        return self.batcher.running_requests == 0

    async def pause(self, request: web.Request) -> web.Response:
        """``POST /pause_generation`` ``{"mode": "abort" | "retract" | "in_place"}``."""
        body = await request.json() if request.body_exists else {}
        mode = body.get("mode", "abort") if isinstance(body, dict) else None
        if mode not in PAUSE_MODES:
            return web.json_response({"detail": f"mode {mode!r} is not one of {list(PAUSE_MODES)}"}, status=422)
        if mode == "in_place" and not self.batcher.keeps_kv:
            return web.json_response({"object": "error", "code": 400, "message": (
                f"pause_generation in_place: the stand-in's {self.host.engine_kind} engine keeps no KV cache to "
                "continue from; run it with --engine hf")}, status=400)
        self.running.clear()
        self.batcher.pause(mode)
        while mode == "abort" and self.update_lock.readers:
            await asyncio.sleep(0.05)
            self.batcher.pause(mode)  # as SGLang aborts again until none is left (tokenizer_manager.py:2271-2279)
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def resume_generation(self, request: web.Request) -> web.Response:
        """``POST /continue_generation``."""
        self.batcher.resume()
        self.running.set()
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})
