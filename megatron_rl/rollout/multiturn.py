"""Multi-turn rollouts: many trajectories in flight, one batched generate call per turn.

Owns :class:`MultiTurnRollout`. Given prompt rows it starts one environment per
trajectory (``reset``), then turn by turn sends every live trajectory's ids to the
engine's ``generate`` in one batch (token in, token out: the prompt of a turn is the
trajectory's ids, which the engine extends), parses tool calls out of each new turn, asks
each environment for its answer (``step``, all of them concurrently, each in a daemon
thread bounded by ``rollout.env.step_timeout_s``), renders the observations into ids with
the chat template (``megatron_rl.data.chat``) and appends them, masked. A trajectory ends
when its environment is done, at the turn or token limit, when the model's turn is cut
without its stop token, or when something fails; what failed ends only that trajectory
with a reason (``megatron_rl.rollout.trajectory.END_REASONS``), printed with its sample id,
unless ``rollout.env.errors_fatal`` turns it into :class:`EnvironmentFailure`, one line
naming the sample and the cause. A hung environment costs its timeout, never the run: its
thread is abandoned (daemon) and nothing waits for it.

Ranks: every rank that must call ``generate`` together takes the same number of turns
(:class:`Peers.any_live`; a rank whose trajectories all ended sends a padding prompt and
drops its answer), and within a model-parallel group only the leader runs environments
and shares what they answered (:class:`Peers.share`), so peers hold identical
trajectories and each environment is called once.

Does not own the engine, the environments' logic (``rollout.envs``), rewards, or metrics
across ranks (the trainer reduces :func:`trajectory_stats`).
"""

from __future__ import annotations

import queue
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence

from megatron_rl.data.chat import ChatRenderer, MalformedToolCall, TemplateError
from megatron_rl.data.prompts import PromptRecord
from megatron_rl.data.tokenizer import HFPromptTokenizer, Messages
from megatron_rl.parallel import comm
from megatron_rl.parallel.groups import ParallelGroups
from megatron_rl.rollout.engine import RolloutEngine, RolloutSample, SamplingParams
from megatron_rl.rollout.envs.base import (
    EnvError,
    Environment,
    EnvStep,
    ModelTurn,
    check_messages,
    checked_step,
)
from megatron_rl.rollout.envs.config import EnvConfig
from megatron_rl.rollout.trajectory import END_REASONS, TrajectoryBuilder


class EnvironmentFailure(RuntimeError):
    """An environment failed and ``rollout.env.errors_fatal`` is set (one line: sample and cause)."""


class Peers(Protocol):
    """The ranks a rollout must stay in step with."""

    leader: bool
    """This rank runs the environments of its model-parallel group."""

    def share(self, obj: Any) -> Any:
        """The leader's ``obj`` on every rank of the model-parallel group."""
        ...

    def any_live(self, live: bool) -> bool:
        """Whether any rank that generates together with this one still has a live trajectory."""
        ...


class LonePeers:
    """A rank on its own (one process, or an engine no other rank generates with)."""

    leader = True

    def share(self, obj: Any) -> Any:
        return obj

    def any_live(self, live: bool) -> bool:
        return live


class GroupPeers:
    """The trainer's ranks: environments run on each model-parallel group's first rank, and
    every rank of the world takes the same number of turns (engines may dispatch experts,
    or push weights, over the whole world inside ``generate``)."""

    def __init__(self, groups: ParallelGroups) -> None:
        self.groups = groups
        self.leader = comm.rank(groups.mp) == 0

    def share(self, obj: Any) -> Any:
        return comm.broadcast_object(obj, 0, self.groups.mp) if comm.size(self.groups.mp) > 1 else obj

    def any_live(self, live: bool) -> bool:
        return not comm.all_ranks_agree(not live, self.groups.world)


@dataclass
class _Call:
    """The outcome of one environment call run by :func:`call_all`."""

    value: Any = None
    """What the call returned."""
    error: str | None = None
    """``"ExcType: message"`` when it raised."""
    timed_out: bool = False
    """It did not finish within the timeout (its thread is left behind)."""
    seconds: float = 0.0
    """Wall time until it finished or was abandoned."""


