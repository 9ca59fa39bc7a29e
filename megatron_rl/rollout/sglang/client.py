"""The SGLang rollout client: async HTTP to SGLang servers.

Targets the HTTP protocol of **SGLang 0.5.23** (``sglang.launch_server``): ``POST
/generate``, ``GET /server_info`` (launch settings, and liveness), ``GET /health_generate``,
``GET /model_info`` and ``POST /flush_cache``; the wire format itself is
:mod:`megatron_rl.rollout.sglang.wire`. Owns request scheduling over one or more servers:
a bound on requests in flight, per-request timeouts, retries with jittered exponential
backoff within a time budget, least-loaded server choice with a cool-down for servers that
failed, hung-server detection, and the exactly-once accounting of samples (the ledger,
counters and errors are :mod:`~megatron_rl.rollout.sglang.ledger`). Does not own the
collective engine (:mod:`~megatron_rl.rollout.sglang.engine`), weight transfer
(:mod:`~megatron_rl.rollout.sglang.weight_sync`), blocking control calls
(:mod:`~megatron_rl.rollout.sglang.control`) or starting servers
(:mod:`~megatron_rl.rollout.sglang.server`).

Exactly-once semantics: each sample of a ``generate`` call has a client-side id (batch tag
+ index). An attempt sends it as ``rid = "<batch>-<index>.a<attempt>"`` (SGLang rejects a
``rid`` that is still in flight, so attempts never reuse one) and checks that
``meta_info.id`` echoes it. A sample has at most one attempt in flight; a failed attempt
(connection lost, timeout, HTTP 5xx/408/429, malformed JSON, a payload that fails
validation, an abort, a stale weight version) is retried on the least-loaded other server
after a backoff; a 4xx (a bad request) and a response without the requested routes (a
server launched without ``--enable-return-routed-experts``) fail at once. Results land in a ledger keyed
by sample index that keeps the first result and drops duplicates, and the call returns
only when the ledger holds every index exactly once, or raises naming the samples that
failed. A server killed mid-batch therefore costs retries, never samples.

Partial rollouts (``partial``): a response may span weight pushes; its tokens carry the
version that produced each (``meta_info.weight_versions``), none may be older than the
version expected, and one that a pause in mode ``abort`` cut short goes on as a new request
from what it had (:mod:`~megatron_rl.rollout.sglang.partial`), counted in ``continued``.

Restarts and hangs: retries last ``retry_budget_s`` (sized for a server restart) rather
than a few attempts. A server that comes back serves its launch weights; with
``resync=True`` a sample answered by a server *behind* the expected version is not retried
there: the server is set aside and, when no other server is left, the call raises
:class:`ServersBehindError` carrying the results it has, so the engine can re-push the
weights (a collective) and ask again for the rest. A server that accepts connections but
never answers (SIGSTOP, a wedged scheduler) is caught by probing its liveness (``GET
/server_info``, a round trip through the scheduler: :mod:`~megatron_rl.rollout.sglang.control`)
once a request has waited ``hang_check_after_s``: no answer within ``health_timeout_s`` ends
the call naming it; the calls before any request (``/model_info``, ``/server_info``) have
``health_timeout_s`` as their limit, so a hung server is named within ``hang_check_after_s +
health_timeout_s`` (25 s at the defaults) on every path.

Before the first samples, :meth:`SGLangClient.check_servers` reads each server's
``/server_info`` (a run that asks for seeded sampling needs ``enable_deterministic_inference``),
and :meth:`SGLangClient.check_logprob_convention` probes that log-probs are of the policy the
trainer scores, ``log_softmax(logits / T)`` (:mod:`~megatron_rl.rollout.sglang.server_checks`).

Memory: at most ``max_concurrency`` responses are held at a time; each is decoded as soon
as it arrives and its int32 routes narrowed to the compact dtype, so host memory grows
with the compact results, not with the wire payloads.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
import uuid
from dataclasses import dataclass
from typing import Sequence

import aiohttp

from megatron_rl.rollout.engine import SamplingParams
from megatron_rl.rollout.sglang.control import LIVENESS_PATH
from megatron_rl.rollout.sglang.ledger import (
    ClientStats,
    RolloutRequestError,
    SampleLedger,
    ServerHungError,
    ServersBehindError,
    StaleWeightVersionError,
)
from megatron_rl.rollout.sglang.partial import ContinuedRequest, behind_versions, is_behind
from megatron_rl.rollout.sglang.server_checks import (
    check_deterministic,
    probe_logprob_convention,
)
from megatron_rl.rollout.sglang.wire import (
    SGLANG_VERSION,
    GenerateResult,
    GenerationAborted,
    MissingRoutesError,
    RouteShape,
    WireFormatError,
    decode_generate_response,
    generate_payload,
)
from moe_routing.validate import RoutingDataError

__all__ = ["SGLANG_VERSION", "SGLangClientConfig", "SGLangClient", "RouteShape", "ClientStats",
           "RolloutRequestError", "StaleWeightVersionError", "ServersBehindError", "ServerHungError", "SampleLedger"]


@dataclass(kw_only=True)
class SGLangClientConfig:
    """How the client talks to SGLang servers."""

    urls: list[str]
    """Base URLs of the servers, e.g. ``http://node3:30000``; requests are load-balanced."""
    request_timeout_s: float = 300.0
    """Limit for one ``/generate`` attempt, connection to last byte."""
    connect_timeout_s: float = 10.0
    """Limit for opening a connection."""
    max_concurrency: int = 256
    """Requests in flight at once over all servers (bounds client memory)."""
    retry_budget_s: float = 300.0
    """A sample keeps retrying for this long after its first failed attempt: long enough for
    a killed server to be restarted and load its model."""
    max_retries: int = 1000
    """Cap on retries per sample, a backstop (tests use it to fail fast): at the default
    backoff a 300 s budget spends 40 to 75 retries."""
    backoff_s: float = 0.5
    """First retry delay; doubles per retry, with jitter."""
    backoff_max_s: float = 8.0
    """Longest retry delay (also bounds how late a sample notices a restarted server)."""
    server_cooldown_s: float = 2.0
    """A server that dropped a connection or answered 5xx gets no new request for this long
    while another server is available."""
    hang_check_after_s: float = 15.0
    """A ``/generate`` attempt unanswered for this long (and every such interval after)
    makes the client probe the server's liveness (``GET /ping``)."""
    health_timeout_s: float = 10.0
    """A server that does not answer ``/ping`` (or ``/model_info``) within this is hung, and
    the call fails naming it."""
    max_resyncs: int = 2
    """Engine: weight re-pushes per ``generate`` call to servers found behind the version."""
    deterministic_inference: bool = False
    """The run asks for seeded sampling: every server must run with
    ``--enable-deterministic-inference`` (checked in ``/server_info``), else SGLang ignores
    ``sampling_seed``."""
    raw_logprobs: bool = False
    """Servers must return ``log_softmax(logits)``, not SGLang's default ``log_softmax(logits / T)`` (T = 1 runs)."""
    partial: bool = False
    """Partial rollouts: weights are pushed while requests run (the servers paused), so a
    response may continue under newer weights, and one aborted by a pause continues as a
    new request from its tokens (:mod:`~megatron_rl.rollout.sglang.partial`)."""

    def __post_init__(self) -> None:
        positive = ("request_timeout_s", "connect_timeout_s", "hang_check_after_s", "health_timeout_s")
        for name in positive:
            if not getattr(self, name) > 0:
                raise ValueError(f"SGLangClientConfig.{name}: must be > 0, got {getattr(self, name)}")
        for name in ("retry_budget_s", "max_retries", "backoff_s", "backoff_max_s", "max_resyncs"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"SGLangClientConfig.{name}: must be >= 0, got {getattr(self, name)}")


