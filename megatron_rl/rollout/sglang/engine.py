"""The SGLang rollout engine: the trainer's side of :mod:`~megatron_rl.rollout.sglang.client`.

Owns what is collective about SGLang rollouts: model-parallel leaders send the requests
and share the samples with their peers, weights are pushed with a version every sample
must then carry (with partial rollouts, ``pause``: pushed while requests run, the servers
paused around the push, :mod:`~megatron_rl.rollout.sglang.pause`, and each token tagged
with the version that produced it), servers found behind that version (restarted) get the
weights again before their samples are asked for again, and the client's counters become
step metrics.
In colocated runs it also releases and resumes the servers' memory, collectively, by the
rules of :mod:`~megatron_rl.rollout.sglang.memory` (refusing, on every rank alike, what would
kill a server: a release with generations in flight, a generation or push into released
memory). Does not own HTTP, retries or the ledger (the client), nor how weights travel
(:mod:`~megatron_rl.rollout.sglang.weight_sync`).
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Protocol, Sequence

import torch

from megatron_rl.parallel import comm
from megatron_rl.rollout.engine import RolloutSample, SamplingParams, check_routes_from
from megatron_rl.rollout.sglang.client import (
    ClientStats,
    RolloutRequestError,
    RouteShape,
    ServersBehindError,
    SGLangClient,
    SGLangClientConfig,
    StaleWeightVersionError,
)
from megatron_rl.rollout.sglang.memory import ServerMemory
from megatron_rl.rollout.sglang.pause import GenerationPause
from megatron_rl.rollout.sglang.wire import GenerateResult

if TYPE_CHECKING:  # the engine is usable without Megatron (a single process, no trainer)
    from megatron_rl.parallel.groups import ParallelGroups

__all__ = ["SGLangEngine", "PendingGeneration", "WeightSyncer", "STEP_METRICS", "route_shape_of"]


class WeightSyncer(Protocol):
    """What the engine needs from :class:`~megatron_rl.rollout.sglang.weight_sync.WeightSync`."""

    def sync(self, version: int, *, reconnect: bool = False, flush_cache: bool = True) -> None:
        """Collectively push the current weights to every server, tagged ``version``;
        ``reconnect``: servers restarted, so transport state they held is rebuilt first;
        ``flush_cache``: the last bucket flushes the servers' cache."""
        ...

    def close(self) -> None:
        """Release what the transport holds."""
        ...

    def take_restarts(self) -> int:
        """Servers found restarted by the pushes since the last call (rank 0; 0 elsewhere)."""
        ...


STEP_METRICS = ("attempts", "retries", "duplicates", "resyncs", "timeouts", "continued", "restarts")
"""Counters :meth:`SGLangEngine.step_metrics` reports, as ``sglang/<name>``."""


@dataclass
class PendingGeneration:
    """A batch :meth:`SGLangEngine.start_generate` began; :meth:`SGLangEngine.finish_generate` ends it."""

    prompts: list
    """Token ids per sample."""
    params: SamplingParams
    """Sampling parameters of the batch."""
    want_routes: bool
    """``return_routed_experts``."""
    seeds: list[int]
    """``sampling_seed`` per sample."""
    expected: str | None
    """Weight version the servers hold while the batch is generated (None: unchecked)."""
    stats: ClientStats = field(default_factory=ClientStats)
    """The background round's client counters."""
    outcome: tuple | None = None
    """The leader's outcome of the background round (see ``SGLangEngine._leader_outcome``)."""
    error: BaseException | None = None
    """What the background thread raised (re-raised by ``finish_generate``)."""
    thread: threading.Thread | None = None
    """The model-parallel leader's thread (None on its peers)."""
    on_samples: Callable[[dict[int, RolloutSample]], None] | None = None
    """Called by the thread with the samples its round got (by index), before it ends."""

    def run(self, engine: "SGLangEngine") -> None:
        """The thread's body: HTTP only, its own event loop and client, no collective; then
        ``on_samples``, which must not raise (it is the caller's work, with its own errors)."""
        try:
            self.outcome = engine._leader_outcome(self.prompts, list(range(len(self.prompts))), self.params,
                                                  self.want_routes, self.seeds, self.expected, self.stats)
        except BaseException as err:  # noqa: BLE001 - re-raised in the main thread
            self.error = err
            return
        if self.on_samples is not None and self.outcome[0] == "ok":
            self.on_samples(self.outcome[1])