def call_all(calls: Sequence[Callable[[], Any]], timeout_s: float, max_parallel: int) -> list[_Call]:
    """Run ``calls`` in daemon threads, at most ``max_parallel`` at once, each bounded by ``timeout_s``.

    A call past its timeout is abandoned: its thread runs on unobserved and no longer
    counts against ``max_parallel``, so a hung environment delays nothing but itself.
    """
    results: list[_Call | None] = [None] * len(calls)
    done: queue.Queue = queue.Queue()
    waiting, running = deque(range(len(calls))), {}

    def work(i: int) -> None:
        try:
            done.put((i, calls[i](), None))
        except BaseException as err:  # noqa: BLE001 - an environment may raise anything
            message = " ".join(str(err).split())
            done.put((i, None, f"{type(err).__name__}: {message}"[:300] if message else type(err).__name__))

    while waiting or running:
        while waiting and len(running) < max_parallel:
            i = waiting.popleft()
            running[i] = time.monotonic()
            threading.Thread(target=work, args=(i,), daemon=True, name=f"megatron-rl-env-{i}").start()
        deadline = min(running.values()) + timeout_s
        try:
            i, value, error = done.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            now = time.monotonic()
            for i, started in list(running.items()):
                if now - started >= timeout_s:
                    results[i] = _Call(timed_out=True, seconds=now - started)
                    del running[i]
            continue
        if i in running:  # else: it finished after being abandoned
            results[i] = _Call(value=value, error=error, seconds=time.monotonic() - running.pop(i))
    return results  # type: ignore[return-value]


@dataclass
class _Outcome:
    """What the leader decided for one trajectory after one model turn (shared with its peers)."""

    reason: str | None = None
    """End reason, or None: the trajectory goes on."""
    reward: float = 0.0
    """The environment's reward for the turn."""
    observation_ids: list[int] = field(default_factory=list)
    """Ids to append (when it goes on)."""
    messages: Messages | None = None
    """The observation as messages (None: given as ids, or none)."""
    metrics: dict[str, float] = field(default_factory=dict)
    """The environment's counts for the turn."""
    seconds: float = 0.0
    """Time the environment took."""
    error: str | None = None
    """What failed, for the printed line."""


@dataclass
class _Live:
    """One trajectory in flight."""

    record: PromptRecord
    builder: TrajectoryBuilder
    conversation: Messages
    env: Environment | None = None
    fault: str | None = None
    """A reset that failed: the reason the trajectory ends after its first turn."""
    checkable: bool = True
    """Every observation was messages, so the template can render the whole conversation."""


