"""Continuous batching for the CPU SGLang stand-in: queued ``/generate`` requests onto one engine,
a modelled decode clock, and what a pause does to the requests it finds.

Shape legend: P prompt tokens, n tokens a request has produced, L MoE layers, K top-K.

Concurrent requests with equal sampling parameters (and the same wish for routes) that
arrive within a short window are answered by one engine call, as SGLang batches requests
continuously; the first request of a batch seeds it. ``alone`` answers each request by its
own engine call, so a sample depends on its own seed and the weights only (SGLang's
deterministic inference). ``last_answer`` is when the engine last answered anything (the
stand-in's ``/health`` waits for it, as SGLang's does for any scheduler output).

**The decode clock.** An engine call computes a request's whole response at once, under the
weights the engine holds (each token's log-prob and the routes of every position it
forwarded come from that pass). ``token_latency_s`` models a GPU's decode time without its
compute: after the call, the response's tokens count as produced one per ``token_latency_s``
(token ``i`` at ``t0 + (i + 1) * token_latency_s``) and the request is answered when its last
one is; requests decode side by side, as SGLang's continuous batching decodes a request that
arrives later alongside the running ones (benchmarks on CPU, ``tools/bench_async.py``).
Without latency a response is answered when computed.

**Pauses** (SGLang's rules, ``sglang/srt/managers/scheduler.py:5817-5932``,
``tokenizer_manager.py:2267-2286``; the endpoints are :mod:`~megatron_rl.sglang_standin.pausing`):
a request whose response is computed but not all produced is cut where the clock is (its n
tokens, their log-probs and the routes of positions ``0 .. P + n - 2`` are kept; the rest
was never produced). Mode ``abort`` answers it with those tokens (``finish_reason`` abort;
a request still queued is answered with none). ``retract`` and ``in_place`` keep it: after
``/continue_generation`` the rest is computed under the weights the engine holds then, from
the prompt and its n tokens: ``retract`` recomputes every position (so the positions before
the cut come back with the recompute's routes, as SGLang's capture by KV slot does after a
retraction), ``in_place`` continues from the KV the first pass left (engines that keep it:
the hf engine's cache of a row, :mod:`~megatron_rl.rollout.local.hf_prefix_cache`): the old
positions keep their routes and the new tokens come from the new weights over the old KV.
Every token carries the version of the weights that produced it (``weight_versions`` spans).
A pause also stops an engine call in progress at its next decode step (engines that can: the
hf engine's :class:`~megatron_rl.rollout.local.hf_generate.DecodeControl`), as SGLang's
scheduler stops decoding at its next step in every mode (``scheduler.py:2031-2036``, an abort at
``:5800-5812``): the call's responses come back cut, and every token the call returns counts as
produced, clock or not: the engine decoded them one step at a time before the stop, its own
steps standing for the clock, as SGLang's scheduler had. So a pause in mode ``abort`` returns
within a decode step rather than after the whole call, with the tokens decoded by then; a kept
request goes on from them. (An engine that cannot stop computes its whole call past the pause;
which of its tokens came before the pause is unknown, so none counts as produced: the clock had
not started.)

Owns the queue, the batch window and size, the modelled decode clock and the pause cuts.
Does not own HTTP, request parsing or the pause endpoints
(:mod:`~megatron_rl.sglang_standin.server`, :mod:`~megatron_rl.sglang_standin.pausing`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Awaitable, Callable

import torch

from megatron_rl.rollout.engine import RolloutSample, SamplingParams
from megatron_rl.rollout.local.hf_generate import DecodeControl
from megatron_rl.rollout.local.hf_prefix_cache import CachedPrefix, PrefixCache
from megatron_rl.rollout.sglang.partial import piece_seed

GenerateFn = Callable[[list[list[int]], SamplingParams, bool, int, PrefixCache | None, DecodeControl],
                      Awaitable[tuple[str, list[RolloutSample]]]]
"""``(prompts, params, return_routed_experts, seed, kv, control) -> (weights version, one sample per
prompt)``, run off the event loop; ``kv`` (engines that keep KV): serves a prompt that extends an
entry from it and keeps every computed row's KV in it; ``control`` (engines that can stop between
decode steps): stopped by a pause, a sample it cut has ``finish_reason`` abort."""


@dataclass
class Answer:
    """What a request's response holds."""

    output_ids: list[int]
    """Every token the request produced."""
    output_logprobs: torch.Tensor
    """``[n]`` their log-probs."""
    finish_reason: str
    """stop, length or abort."""
    routed_experts: torch.Tensor | None
    """``[P + n - 1, L, K]`` routes of every forwarded position (None: not asked for, or no token)."""
    versions: list[str]
    """The weights version of each token."""
    retractions: int = 0
    """Pauses in mode ``retract`` it went through."""

    def spans(self) -> list[tuple[str, int, int]]:
        """``(version, start, end)`` runs of ``versions``."""
        out: list[tuple[str, int, int]] = []
        for i, version in enumerate(self.versions):
            if out and out[-1][0] == version:
                out[-1] = (version, out[-1][1], i + 1)
            else:
                out.append((version, i, i + 1))
        return out


