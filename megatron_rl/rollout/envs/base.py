"""What an environment is to multi-turn rollouts: :class:`Environment`, the model turn it is
shown (:class:`ModelTurn`) and what it answers (:class:`EnvStep`).

One instance serves one trajectory: ``reset(row)`` starts it (returning the first messages,
or None to use the prompt row's own prompt), then ``step(turn)`` answers each model turn
with an observation (chat messages, rendered by the tokenizer's chat template, or token
ids appended as they are), a reward and whether the episode is done. Both are plain
synchronous calls; the rollout driver runs each in its own thread with a timeout, so an
environment may block on I/O. Anything an environment raises, a call that runs past the
timeout, or an answer that is not an :class:`EnvStep` ends only that trajectory (counted,
printed with the sample id), unless ``rollout.env.errors_fatal`` is set.

Does not own running turns (``megatron_rl.rollout.multiturn``), parsing tool calls out of
the model's tokens (``megatron_rl.data.chat``) or the built-ins (``envs.builtin``, ``envs.http``).
"""

from __future__ import annotations

import abc
import math
from dataclasses import dataclass, field
from typing import Any

from megatron_rl.data.chat import ToolCall
from megatron_rl.data.prompts import PromptRecord

Messages = list[dict[str, Any]]
"""Chat messages: ``[{"role": ..., "content": ...}, ...]``."""


class EnvError(RuntimeError):
    """An environment failed in a way it can name (HTTP status, bad answer); ends the trajectory."""


@dataclass(frozen=True)
class ModelTurn:
    """What the model wrote in one turn."""

    index: int
    """1 for the first model turn."""
    text: str
    """The turn's text, without the stop token."""
    token_ids: tuple[int, ...]
    """The turn's generated ids (the stop token included when it was produced)."""
    tool_calls: tuple[ToolCall, ...] = ()
    """Tool calls parsed in the tokenizer's tool format (empty: none)."""


@dataclass
class EnvStep:
    """An environment's answer to a model turn."""

    observation: Messages | list[int] | None = None
    """Messages to append (role "tool" for tool results, "user" for feedback), or token ids
    appended verbatim; None (or empty) when the episode is done."""
    reward: float = 0.0
    """Reward for this turn; a trajectory's reward is the reward function's score of its
    last model turn plus these."""
    done: bool = False
    """The episode is over (a step without an observation also ends it)."""
    metrics: dict[str, float] = field(default_factory=dict)
    """Counts for this turn (e.g. ``tool_calls``, ``tool_errors``), summed over a trajectory's
    turns and averaged over trajectories as ``env/<name>``."""


class Environment(abc.ABC):
    """One trajectory's environment (one instance per trajectory; see the module docstring)."""

    tools: Messages | None = None
    """Tool schemas (JSON Schema function specs), a class attribute: the chat template gets
    them with every prompt and render, so a template that lists tools in its system turn
    does (None: no tools)."""

    @abc.abstractmethod
    def reset(self, row: PromptRecord) -> Messages | None:
        """Start an episode for the prompt row ``row``; the first messages, or None for the row's own prompt."""

    @abc.abstractmethod
    def step(self, turn: ModelTurn) -> EnvStep:
        """Answer model turn ``turn``."""

    def close(self) -> None:
        """Release what the episode holds (called once the trajectory ended, errors ignored)."""


def checked_step(answer: Any, vocab_size: int) -> EnvStep:
    """``answer`` if it is a well-formed :class:`EnvStep`, else :class:`EnvError` saying what is wrong."""
    if not isinstance(answer, EnvStep):
        raise EnvError(f"step returned {type(answer).__name__}, not an EnvStep")
    if isinstance(answer.reward, bool) or not isinstance(answer.reward, (int, float)) or not math.isfinite(
            answer.reward):
        raise EnvError(f"step returned the reward {answer.reward!r}, not a finite number")
    if not isinstance(answer.metrics, dict) or not all(
            isinstance(k, str) and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
            for k, v in answer.metrics.items()):
        raise EnvError(f"step returned the metrics {answer.metrics!r}, not a dict of finite numbers by name")
    observation = answer.observation
    if observation is None or observation == []:
        return answer
    if not isinstance(observation, list):
        raise EnvError(f"step returned an observation of type {type(observation).__name__}, not a list")
    if all(isinstance(x, int) and not isinstance(x, bool) for x in observation):
        bad = [x for x in observation if not 0 <= x < vocab_size]
        if bad:
            raise EnvError(f"step returned the token id {bad[0]}, outside the tokenizer's [0, {vocab_size})")
        return answer
    check_messages(observation, "step returned")
    return answer


def check_messages(messages: Any, what: str) -> None:
    """Raise :class:`EnvError` unless ``messages`` is a non-empty list of {"role": str, "content": str}."""
    if not isinstance(messages, list) or not messages:
        raise EnvError(f"{what} {messages!r}, not a non-empty list of messages or token ids")
    for i, message in enumerate(messages):
        if not (isinstance(message, dict) and isinstance(message.get("role"), str)
                and isinstance(message.get("content"), str)):
            raise EnvError(f"{what} message {i} = {message!r}, not a dict with string 'role' and 'content'")
