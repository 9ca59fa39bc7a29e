"""Reward records, config, function resolution and the call of one reward on one response.

Owns what both sides of the pool share: :class:`RewardConfig`, the input and result
records, turning ``reward.function`` into a callable (:func:`resolve_reward`), the
config-only checks, and :func:`call_reward`, which runs one function on one response and
turns whatever it returns or raises into a :class:`RewardResult`. It does not own the
worker processes or timeouts (``megatron_rl.rewards.pool``) nor the built-in rewards
(``megatron_rl.rewards.builtin``, imported only when a built-in is named, because it
loads sympy).
"""

from __future__ import annotations

import importlib
import inspect
import math
import numbers
from dataclasses import dataclass, field
from typing import Any, Callable

from megatron_rl.config_loading import ConfigError
from megatron_rl.rewards.config import RewardConfig

BUILTIN_REWARDS = {
    "math": "megatron_rl.rewards.builtin:math_reward",
    "exact_match": "megatron_rl.rewards.builtin:exact_match_reward",
}
"""Built-in reward names and the import paths they stand for."""

_MAX_ERROR_CHARS = 300


@dataclass
class RewardInput:
    """One response to score."""

    sample_id: str
    """Identifies the sample in error messages and logs."""
    prompt: str | list[dict]
    """The prompt as text or as chat messages."""
    response: str
    """The generated text to score."""
    ground_truth: str
    """The reference answer from the data set."""
    metadata: dict = field(default_factory=dict)
    """Per-sample extras from the data set, passed to the function unchanged."""


@dataclass
class RewardResult:
    """The score of one response."""

    score: float
    """The reward; ``error_score`` when ``error`` is set."""
    extras: dict[str, float] = field(default_factory=dict)
    """Further numeric fields the function returned, logged as ``reward/<name>``."""
    error: str | None = None
    """One line "ExcType: message" when the function failed or timed out, else None."""
    timed_out: bool = False
    """The error is a time limit (``reward.timeout_s``, or the function's own), kept after one
    retry; counted in ``reward/timeouts`` as well as ``reward/errors``."""


class RewardError(RuntimeError):
    """A reward function failed and ``reward.fatal_errors`` is set."""


class RewardTimeout(TimeoutError):
    """A reward function ran past a time limit of its own (a verifier's parse or comparison):
    a timeout, tried once more, never a wrong answer or an unparseable ground truth."""


def ground_truth_preparer(fn: Callable) -> Callable[[str], Any] | None:
    """``fn.prepare`` when the reward has one: it turns a ground truth into what ``fn`` then
    gets as ``ground_truth`` (e.g. parsed once per prompt, not once per response), run by the
    scorer once per distinct ground truth of a batch, outside the responses' time budget."""
    prepare = getattr(fn, "prepare", None)
    return prepare if callable(prepare) else None


def one_line_error(exc: BaseException) -> str:
    """``"ExcType: message"`` on one line, cut short so that logs stay readable."""
    message = " ".join(str(exc).split())
    text = f"{type(exc).__name__}: {message}" if message else type(exc).__name__
    return text if len(text) <= _MAX_ERROR_CHARS else text[: _MAX_ERROR_CHARS - 3] + "..."


def _import_path(function: str) -> tuple[str, str]:
    module_name, sep, attr_path = function.partition(":")
    if not sep or not module_name or not attr_path:
        raise ConfigError(
            f"reward.function: {function!r} is neither a built-in reward "
            f"({', '.join(sorted(BUILTIN_REWARDS))}) nor an import path 'package.module:function'"
        )
    return module_name, attr_path