@dataclass(eq=False)
class _Request:
    """A queued or running request and what it has produced so far."""

    params: SamplingParams
    """Its sampling parameters (requests batch only with equal ones)."""
    prompt: list[int]
    """Prompt token ids (P)."""
    want_routes: bool
    """``return_routed_experts``."""
    seed: int
    """``sampling_seed`` (the first request of a batch seeds it)."""
    future: asyncio.Future
    """Resolved with the request's :class:`Answer` (or the engine's error)."""
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[torch.Tensor] = field(default_factory=list)
    versions: list[str] = field(default_factory=list)
    routes: torch.Tensor | None = None
    """Routes of positions ``0 .. P + n - 2`` (after a cut)."""
    kv: CachedPrefix | None = None
    """In place: the KV of positions ``0 .. P + n - 2`` the first pass left."""
    retractions: int = 0
    decoding: tuple | None = None
    """While the clock runs: ``(sample, version, t0, kv entry, answer task)``."""

    @property
    def piece(self) -> tuple[list[int], SamplingParams, int]:
        """The engine call that produces the rest: prompt and tokens so far, fewer new tokens, seed."""
        params = dataclasses.replace(self.params, max_new_tokens=self.params.max_new_tokens - len(self.output_ids))
        return self.prompt + self.output_ids, params, piece_seed(self.seed, len(self.output_ids))

    def keep(self, sample: RolloutSample, version: str, n: int) -> None:
        """Add the first ``n`` tokens of ``sample`` (computed under ``version``) to what it produced."""
        self.output_ids.extend(sample.output_ids[:n])
        self.logprobs.append(sample.output_logprobs[:n])
        self.versions.extend([version] * n)
        if sample.routed_experts is not None:
            self.routes = sample.routed_experts[:len(self.prompt) + len(self.output_ids) - 1]

    def answer(self, reason: str) -> Answer:
        routes = self.routes if self.want_routes and self.output_ids else None
        logprobs = torch.cat(self.logprobs) if self.logprobs else torch.zeros(0)
        return Answer(list(self.output_ids), logprobs, reason, routes, list(self.versions), self.retractions)


