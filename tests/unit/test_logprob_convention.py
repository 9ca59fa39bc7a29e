"""Which policy the log-probs describe: the run's switch, its config rules, the temperatures every
pass scores at, and how the SGLang probe tells the two conventions apart.

``train.policy_temperature: sampling`` (the default) scores ``log_softmax(logits / T)`` at each
sample's temperature; ``one`` keeps the T = 1 objective. The probe's decision is pure arithmetic
over the same tokens' log-probs at T = 1 and T = 0.01 (``server_checks.convention_of``): raw ones
stay, scaled ones rise most of the way to 0, sure tokens and in-between rises decide nothing.
"""

from pathlib import Path

import pytest
import torch

from megatron_rl.config import load_config
from megatron_rl.config_loading import ConfigError
from megatron_rl.rollout.engine import RolloutSample
from megatron_rl.rollout.sglang.server_checks import convention_of
from megatron_rl.train.mismatch import sample_temperatures


def _sample(n: int, temperature: float) -> RolloutSample:
    return RolloutSample(prompt_ids=[1, 2], output_ids=list(range(n)), output_logprobs=torch.zeros(n),
                         finish_reason="stop", weight_version=0, temperature=temperature)


def test_every_token_is_scored_at_its_samples_temperature_unless_the_run_trains_t_one():
    samples = [_sample(3, 0.7), _sample(2, 1.3)]
    assert torch.equal(sample_temperatures(samples, "sampling"), torch.tensor([0.7, 0.7, 0.7, 1.3, 1.3]))
    assert sample_temperatures(samples, "one") is None


def test_greedy_rollouts_are_refused_for_the_sampled_policy_and_allowed_for_t_one():
    with pytest.raises(ConfigError, match=r"^rollout.temperature: 0 \(greedy\) draws from no distribution"):
        load_config(None, ["rollout.temperature=0"])
    assert load_config(None, ["rollout.temperature=0", "train.policy_temperature=one"]).rollout.temperature == 0
    with pytest.raises(ConfigError, match=r"train.policy_temperature"):
        load_config(None, ["train.policy_temperature=two"])


def test_distillation_at_a_temperature_other_than_one_needs_the_t_one_policy():
    """The distillation term compares untempered distributions; the sampled policy at T = 0.7 is not one."""
    demo = str(Path(__file__).resolve().parents[2] / "configs" / "demo_distill.yaml")
    with pytest.raises(ConfigError, match=r"^train.policy_temperature: distillation compares the untempered"):
        load_config(demo, ["rollout.temperature=0.7"])
    assert load_config(demo, ["rollout.temperature=0.7", "train.policy_temperature=one"]).rollout.temperature == 0.7
    assert load_config(demo, []).distill.teachers


def test_r3w_needs_an_engine_that_returns_gate_weights():
    with pytest.raises(ConfigError, match=r"^train.routing_replay: R3w replays the engine's gate weights"):
        load_config(None, ["train.routing_replay=R3w", "rollout.engine=sglang", "rollout.sglang.urls=[http://h:1]"])
    for engine in ("hf", "megatron"):
        assert load_config(None, ["train.routing_replay=R3w", f"rollout.engine={engine}"]).train.routing_replay == "R3w"


@pytest.mark.parametrize("at_one, cold, expected", [
    ([-1.2, -0.8, -2.0], [-0.01, -0.02, -0.3], "scaled"),   # most of the way to 0
    ([-1.2, -0.8, -2.0], [-1.2, -0.8, -2.0], "raw"),        # unchanged
    ([-1.2, -0.8, -2.0], [-1.19, -0.79, -2.01], "raw"),     # batch numerics
    ([-1.2, -0.8, -2.0], [-0.7, -0.5, -1.3], None),         # a third of the way: near-ties, cannot tell
    ([-0.001, -0.002], [0.0, 0.0], None),                   # sure tokens: the conventions agree
    ([], [], None),
])
def test_the_probe_tells_scaled_from_raw_and_says_when_it_cannot(at_one, cold, expected):
    assert convention_of(at_one, cold) == expected