class _Retryable(Exception):
    def __init__(self, cause: str, message: str, *, cool_down: bool = False) -> None:
        super().__init__(message)
        self.cause, self.cool_down = cause, cool_down
        self.served = ""
        """The weight version a ``stale_version`` answer carried."""


class SGLangClient:
    """Async client for a set of SGLang servers; use as ``async with SGLangClient(...)``.

    Args:
        cfg: servers, timeouts, concurrency and retry policy.
        routes: shape that routed experts must have.
    """

    def __init__(self, cfg: SGLangClientConfig, routes: RouteShape) -> None:
        if not cfg.urls:
            raise ValueError("SGLangClientConfig.urls: need at least one server URL")
        self.cfg, self.routes = cfg, routes
        self.urls = [u.rstrip("/") for u in cfg.urls]
        self.stats = ClientStats()
        self._in_flight = {u: 0 for u in self.urls}
        self._down_until = {u: 0.0 for u in self.urls}
        self._turn = 0
        self._jitter = random.Random()
        self._behind: dict[str, str] = {}
        self._probes: dict[str, asyncio.Task] = {}
        self._session: aiohttp.ClientSession | None = None
        self._slots: asyncio.Semaphore | None = None

    async def __aenter__(self) -> "SGLangClient":
        timeout = aiohttp.ClientTimeout(total=self.cfg.request_timeout_s, sock_connect=self.cfg.connect_timeout_s)
        # The connector's own limit would queue requests invisibly; the semaphore is the bound.
        self._session = aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0))
        self._slots = asyncio.Semaphore(self.cfg.max_concurrency)
        return self

    async def __aexit__(self, *exc) -> None:
        await self._session.close()

    # ------------------------------------------------------------------ control endpoints

    async def _get(self, url: str, path: str, timeout_s: float | None = None) -> tuple[int, bytes]:
        timeout = None if timeout_s is None else aiohttp.ClientTimeout(total=timeout_s)
        async with self._session.get(url + path, timeout=timeout) as resp:
            return resp.status, await resp.read()

    async def health(self, url: str, *, generate: bool = False) -> bool:
        """``GET /server_info`` is 200 (liveness), or with ``generate`` ``GET /health_generate``
        (a one-token generation, up to SGLang's 20 s)."""
        path, limit = ("/health_generate", None) if generate else (LIVENESS_PATH, self.cfg.health_timeout_s)
        try:
            status, _ = await self._get(url, path, limit)
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return False
        return status == 200

    async def model_info(self, url: str) -> dict:
        """``GET /model_info`` (model path, ``weight_version``), within ``health_timeout_s``.

        Raises:
            ServerHungError: no answer in time.
        """
        try:
            status, body = await self._get(url, "/model_info", self.cfg.health_timeout_s)
        except asyncio.TimeoutError:
            raise ServerHungError(f"server {url} did not answer /model_info within "
                                  f"{self.cfg.health_timeout_s:g}s (hung?)") from None
        if status != 200:
            raise RolloutRequestError(f"{url}/model_info: HTTP {status}: {body[:200]!r}")
        return json.loads(body)

    async def server_info(self, url: str) -> dict:
        """``GET /server_info``: SGLang's resolved launch settings (``tp_size``, flags)."""
        limit = self.cfg.hang_check_after_s + self.cfg.health_timeout_s
        try:
            status, body = await self._get(url, "/server_info", limit)
        except asyncio.TimeoutError:
            raise ServerHungError(f"server {url} did not answer /server_info within {limit:g}s (hung?)") from None
        if status != 200:
            raise RolloutRequestError(f"{url}/server_info: HTTP {status}: {body[:200]!r}")
        return json.loads(body)

    async def flush_cache(self, url: str) -> None:
        """``POST /flush_cache``; SGLang refuses (400) while requests are running."""
        async with self._session.post(url + "/flush_cache") as resp:
            if resp.status != 200:
                raise RolloutRequestError(f"{url}/flush_cache: HTTP {resp.status}: {(await resp.read())[:200]!r}")

    async def check_servers(self) -> dict[str, dict]:
        """``/model_info`` and ``/server_info`` of every server (merged, by URL); a server that
        cannot be reached is set aside for a cool-down, a hung one or one launched without what
        the run needs ends the call; raises when none answers."""
        infos, failures = {}, []
        for url in self.urls:
            try:
                model = await self.model_info(url)  # first: the quick one names a hung server soonest
                infos[url] = {**await self.server_info(url), **model}
            except ServerHungError:
                raise
            except (RolloutRequestError, aiohttp.ClientError, ValueError) as err:
                failures.append(f"{url}: {type(err).__name__}: {err}")
                self._down_until[url] = time.monotonic() + self.cfg.server_cooldown_s
        if not infos:
            raise RolloutRequestError("no SGLang server is reachable: " + "; ".join(failures))
        if self.cfg.deterministic_inference:
            check_deterministic(infos)
        return infos

    async def check_logprob_convention(self) -> None:
        """Every server's log-probs at T != 1 are of the policy the trainer scores (``raw_logprobs``; a probe,
        :mod:`~megatron_rl.rollout.sglang.server_checks`); raises naming a server whose are not."""
        for url in self.urls:
            await probe_logprob_convention(self._session, url, self.cfg.request_timeout_s, raw=self.cfg.raw_logprobs)

    # ------------------------------------------------------------------ generation

    async def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        *,
        return_routed_experts: bool,
        expected_version: str | None = None,
        seeds: Sequence[int] | None = None,
        resync: bool = False,
        routes_from: Sequence[int] | None = None,
    ) -> list[GenerateResult]:
        """One result per prompt, in prompt order, each accounted for exactly once.

        Args:
            prompts: token ids per sample.
            params: sampling parameters shared by the samples.
            return_routed_experts: request and decode routes.
            expected_version: reject (and retry) responses from any other weight version.
            seeds: ``sampling_seed`` per sample (SGLang honors it with deterministic inference).
            resync: the caller can re-push weights: a server behind ``expected_version`` is
                set aside instead of retried, and :class:`ServersBehindError` is raised when
                samples are left with no server.
            routes_from: ``routed_experts_start_len`` per sample (None: 0): routes come back
                for the positions from there on (multi-turn rollouts ask for the new ones).

        Raises:
            RolloutRequestError: a sample failed within its retry budget, or was refused (4xx).
            StaleWeightVersionError: the last failure of a sample was a version mismatch.
            ServersBehindError: with ``resync``, servers are behind (the results so far attached).
            ServerHungError: a server held a request and did not answer ``/health``.
        """
        ledger = SampleLedger(uuid.uuid4().hex[:12], len(prompts))
        if resync and expected_version is not None:
            await self._find_behind(expected_version)
        tasks = [
            asyncio.create_task(self._sample(ledger, i, prompt, params, return_routed_experts, expected_version,
                                             None if seeds is None else seeds[i], resync,
                                             0 if routes_from is None else routes_from[i]))
            for i, prompt in enumerate(prompts)
        ]
        try:
            await asyncio.gather(*tasks)
        finally:
            for task in [*tasks, *self._probes.values()]:
                task.cancel()
        self.stats.duplicates_dropped += ledger.duplicates
        received = ledger.received()
        if self._behind and len(received) < len(prompts):
            servers = ", ".join(f"{u} (at {v!r})" for u, v in self._behind.items())
            raise ServersBehindError(f"batch {ledger.batch}: {len(prompts) - len(received)} samples wait for "
                                     f"servers behind weight version {expected_version!r}: {servers}",
                                     dict(self._behind), received)
        return ledger.results()

    async def _find_behind(self, expected: str) -> None:
        """Set aside servers whose ``/model_info`` shows older weights, before any request
        (a hung server ends the call here, within ``health_timeout_s``)."""
        async def version(url: str) -> str | None:
            try:
                return str((await self.model_info(url)).get("weight_version"))
            except ServerHungError:
                raise
            except (RolloutRequestError, aiohttp.ClientError, ValueError):
                return None  # unreachable now: requests to it will retry within their budget

        for url, served in zip(self.urls, await asyncio.gather(*(version(u) for u in self.urls))):
            if served is not None and is_behind(served, expected):
                self._behind[url] = served

    async def _sample(self, ledger, index, prompt, params, want_routes, expected_version, seed, resync,
                      start_len: int = 0) -> None:
        last_error, first_failure, attempt = None, None, 0
        url = None
        request = ContinuedRequest(list(prompt), params, start_len, seed)
        while True:
            try:
                async with self._slots:
                    # Choose the server only once a slot is free, so the choice sees current load.
                    url = self._pick(avoid=url)
                    if url is None:
                        return  # every server is behind: the engine re-pushes weights and asks again
                    rid = f"{ledger.batch}-{index}.a{attempt}" + (f".p{request.pieces}" if request.pieces else "")
                    payload = generate_payload(rid=rid, prompt_ids=request.piece_prompt, params=request.piece_params,
                                               return_routed_experts=want_routes, sampling_seed=request.piece_seed,
                                               routes_from=request.piece_start)
                    piece = await self._attempt(url, rid, payload, index, len(request.piece_prompt), want_routes,
                                                expected_version, request.piece_start)
                result = request.continue_after(piece) if piece.finish_reason == "abort" else request.result(piece)
                if result is None:
                    self.stats.continued += 1  # paused in mode abort: the rest is a new request
                    continue
                result.meta.update(server=url, attempts=attempt + 1)
                ledger.add(index, result)
                self.stats.per_server[url] = self.stats.per_server.get(url, 0) + 1
                return
            except _Retryable as err:
                self.stats.retries[err.cause] = self.stats.retries.get(err.cause, 0) + 1
                if err.cool_down:
                    self._down_until[url] = time.monotonic() + self.cfg.server_cooldown_s
                last_error = err
                if resync and err.cause == "stale_version" and is_behind(err.served, expected_version):
                    # Retrying there cannot help until the engine re-pushes the weights; another
                    # server, if any is current, can take the sample at once.
                    self._behind[url] = err.served
                    attempt += 1
                    continue
            now = time.monotonic()
            first_failure = now if first_failure is None else first_failure
            spent = now - first_failure
            if attempt >= self.cfg.max_retries or spent >= self.cfg.retry_budget_s:
                break
            delay = min(self.cfg.backoff_max_s, self.cfg.backoff_s * 2 ** min(attempt, 30))
            delay *= 0.5 + 0.5 * self._jitter.random()
            await asyncio.sleep(min(delay, self.cfg.retry_budget_s - spent))
            attempt += 1
        kind = StaleWeightVersionError if last_error.cause == "stale_version" else RolloutRequestError
        raise kind(f"sample {index} of batch {ledger.batch}: gave up after {attempt + 1} attempts; "
                   f"last failure ({last_error.cause}): {last_error}; retried for {spent:.1f}s "
                   f"(budget {self.cfg.retry_budget_s:g}s or {self.cfg.max_retries} retries)")

    def _pick(self, avoid: str | None) -> str | None:
        """Least-loaded server not cooling down, preferring one other than ``avoid``; servers
        behind the expected weights are never chosen (None when only those are left)."""
        now = time.monotonic()
        usable = [u for u in self.urls if u not in self._behind]
        if not usable:
            return None
        ready = [u for u in usable if self._down_until[u] <= now]
        if not ready:
            ready = [min(usable, key=self._down_until.__getitem__)]
        if avoid in ready and len(ready) > 1:
            ready.remove(avoid)
        least = min(self._in_flight[u] for u in ready)
        tied = [u for u in ready if self._in_flight[u] == least]
        self._turn += 1
        return tied[self._turn % len(tied)]

    async def _post_watched(self, url: str, payload: dict, source: str) -> tuple[int, bytes]:
        """``POST /generate``; while it waits, liveness tells a slow server from a hung one.

        A non-streaming ``/generate`` sends nothing until the whole response is done, so the
        silence of a long generation looks like a stopped server; the scheduler, which answers
        ``/server_info`` between two batches, tells them apart.
        """
        async def post() -> tuple[int, bytes]:
            async with self._session.post(url + "/generate", json=payload) as resp:
                return resp.status, await resp.read()

        request = asyncio.ensure_future(post())
        try:
            while True:
                done, _ = await asyncio.wait({request}, timeout=self.cfg.hang_check_after_s)
                if done:
                    return request.result()
                problem = await self._probe(url)
                if problem is not None:
                    self.stats.timeouts += 1
                    raise ServerHungError(f"{source}: no answer after {self.cfg.hang_check_after_s:g}s and {problem}")
        finally:
            request.cancel()

    async def _probe(self, url: str) -> str | None:
        """Why ``url`` looks hung (None: it answered ``/server_info``, or it is down, which the
        request itself will show). One probe per server at a time serves every waiting request."""
        task = self._probes.get(url)
        if task is None or task.done():
            task = self._probes[url] = asyncio.ensure_future(self._liveness_problem(url))
        return await asyncio.shield(task)

    async def _liveness_problem(self, url: str) -> str | None:
        limit = self.cfg.health_timeout_s
        try:
            async with self._session.get(url + LIVENESS_PATH, timeout=aiohttp.ClientTimeout(total=limit)) as resp:
                status = resp.status
        except asyncio.TimeoutError:
            return f"server {url} did not answer {LIVENESS_PATH} within {limit:g}s (hung?)"
        except aiohttp.ClientError:
            return None
        return None if status == 200 else f"server {url} answered {LIVENESS_PATH} with HTTP {status} (unhealthy)"

    async def _attempt(self, url, rid, payload, index, prompt_len, want_routes, expected_version,
                       start_len: int = 0) -> GenerateResult:
        source = f"sample {index} (rid {rid}) from {url}"
        self.stats.attempts += 1
        self._in_flight[url] += 1
        self.stats.max_in_flight = max(self.stats.max_in_flight, sum(self._in_flight.values()))
        try:
            status, body = await self._post_watched(url, payload, source)
        except asyncio.TimeoutError:
            self.stats.timeouts += 1
            raise _Retryable("timeout", f"{source}: no response within {self.cfg.request_timeout_s:g}s") from None
        except aiohttp.ClientError as err:
            raise _Retryable("connection", f"{source}: {type(err).__name__}: {err}", cool_down=True) from None
        finally:
            self._in_flight[url] -= 1
        if status >= 500 or status in (408, 429):
            raise _Retryable("http_5xx" if status >= 500 else f"http_{status}",
                             f"{source}: HTTP {status}: {body[:300]!r}", cool_down=status >= 500)
        if status != 200:
            raise RolloutRequestError(f"{source}: HTTP {status} (request refused, not retried): {body[:500]!r}")
        try:
            data = json.loads(body)
        except ValueError as err:
            raise _Retryable("malformed_json", f"{source}: response is not JSON ({err}): {body[:120]!r}") from None
        del body
        try:
            result = decode_generate_response(
                data, rid=rid, prompt_len=prompt_len, want_routes=want_routes, num_layers=self.routes.num_layers,
                topk=self.routes.topk, num_experts=self.routes.num_experts, source=source,
                moe_layers=self.routes.moe_layers, start_len=start_len, allow_abort=self.cfg.partial,
            )
        except MissingRoutesError as err:
            raise RolloutRequestError(f"{err} (not retried)") from None
        except (WireFormatError, RoutingDataError) as err:
            raise _Retryable("bad_payload", str(err)) from None
        except GenerationAborted as err:
            raise _Retryable("aborted", str(err)) from None
        served = None if expected_version is None else behind_versions(result, expected_version,
                                                                       partial=self.cfg.partial)
        if served is not None:
            stale = _Retryable("stale_version", f"{source}: generated with weight version {served!r}, "
                               f"expected {expected_version!r} (a server restarted without the current weights, "
                               "or one whose weight sync failed, stays stale)")
            stale.served = served
            raise stale
        return result

