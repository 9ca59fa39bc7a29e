"""Multi-turn rollouts against environments, on one process with a scripted engine.

The engine answers from the prompt's text (a calculator call first, the boxed answer once a
tool response is in the prompt; a malformed call or a turn cut without its stop token for
the rows that ask for it) and returns log-probs and routes of the shapes a real engine
returns, recording the ``routes_from`` of each request. Shown:

- the built-in environments: the calculator's arithmetic, refusals and counts; feedback;
- a batch where one trajectory's environment raises, one hangs past the timeout, one
  answers malformed output, one model turn holds a malformed tool call and one is cut at
  the length limit: each ends with its reason, is printed with its sample id, and the
  healthy trajectory in the same batch finishes (with stitched routes and its counts);
- with ``errors_fatal`` the first fault stops the rollout with one line naming sample and cause;
- the http environment against a local server: a healthy session; HTTP 503 (retried, then
  given up), a dropped connection, a request past its timeout and a body that is not JSON
  each end one trajectory with a reason naming the URL and the cause.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from env_servers import MisbehavingEnvServer

from megatron_rl.config_loading import ConfigError
from megatron_rl.data.config import TokenizerConfig
from megatron_rl.data.prompts import PromptRecord
from megatron_rl.data.tokenizer import load_tokenizer
from megatron_rl.rollout.engine import RolloutSample, SamplingParams, check_routes_from
from megatron_rl.rollout.envs.base import ModelTurn
from megatron_rl.rollout.envs.builtin import (
    CalculatorEnv,
    CalculatorError,
    FeedbackEnv,
    evaluate_expression,
)
from megatron_rl.rollout.envs.config import EnvConfig, HttpEnvConfig
from megatron_rl.rollout.envs.load import check_env_config, env_factory
from megatron_rl.rollout.multiturn import (
    EnvironmentFailure,
    LonePeers,
    MultiTurnRollout,
    is_env_count,
    trajectory_stats,
)

ASSET = Path(__file__).resolve().parents[2] / "megatron_rl" / "assets" / "tiny_qwen3_moe"
CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "7 * 8 + 15"}}\n</tool_call>'
L, K = 4, 2


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(TokenizerConfig(), str(ASSET))


class ScriptedEngine:
    """Answers from the prompt's text (see the module docstring); records ``routes_from``."""

    weight_version = 5

    def __init__(self, tokenizer) -> None:
        self.tok = tokenizer
        self.requests: list[list[int]] = []

    def generate(self, prompts, params, *, return_routed_experts, seed, routes_from=None):
        starts = check_routes_from(prompts, routes_from)
        self.requests.append(starts)
        out = []
        for prompt, start in zip(prompts, starts):
            text = self.tok.hf_tokenizer.decode(prompt)
            stop = True
            if "<tool_response>" in text or "tool\n" in text:
                reply = "\\boxed{71}"
            elif "[badcall]" in text:
                reply = '<tool_call>\n{"name": "calculator", "arguments": {\n</tool_call>'
            elif "[cut]" in text:
                reply, stop = "12345", False
            else:
                reply = CALL
            ids = self.tok.encode_text(reply) + ([self.tok.stop_token_ids[0]] if stop else [])
            n = len(prompt) + len(ids) - 1 - start
            out.append(RolloutSample(prompt_ids=list(prompt), output_ids=ids, output_logprobs=torch.full((len(ids),), -0.5),
                                     finish_reason="stop" if stop else "length", weight_version=self.weight_version,
                                     routed_experts=torch.randint(0, 8, (n, L, K)) if return_routed_experts else None))
        return out


class FaultyEnv(CalculatorEnv):
    """The calculator, except for the rows whose id names a fault."""

    def reset(self, row):
        self.kind = row.sample_id
        if self.kind == "reset_raises":
            raise ConnectionError("sandbox unavailable")
        return super().reset(row)

    def step(self, turn: ModelTurn):
        if self.kind == "raise":
            raise RuntimeError("tool crashed")
        if self.kind == "hang":
            time.sleep(60)
        if self.kind == "malformed_output":
            return {"observation": "71"}
        return super().step(turn)


def _records(tokenizer, kinds: list[str]) -> list[PromptRecord]:
    return [PromptRecord(sample_id=kind, prompt=f"What is 7 * 8 + 15? [{kind}]",
                         prompt_ids=tuple(tokenizer.encode_prompt(f"What is 7 * 8 + 15? [{kind}]")),
                         ground_truth="71", metadata={}) for kind in kinds]


