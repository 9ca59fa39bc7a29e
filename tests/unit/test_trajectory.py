"""Multi-turn trajectories as the trainer sees them: token ids end to end, the loss mask is
exactly the generated tokens, routes are stitched per position, and every objective,
aggregation and filter of the library counts only what the policy generated.

The trajectories are built by hand with :class:`TrajectoryBuilder` (prompt, a model turn,
an environment observation, another model turn), so the expected mask is known position by
position. The objective checks compare each preset (and combinations of pieces) on the
trajectories against the same call with every per-token input at the environment's tokens
replaced by other values: the loss, its gradient and the kept mask must not change at all
(exact equality: a masked token contributes an exact zero), and the environment tokens'
gradient must be zero. A per-sequence reference written out by hand checks that
seq-mean-token-mean divides by generated tokens only.
"""

from __future__ import annotations

import pytest
import torch

from megatron_rl.algos import (
    TokenBatch,
    build_loss_mask,
    compute_advantages,
    get_preset,
    policy_loss,
)
from megatron_rl.algos.presets import OBJECTIVE_PRESETS
from megatron_rl.algos.segments import seq_ids_from_cu_seqlens
from megatron_rl.rollout.engine import RolloutSample
from megatron_rl.rollout.trajectory import (
    TrajectoryBuilder,
    TrajectoryError,
    turn_of_positions,
)

L, K = 3, 2


def _turn(prompt: list[int], output: list[int], start: int, seed: int) -> RolloutSample:
    gen = torch.Generator().manual_seed(seed)
    n = len(prompt) + len(output) - 1 - start
    return RolloutSample(prompt_ids=list(prompt), output_ids=list(output),
                         output_logprobs=-torch.rand(len(output), generator=gen), finish_reason="stop",
                         weight_version=3, routed_experts=torch.randint(0, 8, (n, L, K), generator=gen))


def _trajectory(prompt: list[int], turns: list[list[int]], observations: list[list[int]], seed: int) -> tuple:
    """A finished trajectory and the routes each turn returned."""
    b = TrajectoryBuilder(prompt)
    returned = []
    for k, output in enumerate(turns):
        start = b.routes_covered
        sample = _turn(b.ids, output, start, seed + k)
        returned.append(sample.routed_experts)
        b.add_turn(sample, start, with_routes=True)
        if k < len(observations):
            b.add_observation(observations[k], reward=0.25 * (k + 1))
        else:
            b.add_final_reward(0.0)
    b.end("done")
    return b.sample(with_routes=True), returned


def test_mask_logprobs_routes_and_turns_of_a_hand_built_trajectory():
    sample, returned = _trajectory([1, 2, 3], [[10, 11, 2], [12, 2]], [[7, 8, 9, 4]], seed=0)
    assert sample.prompt_ids == [1, 2, 3]
    assert sample.output_ids == [10, 11, 2, 7, 8, 9, 4, 12, 2]
    assert sample.loss_mask().tolist() == [True, True, True, False, False, False, False, True, True]
    lp = sample.output_logprobs
    assert torch.isnan(lp[3:7]).all() and not torch.isnan(lp[[0, 1, 2, 7, 8]]).any()
    assert sample.turns == [(0, 3), (7, 9)] and sample.turn_rewards == [0.25, 0.0]
    assert sample.end_reason == "done" and sample.finish_reason == "stop" and sample.weight_version == 3
    # Turn 1 computed positions 0..4 (the prompt and its first two decode steps); turn 2 the
    # last generated token of turn 1, the four environment tokens and its own first token.
    assert [r.shape[0] for r in returned] == [5, 6]
    assert torch.equal(sample.routed_experts, torch.cat(returned))
    assert sample.routed_experts.shape == (len(sample.prompt_ids) + len(sample.output_ids) - 1, L, K)
    assert turn_of_positions(3, sample.turns, 11).tolist() == [1] * 5 + [2] * 6


def test_a_single_turn_sample_is_the_special_case():
    one = RolloutSample(prompt_ids=[1, 2], output_ids=[5, 6, 2], output_logprobs=torch.zeros(3),
                        finish_reason="stop", weight_version=0)
    assert one.loss_mask().tolist() == [True, True, True] and one.turns is None and one.end_reason is None