class MultiTurnRollout:
    """Multi-turn rollouts against one kind of environment (see the module docstring).

    Args:
        engine: the rollout engine (its ``generate`` is called once per turn).
        tokenizer: the run's tokenizer (its chat template renders messages).
        cfg: the ``rollout.env`` section.
        make_env: makes one environment per trajectory (``envs.load.env_factory``).
        peers: the ranks to stay in step with.
        max_length: the model's maximum sequence length.
    """

    def __init__(self, engine: RolloutEngine, tokenizer: HFPromptTokenizer, cfg: EnvConfig,
                 make_env: Callable[[], Environment], peers: Peers, max_length: int) -> None:
        self.engine, self.cfg, self.make_env, self.peers = engine, cfg, make_env, peers
        self.renderer = ChatRenderer(tokenizer)
        self.limit = min(max_length, cfg.max_total_tokens or max_length)
        self.printed = 0
        self._envs: list[Environment | None] = []
        """The leader's environment per trajectory of the running call (None: its reset failed)."""

    def run(self, records: Sequence[PromptRecord], params: SamplingParams, *, seed: int,
            return_routes: bool) -> list[RolloutSample]:
        """One trajectory per record (repeat a record for a group); collective as the engine's ``generate``."""
        self.printed = 0
        live = self._start(records, params)
        for turn in range(1, self.cfg.max_turns + 1):
            mine = [t for t in live if t.builder.live]
            if not self.peers.any_live(bool(mine)):
                break
            prompts = [t.builder.ids for t in mine] or [live[0].builder.prompt_ids]
            starts = [t.builder.routes_covered for t in mine] or [0]
            samples = self.engine.generate(prompts, params, return_routed_experts=return_routes,
                                           seed=seed * 1009 + turn, routes_from=starts)
            for t, sample, start in zip(mine, samples, starts):
                t.builder.add_turn(sample, start, return_routes)
            outcomes = self.peers.share(self._decide(mine, turn, params) if self.peers.leader else None)
            for t, outcome in zip(mine, outcomes):
                self._apply(t, outcome)
        self._close(live)
        return [self._finish(t, return_routes) for t in live]

    # ------------------------------------------------------------------ start

    def _start(self, records: Sequence[PromptRecord], params: SamplingParams) -> list[_Live]:
        """Each record's trajectory with its first prompt (the leader resets the environments)."""
        starts = self.peers.share(self._reset_all(records, params) if self.peers.leader else None)
        live = [_Live(record, TrajectoryBuilder(prompt_ids), conversation, fault=fault)
                for record, (prompt_ids, conversation, fault) in zip(records, starts)]
        if self.peers.leader:
            for t, env in zip(live, self._envs):
                t.env = env
        return live

    def _reset_all(self, records: Sequence[PromptRecord], params: SamplingParams) -> list[tuple]:
        """(prompt ids, first messages, fault) per record; a failed reset falls back to the row's
        own prompt, generates one turn and ends with the fault."""
        self._envs = []
        calls = []
        for record in records:
            env = self.make_env()
            self._envs.append(env)
            calls.append(lambda env=env, record=record: env.reset(record))
        starts = []
        for i, (record, call) in enumerate(zip(records, call_all(calls, self.cfg.step_timeout_s,
                                                                   self.cfg.max_parallel))):
            own = (list(record.prompt_ids), self.renderer.tokenizer.prompt_messages(record.prompt))
            fault, error = self._fault_of(call)
            if fault is None and call.value is not None:
                try:
                    check_messages(call.value, "reset returned")
                    ids = self.renderer.render_ids(call.value, add_generation_prompt=True)
                    if len(ids) + params.max_new_tokens > self.limit:
                        raise EnvError(f"reset returned a prompt of {len(ids)} tokens, which with "
                                       f"rollout.max_new_tokens does not fit in {self.limit}")
                    own = (ids, list(call.value))
                except EnvError as err:
                    fault, error = "env_error", str(err)
            if fault is not None:
                self._report(record, 0, error)
                self._envs[i] = None
            starts.append((*own, fault))
        return starts

    # ------------------------------------------------------------------ a turn

    def _decide(self, mine: list[_Live], turn: int, params: SamplingParams) -> list[_Outcome]:
        """The leader's outcome per live trajectory after model turn ``turn``."""
        outcomes: list[_Outcome | None] = [None] * len(mine)
        stepping, calls = [], []
        for i, t in enumerate(mine):
            start, end = t.builder.turns[-1]
            output = t.builder.ids[len(t.builder.prompt_ids) + start: len(t.builder.prompt_ids) + end]
            if t.fault is not None:
                outcomes[i] = _Outcome(reason=t.fault)
            elif t.builder.finish_reason == "length":
                outcomes[i] = _Outcome(reason="length")
            else:
                text = self.renderer.turn_text(output)
                prefix = self.renderer.hf.decode(t.builder.ids[: len(t.builder.ids) - len(output)],
                                                 skip_special_tokens=False)
                try:
                    calls_made = self.renderer.tool_calls(self.renderer.hf.decode(output, skip_special_tokens=False),
                                                          prefix)
                except MalformedToolCall as err:
                    outcomes[i] = _Outcome(reason="malformed_tool_call", error=f"malformed tool call: {err}")
                    continue
                model_turn = ModelTurn(turn, text, tuple(output), calls_made)
                t.conversation.append({"role": "assistant", "content": text})
                stepping.append(i)
                calls.append(lambda env=t.env, model_turn=model_turn: env.step(model_turn))
        for i, call in zip(stepping, call_all(calls, self.cfg.step_timeout_s, self.cfg.max_parallel)):
            outcomes[i] = self._outcome(mine[i], call, turn, params)
        for t, outcome in zip(mine, outcomes):
            if outcome.error is not None and outcome.reason != "malformed_tool_call":
                self._report(t.record, turn, outcome.error)
        return outcomes  # type: ignore[return-value]

    def _outcome(self, t: _Live, call: _Call, turn: int, params: SamplingParams) -> _Outcome:
        """What an environment's answer (or failure) means for its trajectory."""
        fault, error = self._fault_of(call)
        if fault is not None:
            return _Outcome(reason=fault, error=error, seconds=call.seconds)
        try:
            step: EnvStep = checked_step(call.value, self.renderer.tokenizer.vocab_size)
        except EnvError as err:
            return _Outcome(reason="env_error", error=str(err), seconds=call.seconds)
        base = _Outcome(reward=float(step.reward), metrics=dict(step.metrics), seconds=call.seconds)
        if step.done or not step.observation:
            base.reason = "done"
        elif turn == self.cfg.max_turns:
            base.reason = "max_turns"
        else:
            try:
                ids, messages = self._observation(t, step.observation)
            except TemplateError as err:
                base.reason, base.error = "template_error", str(err)
                return base
            if len(t.builder.ids) + len(ids) + params.max_new_tokens > self.limit:
                base.reason = "max_tokens"
            else:
                base.observation_ids, base.messages = ids, messages
        return base

    def _observation(self, t: _Live, observation: Messages | list[int]) -> tuple[list[int], Messages | None]:
        """Ids (and messages) of an observation: token ids verbatim, messages through the template."""
        if all(isinstance(x, int) for x in observation):
            return list(observation), None
        return self.renderer.observation_ids(t.conversation, observation), list(observation)

    def _fault_of(self, call: _Call) -> tuple[str | None, str | None]:
        if call.timed_out:
            return "env_timeout", f"no answer within rollout.env.step_timeout_s={self.cfg.step_timeout_s:g}"
        if call.error is not None:
            return "env_error", call.error
        return None, None

    def _report(self, record: PromptRecord, turn: int, error: str) -> None:
        """Print (a few of) the faults; with ``errors_fatal``, stop the run with the first."""
        where = f"sample {record.sample_id} (turn {turn})" if turn else f"sample {record.sample_id} (reset)"
        line = f"environment {self.cfg.name!r} failed on {where}: {error}"
        if self.cfg.errors_fatal:
            raise EnvironmentFailure(line + " (rollout.env.errors_fatal)")
        if self.printed < self.cfg.max_errors_printed:
            print(line, file=sys.stderr, flush=True)
            self.printed += 1

    def _apply(self, t: _Live, outcome: _Outcome) -> None:
        """Apply the leader's outcome to this rank's copy of the trajectory."""
        stats = t.builder.meta.setdefault("env_metrics", {})
        for name, value in outcome.metrics.items():
            stats[name] = stats.get(name, 0.0) + value
        t.builder.meta["env_time_s"] = t.builder.meta.get("env_time_s", 0.0) + outcome.seconds
        if outcome.reason is not None:
            t.builder.add_final_reward(outcome.reward)
            t.builder.end(outcome.reason)
            return
        if outcome.messages is None:
            t.checkable = False
        else:
            t.conversation.extend(outcome.messages)
        t.builder.add_observation(outcome.observation_ids, outcome.reward)

    # ------------------------------------------------------------------ the end

    def _close(self, live: list[_Live]) -> None:
        """Close the leader's environments (each bounded by the timeout; failures ignored)."""
        envs = [t.env for t in live if t.env is not None]
        if envs:
            call_all([env.close for env in envs], self.cfg.step_timeout_s, self.cfg.max_parallel)

    def _finish(self, t: _Live, with_routes: bool) -> RolloutSample:
        """The trajectory as a sample, with its counts and the template check in ``meta``."""
        b = t.builder
        if b.live:
            b.end("max_turns")
        if len(t.conversation) and t.conversation[-1]["role"] != "assistant" and b.turns:
            start, end = b.turns[-1]
            output = b.ids[len(b.prompt_ids) + start: len(b.prompt_ids) + end]
            t.conversation.append({"role": "assistant", "content": self.renderer.turn_text(output)})
        b.meta["turns"] = len(b.turns)
        b.meta["template_mismatch_at"] = self.renderer.first_mismatch(t.conversation, b.ids) if t.checkable else None
        b.meta["template_checked"] = t.checkable
        b.meta["messages"] = t.conversation
        return b.sample(with_routes)