def _rollout(tokenizer, cfg: EnvConfig, make_env=None) -> tuple[MultiTurnRollout, ScriptedEngine]:
    engine = ScriptedEngine(tokenizer)
    return MultiTurnRollout(engine, tokenizer, cfg, make_env or FaultyEnv, LonePeers(), 512), engine


PARAMS = SamplingParams(max_new_tokens=32)


def test_calculator_and_feedback_environments():
    assert evaluate_expression("7 * 8 + 15") == 71 and evaluate_expression("-(3 - 5) ** 2 / 4") == -1.0
    for bad, why in (("__import__('os')", "Call is not allowed"), ("2 ** 100", "exponent 100"),
                     ("1 / 0", "division by zero"), ("7 *", "cannot parse")):
        with pytest.raises(CalculatorError, match=why):
            evaluate_expression(bad)
    env = CalculatorEnv()
    env.reset(PromptRecord(sample_id="x", prompt="q", prompt_ids=(1,), ground_truth="71", metadata={}))
    from megatron_rl.data.chat import ToolCall

    step = env.step(ModelTurn(1, "", (1,), (ToolCall("calculator", {"expression": "7*8+15"}),
                                            ToolCall("search", {}), ToolCall("calculator", {"expression": 3}))))
    assert [m["content"] for m in step.observation] == [
        "71", "error: unknown tool 'search'", "error: the argument 'expression' must be a string"]
    assert step.metrics == {"tool_calls": 3, "tool_errors": 2, "correct_tool_use": 1} and not step.done
    assert env.step(ModelTurn(2, "\\boxed{71}", (1,))).done
    feedback = FeedbackEnv(retry_penalty=-0.1)
    feedback.reset(PromptRecord(sample_id="x", prompt="q", prompt_ids=(1,), ground_truth="71", metadata={}))
    wrong = feedback.step(ModelTurn(1, "\\boxed{70}", (1,)))
    assert wrong.observation == [{"role": "user", "content": "Wrong, try again."}] and wrong.reward == -0.1
    assert feedback.step(ModelTurn(2, "so 71", (1,))).done


def test_each_fault_ends_only_its_trajectory_with_a_counted_reason(tokenizer, capsys):
    kinds = ["ok", "raise", "hang", "malformed_output", "badcall", "cut", "reset_raises"]
    rollout, engine = _rollout(tokenizer, EnvConfig(name="faulty", step_timeout_s=0.5, max_turns=3))
    started = time.monotonic()
    samples = rollout.run(_records(tokenizer, kinds), PARAMS, seed=1, return_routes=True)
    assert time.monotonic() - started < 30
    reasons = {kind: s.end_reason for kind, s in zip(kinds, samples)}
    assert reasons == {"ok": "done", "raise": "env_error", "hang": "env_timeout", "malformed_output": "env_error",
                       "badcall": "malformed_tool_call", "cut": "length", "reset_raises": "env_error"}
    err = capsys.readouterr().err
    for kind, cause in (("raise", "RuntimeError: tool crashed"), ("hang", "no answer within"),
                        ("malformed_output", "step returned dict, not an EnvStep"),
                        ("reset_raises", "ConnectionError: sandbox unavailable")):
        assert f"environment 'faulty' failed on sample {kind} " in err and cause in err, (kind, err)
    ok = samples[0]
    assert len(ok.turns) == 2 and ok.turn_rewards == [0.0, 0.0] and ok.meta["template_mismatch_at"] is None
    assert ok.meta["env_metrics"] == {"tool_calls": 1, "tool_errors": 0, "correct_tool_use": 1}
    n = len(ok.prompt_ids) + len(ok.output_ids)
    assert ok.routed_experts.shape == (n - 1, L, K)
    generated = ok.loss_mask()
    start, end = ok.turns[1]
    assert generated[: ok.turns[0][1]].all() and not generated[ok.turns[0][1]:start].any() and generated[start:].all()
    # Turn 2 asked only for positions turn 1 left uncovered.
    assert engine.requests[1][0] == len(ok.prompt_ids) + ok.turns[0][1] - 1
    stats = trajectory_stats(samples)
    assert stats["env/turns"] == [2, 1, 1, 1, 1, 1, 1] and stats["env/end/env_error"] == [0, 1, 0, 1, 0, 0, 1]
    assert stats["env/end/done"] == [1, 0, 0, 0, 0, 0, 0] and len(stats["env/end/max_turns"]) == 7
    assert stats["env/tool_calls"] == [1.0] and 0 < stats["env/masked_token_frac"][0] < 1


