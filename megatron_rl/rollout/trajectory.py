"""A multi-turn trajectory as token ids end to end, assembled turn by turn.

Shape legend: N tokens of the trajectory (prompt, then the model's turns and what the
environment wrote between them), L MoE layers, K top-K.

Owns :class:`TrajectoryBuilder`: it holds the ids of a trajectory, appends each model
turn exactly as the engine returned it (token in, token out: an earlier turn is never
re-tokenized) and each environment observation as ids, and keeps per output token whether
the policy generated it, its rollout log-prob (NaN where the environment wrote it) and
which turn it belongs to. Routes are stitched per position from the engine pass that
computed it: a turn's request asks the engine only for the positions no earlier pass
covered (``routes_from``, SGLang's ``routed_experts_start_len``), which are the last
generated token of the previous turn and the environment's tokens (the next turn's
prefill) followed by the new turn's decode steps; whatever prefix an engine served from
its cache was computed, and routed, by an earlier pass, whose rows are already held. The
finished trajectory is a :class:`~megatron_rl.rollout.engine.RolloutSample` whose routes
cover ``[N - 1, L, K]`` like a single-turn sample's, because a trajectory always ends
with a model turn.

Also owns :func:`turn_layout`, the turns of a batch of samples as the objective's per-turn
credit reads them (``megatron_rl.algos.turn_credit``).

Does not own running the turns or environments (``megatron_rl.rollout.multiturn``) nor
rendering messages into ids (``megatron_rl.data.chat``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from megatron_rl.algos import TurnLayout
from megatron_rl.rollout.engine import RolloutSample

END_REASONS = (
    "done", "max_turns", "max_tokens", "length", "malformed_tool_call", "env_error", "env_timeout", "template_error",
)
"""Why a trajectory ended: the environment said done; the turn limit; the token limit (the
next observation and turn would not fit); the model's turn was cut at ``max_new_tokens``
without its stop token; the model wrote a tool call that does not parse; the environment
raised, answered malformed output or failed over HTTP; it did not answer within the
timeout; the chat template could not render the observation after the conversation."""

ENV_FAULTS = ("env_error", "env_timeout")
"""End reasons that are the environment's fault, not the policy's (scored ``reward.error_score``)."""


class TrajectoryError(ValueError):
    """A turn does not continue the trajectory it is appended to (names the turn)."""


@dataclass
class TrajectoryBuilder:
    """One trajectory being built; ``prompt_ids`` is the first prompt."""

    prompt_ids: list[int]
    """The first prompt's ids."""
    ids: list[int] = field(default_factory=list)
    """Every token so far (starts as ``prompt_ids``)."""
    generated: list[bool] = field(default_factory=list)
    """Per output token: the policy generated it."""
    logprobs: list[torch.Tensor] = field(default_factory=list)
    """Per appended span, its ``[n]`` fp32 rollout log-probs (NaN for environment tokens)."""
    routes: list[torch.Tensor] = field(default_factory=list)
    """Per model turn, the ``[n, L, K]`` routes of the positions its pass computed first."""
    routes_covered: int = 0
    """Positions ``0 .. routes_covered - 1`` have routes."""
    turns: list[tuple[int, int]] = field(default_factory=list)
    """``(start, end)`` of each model turn in the output tokens."""
    turn_rewards: list[float] = field(default_factory=list)
    """The environment's reward after each model turn."""
    versions: list[int] = field(default_factory=list)
    """Weight version of each model turn (its oldest token's)."""
    token_versions: list[torch.Tensor] = field(default_factory=list)
    """Per appended span, the version of each token (an environment's: the turn's before them)."""
    finish_reason: str = "stop"
    """The last model turn's finish reason ("length": cut at max_new_tokens)."""
    end_reason: str | None = None
    """Why the trajectory ended (None: still running)."""
    meta: dict = field(default_factory=dict)
    """Counters and notes carried to the finished sample's ``meta``."""

    def __post_init__(self) -> None:
        self.prompt_ids = list(self.prompt_ids)
        if not self.ids:
            self.ids = list(self.prompt_ids)

    @property
    def live(self) -> bool:
        """Whether the trajectory still takes turns."""
        return self.end_reason is None

    def end(self, reason: str) -> None:
        """Stop taking turns, for ``reason`` (one of :data:`END_REASONS`)."""
        if reason not in END_REASONS:
            raise ValueError(f"unknown end reason {reason!r}; one of {END_REASONS}")
        self.end_reason = reason

    def add_turn(self, sample: RolloutSample, routes_from: int, with_routes: bool) -> None:
        """Append a model turn the engine generated from ``ids`` with ``routes_from`` (the
        value :attr:`routes_covered` had when the request was made)."""
        turn = len(self.turns) + 1
        if list(sample.prompt_ids) != self.ids:
            raise TrajectoryError(f"turn {turn}: the engine answered another prompt than the trajectory's ids")
        if not sample.output_ids:
            raise TrajectoryError(f"turn {turn}: the engine returned no token")
        start = len(self.ids) - len(self.prompt_ids)
        self.ids.extend(sample.output_ids)
        self.generated.extend([True] * len(sample.output_ids))
        self.logprobs.append(sample.output_logprobs.float())
        self.turns.append((start, start + len(sample.output_ids)))
        self.versions.append(sample.weight_version)
        self.token_versions.append(sample.versions())
        self.finish_reason = sample.finish_reason
        if with_routes:
            self._add_routes(sample.routed_experts, routes_from, turn)

    def _add_routes(self, routes: torch.Tensor | None, routes_from: int, turn: int) -> None:
        """Keep a turn's routes: rows for positions ``routes_from .. len(ids) - 2``."""
        if routes_from != self.routes_covered:
            raise TrajectoryError(f"turn {turn}: routes were asked from position {routes_from}, but positions "
                                  f"0..{self.routes_covered - 1} are the ones already covered")
        expected = len(self.ids) - 1 - routes_from
        if routes is None or routes.dim() != 3 or routes.shape[0] != expected:
            shape = None if routes is None else tuple(routes.shape)
            raise TrajectoryError(f"turn {turn}: the engine returned routes of shape {shape}, expected "
                                  f"[{expected}, L, K] (positions {routes_from}..{len(self.ids) - 2})")
        if self.routes and routes.shape[1:] != self.routes[0].shape[1:]:
            raise TrajectoryError(f"turn {turn}: routes of shape {tuple(routes.shape)} do not stack with the "
                                  f"earlier turns' [*, {', '.join(map(str, self.routes[0].shape[1:]))}]")
        self.routes.append(routes)
        self.routes_covered = len(self.ids) - 1

    def add_observation(self, ids: list[int], reward: float) -> None:
        """Append what the environment answered the last model turn (its ids, masked) and its reward."""
        self.turn_rewards.append(float(reward))
        if ids:
            self.ids.extend(ids)
            self.generated.extend([False] * len(ids))
            self.logprobs.append(torch.full((len(ids),), float("nan")))
            self.token_versions.append(torch.full((len(ids),), int(self.token_versions[-1][-1])))

    def add_final_reward(self, reward: float) -> None:
        """The environment's reward after the last model turn (no observation follows)."""
        self.turn_rewards.append(float(reward))

    def sample(self, with_routes: bool) -> RolloutSample:
        """The finished trajectory as one sample (``prompt_ids`` + everything after them)."""
        if not self.turns:
            raise TrajectoryError("a trajectory without a model turn cannot become a sample")
        if not self.generated[-1]:
            raise TrajectoryError("a trajectory must end with a model turn (its last tokens were the environment's)")
        routes = None
        if with_routes:
            routes = torch.cat(self.routes)
            if routes.shape[0] != len(self.ids) - 1:
                raise TrajectoryError(f"stitched routes cover {routes.shape[0]} positions, the trajectory "
                                      f"forwards {len(self.ids) - 1}")
        output = self.ids[len(self.prompt_ids):]
        versions = torch.cat(self.token_versions)
        return RolloutSample(
            prompt_ids=list(self.prompt_ids), output_ids=output, output_logprobs=torch.cat(self.logprobs),
            finish_reason="length" if self.finish_reason == "length" or self.end_reason == "max_tokens" else "stop",
            weight_version=min(self.versions), routed_experts=routes,
            token_versions=versions if len(set(versions.tolist())) > 1 else None,
            meta={"end_reason": self.end_reason, **self.meta},
            generated_mask=torch.tensor(self.generated, dtype=torch.bool), turns=list(self.turns),
            turn_rewards=list(self.turn_rewards), end_reason=self.end_reason,
        )


