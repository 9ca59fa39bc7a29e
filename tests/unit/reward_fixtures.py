"""Reward functions for tests/unit/test_rewards.py, importable by reward worker processes.

``by_behaviour`` lets one worker pool serve every test: each sample's metadata names the
fixture behaviour to run, so the tests share one pool instead of starting one per function.
"""

import os
import sys
import time

from megatron_rl.rewards.builtin import exact_match_reward, math_reward


def good(prompt, response, ground_truth, metadata):
    return float(len(response))


def with_extras(prompt, response, ground_truth, metadata):
    return {"score": 0.5, "length": len(response), "bonus": 0.25}


def raising(prompt, response, ground_truth, metadata):
    raise ZeroDivisionError(f"cannot score {response!r}")


def wrong_signature(prompt, response):
    return 1.0


def slow(prompt, response, ground_truth, metadata):
    time.sleep(float(metadata.get("sleep_s", 60.0)))
    return 1.0


def returns_text(prompt, response, ground_truth, metadata):
    return "1.0"


def returns_nan(prompt, response, ground_truth, metadata):
    return {"score": float("nan")}


def dies(prompt, response, ground_truth, metadata):
    os._exit(3)


def what_the_worker_imported(prompt, response, ground_truth, metadata):
    """Whether this worker re-ran its parent's main module (in a trainer rank: the entry point,
    torch and Megatron behind it) and whether torch is loaded."""
    parent_main = getattr(sys.modules["__main__"], "__file__", None) is not None  # else the forkserver's own
    return {"score": 1.0, "parent_main": float(parent_main), "torch": float("torch" in sys.modules)}


_inside = {"now": 0, "most": 0}


def counts_callers(prompt, response, ground_truth, metadata):
    """In-process only: records how many calls run at once (``most_at_once``)."""
    _inside["now"] += 1
    _inside["most"] = max(_inside["most"], _inside["now"])
    time.sleep(0.02)
    _inside["now"] -= 1
    return 1.0


def most_at_once() -> int:
    return _inside["most"]


NOT_CALLABLE = 3

def slow_once(prompt, response, ground_truth, metadata):
    """Hangs on its first call for a sample (a marker file records it), answers on the next."""
    marker = metadata["marker"]
    if not os.path.exists(marker):
        open(marker, "w").close()
        time.sleep(60.0)
    return 1.0


def own_timeout(prompt, response, ground_truth, metadata):
    """Runs out of a time limit of its own, as a verifier does."""
    raise TimeoutError(f"verifier gave up on {response!r}")


class Prepared(str):
    """A ground truth as ``counted.prepare`` made it."""


_prepared = []


def counted(prompt, response, ground_truth, metadata):
    """In-process only: scores 1.0 when it gets the ground truth ``prepare`` made."""
    return 1.0 if isinstance(ground_truth, Prepared) else 0.0


def _prepare(ground_truth):
    _prepared.append(ground_truth)
    if ground_truth == "unparseable":
        raise ValueError(f"cannot parse the ground truth {ground_truth!r}")
    return Prepared(ground_truth)


counted.prepare = _prepare


def prepared_ground_truths() -> list[str]:
    return list(_prepared)


_BEHAVIOURS = {
    "good": good,
    "with_extras": with_extras,
    "raising": raising,
    "slow": slow,
    "returns_text": returns_text,
    "returns_nan": returns_nan,
    "dies": dies,
    "what_the_worker_imported": what_the_worker_imported,
    "math": math_reward,
    "exact_match": exact_match_reward,
    "slow_once": slow_once,
    "own_timeout": own_timeout,
}


def by_behaviour(prompt, response, ground_truth, metadata):
    return _BEHAVIOURS[metadata["behaviour"]](prompt, response, ground_truth, metadata)