def test_errors_fatal_is_one_line_naming_sample_and_cause(tokenizer):
    rollout, _ = _rollout(tokenizer, EnvConfig(name="faulty", errors_fatal=True))
    with pytest.raises(EnvironmentFailure) as info:
        rollout.run(_records(tokenizer, ["ok", "raise"]), PARAMS, seed=1, return_routes=False)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("environment 'faulty' failed on sample raise (turn 1): RuntimeError: tool crashed")


def test_http_environment_faults_end_one_trajectory_each(tokenizer, capsys):
    kinds = ["ok", "5xx", "drop", "slow", "notjson"]
    with MisbehavingEnvServer(slow_s=3.0) as server:
        cfg = EnvConfig(name="http", step_timeout_s=20.0,
                        http=HttpEnvConfig(url=server.url, request_timeout_s=1.0, retries=1, backoff_s=0.05))
        check_env_config(cfg)
        rollout, _ = _rollout(tokenizer, cfg, env_factory(cfg))
        samples = rollout.run(_records(tokenizer, kinds), PARAMS, seed=1, return_routes=False)
        requests, url = server.requests, server.url
    reasons = {kind: s.end_reason for kind, s in zip(kinds, samples)}
    assert reasons == {"ok": "done", "5xx": "env_error", "drop": "env_error", "slow": "env_error",
                       "notjson": "env_error"}
    assert samples[0].turn_rewards == [0.0, 0.5] and samples[0].meta["env_metrics"] == {"tool_calls": 1}
    assert requests["step", "5xx"] == 2 and requests["step", "drop"] == 2  # one retry each
    assert all(requests["close", kind] == 1 for kind in kinds)
    err = capsys.readouterr().err
    assert f"{url}/step: HTTP 503 after 2 attempts" in err
    assert "ServerDisconnectedError" in err and "TimeoutError after 2 attempts" in err
    assert f"{url}/step: the answer is not JSON" in err


def test_bad_environment_configuration_is_named():
    for cfg, message in ((EnvConfig(name="no_such_module:Env"), "rollout.env.name: cannot import 'no_such_module'"),
                         (EnvConfig(name="calculator", args={"digits": 3}), "rollout.env.args: calculator does not"),
                         (EnvConfig(name="megatron_rl.rollout.envs.base:Environment"), "is abstract"),
                         (EnvConfig(name="json:dumps"), "is a function, not a class"),
                         (EnvConfig(name="nocolon"), "neither a built-in environment")):
        with pytest.raises(ConfigError, match=message):
            check_env_config(cfg)


def test_an_environment_count_is_a_mean_over_every_trajectory():
    """An environment that reports ``hits`` only on a hit: 1 of 16 trajectories hit, so
    ``env/hits`` is 1/16 (it was 1.0, the mean over the trajectories that reported it); the
    module's own statistics keep their own denominators."""
    from megatron_rl.train.rollouts import RolloutSource

    def trajectory(metrics, checked):
        sample = RolloutSample(prompt_ids=[1], output_ids=[2, 3, 4], output_logprobs=torch.zeros(3),
                               finish_reason="stop", weight_version=0, turns=[(0, 1), (2, 3)], end_reason="done",
                               generated_mask=torch.tensor([True, False, True]))
        sample.meta.update(turns=2, env_metrics=metrics, env_time_s=0.5, template_checked=checked,
                           template_mismatch_at=None)
        return sample

    samples = [trajectory({"hits": 1.0, "tool_calls": 2.0}, True)]
    samples += [trajectory({"tool_calls": 1.0}, i < 3) for i in range(15)]
    source = object.__new__(RolloutSource)  # what reducing a rank's statistics needs of it
    source.groups = type("Groups", (), {"dp_size": 1})()
    means = {name: float(value) for name, value in source.agreed_means(trajectory_stats(samples)).items()}
    assert means["env/hits"] == 1 / 16 and means["env/tool_calls"] == 17 / 16
    assert means["env/turns"] == 2.0 and means["env/end/done"] == 1.0 and means["env/time_s"] == 0.5
    # Each mean is reduced in float64 and logged as float32.
    assert means["env/template_mismatch_frac"] == 0.0 and means["env/masked_token_frac"] == float(torch.tensor(1 / 3))
    assert is_env_count("env/hits") and not any(is_env_count(n) for n in ("env/turns", "env/end/done", "reward/x"))
