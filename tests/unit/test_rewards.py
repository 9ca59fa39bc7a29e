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


def test_hung_reward_times_out_twice_and_pool_is_replaced(pool_scorer):
    starts = pool_scorer.pool_starts
    begin = time.monotonic()
    results = pool_scorer.score([_item("good"), _item("slow"), _item("good", "abc"), _item("good")])
    elapsed = time.monotonic() - begin
    assert results[1].error == f"TimeoutError: scoring took longer than reward.timeout_s={POOL_TIMEOUT_S}s (2 attempts)"
    assert results[1].timed_out and not any(r.timed_out for r in results[::2])
    assert [r.score for r in results] == [2.0, 0.0, 3.0, 2.0]
    assert 2 * POOL_TIMEOUT_S <= elapsed < 2 * POOL_TIMEOUT_S + 20
    assert pool_scorer.pool_starts == starts + 2  # one replacement per timeout
    assert pool_scorer.score([_item("good")])[0].score == 2.0


def test_a_timeout_is_tried_once_more_before_it_scores_the_error(pool_scorer, tmp_path):
    """A response that ran out of time once (a busy machine) is scored on its retry; one that
    runs out of a limit of its own twice is a timeout, never a wrong answer."""
    results = pool_scorer.score([_item("slow_once", marker=str(tmp_path / "m")), _item("own_timeout"),
                                 _item("good")])
    assert results[0] == RewardResult(score=1.0)
    assert results[1].timed_out and results[1].score == 0.0
    assert results[1].error == "TimeoutError: verifier gave up on '42' (2 attempts)"
    assert results[2] == RewardResult(score=2.0)


def test_a_ground_truth_is_prepared_once_per_prompt_and_its_failure_fails_its_responses():
    import reward_fixtures

    scorer = RewardScorer(RewardConfig(function=f"{FIXTURES}:counted", num_workers=0))
    items = [_item("x", ground_truth=truth) for truth in ("3", "4", "unparseable") for _ in range(4)]
    results = scorer.score(items)
    assert reward_fixtures.prepared_ground_truths() == ["3", "4", "unparseable"]
    assert results[:8] == [RewardResult(score=1.0)] * 8
    assert results[8:] == [RewardResult(score=0.0, error="ValueError: cannot parse the ground truth 'unparseable'")] * 4


def _slow_math_parse(monkeypatch, seconds):
    """math-verify's own parse, ``seconds`` slower (a loaded machine, a fresh parser); returns
    the texts it was asked to parse."""
    import math_verify.parser

    texts, real = [], math_verify.parser.extract_target_from_pred

    def slow(pred, *args, **kwargs):
        texts.append(pred)
        time.sleep(seconds)
        return real(pred, *args, **kwargs)

    monkeypatch.setattr(math_verify.parser, "extract_target_from_pred", slow)
    return texts


def test_math_parses_the_ground_truth_once_per_prompt_outside_the_responses_budget(monkeypatch):
    texts = _slow_math_parse(monkeypatch, 0.8)
    scorer = RewardScorer(RewardConfig(function="math", num_workers=0, timeout_s=1.4))
    items = [_item("x", response, "42") for response in ("\\boxed{42}", "\\boxed{41}", "42", "so 42")]
    assert [(r.score, r.error) for r in scorer.score(items)] == [(1.0, None), (0.0, None), (1.0, None), (1.0, None)]
    assert texts == ["$42$", "$42$", "$41$", "$42$", "$42$"]  # the ground truth once, then each answer


def test_a_math_verify_timeout_is_a_timeout_not_an_unparseable_ground_truth(monkeypatch):
    import megatron_rl.rewards.builtin as builtin

    _slow_math_parse(monkeypatch, 1.5)
    monkeypatch.setattr(builtin, "PARSE_TIMEOUT_S", 1)
    scorer = RewardScorer(RewardConfig(function="math", num_workers=0, timeout_s=30))
    (result,) = scorer.score([_item("x", "\\boxed{42}", "42")])
    assert result.timed_out and result.score == 0.0
    assert result.error == ("RewardTimeout: math-verify took longer than 1s to parse the ground truth '42' "
                            "(2 attempts)")


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


def test_a_steps_reward_metrics_count_errors_and_the_timeouts_among_them():
    import torch

    from megatron_rl.algos.section import ObjectiveConfig
    from megatron_rl.config import RunConfig
    from megatron_rl.rollout.engine import RolloutSample
    from megatron_rl.train.rollouts import RolloutSource, Round, _Drawn

    source = object.__new__(RolloutSource)  # what scoring a round needs of a rank's source
    source.cfg, source.objective, source.multiturn = RunConfig(), ObjectiveConfig(), None
    source.groups = type("Groups", (), {"dp_size": 1})()
    G = source.cfg.rollout.group_size
    samples = [RolloutSample(prompt_ids=[1], output_ids=[2, 3], output_logprobs=torch.zeros(2), finish_reason="stop",
                             weight_version=0) for _ in range(2 * G)]
    results = [RewardResult(score=1.0, extras={"has_answer": 1.0})] * (2 * G - 3)
    results += [RewardResult(score=0.0, error="ValueError: x"),
                RewardResult(score=0.0, error="TimeoutError: y (2 attempts)", timed_out=True),
                RewardResult(score=0.0, error="TimeoutError: z (2 attempts)", timed_out=True)]
    drawn = _Drawn()
    source._sort_round(drawn, Round(["p", "q"], samples), results)
    metrics = source._reward_extras(drawn.extras, drawn.errors, drawn.timeouts)
    assert float(metrics["reward/errors"]) == 3.0 and float(metrics["reward/timeouts"]) == 2.0


EIGHT_FRESH_WORKERS = """
from megatron_rl.rewards.config import RewardConfig
from megatron_rl.rewards.core import RewardInput
from megatron_rl.rewards.pool import RewardScorer

items = [RewardInput(f"add-{a}-{a + 1}", "q", f"so \\\\boxed{{{2 * a + 1}}}", str(2 * a + 1), {})
         for a in range(16) for _ in range(2)]
with RewardScorer(RewardConfig(function="math", num_workers=8)) as scorer:
    print([(r.score, r.error) for r in scorer.score(items)])
"""


def test_math_with_eight_fresh_workers_on_busy_cores_scores_every_correct_answer():
    """The README's ``reward.num_workers: 8`` while two other processes keep both cores busy:
    a fresh worker's first parse (math-verify builds its grammar: 0.4 s of CPU when quiet) ran
    past the 2 s parse limit and turned correct answers into "cannot parse the ground truth".
    In a process of its own: a fresh forkserver, as a trainer rank's pool has (stopping this
    process's would wait for the module's pool, whose workers hold it)."""
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        done = subprocess.run([sys.executable, "-c", EIGHT_FRESH_WORKERS], capture_output=True, text=True,
                              timeout=600)
    finally:
        for process in busy:
            process.kill()
            process.wait()
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str([(1.0, None)] * 32)
