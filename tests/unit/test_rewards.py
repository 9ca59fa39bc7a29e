"""The reward layer: built-ins, import-path resolution, error policy, timeouts, pool parity."""

import logging
import multiprocessing.forkserver
import subprocess
import sys
import threading
import time

import pytest

from megatron_rl.config_loading import ConfigError
from megatron_rl.rewards.builtin import (
    exact_match_reward,
    extract_final_answer,
    math_reward,
)
from megatron_rl.rewards.config import RewardConfig
from megatron_rl.rewards.core import (
    RewardError,
    RewardInput,
    RewardResult,
    check_reward_config,
    resolve_reward,
)
from megatron_rl.rewards.pool import RewardScorer

FIXTURES = "reward_fixtures"
POOL_TIMEOUT_S = 1.5

# (response, ground truth, score, has_answer)
MATH_CASES = [
    ("\\boxed{42}", "42", 1.0, 1.0),
    ("the answer is 42", "42", 1.0, 1.0),
    ("so we get 42.0", "42", 1.0, 1.0),
    ("41", "42", 0.0, 1.0),
    ("1/2", "\\frac{1}{2}", 1.0, 1.0),
    ("\\boxed{\\frac{1}{2}}", "0.5", 1.0, 1.0),
    ("First 3, then 7, so \\boxed{x^2+1}.", "x^2 + 1", 1.0, 1.0),
    ("\\boxed{1} was wrong; finally \\boxed{\\frac{3}{4}}", "3/4", 1.0, 1.0),
    ("Total: 1,234 apples", "1234", 1.0, 1.0),
    ("it drops to -5 degrees", "-5", 1.0, 1.0),
    ("42", "\\boxed{42}", 1.0, 1.0),
    ("I do not know.", "42", 0.0, 0.0),
]


def _item(behaviour, response="42", ground_truth="42", sample_id=None, **metadata):
    return RewardInput(
        sample_id=sample_id or f"sample-{behaviour}",
        prompt=[{"role": "user", "content": "What is 6 * 7?"}],
        response=response,
        ground_truth=ground_truth,
        metadata={"behaviour": behaviour, **metadata},
    )


@pytest.fixture(scope="module")
def pool_scorer():
    # A process has one forkserver, started by whoever needs it first with their preload: in
    # this test process that may be the gloo worlds' (torch, Megatron-Core), which a trainer
    # rank's pool never sees (a rank starts its own). Stopped so the pool starts its own.
    multiprocessing.forkserver._forkserver._stop()
    cfg = RewardConfig(function=f"{FIXTURES}:by_behaviour", num_workers=2, timeout_s=POOL_TIMEOUT_S)
    with RewardScorer(cfg) as scorer:
        yield scorer


@pytest.mark.parametrize("response, ground_truth, score, has_answer", MATH_CASES)
def test_math_reward_cases(response, ground_truth, score, has_answer):
    assert math_reward("", response, ground_truth, {}) == {"score": score, "has_answer": has_answer}


def test_math_answer_extraction():
    assert extract_final_answer("\\boxed{\\frac{1}{\\sqrt{2}}} and more") == "\\frac{1}{\\sqrt{2}}"
    assert extract_final_answer("unbalanced \\boxed{3} then \\boxed{4") == "3"
    assert extract_final_answer("from 3-5 we get 2") == "2"
    assert extract_final_answer("nothing here") is None


def test_math_reward_off_main_thread_runs_without_signal_timeouts():
    # math-verify's alarms only work in a main thread; off it the reward must still score.
    out = {}
    thread = threading.Thread(target=lambda: out.update(math_reward("", "\\boxed{0.5}", "1/2", {})))
    thread.start()
    thread.join()
    assert out == {"score": 1.0, "has_answer": 1.0}


def test_exact_match():
    assert exact_match_reward("", "  Paris\n", "Paris", {}) == 1.0
    assert exact_match_reward("", "paris", "Paris", {}) == 0.0
    scorer = RewardScorer(RewardConfig(function="exact_match", num_workers=0))
    results = scorer.score([_item("x", "a", "a"), _item("x", "a", "b")])
    assert [r.score for r in results] == [1.0, 0.0]


def test_resolve_builtins_and_import_paths():
    assert resolve_reward("math") is math_reward
    assert resolve_reward("exact_match") is exact_match_reward
    import reward_fixtures

    assert resolve_reward(f"{FIXTURES}:good") is reward_fixtures.good


@pytest.mark.parametrize(
    "function, problem",
    [
        ("no_such_package.rewards:fn", "cannot import module"),
        (f"{FIXTURES}:missing", "has no attribute"),
        (f"{FIXTURES}:wrong_signature", "must accept (prompt, response, ground_truth, metadata)"),
        (f"{FIXTURES}:NOT_CALLABLE", "not callable"),
        ("maths", "neither a built-in reward"),
        (f"{FIXTURES}:", "neither a built-in reward"),
    ],
)
def test_resolve_rejects_bad_functions(function, problem):
    with pytest.raises(ConfigError) as err:
        resolve_reward(function)
    assert str(err.value).startswith("reward.function: ")
    assert repr(function) in str(err.value) and problem in str(err.value)


@pytest.mark.parametrize(
    "change, key",
    [
        ({"num_workers": -1}, "reward.num_workers"),
        ({"timeout_s": 0.0}, "reward.timeout_s"),
        ({"error_score": float("nan")}, "reward.error_score"),
        ({"function": "x.y:z"}, "reward.function"),
    ],
)
def test_check_reward_config(change, key):
    check_reward_config(RewardConfig())
    with pytest.raises(ConfigError, match=f"^{key}: "):
        check_reward_config(RewardConfig(**change))