class ContinuousBatcher:
    """Batches submitted requests onto ``generate``; run it with :meth:`running`.

    Args:
        generate: the engine call.
        window_s: how long the first queued request waits for others to batch with.
        max_batch: most sequences per engine call.
        token_latency_s: modelled decode time per token (0: answered at once).
        alone: every request is its own engine call.
        keeps_kv: the engine keeps each row's KV when asked (pauses in place are modelled).
        stops: the engine stops a call between decode steps when its control is stopped.
    """

    def __init__(self, generate: GenerateFn, *, window_s: float = 0.01, max_batch: int = 256,
                 token_latency_s: float = 0.0, alone: bool = False, keeps_kv: bool = False,
                 stops: bool = False) -> None:
        self.generate, self.window_s, self.max_batch = generate, window_s, max_batch
        self.token_latency_s, self.alone, self.keeps_kv, self.stops = token_latency_s, alone, keeps_kv, stops
        self.last_answer = 0.0
        """``time.monotonic()`` when the engine last answered (or failed) a batch."""
        self.batches = 0
        """Engine calls made."""
        self.decoding: set[_Request] = set()
        """Requests computed whose tokens the clock is still producing."""
        self.paused: str | None = None
        """The mode generation is paused in (None: running)."""
        self.parked: list[_Request] = []
        """Requests a retract or in-place pause cut, continued after the pause."""
        self._call: tuple[DecodeControl, str | None] | None = None
        """The engine call in progress: its control, and the mode of the pause that stopped it."""
        self._waiting: asyncio.Queue | None = None
        self._resumed: asyncio.Event | None = None

    async def submit(self, prompt: list[int], params: SamplingParams, want_routes: bool, seed: int) -> Answer:
        """The request's answer, once produced; raises the engine's error."""
        future = asyncio.get_running_loop().create_future()
        await self._waiting.put(_Request(params, list(prompt), want_routes, seed, future))
        return await future

    @property
    def queued(self) -> int:
        """Requests waiting for an engine call."""
        return 0 if self._waiting is None else self._waiting.qsize()

    @property
    def running_requests(self) -> int:
        """Requests the scheduler runs (decoding, or cut in place and kept with their KV)."""
        return len(self.decoding) + sum(1 for r in self.parked if self.paused == "in_place")

    async def running(self, _app=None) -> AsyncIterator[None]:
        """Batches while suspended at its ``yield`` (an aiohttp ``cleanup_ctx`` entry);
        afterwards the requests still decoding are cancelled."""
        self._waiting, self._resumed = asyncio.Queue(), asyncio.Event()
        self._resumed.set()
        task = asyncio.create_task(self._batch_forever())
        yield
        for request in list(self.decoding):
            request.decoding[4].cancel()
        self.decoding.clear()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    async def _batch_forever(self) -> None:
        while True:
            await self._resumed.wait()
            batch = [await self._waiting.get()]
            deadline = time.monotonic() + self.window_s
            while len(batch) < self.max_batch and (left := deadline - time.monotonic()) > 0:
                try:
                    batch.append(await asyncio.wait_for(self._waiting.get(), left))
                except asyncio.TimeoutError:
                    break
            if self.paused is not None:  # a pause came while the batch gathered: it stays queued
                for request in batch:
                    self._waiting.put_nowait(request)
                continue
            groups: dict[tuple, list[_Request]] = {}
            for request in batch:
                key = id(request) if self.alone else (repr(request.piece[1]), request.want_routes)
                groups.setdefault(key, []).append(request)
            for members in groups.values():
                await self._run(members)

    async def _run(self, members: list[_Request]) -> None:
        if self.paused is not None:  # a pause came while an earlier group ran: none of these started
            for m in members:
                if self.paused == "abort":
                    self._resolve(m, "abort")
                else:
                    self._waiting.put_nowait(m)
            return
        pieces = [m.piece for m in members]
        kv = PrefixCache() if self.keeps_kv else None
        for m in members:
            if m.kv is not None:
                kv.store(m.kv)
        self.batches += 1
        control = DecodeControl(None)
        self._call = (control, None)
        try:
            version, samples = await self.generate([p[0] for p in pieces], pieces[0][1], members[0].want_routes,
                                                   pieces[0][2], kv, control)
        except Exception as err:  # noqa: BLE001 - each waiting request gets the error
            self.last_answer = time.monotonic()
            for m in members:
                if not m.future.done():
                    m.future.set_exception(err)
            return
        finally:
            stopped_in, self._call = self._call[1], None
        now = time.monotonic()
        # Computed after the pause began (nothing was produced yet), or stopped by a pause that has
        # ended since (its requests were cut all the same, and the kept ones go on at once).
        mode = self.paused or stopped_in
        decoded_before_stop = stopped_in is not None and self.stops
        for m, (prompt, _, _), sample in zip(members, pieces, samples):
            m.kv = None
            entry = None if kv is None else kv.take((*prompt, *sample.output_ids[:-1]))
            delay = self.token_latency_s * len(sample.output_ids)
            task = asyncio.get_running_loop().call_later(delay, self._finish, m)
            m.decoding = (sample, version, now, entry, task)
            self.decoding.add(m)
            if mode is not None:
                self._cut(m, now, mode, every_token_produced=decoded_before_stop)
        if self.paused is None and self.parked:
            self.resume()

    def _finish(self, request: _Request) -> None:
        sample, version, _, _, _ = request.decoding
        self.decoding.discard(request)
        request.decoding = None
        request.keep(sample, version, len(sample.output_ids))
        self._resolve(request, sample.finish_reason)

    def _resolve(self, request: _Request, reason: str) -> None:
        self.last_answer = time.monotonic()
        if not request.future.done():
            request.future.set_result(request.answer(reason))

    # ------------------------------------------------------------------ pauses

    def pause(self, mode: str) -> None:
        """Stop producing tokens: each running request is cut where the clock is (see the
        module docstring); ``abort`` answers them, and the queued ones, with what they have."""
        self.paused = mode
        self._resumed.clear()
        if self._call is not None:
            self._call[0].stop()
            self._call = (self._call[0], self._call[1] or mode)
        now = time.monotonic()
        for request in list(self.decoding):
            self._cut(request, now, mode)
        if mode == "abort":
            while not self._waiting.empty():
                self._resolve(self._waiting.get_nowait(), "abort")

    def _cut(self, request: _Request, now: float, mode: str, every_token_produced: bool = False) -> None:
        sample, version, t0, entry, task = request.decoding
        task.cancel()
        self.decoding.discard(request)
        request.decoding = None
        latency = self.token_latency_s
        produced = len(sample.output_ids)
        if latency > 0 and not every_token_produced:
            produced = min(produced, math.floor((now - t0) / latency + 1e-9))
        prompt_len = len(request.prompt) + len(request.output_ids)
        request.keep(sample, version, produced)
        if produced == len(sample.output_ids) and sample.finish_reason != "abort":  # it had ended
            self._resolve(request, sample.finish_reason)
        elif mode == "abort":
            self._resolve(request, "abort")
        else:
            if mode == "retract":
                request.retractions += 1
            elif entry is not None:  # in place: the KV of every position before the cut stays
                keep = prompt_len + produced - 1
                request.kv = CachedPrefix(entry.ids[:keep], [k[:, :keep] for k in entry.keys],
                                          [v[:, :keep] for v in entry.values],
                                          None if entry.routes_CLK is None else entry.routes_CLK[:keep])
            self.parked.append(request)

    def resume(self) -> None:
        """``/continue_generation``: the requests a pause kept are computed on from where they were cut."""
        parked, self.parked, self.paused = self.parked, [], None
        for request in parked:
            self._waiting.put_nowait(request)
        self._resumed.set()