def resolve_reward(function: str) -> Callable:
    """The callable that ``reward.function`` names, checked to accept the four arguments.

    Raises ConfigError naming ``reward.function`` and the path when the module does not
    import, the attribute is missing or not callable, or the signature does not bind
    ``(prompt, response, ground_truth, metadata)`` positionally.
    """
    path = BUILTIN_REWARDS.get(function, function)
    module_name, attr_path = _import_path(path)
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as exc:  # a user module may fail at import with any error
        raise ConfigError(
            f"reward.function: cannot import module {module_name!r} of {function!r}: "
            f"{one_line_error(exc)}"
        ) from exc
    for name in attr_path.split("."):
        if not hasattr(obj, name):
            raise ConfigError(
                f"reward.function: {function!r}: {module_name!r} has no attribute {attr_path!r}"
            )
        obj = getattr(obj, name)
    if not callable(obj):
        raise ConfigError(f"reward.function: {function!r} is not callable ({type(obj).__name__})")
    if inspect.iscoroutinefunction(obj):
        raise ConfigError(f"reward.function: {function!r} is async; reward functions are plain")
    try:
        signature = inspect.signature(obj)
    except (TypeError, ValueError):
        # Some C callables carry no signature; they are checked when first called.
        return obj
    try:
        signature.bind("prompt", "response", "ground_truth", {})
    except TypeError as exc:
        raise ConfigError(
            f"reward.function: {function!r} must accept (prompt, response, ground_truth, "
            f"metadata) positionally; its signature is {signature}: {exc}"
        ) from exc
    return obj


def check_reward_config(cfg: RewardConfig) -> None:
    """Every check that needs only the config (and the import path); ConfigError on failure."""
    resolve_reward(cfg.function)
    if cfg.num_workers < 0:
        raise ConfigError(
            f"reward.num_workers: must be >= 0 (0 scores in-process), got {cfg.num_workers}"
        )
    if not cfg.timeout_s > 0 or not math.isfinite(cfg.timeout_s):
        raise ConfigError(f"reward.timeout_s: must be a finite number > 0, got {cfg.timeout_s}")
    if not math.isfinite(cfg.error_score):
        raise ConfigError(f"reward.error_score: must be finite, got {cfg.error_score}")


def _finite_number(value: Any, what: str) -> float:
    # bool is an int subclass; a True score is more likely a bug than a reward of 1.
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{what} must be a float, got {type(value).__name__}")
    number = float(value)
    if not math.isfinite(number):
        raise ValueError(f"{what} is {number}")
    return number


def result_from_return(value: Any) -> RewardResult:
    """Check a reward's return value (float, or dict with "score") and wrap it."""
    if isinstance(value, dict):
        if "score" not in value:
            raise ValueError(f"returned dict has no 'score' (keys: {sorted(map(str, value))})")
        extras = {
            str(name): _finite_number(extra, f"returned field {name!r}")
            for name, extra in value.items()
            if name != "score"
        }
        return RewardResult(score=_finite_number(value["score"], "returned 'score'"), extras=extras)
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"reward must return a float or a dict with 'score', got {type(value).__name__}"
        )
    return RewardResult(score=_finite_number(value, "returned score"))


def error_result(error: str, error_score: float, timed_out: bool = False) -> RewardResult:
    """The result of a response whose reward failed (``timed_out``: ran past a time limit)."""
    return RewardResult(score=error_score, extras={}, error=error, timed_out=timed_out)


def call_reward(fn: Callable, item: tuple, error_score: float) -> RewardResult:
    """Run ``fn(prompt, response, ground_truth, metadata)``; any failure becomes an error result."""
    try:
        return result_from_return(fn(*item))
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:
        # BaseException because some verifiers raise BaseException subclasses on their own
        # timeouts (math-verify's TimeoutException does), and those are the function's failure.
        return error_result(one_line_error(exc), error_score, timed_out=isinstance(exc, TimeoutError))


def call_preparer(prepare: Callable[[str], Any], ground_truth: str, error_score: float) -> Any:
    """``prepare(ground_truth)``, or the error result its responses get when it fails."""
    try:
        return prepare(ground_truth)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # as call_reward: a failure of the reward's own code
        return error_result(one_line_error(exc), error_score, timed_out=isinstance(exc, TimeoutError))


def reward_args(item: RewardInput) -> tuple:
    """The positional arguments of the user function for one input."""
    return (item.prompt, item.response, item.ground_truth, item.metadata)
