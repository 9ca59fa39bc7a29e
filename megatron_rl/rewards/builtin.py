"""Built-in reward functions: ``math`` (final answer checked with math-verify) and ``exact_match``.

Owns the answer extraction of the ``math`` reward and how it calls math-verify. It does not
own dispatch, timeouts of a whole response or error handling (``megatron_rl.rewards.pool``
and ``megatron_rl.rewards.core``). Importing this module loads math-verify and sympy
(about a second), which is why ``megatron_rl.rewards`` imports it only when a built-in is
named.

math-verify's limits are its own: a parse or a comparison that runs past one is a
:class:`~megatron_rl.rewards.core.RewardTimeout` (tried once more by the scorer), never a
wrong answer or an unparseable ground truth. The ground truth is parsed once per prompt
(``math_reward.prepare``, run by the scorer outside the responses' time budget), and a worker
warms the parser before its first response (``math_reward.warm_up``): math-verify's first
parse in a process builds its grammar, 0.4 s of CPU on a quiet machine, which on a busy one
with eight fresh workers ran past the 2 s limit.
"""

from __future__ import annotations

import itertools
import re
import threading
from dataclasses import dataclass

from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify
from math_verify.errors import TimeoutException

from megatron_rl.rewards.core import RewardTimeout

PARSE_TIMEOUT_S = 2
"""math-verify's own limit (whole seconds, it uses signal.alarm) for parsing one answer."""
VERIFY_TIMEOUT_S = 2
"""math-verify's own limit (whole seconds) for one comparison."""

_EXTRACTION = (LatexExtractionConfig(), ExprExtractionConfig())
_BOXED = re.compile(r"\\boxed\s*\{")
# A number, with thousands separators, decimals and an optional "/denominator" so that a
# plain-text fraction such as "1/2" is one answer rather than its denominator. A minus sign
# counts only when it does not follow a word character ("3-5" is not "-5").
_NUMBER = re.compile(
    r"(?:(?<![\w.)])-)?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:\s*/\s*\d+(?:\.\d+)?)?"
)
_MATH_DELIMITERS = ("$", "\\(", "\\[", "\\boxed")


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` whose braces balance, or None."""
    for match in reversed(list(_BOXED.finditer(text))):
        depth = 1
        for pos in range(match.end(), len(text)):
            if text[pos] == "{":
                depth += 1
            elif text[pos] == "}":
                depth -= 1
                if depth == 0:
                    return text[match.end() : pos].strip()
    return None


def extract_final_answer(response: str) -> str | None:
    """The last ``\\boxed{}`` content or, when there is none, the last number; None if neither."""
    boxed = last_boxed(response)
    if boxed:
        return boxed
    numbers = _NUMBER.findall(response)
    return numbers[-1] if numbers else None


def _as_latex(text: str) -> str:
    # math-verify's LaTeX extraction looks for math delimiters; a bare "42" or "\frac{1}{2}"
    # from a data set or from inside \boxed{} has none, so it is wrapped as inline math.
    if any(delimiter in text for delimiter in _MATH_DELIMITERS):
        return text
    return f"${text}$"


def _math_verify_timeouts() -> tuple[int | None, int | None]:
    # math-verify times out with signal.alarm, which Python allows only in the main thread.
    # Pool workers run rewards in their main thread; in-process scoring from another thread
    # (num_workers=0 under a trainer thread) runs without these limits instead of failing.
    if threading.current_thread() is threading.main_thread():
        return PARSE_TIMEOUT_S, VERIFY_TIMEOUT_S
    return None, None


def _parse(text: str, what: str) -> list:
    """math-verify's parse of ``text``; [] when it finds nothing it can parse.

    Raises:
        RewardTimeout: the parse ran past :data:`PARSE_TIMEOUT_S` (``what`` names the text).
    """
    limit, _ = _math_verify_timeouts()
    try:
        return parse(_as_latex(text), _EXTRACTION, parsing_timeout=limit, raise_on_error=True)
    except TimeoutException:
        raise RewardTimeout(f"math-verify took longer than {limit}s to parse {what} {text!r}") from None
    except Exception:  # noqa: BLE001 - math-verify's own answer for a text it cannot parse
        return []


@dataclass(frozen=True)
class ParsedGroundTruth:
    """A ground truth and math-verify's parse of it (picklable: sympy objects and strings)."""

    text: str
    parsed: list


def parse_ground_truth(ground_truth: str) -> ParsedGroundTruth:
    """The ground truth parsed once for all of a prompt's responses (``math_reward.prepare``).

    Raises:
        ValueError: empty, or math-verify cannot parse it.
        RewardTimeout: the parse ran past its limit.
    """
    if not ground_truth.strip():
        raise ValueError("ground truth is empty")
    parsed = _parse(ground_truth.strip(), "the ground truth")
    if not parsed:
        raise ValueError(f"math-verify cannot parse the ground truth {ground_truth!r}")
    return ParsedGroundTruth(ground_truth, parsed)


WARM_UP_TIMEOUT_S = 120
"""Limit of the warm-up's parse and comparison (a worker's start-up wait is longer)."""


def warm_up() -> None:
    """Pay math-verify's first parse and comparison (its grammar is built on first use) now,
    so that no response is charged for it (``math_reward.warm_up``; a pool worker's main thread)."""
    gold = parse("$1$", _EXTRACTION, parsing_timeout=WARM_UP_TIMEOUT_S)
    verify(gold, parse("$1$", _EXTRACTION, parsing_timeout=WARM_UP_TIMEOUT_S), timeout_seconds=WARM_UP_TIMEOUT_S)


def math_reward(prompt, response: str, ground_truth: str | ParsedGroundTruth, metadata) -> dict[str, float]:
    """1.0 when the response's final answer equals the ground truth mathematically, else 0.0.

    The answer is the last ``\\boxed{}`` content, else the last number. Extras:
    ``has_answer`` is 1.0 when an answer could be extracted. ``ground_truth``: the text, or
    what :func:`parse_ground_truth` made of it.

    Raises:
        RewardTimeout: math-verify ran past its own limit parsing or comparing.
    """
    gold = ground_truth if isinstance(ground_truth, ParsedGroundTruth) else parse_ground_truth(ground_truth)
    answer = extract_final_answer(response)
    if answer is None:
        return {"score": 0.0, "has_answer": 0.0}
    predicted = _parse(answer, "the answer")
    correct = any(_equal(g, t, answer, gold.text) for g, t in itertools.product(gold.parsed, predicted))
    return {"score": 1.0 if correct else 0.0, "has_answer": 1.0}


def _equal(gold, target, answer: str, ground_truth: str) -> bool:
    """math-verify's comparison of one pair (``verify`` compares every pair, any equal one
    counts), a pair it cannot compare being unequal, as in ``verify``.

    Raises:
        RewardTimeout: the comparison ran past :data:`VERIFY_TIMEOUT_S`.
    """
    _, limit = _math_verify_timeouts()
    try:
        return verify(gold, target, timeout_seconds=limit, raise_on_error=True)
    except TimeoutException:
        raise RewardTimeout(f"math-verify took longer than {limit}s to compare {answer!r} with "
                            f"{ground_truth!r}") from None
    except Exception:  # noqa: BLE001 - math-verify's own answer for a pair it cannot compare
        return False


math_reward.prepare = parse_ground_truth
math_reward.warm_up = warm_up


def exact_match_reward(prompt, response: str, ground_truth: str, metadata) -> float:
    """1.0 when the response equals the ground truth up to surrounding whitespace, else 0.0."""
    return 1.0 if response.strip() == ground_truth.strip() else 0.0