def test_raising_reward_is_an_error_result_with_its_sample_id(pool_scorer, caplog):
    items = [_item("good"), _item("raising", sample_id="row-17"), _item("good")]
    with caplog.at_level(logging.WARNING, logger="megatron_rl.rewards"):
        results = pool_scorer.score(items)
    assert [r.score for r in results] == [2.0, 0.0, 2.0]
    assert results[1].error == "ZeroDivisionError: cannot score '42'"
    assert results[0].error is None and results[2].error is None
    assert "row-17" in caplog.text and "1 of 3" in caplog.text


def test_error_score_and_fatal_errors():
    cfg = RewardConfig(function=f"{FIXTURES}:raising", num_workers=0, error_score=-1.0)
    assert RewardScorer(cfg).score([_item("raising")])[0].score == -1.0
    cfg = RewardConfig(function=f"{FIXTURES}:by_behaviour", num_workers=0, fatal_errors=True)
    fatal = RewardScorer(cfg)
    expected = r"'reward_fixtures:by_behaviour' .*'row-3': ZeroDivisionError"
    with pytest.raises(RewardError, match=expected):
        fatal.score([_item("good"), _item("raising", sample_id="row-3")])


def test_dict_extras_and_bad_return_values(pool_scorer):
    items = [_item("with_extras", "abcd"), _item("returns_text"), _item("returns_nan")]
    results = pool_scorer.score(items)
    assert results[0] == RewardResult(score=0.5, extras={"length": 4.0, "bonus": 0.25}, error=None)
    assert results[1].error.startswith("TypeError: reward must return a float or a dict")
    assert results[2].error == "ValueError: returned 'score' is nan"


def test_hung_reward_times_out_and_pool_is_replaced(pool_scorer):
    starts = pool_scorer.pool_starts
    begin = time.monotonic()
    results = pool_scorer.score([_item("good"), _item("slow"), _item("good", "abc"), _item("good")])
    elapsed = time.monotonic() - begin
    assert results[1].error.startswith("TimeoutError: scoring took longer than reward.timeout_s=")
    assert [r.score for r in results] == [2.0, 0.0, 3.0, 2.0]
    assert POOL_TIMEOUT_S <= elapsed < POOL_TIMEOUT_S + 15
    assert pool_scorer.pool_starts == starts + 1
    assert pool_scorer.score([_item("good")])[0].score == 2.0


def test_dead_worker_is_replaced(pool_scorer):
    results = pool_scorer.score([_item("dies"), _item("good"), _item("good", "abc")])
    assert results[0].error.startswith("BrokenProcessPool")
    assert [r.score for r in results[1:]] == [2.0, 3.0]


def test_workers_start_light_also_after_a_replacement(pool_scorer):
    """A worker imports the reward's module and the pool's, not its parent's main module: a
    trainer rank's is the entry point (torch, Megatron: seconds per worker, per replacement)."""
    pool_scorer.score([_item("dies")])  # the pool is replaced
    extras = [r.extras for r in pool_scorer.score([_item("what_the_worker_imported")] * 2)]
    assert extras == [{"parent_main": 0.0, "torch": 0.0}] * 2


def _parity_batch():
    items = [
        _item("math", response, truth, sample_id=f"m{i}")
        for i, (response, truth, *_) in enumerate(MATH_CASES)
    ]
    items += [_item("good", "x" * n, sample_id=f"g{n}") for n in range(12)]
    items += [_item("exact_match", "a", "a"), _item("with_extras", "abc"), _item("raising")]
    return items


def test_order_is_kept_and_in_process_matches_pool(pool_scorer):
    items = _parity_batch()
    pooled = pool_scorer.score(items)
    expected_math = [RewardResult(score=s, extras={"has_answer": h}) for _, _, s, h in MATH_CASES]
    assert pooled[: len(MATH_CASES)] == expected_math
    lengths = pooled[len(MATH_CASES) : len(MATH_CASES) + 12]
    assert [r.score for r in lengths] == [float(n) for n in range(12)]
    cfg = RewardConfig(function=f"{FIXTURES}:by_behaviour", num_workers=0, timeout_s=POOL_TIMEOUT_S)
    assert RewardScorer(cfg).score(items) == pooled


def test_callers_in_two_threads_are_scored_one_at_a_time():
    """The trainer's thread and the thread scoring a batch generated ahead share one scorer."""
    import reward_fixtures

    scorer = RewardScorer(RewardConfig(function=f"{FIXTURES}:counts_callers", num_workers=0))
    start, results = threading.Barrier(2), {}

    def caller(name):
        start.wait()
        results[name] = scorer.score([_item(name, response=name * (i + 1)) for i in range(5)])

    threads = [threading.Thread(target=caller, args=(name,)) for name in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert reward_fixtures.most_at_once() == 1
    assert results["a"] == results["b"] == [RewardResult(score=1.0)] * 5


def test_score_after_close_raises():
    scorer = RewardScorer(RewardConfig(function="exact_match", num_workers=1))
    scorer.close()
    scorer.close()
    with pytest.raises(RuntimeError, match="after close"):
        scorer.score([_item("x")])


def test_package_import_is_light():
    code = (
        "import sys, megatron_rl.rewards; "
        "heavy = [m for m in ('torch', 'megatron.core', 'sympy', 'math_verify') "
        "if m in sys.modules]; "
        "assert not heavy, heavy"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
