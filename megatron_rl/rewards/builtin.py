"""Built-in reward functions: ``math`` (final answer checked with math-verify) and ``exact_match``.

Owns the answer extraction of the ``math`` reward and how it calls math-verify. It does not
own dispatch, timeouts of a whole response or error handling (``megatron_rl.rewards.pool``
and ``megatron_rl.rewards.core``). Importing this module loads math-verify and sympy
(about a second), which is why ``megatron_rl.rewards`` imports it only when a built-in is
named.
"""

from __future__ import annotations

import re
import threading

from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

PARSE_TIMEOUT_S = 2
"""math-verify's own limit (whole seconds, it uses signal.alarm) for parsing one answer."""
VERIFY_TIMEOUT_S = 2
"""math-verify's own limit (whole seconds) for one comparison; on expiry it answers "not equal"."""

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


def math_reward(prompt, response: str, ground_truth: str, metadata) -> dict[str, float]:
    """1.0 when the response's final answer equals the ground truth mathematically, else 0.0.

    The answer is the last ``\\boxed{}`` content, else the last number. Extras:
    ``has_answer`` is 1.0 when an answer could be extracted.
    """
    if not ground_truth.strip():
        raise ValueError("ground truth is empty")
    answer = extract_final_answer(response)
    if answer is None:
        return {"score": 0.0, "has_answer": 0.0}
    parse_timeout, verify_timeout = _math_verify_timeouts()
    gold = parse(_as_latex(ground_truth.strip()), _EXTRACTION, parsing_timeout=parse_timeout)
    if not gold:
        raise ValueError(f"math-verify cannot parse the ground truth {ground_truth!r}")
    predicted = parse(_as_latex(answer), _EXTRACTION, parsing_timeout=parse_timeout)
    correct = verify(gold, predicted, timeout_seconds=verify_timeout)
    return {"score": 1.0 if correct else 0.0, "has_answer": 1.0}


def exact_match_reward(prompt, response: str, ground_truth: str, metadata) -> float:
    """1.0 when the response equals the ground truth up to surrounding whitespace, else 0.0."""
    return 1.0 if response.strip() == ground_truth.strip() else 0.0