def turn_of_positions(prompt_length: int, turns: list[tuple[int, int]], num_positions: int) -> torch.Tensor:
    """``[num_positions]`` int64: for each forwarded position of a trajectory, the model turn
    (1, 2, ...) whose engine pass computed it first (turn 1: the prompt and its decode steps;
    turn k: the previous turn's last token, the environment's tokens, and its decode steps).

    Args:
        prompt_length: tokens of the first prompt.
        turns: ``(start, end)`` of each model turn in the output tokens.
        num_positions: forwarded positions (N - 1).
    """
    ends = torch.tensor([prompt_length + end - 1 for _, end in turns])
    return torch.searchsorted(ends, torch.arange(num_positions), right=True) + 1


def turn_layout(samples: list[RolloutSample]) -> TurnLayout:
    """The turns of ``samples`` packed as the trainer packs their output tokens (per-turn
    credit, ``objective.turn_credit='turn'``): each output token belongs to the model turn it
    was generated in or, for an environment's tokens, the turn they answer; a single-turn
    sample is one turn. A turn the environment gave no reward for (it failed) has reward 0."""
    rewards: list[float] = []
    seq_ids: list[int] = []
    turn_ids = []
    for i, s in enumerate(samples):
        turns = s.turns or [(0, len(s.output_ids))]
        starts = torch.tensor([start for start, _ in turns])
        local = torch.searchsorted(starts, torch.arange(len(s.output_ids)), right=True) - 1
        turn_ids.append(local.clamp(min=0) + len(rewards))
        given = list(s.turn_rewards or [])[:len(turns)]
        rewards.extend(given + [0.0] * (len(turns) - len(given)))
        seq_ids.extend([i] * len(turns))
    return TurnLayout(turn_rewards_U=torch.tensor(rewards, dtype=torch.float64),
                      turn_seq_ids_U=torch.tensor(seq_ids, dtype=torch.int64),
                      turn_ids_T=torch.cat(turn_ids) if turn_ids else torch.zeros(0, dtype=torch.int64))