def test_a_turn_that_does_not_continue_the_trajectory_is_refused():
    b = TrajectoryBuilder([1, 2, 3])
    with pytest.raises(TrajectoryError, match="turn 1: the engine answered another prompt"):
        b.add_turn(_turn([1, 2], [5], 0, 0), 0, with_routes=True)
    with pytest.raises(TrajectoryError, match=r"turn 1: routes were asked from position 2"):
        b.add_turn(_turn([1, 2, 3], [5, 2], 2, 0), 2, with_routes=True)
    b = TrajectoryBuilder([1, 2, 3])
    bad = _turn([1, 2, 3], [5, 2], 0, 0)
    bad.routed_experts = bad.routed_experts[1:]
    with pytest.raises(TrajectoryError, match=r"turn 1: .* expected \[4, L, K\] \(positions 0\.\.3\)"):
        b.add_turn(bad, 0, with_routes=True)
    b = TrajectoryBuilder([1, 2, 3])
    b.add_turn(_turn([1, 2, 3], [5, 2], 0, 0), 0, with_routes=True)
    b.add_observation([7, 8], reward=0.0)
    with pytest.raises(TrajectoryError, match="must end with a model turn"):
        b.sample(with_routes=True)


def _batch(samples: list[RolloutSample], seed: int) -> tuple[TokenBatch, torch.Tensor]:
    """A TokenBatch over the trajectories' output tokens with random inputs, and the group rewards."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([len(s.output_ids) for s in samples])
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    T = int(cu[-1])
    mask_T = torch.cat([s.loss_mask() for s in samples])
    old = -torch.rand(T, generator=gen, dtype=torch.float64) * 3
    batch = TokenBatch(
        logprobs_T=(old + 0.3 * torch.randn(T, generator=gen, dtype=torch.float64)).clamp(max=-1e-3),
        old_logprobs_T=old, advantages_T=torch.randn(T, generator=gen, dtype=torch.float64),
        loss_mask_T=mask_T, seq_ids_T=seq_ids_from_cu_seqlens(cu), num_seqs=len(samples),
        rollout_logprobs_T=old + 0.1 * torch.randn(T, generator=gen, dtype=torch.float64),
        ref_logprobs_T=old + 0.2 * torch.randn(T, generator=gen, dtype=torch.float64),
        entropy_T=torch.rand(T, generator=gen, dtype=torch.float64) * 2,
        rspo_gamma_T=torch.rand(T, generator=gen, dtype=torch.float64) * 0.9 + 0.1,
        truncated_S=torch.tensor([False, True, False, False]),
    )
    return batch, torch.tensor([1.0, 0.0, 1.0, 0.5], dtype=torch.float64)


def _trajectories() -> list[RolloutSample]:
    return [
        _trajectory([1, 2, 3], [[10, 11, 12, 2], [13, 2]], [[7, 8, 9]], seed=0)[0],
        _trajectory([1, 2], [[10, 2], [11, 12, 2], [14, 2]], [[7, 8], [9, 9, 9, 9]], seed=10)[0],
        _trajectory([4, 5, 6], [[20, 21, 22, 23, 2]], [], seed=20)[0],
        _trajectory([4], [[30, 2], [31, 2]], [[7, 7, 7, 7, 7, 7]], seed=30)[0],
    ]


def _env_scrambled(batch: TokenBatch, seed: int) -> TokenBatch:
    """``batch`` with every float input replaced by other values at the environment's tokens."""
    gen = torch.Generator().manual_seed(seed)
    env_T = ~batch.loss_mask_T

    def scramble(t: torch.Tensor, low: float, high: float) -> torch.Tensor:
        other = torch.rand(t.shape, generator=gen, dtype=t.dtype) * (high - low) + low
        return torch.where(env_T, other, t)

    return TokenBatch(
        logprobs_T=scramble(batch.logprobs_T, -9.0, -0.01), old_logprobs_T=scramble(batch.old_logprobs_T, -9.0, -0.01),
        advantages_T=scramble(batch.advantages_T, -5.0, 5.0), loss_mask_T=batch.loss_mask_T,
        seq_ids_T=batch.seq_ids_T, num_seqs=batch.num_seqs,
        rollout_logprobs_T=scramble(batch.rollout_logprobs_T, -9.0, -0.01),
        ref_logprobs_T=scramble(batch.ref_logprobs_T, -9.0, -0.01), entropy_T=scramble(batch.entropy_T, 0.0, 50.0),
        rspo_gamma_T=scramble(batch.rspo_gamma_T, 0.01, 1.0), truncated_S=batch.truncated_S,
    )


