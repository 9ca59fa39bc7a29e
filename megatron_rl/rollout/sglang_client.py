"""The SGLang rollout backend: an async HTTP client and the engine the trainer calls.

Targets the HTTP protocol of **SGLang 0.5.23** (``sglang.launch_server``): ``POST
/generate``, ``GET /health``, ``GET /health_generate``, ``GET /model_info``, ``POST
/flush_cache`` and ``POST /update_weight_version``; the wire format itself is
:mod:`megatron_rl.rollout.sglang_wire`. Owns request scheduling over one or more servers:
a bound on requests in flight, per-request timeouts, retries with jittered exponential
backoff, least-loaded server choice with a cool-down for servers that failed, and the
exactly-once accounting of samples. Does not own weight transfer
(:mod:`~megatron_rl.rollout.weight_sync`) or starting servers
(:mod:`~megatron_rl.rollout.sglang_server`).

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

Memory: at most ``max_concurrency`` responses are held at a time; each is decoded as soon
as it arrives and its int32 routes narrowed to the compact dtype, so host memory grows
with the compact results, not with the wire payloads.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, Sequence

import aiohttp
import torch
import torch.distributed as dist

from megatron_rl.rollout.engine import RolloutSample, SamplingParams
from megatron_rl.rollout.sglang_wire import (
    SGLANG_VERSION,
    GenerateResult,
    GenerationAborted,
    MissingRoutesError,
    WireFormatError,
    decode_generate_response,
    generate_payload,
)
from moe_routing.validate import RoutingDataError

if TYPE_CHECKING:  # the client itself runs without Megatron
    from megatron_rl.parallel.groups import ParallelGroups

__all__ = ["SGLANG_VERSION", "SGLangClientConfig", "SGLangClient", "SGLangEngine", "RouteShape",
           "RolloutRequestError", "StaleWeightVersionError", "SampleLedger", "request_json"]


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
    max_retries: int = 4
    """Retries per sample after its first attempt."""
    backoff_s: float = 0.5
    """First retry delay; doubles per retry, with jitter."""
    backoff_max_s: float = 8.0
    """Longest retry delay."""
    server_cooldown_s: float = 2.0
    """A server that dropped a connection or answered 5xx gets no new request for this long
    while another server is available."""


@dataclass(frozen=True)
class RouteShape:
    """What decoded routes must look like for the trained model."""

    num_layers: int
    """L: MoE layers (columns of the routes)."""
    topk: int
    """K."""
    num_experts: int
    """E."""


class RolloutRequestError(RuntimeError):
    """A sample could not be generated within the retry budget, or a request was refused."""


class StaleWeightVersionError(RolloutRequestError):
    """A server kept answering with another weight version than the trainer expects."""


class _Retryable(Exception):
    def __init__(self, cause: str, message: str, *, cool_down: bool = False) -> None:
        super().__init__(message)
        self.cause, self.cool_down = cause, cool_down


@dataclass
class ClientStats:
    """Counters of one client (reset per ``generate`` call by the engine)."""

    attempts: int = 0
    """``/generate`` attempts sent."""
    retries: dict[str, int] = field(default_factory=dict)
    """Failed attempts by cause (connection, timeout, http_5xx, malformed_json, bad_payload, ...)."""
    duplicates_dropped: int = 0
    """Results that arrived for a sample already accounted for."""
    max_in_flight: int = 0
    """Most requests in flight at once."""
    per_server: dict[str, int] = field(default_factory=dict)
    """Successful responses by server URL."""


class SampleLedger:
    """Results of one batch keyed by sample index: first result wins, the end checks all."""

    def __init__(self, batch: str, count: int) -> None:
        self.batch, self.count = batch, count
        self._results: dict[int, Any] = {}
        self.duplicates = 0

    def add(self, index: int, result: Any) -> bool:
        """Record ``result`` for ``index``; False (and counted) when it is a duplicate."""
        if not 0 <= index < self.count:
            raise RolloutRequestError(f"batch {self.batch}: result for unknown sample {index}")
        if index in self._results:
            self.duplicates += 1
            return False
        self._results[index] = result
        return True

    def results(self) -> list[Any]:
        """Every sample's result in index order; raises unless each is present exactly once."""
        missing = [i for i in range(self.count) if i not in self._results]
        if missing:
            raise RolloutRequestError(
                f"batch {self.batch}: {len(missing)} of {self.count} samples have no result: {missing[:20]}"
            )
        return [self._results[i] for i in range(self.count)]


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

    async def _get(self, url: str, path: str) -> tuple[int, bytes]:
        async with self._session.get(url + path) as resp:
            return resp.status, await resp.read()

    async def health(self, url: str, *, generate: bool = False) -> bool:
        """``GET /health`` (or ``/health_generate``, which runs a one-token generation) is 200."""
        try:
            status, _ = await self._get(url, "/health_generate" if generate else "/health")
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return False
        return status == 200

    async def model_info(self, url: str) -> dict:
        """``GET /model_info``: model path, ``weight_version``, architecture."""
        status, body = await self._get(url, "/model_info")
        if status != 200:
            raise RolloutRequestError(f"{url}/model_info: HTTP {status}: {body[:200]!r}")
        return json.loads(body)

    async def flush_cache(self, url: str) -> None:
        """``POST /flush_cache``; SGLang refuses (400) while requests are running."""
        async with self._session.post(url + "/flush_cache") as resp:
            if resp.status != 200:
                raise RolloutRequestError(f"{url}/flush_cache: HTTP {resp.status}: {(await resp.read())[:200]!r}")

    async def check_servers(self) -> dict[str, dict]:
        """``/health`` and ``/model_info`` of every server; raises when none answers."""
        infos, failures = {}, []
        for url in self.urls:
            try:
                if not await self.health(url):
                    raise RolloutRequestError("GET /health is not 200")
                infos[url] = await self.model_info(url)
            except (RolloutRequestError, aiohttp.ClientError, asyncio.TimeoutError, ValueError) as err:
                failures.append(f"{url}: {err}")
                self._down_until[url] = time.monotonic() + self.cfg.server_cooldown_s
        if not infos:
            raise RolloutRequestError("no SGLang server is reachable: " + "; ".join(failures))
        return infos

    # ------------------------------------------------------------------ generation

    async def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        *,
        return_routed_experts: bool,
        expected_version: str | None = None,
        seeds: Sequence[int] | None = None,
    ) -> list[GenerateResult]:
        """One result per prompt, in prompt order, each accounted for exactly once.

        Args:
            prompts: token ids per sample.
            params: sampling parameters shared by the samples.
            return_routed_experts: request and decode routes.
            expected_version: reject (and retry) responses from any other weight version.
            seeds: ``sampling_seed`` per sample (SGLang honors it with deterministic inference).

        Raises:
            RolloutRequestError: a sample failed after its retries, or was refused (4xx).
            StaleWeightVersionError: the last failure of a sample was a version mismatch.
        """
        ledger = SampleLedger(uuid.uuid4().hex[:12], len(prompts))
        tasks = [
            asyncio.create_task(self._sample(ledger, i, prompt, params, return_routed_experts, expected_version,
                                             None if seeds is None else seeds[i]))
            for i, prompt in enumerate(prompts)
        ]
        try:
            await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
        self.stats.duplicates_dropped += ledger.duplicates
        return ledger.results()

    async def _sample(self, ledger, index, prompt, params, want_routes, expected_version, seed) -> None:
        last_url, last_error = None, None
        for attempt in range(self.cfg.max_retries + 1):
            try:
                async with self._slots:
                    # Choose the server only once a slot is free, so the choice sees current load.
                    url = self._pick(avoid=last_url)
                    rid = f"{ledger.batch}-{index}.a{attempt}"
                    payload = generate_payload(rid=rid, prompt_ids=prompt, params=params,
                                               return_routed_experts=want_routes, sampling_seed=seed)
                    result = await self._attempt(url, rid, payload, index, len(prompt), want_routes, expected_version)
                result.meta.update(server=url, attempts=attempt + 1)
                ledger.add(index, result)
                self.stats.per_server[url] = self.stats.per_server.get(url, 0) + 1
                return
            except _Retryable as err:
                self.stats.retries[err.cause] = self.stats.retries.get(err.cause, 0) + 1
                if err.cool_down:
                    self._down_until[url] = time.monotonic() + self.cfg.server_cooldown_s
                last_url, last_error = url, err
            if attempt < self.cfg.max_retries:
                delay = min(self.cfg.backoff_max_s, self.cfg.backoff_s * 2**attempt)
                await asyncio.sleep(delay * (0.5 + 0.5 * self._jitter.random()))
        kind = StaleWeightVersionError if last_error.cause == "stale_version" else RolloutRequestError
        raise kind(f"sample {index} of batch {ledger.batch}: gave up after {self.cfg.max_retries + 1} attempts; "
                   f"last failure ({last_error.cause}): {last_error}")

    def _pick(self, avoid: str | None) -> str:
        """Least-loaded server not cooling down, preferring one other than ``avoid``."""
        now = time.monotonic()
        ready = [u for u in self.urls if self._down_until[u] <= now]
        if not ready:
            ready = [min(self.urls, key=self._down_until.__getitem__)]
        if avoid in ready and len(ready) > 1:
            ready.remove(avoid)
        least = min(self._in_flight[u] for u in ready)
        tied = [u for u in ready if self._in_flight[u] == least]
        self._turn += 1
        return tied[self._turn % len(tied)]

    async def _attempt(self, url, rid, payload, index, prompt_len, want_routes, expected_version) -> GenerateResult:
        source = f"sample {index} (rid {rid}) from {url}"
        self.stats.attempts += 1
        self._in_flight[url] += 1
        self.stats.max_in_flight = max(self.stats.max_in_flight, sum(self._in_flight.values()))
        try:
            async with self._session.post(url + "/generate", json=payload) as resp:
                status, body = resp.status, await resp.read()
        except asyncio.TimeoutError:
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
            )
        except MissingRoutesError as err:
            raise RolloutRequestError(f"{err} (not retried)") from None
        except (WireFormatError, RoutingDataError) as err:
            raise _Retryable("bad_payload", str(err)) from None
        except GenerationAborted as err:
            raise _Retryable("aborted", str(err)) from None
        if expected_version is not None and result.weight_version != expected_version:
            raise _Retryable("stale_version", f"{source}: generated with weight version {result.weight_version!r}, "
                             f"expected {expected_version!r} (a server restarted without the current weights, "
                             "or one whose weight sync failed, stays stale)")
        return result


