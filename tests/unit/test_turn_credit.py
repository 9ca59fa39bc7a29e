"""Per-turn credit (``objective.turn_credit='turn'``) on hand-built multi-turn trajectories,
against the formulas of docs/agentic.md written out in plain Python floats: each turn's
reward (the last turn takes what the trajectory reward leaves), its discounted return-to-go
summed term by term, and the estimator's baseline over the turns at the same position of
the prompt's other trajectories; every token of a turn (its environment tokens included)
gets that turn's value, and the token estimators give the environment's tokens nothing."""

from __future__ import annotations

import statistics

import pytest
import torch

from megatron_rl.algos import (
    InputError,
    ObjectiveConfigError,
    TurnLayout,
    compute_advantages,
    get_preset,
)
from megatron_rl.rollout.engine import RolloutSample
from megatron_rl.rollout.trajectory import turn_layout

# Per trajectory: group, model turns' lengths, the environment tokens after each turn, the
# environment's reward after each turn, and the trajectory reward R_i the trainer scored.
TRAJECTORIES = [
    (0, [3, 2], [2, 0], [0.5, 0.0], 1.5),
    (0, [2, 1, 2], [1, 3, 0], [0.25, -0.5, 0.0], 0.75),
    (0, [4], [0], [], 0.0),  # a single-turn sample: no environment, no turn rewards
    (1, [1, 2], [2, 0], [1.0, 0.0], 2.0),
    (1, [2, 2], [1, 0], [0.0, 0.0], -1.0),
    (1, [3, 1, 1], [1, 1, 0], [0.5, 0.5], 1.0),  # the environment gave no reward after its last turn
]


def _samples() -> list[RolloutSample]:
    samples = []
    for _, lengths, env, rewards, _ in TRAJECTORIES:
        generated, turns = [], []
        for n, m in zip(lengths, env):
            turns.append((len(generated), len(generated) + n))
            generated += [True] * n + [False] * m
        multi = len(lengths) > 1
        samples.append(RolloutSample(
            prompt_ids=[1, 2], output_ids=list(range(len(generated))),
            output_logprobs=torch.zeros(len(generated)), finish_reason="stop", weight_version=0,
            generated_mask=torch.tensor(generated) if multi else None,
            turns=turns if multi else None, turn_rewards=list(rewards) if multi else None,
        ))
    return samples


def _expected_returns(discount: float) -> list[list[float]]:
    """G_{i,k} = sum_{j >= k} discount^(j - k) r_{i,j}, term by term."""
    out = []
    for _, lengths, _, env, total in TRAJECTORIES:
        env = (list(env) + [0.0] * len(lengths))[:len(lengths)]
        r = env[:-1] + [total - sum(env[:-1])]
        out.append([sum(discount ** (j - k) * r[j] for j in range(k, len(r))) for k in range(len(r))])
    return out


def _expected_turn_values(name: str, discount: float, eps: float) -> list[list[float]]:
    returns = _expected_returns(discount)
    if name == "reinforce":
        return returns
    peers: dict[tuple[int, int], list[float]] = {}
    for (group, *_), g in zip(TRAJECTORIES, returns):
        for k, value in enumerate(g):
            peers.setdefault((group, k), []).append(value)
    values = []
    for (group, *_), g in zip(TRAJECTORIES, returns):
        row = []
        for k, value in enumerate(g):
            others = peers[(group, k)]
            if len(others) < 2:
                row.append(0.0)
            elif name == "rloo":
                row.append(value - (sum(others) - value) / (len(others) - 1))
            elif name == "dr_grpo":
                row.append(value - statistics.fmean(others))
            else:
                std = statistics.stdev(others)
                row.append(0.0 if std == 0 else (value - statistics.fmean(others)) / (std + eps))
        values.append(row)
    return values