CONFIGS = {name: {} for name in OBJECTIVE_PRESETS.names()} | {
    "gspo+stapo+rspo+tis": {"base": "gspo", "stapo_tau_p": 0.9, "rspo_gamma_min": 0.3, "mismatch": "tis"},
    "grpo+8020+seq-mis": {"base": "grpo", "entropy_top_rho": 0.5, "mismatch": "mis", "mismatch_level": "sequence"},
    "dapo+overlong+entropy": {"base": "dapo", "overlong_filter": True, "entropy_coef": 0.01},
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_environment_tokens_change_no_loss_gradient_or_kept_token(name):
    overrides = dict(CONFIGS[name])
    cfg = get_preset(overrides.pop("base", name), **overrides)
    samples = _trajectories()
    batch, _ = _batch(samples, seed=1)
    results = []
    for b in (batch, _env_scrambled(batch, seed=2)):
        logprobs = b.logprobs_T.clone().requires_grad_(True)
        b = TokenBatch(**{**{f: getattr(b, f) for f in b.__dataclass_fields__}, "logprobs_T": logprobs})
        kept_T, _ = build_loss_mask(cfg, b)
        loss, _ = policy_loss(cfg, b)
        loss.backward()
        results.append((loss.detach(), logprobs.grad, kept_T))
    (loss_a, grad_a, kept_a), (loss_b, grad_b, kept_b) = results
    env_T = ~batch.loss_mask_T
    assert not bool(kept_a[env_T].any()), "an environment token was kept"
    assert torch.equal(kept_a, kept_b)
    assert torch.equal(loss_a, loss_b), (float(loss_a), float(loss_b))
    assert torch.equal(grad_a, grad_b)
    assert bool((grad_a[env_T] == 0).all())


def test_seq_mean_token_mean_divides_by_generated_tokens_only():
    cfg = get_preset("grpo", kl_coef=0.0)
    samples = _trajectories()
    batch, _ = _batch(samples, seed=3)
    loss, _ = policy_loss(cfg, batch)
    ratio = (batch.logprobs_T - batch.old_logprobs_T).exp()
    clipped = ratio.clamp(1 - cfg.eps_low, 1 + cfg.eps_high)
    per_token = -torch.minimum(ratio * batch.advantages_T, clipped * batch.advantages_T)
    expected, start = 0.0, 0
    for s in samples:
        n = len(s.output_ids)
        mask = s.loss_mask()
        expected += float(per_token[start:start + n][mask].sum()) / int(mask.sum())
        start += n
    assert loss.item() == pytest.approx(expected / len(samples), rel=1e-12)


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_kl", "rloo_baseline"])
def test_advantages_over_trajectories_depend_on_generated_tokens_only(name):
    cfg = {"reinforce_pp_kl": get_preset("reinforce_pp", kl_in_reward_coef=0.1),
           "rloo_baseline": get_preset("rloo", advantage="reinforce_pp_baseline")}.get(name) or get_preset(name)
    samples = _trajectories()
    batch, rewards_S = _batch(samples, seed=4)
    scrambled = _env_scrambled(batch, seed=5)
    gen_T, env_T = batch.loss_mask_T, ~batch.loss_mask_T
    out = [compute_advantages(cfg, rewards_S=rewards_S, group_ids_S=torch.tensor([0, 0, 1, 1]),
                              seq_ids_T=b.seq_ids_T, loss_mask_T=b.loss_mask_T, num_groups=2,
                              old_logprobs_T=b.old_logprobs_T, ref_logprobs_T=b.ref_logprobs_T)
           for b in (batch, scrambled)]
    assert torch.equal(out[0][gen_T], out[1][gen_T])
    if cfg.advantage.startswith("reinforce"):
        assert bool((out[0][env_T] == 0).all())  # token estimators give masked tokens nothing
        assert float(out[0][gen_T].mean().abs()) < 1e-12  # whitened over the generated tokens only