def request_json(method: str, url: str, payload: Any = None, *, timeout_s: float = 60.0) -> tuple[int, Any]:
    """Blocking JSON request for control calls (weight updates, health polling).

    Returns:
        ``(status, body)``: body parsed as JSON when it is, else the text; status 0 and the
        error text when the server could not be reached.
    """
    data = None if payload is None else json.dumps(payload).encode()
    request = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as resp:
            status, raw = resp.status, resp.read()
    except urllib.error.HTTPError as err:
        status, raw = err.code, err.read()
    except (urllib.error.URLError, OSError) as err:
        return 0, str(getattr(err, "reason", err))
    text = raw.decode(errors="replace")
    try:
        return status, json.loads(text)
    except ValueError:
        return status, text


class WeightSyncer(Protocol):
    """What the engine needs from :class:`~megatron_rl.rollout.weight_sync.WeightSync`."""

    def sync(self, version: int) -> None:
        """Collectively push the current weights to every server, tagged ``version``."""
        ...

    def close(self) -> None:
        """Release what the transport holds."""
        ...


class SGLangEngine:
    """The SGLang backend of :class:`~megatron_rl.rollout.engine.RolloutEngine`.

    ``generate`` is called collectively on every rank (like the embedded engine), each
    data-parallel rank with its own prompts. Only rank 0 of each model-parallel (TP x PP)
    group sends requests; it broadcasts the samples, or the error, to its model-parallel
    peers, so peers never duplicate requests and all fail together. ``update_weights`` is
    collective too: the weights are gathered and pushed by ``weight_sync``, and from then
    on every sample must carry that version. Without ``weight_sync`` the servers' weights
    are managed elsewhere and versions are not checked.

    Args:
        cfg: client configuration.
        routes: shape of the routed experts of the trained model.
        groups: this rank's parallel groups (None: a single process, no trainer).
        weight_sync: pushes weights to the servers; it runs before the first ``generate``
            too, so servers never serve weights the trainer does not hold.
    """

    def __init__(self, cfg: SGLangClientConfig, routes: RouteShape, *, groups: ParallelGroups | None = None,
                 weight_sync: WeightSyncer | None = None) -> None:
        self.cfg, self.routes, self.groups, self.weight_sync = cfg, routes, groups, weight_sync
        self.weight_version = 0
        self.synced = False
        self.stats = ClientStats()
        self.server_info: dict[str, dict] = {}

    def update_weights(self, version: int) -> None:
        """Push the trainer's weights tagged ``version`` (collective when ``weight_sync`` is set)."""
        if self.weight_sync is not None:
            self.weight_sync.sync(version)
            self.synced = True
        self.weight_version = version

    def close(self) -> None:
        """Release the weight-sync transport (collective like ``update_weights``)."""
        if self.weight_sync is not None:
            self.weight_sync.close()

    def _leader(self) -> bool:
        return self.groups is None or dist.get_rank(self.groups.mp) == 0

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams, *,
                 return_routed_experts: bool = True, seed: int = 0) -> list[RolloutSample]:
        """One response per prompt of this DP rank (collective over the model-parallel group)."""
        if self.weight_sync is not None and not self.synced:
            self.update_weights(self.weight_version)
        outcome: tuple[str, Any] | None = None
        if self._leader():
            try:
                outcome = ("ok", asyncio.run(self._generate(prompts, params, return_routed_experts, seed)))
            except Exception as err:  # noqa: BLE001 - peers must learn about any failure
                if self.groups is None or self.groups.mp.size() == 1:
                    raise
                outcome = ("error", f"{type(err).__name__}: {err}")
        if self.groups is not None and self.groups.mp.size() > 1:
            box = [outcome]
            dist.broadcast_object_list(box, src=dist.get_global_rank(self.groups.mp, 0), group=self.groups.mp)
            outcome = box[0]
        if outcome[0] == "error":
            raise RolloutRequestError(f"SGLang rollout failed on the model-parallel leader: {outcome[1]}")
        return outcome[1]

    async def _generate(self, prompts, params, want_routes, seed) -> list[RolloutSample]:
        dp_rank = 0 if self.groups is None else self.groups.dp_rank
        seeds = [(seed * 1_000_003 + dp_rank * 7_919 + i) % 2**31 for i in range(len(prompts))]
        expected = str(self.weight_version) if self.synced else None
        async with SGLangClient(self.cfg, self.routes) as client:
            if not self.server_info:
                self.server_info = await client.check_servers()
            results = await client.generate(prompts, params, return_routed_experts=want_routes,
                                            expected_version=expected, seeds=seeds)
            self.stats = client.stats
        return [self._sample(prompt, r) for prompt, r in zip(prompts, results)]

    def _sample(self, prompt: Sequence[int], result: GenerateResult) -> RolloutSample:
        version = result.weight_version
        number = int(version) if version is not None and version.lstrip("-").isdigit() else self.weight_version
        return RolloutSample(
            prompt_ids=list(prompt), output_ids=result.output_ids, output_logprobs=result.output_logprobs,
            finish_reason=result.finish_reason, weight_version=number, routed_experts=result.routed_experts,
            meta={"rid": result.rid, "server_weight_version": version, **result.meta},
        )


def route_shape_of(model: torch.nn.Module) -> RouteShape:
    """:class:`RouteShape` of a Megatron GPT model (every layer MoE)."""
    from megatron_rl.parallel.schedule import unwrap

    config = unwrap(model).config
    return RouteShape(num_layers=config.num_layers, topk=config.moe_router_topk, num_experts=config.num_moe_experts)