def _inputs(samples: list[RolloutSample]) -> dict:
    lengths = [len(s.output_ids) for s in samples]
    return dict(
        rewards_S=torch.tensor([t[-1] for t in TRAJECTORIES], dtype=torch.float64),
        group_ids_S=torch.tensor([t[0] for t in TRAJECTORIES]),
        seq_ids_T=torch.repeat_interleave(torch.arange(len(samples)), torch.tensor(lengths)),
        loss_mask_T=torch.cat([s.loss_mask() for s in samples]), num_groups=2,
    )


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo", "reinforce"])
@pytest.mark.parametrize("discount", [1.0, 0.9, 0.25])
def test_each_turn_gets_its_discounted_return_compared_within_prompt_and_turn(name, discount):
    cfg = get_preset("grpo", advantage=name, turn_credit="turn", turn_discount=discount)
    samples = _samples()
    adv_T = compute_advantages(cfg, **_inputs(samples), turns=turn_layout(samples))
    expected = []
    for (_, lengths, env, _, _), row in zip(TRAJECTORIES, _expected_turn_values(name, discount, cfg.adv_std_eps)):
        for n, m, value in zip(lengths, env, row):
            expected += [value] * n + [0.0 if name == "reinforce" else value] * m
    assert adv_T.tolist() == pytest.approx(expected, rel=1e-12, abs=1e-12)


def test_with_single_turn_samples_per_turn_credit_is_the_trajectory_credit():
    samples = [s for s, t in zip(_samples(), TRAJECTORIES) if len(t[1]) == 1] * 4
    inputs = {"rewards_S": torch.tensor([0.0, 1.0, 3.0, 0.5], dtype=torch.float64),
              "group_ids_S": torch.tensor([0, 0, 1, 1]), "num_groups": 2,
              "seq_ids_T": torch.arange(4).repeat_interleave(4), "loss_mask_T": torch.ones(16, dtype=torch.bool)}
    for name in ("grpo", "rloo", "reinforce_pp"):  # (REINFORCE++'s KL enters per token, so without it)
        trajectory = compute_advantages(get_preset(name, kl_in_reward_coef=0.0), **inputs)
        per_turn = compute_advantages(get_preset(name, kl_in_reward_coef=0.0, turn_credit="turn", turn_discount=0.5),
                                      **inputs, turns=turn_layout(samples))
        assert torch.equal(trajectory, per_turn), name


def test_kl_in_the_reward_is_summed_per_turn_before_discounting():
    samples = _samples()
    inputs = _inputs(samples)
    gen = torch.Generator().manual_seed(0)
    T = inputs["seq_ids_T"].numel()
    old_T, ref_T = -torch.rand(T, generator=gen), -torch.rand(T, generator=gen)
    beta, discount = 0.1, 0.5
    cfg = get_preset("grpo", advantage="reinforce", turn_credit="turn", turn_discount=discount, kl_in_reward_coef=beta)
    adv_T = compute_advantages(cfg, **inputs, turns=turn_layout(samples), old_logprobs_T=old_T, ref_logprobs_T=ref_T)
    expected, t = [], 0
    for (_, lengths, env_tokens, env, total) in TRAJECTORIES:
        env = (list(env) + [0.0] * len(lengths))[:len(lengths)]
        r = env[:-1] + [total - sum(env[:-1])]
        for k, n in enumerate(lengths):  # the penalty of the turn's generated tokens joins its reward
            r[k] += sum(-beta * (float(old_T[t + j]) - float(ref_T[t + j])) for j in range(n))
            t += n + env_tokens[k]
        g = [sum(discount ** (j - k) * r[j] for j in range(k, len(r))) for k in range(len(r))]
        for n, m, value in zip(lengths, env_tokens, g):
            expected += [value] * n + [0.0] * m
    assert adv_T.tolist() == pytest.approx(expected, rel=1e-6, abs=1e-7)  # the penalty is float32


def test_bad_settings_and_layouts_name_the_culprit():
    with pytest.raises(ObjectiveConfigError, match="turn_discount"):
        get_preset("grpo", turn_credit="turn", turn_discount=0.0)
    with pytest.raises(ObjectiveConfigError, match="turn_credit"):
        get_preset("grpo", turn_credit="step")
    samples = _samples()
    cfg = get_preset("grpo", turn_credit="turn")
    with pytest.raises(InputError, match="turns"):
        compute_advantages(cfg, **_inputs(samples))
    good = turn_layout(samples)
    foreign = TurnLayout(good.turn_rewards_U, good.turn_seq_ids_U, good.turn_ids_T.roll(1))
    with pytest.raises(InputError, match="turn_ids_T names a turn of another sequence at token 0"):
        compute_advantages(cfg, **_inputs(samples), turns=foreign)