class SGLangEngine:
    """The SGLang backend of :class:`~megatron_rl.rollout.engine.RolloutEngine`.

    ``generate`` is called collectively on every rank (like the embedded engine), each
    data-parallel rank with its own prompts. Only rank 0 of each model-parallel (TP x PP)
    group sends requests; it broadcasts the samples, or the error, to its model-parallel
    peers, so peers never duplicate requests and all fail together. ``update_weights`` is
    collective too: the weights are gathered and pushed by ``weight_sync``, and from then
    on every sample must carry that version. Without ``weight_sync`` the servers' weights
    are managed elsewhere and versions are not checked.

    With ``weight_sync``, a server that restarted (it serves its launch weights) is healed:
    each round of ``generate`` ends with one exchange over the world in which every rank
    learns the servers any leader found behind (and any failure, so all ranks fail
    together); the weights are then pushed again, a collective every rank enters, and the
    samples still missing are asked for again, at most ``cfg.max_resyncs`` times per call.

    Args:
        cfg: client configuration.
        routes: shape of the routed experts of the trained model.
        groups: this rank's parallel groups (None: a single process, no trainer).
        weight_sync: pushes weights to the servers; it runs before the first ``generate``
            too, so servers never serve weights the trainer does not hold.
        memory: the servers' memory, for colocated runs (:meth:`release_memory`,
            :meth:`resume_memory`); None: the servers keep theirs.
        pause: partial rollouts: pauses the servers around a push made while batches begun by
            :meth:`start_generate` are in flight (None: pushes wait for nothing to be in flight).
    """

    def __init__(self, cfg: SGLangClientConfig, routes: RouteShape, *, groups: ParallelGroups | None = None,
                 weight_sync: WeightSyncer | None = None, memory: ServerMemory | None = None,
                 pause: GenerationPause | None = None) -> None:
        self.cfg, self.routes, self.groups, self.weight_sync = cfg, routes, groups, weight_sync
        self.memory, self.pause = memory, pause
        self.pending: set[int] = set()
        """``id`` of each batch :meth:`start_generate` began and :meth:`finish_generate` has not ended."""
        self.weight_version = 0
        self.synced = False
        self.stats = ClientStats()
        """Counters of the last ``generate`` call."""
        self._totals = ClientStats()
        self.server_info: dict[str, dict] = {}
        self.convention_checked = False
        """The servers' log-probs were probed to be raw (before the first request at T not 0 or 1)."""

    def update_weights(self, version: int) -> None:
        """Push the trainer's weights tagged ``version`` (collective when ``weight_sync`` is set)."""
        if self.memory is not None:
            self.memory.check_push()
        if self.weight_sync is not None:
            self._sync(version)
            self.synced = True
        self.weight_version = version

    def _sync(self, version: int, reconnect: bool = False) -> None:
        """Collective: push ``version``; with batches in flight and ``pause`` set, inside a pause.

        Without ``pause`` the caller has let every batch's requests end first (nothing may run
        while a session's calls land, see :mod:`~megatron_rl.rollout.sglang.pause`)."""
        if self.pause is not None and not self.synced:
            # A trainer killed mid-push left its servers paused: a continue first (harmless otherwise).
            self._on_rank0(self.pause.resume, "continuing generation on the SGLang servers")
        paused = self.pause is not None and bool(self.pending)
        if paused:
            self._on_rank0(self.pause.pause, f"pausing generation for weight version {version}")
        flush = {} if not paused or self.pause.flush_cache else {"flush_cache": False}
        self.weight_sync.sync(version, reconnect=reconnect, **flush)
        if paused:
            self._on_rank0(self.pause.resume, f"continuing generation under weight version {version}")

    def close(self) -> None:
        """Release the weight-sync transport (collective like ``update_weights``)."""
        if self.weight_sync is not None:
            self.weight_sync.close()

    # ------------------------------------------------------------------ colocated runs

    def release_memory(self) -> None:
        """Collective over the world: pause generation and release every memory region of every
        server (global rank 0 sends), once no generation of this engine is in flight."""
        self.memory.check_release(len(self.pending))
        self._on_rank0(self.memory.send_release, "releasing the SGLang servers' memory")
        self.memory.mark_released()

    def resume_memory(self, tags: Sequence[str]) -> None:
        """Collective over the world: resume ``tags`` on every server (generation continues once
        all are resident; the weights come back empty: push them next)."""
        self.memory.check_resume(tags)
        self._on_rank0(lambda: self.memory.send_resume(tags), f"resuming the SGLang servers' {list(tags)}")
        self.memory.mark_resumed(tags)

    def _on_rank0(self, call: Callable[[], None], what: str) -> None:
        """``call`` on global rank 0; its failure raised on every rank."""
        error = None
        if self._rank0():
            try:
                call()
            except Exception as err:  # noqa: BLE001 - reported to every rank below
                error = err
        if self.groups is None:
            if error is not None:
                raise error
            return
        comm.raise_first_failure(error, self.groups.world, what)

    def _leader(self) -> bool:
        return self.groups is None or comm.rank(self.groups.mp) == 0

    def _rank0(self) -> bool:
        """Global rank 0, or the engine alone (no groups)."""
        return self.groups is None or comm.rank(self.groups.world) == 0

    def _shares_outcome(self) -> bool:
        """Whether other ranks must hear this rank's outcome of a round (so it must not just raise)."""
        return self.groups is not None and (comm.size(self.groups.mp) > 1 or self.weight_sync is not None)

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams, *,
                 return_routed_experts: bool = True, seed: int = 0,
                 routes_from: Sequence[int] | None = None) -> list[RolloutSample]:
        """One response per prompt of this DP rank (collective over the model-parallel group,
        and over the world when ``weight_sync`` is set); ``routes_from``: each request's
        ``routed_experts_start_len``."""
        routes_from = check_routes_from(prompts, routes_from)
        if self.memory is not None:
            self.memory.check_generate()
        if self.weight_sync is not None and not self.synced:
            self.update_weights(self.weight_version)
        self.stats = ClientStats()
        return self._complete(prompts, params, return_routed_experts, self._seeds(seed, len(prompts)), None,
                              routes_from=routes_from)

    def _seeds(self, seed: int, count: int) -> list[int]:
        dp_rank = 0 if self.groups is None else self.groups.dp_rank
        return [(seed * 1_000_003 + dp_rank * 7_919 + i) % 2**31 for i in range(count)]

    def _complete(self, prompts, params, want_routes, seeds, first: tuple | None,
                  resync_version: int | None = None, routes_from: list[int] | None = None) -> list[RolloutSample]:
        """Rounds until every prompt has its sample; ``first``: the first round's leader outcome,
        already obtained (by :meth:`start_generate`'s thread), else it is asked for now;
        ``resync_version``: the version a re-push tags the weights with (None: ``weight_version``)."""
        done: dict[int, RolloutSample] = {}
        try:
            while True:
                if first is not None:
                    samples, behind = self._share(first)
                    first = None
                else:
                    todo = [i for i in range(len(prompts)) if i not in done]
                    samples, behind = self._round(prompts, todo, params, want_routes, seeds, routes_from)
                done.update(samples)
                if not behind:
                    return [done[i] for i in range(len(prompts))]
                if resync_version is not None:
                    self.weight_version = resync_version
                servers = ", ".join(f"{u} (at {v!r})" for u, v in sorted(behind.items()))
                if self.stats.resyncs >= self.cfg.max_resyncs:
                    raise StaleWeightVersionError(
                        f"servers still behind weight version {self.weight_version} after {self.stats.resyncs} "
                        f"re-pushes of the weights: {servers}")
                if self._rank0():
                    print(f"SGLang servers behind weight version {self.weight_version} (restarted?): {servers}; "
                          "pushing the weights again", flush=True)
                self._sync(self.weight_version, reconnect=True)
                self.stats.resyncs += 1
        finally:
            self._totals.add(self.stats)

    # ------------------------------------------------------------------ asynchronous rollouts

    def start_generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams, *,
                       return_routed_experts: bool = True, seed: int = 0,
                       on_samples: Callable[[dict[int, RolloutSample]], None] | None = None) -> "PendingGeneration":
        """Begin :meth:`generate` in the background; :meth:`finish_generate` returns its samples.

        Called on every rank together (the first weight push may be due, a collective); after
        that only the model-parallel leader works, in a thread that does HTTP and nothing
        collective, starting from the weights the servers hold now (``weight_version``, the
        oldest a token may carry). Without ``pause`` the trainer pushes nothing until the
        batch's requests have ended, so one version generates each; with it, pushes pause the
        servers and later tokens come from later versions, each tagged
        (:mod:`megatron_rl.train.async_rollouts`). Same seeds as :meth:`generate`.
        ``on_samples`` (leader only) gets what the round got, in the thread, as soon as it has
        it (the trainer scores them there); samples asked for again at the join are not in it.
        """
        if self.memory is not None:
            self.memory.check_generate()
        if self.weight_sync is not None and not self.synced:
            self.update_weights(self.weight_version)
        pending = PendingGeneration(list(prompts), params, return_routed_experts, self._seeds(seed, len(prompts)),
                                    expected=str(self.weight_version) if self.synced else None,
                                    on_samples=on_samples)
        if self._leader():
            pending.thread = threading.Thread(target=pending.run, args=(self,), daemon=True,
                                              name="megatron-rl-async-rollouts")
            pending.thread.start()
        self.pending.add(id(pending))
        return pending

    def finish_generate(self, pending: "PendingGeneration", version: int) -> list[RolloutSample]:
        """Collective (as :meth:`generate`): wait for a batch begun by :meth:`start_generate`
        and share it with the model-parallel peers.

        ``version`` is the trainer's weight version now. Samples that the background round
        could not get because a server restarted (it came back behind) are asked for again
        here, after the weights are pushed again, which only the main thread may do (a
        collective): the trainer's weights are at ``version`` by now, so they are pushed,
        and those samples tagged, as ``version``. Retries, never lost samples.
        """
        if pending.thread is not None:
            pending.thread.join()
        self.pending.discard(id(pending))
        if pending.error is not None:
            raise pending.error
        self.stats = pending.stats
        outcome = pending.outcome if self._leader() else None
        # A re-push, if one is needed, can only send the trainer's weights as they are now.
        return self._complete(pending.prompts, pending.params, pending.want_routes, pending.seeds,
                              ("shared", outcome), resync_version=version)

    def generate_local(self, prompts: Sequence[Sequence[int]], params: SamplingParams, *,
                       return_routed_experts: bool = True, seed: int = 0, routes_from: Sequence[int] | None = None,
                       expected: str | None, stats: ClientStats) -> list[RolloutSample]:
        """:meth:`generate` by this rank alone over HTTP, nothing collective and no engine field
        read (``expected``: the weight version the servers hold; ``stats`` collects the client's
        counters): what a background thread's multi-turn rollout calls turn after turn (the
        asynchronous rollouts of ``megatron_rl.train.async_rollouts``). A server found behind
        cannot be given the weights from there, so it ends the batch with an error."""
        routes_from = check_routes_from(prompts, routes_from)
        todo = list(range(len(prompts)))
        samples, behind = asyncio.run(self._generate(prompts, todo, params, return_routed_experts,
                                                     self._seeds(seed, len(prompts)), expected, stats, routes_from))
        if behind:
            servers = ", ".join(f"{u} (at {v!r})" for u, v in sorted(behind.items()))
            raise StaleWeightVersionError(f"servers behind weight version {expected} during a background multi-turn "
                                          f"rollout: {servers}")
        return [samples[i] for i in todo]

    def count_background(self, stats: ClientStats) -> None:
        """Add a background round's client counters to the next :meth:`step_metrics`."""
        self._totals.add(stats)

    def _round(self, prompts, todo, params, want_routes, seeds,
               routes_from: list[int] | None = None) -> tuple[dict[int, RolloutSample], dict[str, str]]:
        """Samples for the indices ``todo``, and every server (on any rank) found behind."""
        outcome = (self._leader_outcome(prompts, todo, params, want_routes, seeds, routes_from=routes_from)
                   if self._leader() else None)
        return self._share(("shared", outcome))

    def _leader_outcome(self, prompts, todo, params, want_routes, seeds, expected: str | None = None,
                        stats: ClientStats | None = None, routes_from: list[int] | None = None) -> tuple:
        """``("ok", samples, behind)`` or ``("error", message)``: the leader's HTTP work of one round."""
        try:
            return ("ok", *asyncio.run(self._generate(prompts, todo, params, want_routes, seeds, expected, stats,
                                                      routes_from)))
        except Exception as err:  # noqa: BLE001 - peers must learn about any failure
            if not self._shares_outcome():
                raise
            return ("error", f"{type(err).__name__}: {err}")

    def _share(self, wrapped: tuple) -> tuple[dict[int, RolloutSample], dict[str, str]]:
        """The leader's outcome of a round on every rank that must hear it (collective)."""
        outcome = wrapped[1]
        if self.groups is not None and comm.size(self.groups.mp) > 1:
            outcome = comm.broadcast_object(outcome, 0, self.groups.mp)
        error = None
        if outcome[0] == "error":
            error = RolloutRequestError(f"SGLang rollout failed on the model-parallel leader: {outcome[1]}")
        if self.groups is None or self.weight_sync is None:
            if error is not None:
                raise error
            return outcome[1], dict(outcome[2])
        # Every rank takes part in a re-push: all must agree on failures and on the servers behind.
        comm.raise_first_failure(error, self.groups.world, "an SGLang rollout round")
        behind = {}
        for found in comm.all_gather_objects(outcome[2], self.groups.world):
            behind.update(found)
        return outcome[1], behind

    async def _generate(self, prompts, todo, params, want_routes, seeds, expected: str | None = None,
                        stats: ClientStats | None = None,
                        routes_from: list[int] | None = None) -> tuple[dict, dict[str, str]]:
        """``stats``/``expected``: given by the background thread, which must not read the
        engine's fields (the main thread owns them); else this call's own."""
        if not todo:
            return {}, {}
        if stats is None:
            expected = str(self.weight_version) if self.synced else None
        async with SGLangClient(self.cfg, self.routes) as client:
            try:
                if not self.server_info:
                    self.server_info = await client.check_servers()
                if params.temperature not in (0.0, 1.0) and not self.convention_checked:
                    await client.check_logprob_convention()
                    self.convention_checked = True
                try:
                    results = await client.generate([prompts[i] for i in todo], params,
                                                    return_routed_experts=want_routes, expected_version=expected,
                                                    seeds=[seeds[i] for i in todo],
                                                    resync=self.weight_sync is not None,
                                                    routes_from=None if routes_from is None else
                                                    [routes_from[i] for i in todo])
                    got, behind = dict(enumerate(results)), {}
                except ServersBehindError as err:
                    got, behind = err.partial, err.behind
            finally:
                (self.stats if stats is None else stats).add(client.stats)
        return {todo[j]: self._sample(prompts[todo[j]], r, params.temperature) for j, r in got.items()}, behind

    def step_metrics(self) -> dict[str, torch.Tensor]:
        """``sglang/{attempts,retries,duplicates,resyncs,timeouts,continued,restarts}`` since the last
        call (``restarts``: servers the weight push found restarted, which a rollout may not have seen).

        Collective over the world when ``groups`` is set, with the same values on every
        rank: only model-parallel leaders send requests, so their counters are summed over
        the world; every rank takes part in a re-push, so those are counted once (rank 0),
        as the restarts rank 0's push found.
        """
        totals, self._totals = self._totals, ClientStats()
        leader = self._leader()
        first = self._rank0()
        restarts = self.weight_sync.take_restarts() if first and self.weight_sync is not None else 0
        counts = torch.tensor([
            totals.attempts if leader else 0, sum(totals.retries.values()) if leader else 0,
            totals.duplicates_dropped if leader else 0, totals.resyncs if first else 0,
            totals.timeouts if leader else 0, totals.continued if leader else 0, restarts,
        ], dtype=torch.float64)
        if self.groups is not None:
            comm.all_reduce(counts, self.groups.world)
        return {f"sglang/{name}": counts[i].float() for i, name in enumerate(STEP_METRICS)}

    def _sample(self, prompt: Sequence[int], result: GenerateResult, temperature: float) -> RolloutSample:
        version = result.weight_version

        def number(v: str | None) -> int:
            return int(v) if v is not None and v.lstrip("-").isdigit() else self.weight_version

        token_versions = None
        if result.token_versions is not None and len(set(result.token_versions)) > 1:
            token_versions = torch.tensor([number(v) for v in result.token_versions], dtype=torch.int64)
        first = number(result.token_versions[0] if result.token_versions else version)
        return RolloutSample(
            prompt_ids=list(prompt), output_ids=result.output_ids, output_logprobs=result.output_logprobs,
            finish_reason=result.finish_reason, weight_version=first if token_versions is None else
            int(token_versions.min()), routed_experts=result.routed_experts, token_versions=token_versions,
            temperature=temperature,
            meta={"rid": result.rid, "server_weight_version": version, **result.meta},
        )


def route_shape_of(model: torch.nn.Module) -> RouteShape:
    """:class:`RouteShape` of a Megatron GPT model (dense first layers' columns dropped on decode)."""
    from megatron_rl.parallel.families import moe_layer_numbers
    from megatron_rl.parallel.schedule import unwrap

    config = unwrap(model).config
    moe = tuple(n - 1 for n in moe_layer_numbers(config))
    return RouteShape(num_layers=config.num_layers, topk=config.moe_router_topk, num_experts=config.num_moe_experts,
                      moe_layers=None if len(moe) == config.num_layers else moe)