OWN_STATS = ("env/turns", "env/time_s", "env/masked_token_frac", "env/template_mismatch_frac")
"""The ``env/*`` statistics this module computes (besides ``env/end/<reason>``); any other
``env/<name>`` is an environment's count."""


def is_env_count(name: str) -> bool:
    """Whether ``name`` is an environment's count (``env/<count>``): its metric is the mean over
    every trajectory, one that did not report it counting 0 (an environment that reports
    ``hits`` only on a hit: ``env/hits`` is the share of trajectories that hit)."""
    return name.startswith("env/") and name not in OWN_STATS and not name.startswith("env/end/")


def trajectory_stats(samples: Sequence[RolloutSample]) -> dict[str, list[float]]:
    """Per-trajectory numbers behind the ``env/*`` metrics (names -> one value per trajectory
    that has it): turns, each environment count, environment seconds, environment tokens and
    all output tokens, template mismatches (of the trajectories checked), and per end reason
    1 or 0 (their means are the shares of trajectories that ended so). The counts' means are
    over every trajectory (:func:`is_env_count`)."""
    stats: dict[str, list[float]] = {}

    def add(name: str, value: float) -> None:
        stats.setdefault(name, []).append(float(value))

    for s in samples:
        if s.turns is None:
            continue
        meta = s.meta
        add("env/turns", meta.get("turns", len(s.turns)))
        for name, value in meta.get("env_metrics", {}).items():
            add(f"env/{name}", value)
        add("env/time_s", meta.get("env_time_s", 0.0))
        add("env/masked_token_frac", float((~s.loss_mask()).sum()) / max(1, len(s.output_ids)))
        if meta.get("template_checked"):
            add("env/template_mismatch_frac", meta.get("template_mismatch_at") is not None)
        for reason in END_REASONS:
            add(f"env/end/{reason}", reason == s.end_reason)
    return stats
