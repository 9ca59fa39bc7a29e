"""Bad input is rejected with an error naming the tensor or option; all-masked is defined."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_rl.algos import (
    OBJECTIVE_PRESETS,
    InputError,
    ObjectiveConfig,
    ObjectiveConfigError,
    TokenBatch,
    get_preset,
    policy_loss,
)
from megatron_rl.registry import UnknownNameError

F64 = torch.float64


def _batch(n: int = 12, num_seqs: int = 3) -> dict:
    gen = torch.Generator().manual_seed(0)
    logprobs = -torch.rand(n, generator=gen, dtype=F64) * 4
    return dict(
        logprobs_T=logprobs,
        old_logprobs_T=logprobs + 0.1 * torch.randn(n, generator=gen, dtype=F64),
        advantages_T=torch.randn(n, generator=gen, dtype=F64),
        loss_mask_T=torch.ones(n, dtype=torch.bool),
        seq_ids_T=torch.arange(n) * num_seqs // n,
        num_seqs=num_seqs,
    )


EXTRAS = ("rollout_logprobs_T", "ref_logprobs_T", "entropy_T", "rspo_gamma_T")


def _full_batch() -> dict:
    b = _batch()
    b.update({name: torch.full((12,), 0.5, dtype=F64) for name in EXTRAS})
    b["truncated_S"] = torch.tensor([False, True, False])
    return b


# ------------------------------------------------------------------------ tensors
@pytest.mark.parametrize("name", ["logprobs_T", "old_logprobs_T", "advantages_T", *EXTRAS])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_input_is_named_with_its_token(name, bad):
    b = _full_batch()
    b[name] = b[name].clone()
    b[name][7] = bad
    with pytest.raises(InputError, match=f"{name} contains NaN/inf at token 7"):
        policy_loss(get_preset("ppo"), TokenBatch(**b))


@pytest.mark.parametrize(
    "name", ["old_logprobs_T", "advantages_T", "loss_mask_T", "seq_ids_T", *EXTRAS]
)
def test_mismatched_length_is_named(name):
    b = _full_batch()
    b[name] = b[name][:-1]
    with pytest.raises(InputError, match=f"{name} has 11 tokens but logprobs_T has 12"):
        policy_loss(get_preset("ppo"), TokenBatch(**b))


def test_structural_errors_are_named():
    b = _batch()
    with pytest.raises(InputError, match="empty batch: logprobs_T has 0 tokens"):
        policy_loss(
            get_preset("ppo"),
            TokenBatch(**{k: (v[:0] if isinstance(v, torch.Tensor) else v) for k, v in b.items()}),
        )
    with pytest.raises(InputError, match="truncated_S has 2 entries but num_seqs=3"):
        policy_loss(get_preset("ppo"), TokenBatch(**b, truncated_S=torch.zeros(2, dtype=torch.bool)))
    with pytest.raises(InputError, match="seq_ids_T has an id outside \\[0, 3\\) at token 11"):
        policy_loss(get_preset("ppo"), TokenBatch(**{**b, "seq_ids_T": torch.tensor([0] * 11 + [3])}))
    with pytest.raises(InputError, match="seq_ids_T must have a bool or integer dtype"):
        policy_loss(get_preset("ppo"), TokenBatch(**{**b, "seq_ids_T": b["seq_ids_T"].double()}))
    with pytest.raises(InputError, match="loss_mask_T has a value other than 0/1 at token 4"):
        policy_loss(
            get_preset("ppo"),
            TokenBatch(**{**b, "loss_mask_T": torch.tensor([1, 1, 1, 1, 2] + [1] * 7)}),
        )
    with pytest.raises(InputError, match="advantages_T must be 1-D"):
        policy_loss(get_preset("ppo"), TokenBatch(**{**b, "advantages_T": b["advantages_T"].reshape(3, 4)}))
    with pytest.raises(InputError, match="num_seqs must be a positive int"):
        policy_loss(get_preset("ppo"), TokenBatch(**{**b, "num_seqs": 0}))
    with pytest.raises(InputError, match="rspo_gamma_T is outside \\(0, 1\\] at token 0"):
        policy_loss(get_preset("rspo"), TokenBatch(**b, rspo_gamma_T=torch.full((12,), 1.5, dtype=F64)))
    with pytest.raises(InputError, match="global_num_tokens is negative"):
        policy_loss(get_preset("ppo"), TokenBatch(**b), global_num_tokens=-3)


@pytest.mark.parametrize(
    "overrides,missing",
    [
        (dict(kl_coef=0.1), "ref_logprobs_T"),
        (dict(mismatch="tis"), "rollout_logprobs_T"),
        (dict(rspo_gamma_min=0.5), "rspo_gamma_T"),
        (dict(overlong_filter=True), "truncated_S"),
        (dict(entropy_top_rho=0.2), "entropy_T"),
        (dict(stapo_tau_p=0.002), "entropy_T"),
        (dict(entropy_coef=0.01), "entropy_T"),
    ],
)
def test_missing_configured_input_is_named(overrides, missing):
    with pytest.raises(InputError, match=f"{missing} is required"):
        policy_loss(get_preset("ppo", **overrides), TokenBatch(**_batch()))


def test_check_inputs_false_skips_value_checks():
    b = _batch()
    b["advantages_T"] = b["advantages_T"].clone()
    b["advantages_T"][0] = float("nan")
    loss, _ = policy_loss(get_preset("ppo", check_inputs=False), TokenBatch(**b))
    assert torch.isnan(loss)


# --------------------------------------------------------------------- all masked
@pytest.mark.parametrize("name", OBJECTIVE_PRESETS.names())
def test_all_masked_batch_gives_zero_loss_and_zero_gradient(name):
    b = _full_batch()
    b["loss_mask_T"] = torch.zeros(12, dtype=torch.bool)
    lp = b["logprobs_T"].clone().requires_grad_(True)
    loss, metrics = policy_loss(get_preset(name), TokenBatch(**{**b, "logprobs_T": lp}))
    (grad,) = torch.autograd.grad(loss, lp)
    assert loss.item() == 0.0 and (grad == 0).all()
    assert int(metrics["count/kept_tokens"]) == 0
    assert all(torch.isfinite(v).all() for v in metrics.values())


# ---------------------------------------------------------------------- config
@pytest.mark.parametrize(
    "overrides,field",
    [
        (dict(eps_low=-0.1), "eps_low"),
        (dict(eps_high=-0.1), "eps_high"),
        (dict(eps_low=1.5), "eps_low"),
        (dict(dual_clip_c=1.0), "dual_clip_c"),
        (dict(gate="soft", tau_pos=0.0), "tau_pos"),
        (dict(gate="soft", tau_neg=-1.0), "tau_neg"),
        (dict(entropy_top_rho=0.0), "entropy_top_rho"),
        (dict(entropy_top_rho=1.2), "entropy_top_rho"),
        (dict(stapo_tau_p=0.0), "stapo_tau_p"),
        (dict(stapo_q=0.0), "stapo_q"),
        (dict(rspo_gamma_min=1.5), "rspo_gamma_min"),
        (dict(mismatch="mis", mismatch_low=2.0, mismatch_high=1.0), "mismatch_high"),
        (dict(mismatch="tis", mismatch_low=-1.0), "mismatch_low"),
        (dict(kl_coef=-0.1), "kl_coef"),
        (dict(entropy_coef=-0.1), "entropy_coef"),
        (dict(eps_high_is=-1.0), "eps_high_is"),
        (dict(aggregation="constant_normalizer"), "max_len"),
        (dict(aggregation="constant_normalizer", max_len=0), "max_len"),
        (dict(max_len=100), "max_len"),
        (dict(ratio_unit="bogus"), "ratio_unit"),
        (dict(aggregation="mean"), "aggregation"),
        (dict(advantage="gae"), "advantage"),
        (dict(kl_estimator="k4"), "kl_estimator"),
        (dict(eps_high=float("nan")), "eps_high"),
        (
            dict(overlong_penalty_max_len=100, overlong_penalty_cache_len=100),
            "overlong_penalty_cache_len",
        ),
    ],
)
def test_invalid_hyperparameter_names_the_field(overrides, field):
    with pytest.raises(ObjectiveConfigError, match=field):
        get_preset("ppo", **overrides)


@pytest.mark.parametrize(
    "base,overrides,field",
    [
        ("gspo", dict(gate="cispo"), "gate"),
        ("gmpo", dict(gate="soft"), "gate"),
        ("rloo", dict(gate="clip"), "gate"),
        ("sapo", dict(dual_clip_c=3.0), "dual_clip_c"),
        ("gmpo", dict(dual_clip_c=3.0), "dual_clip_c"),
        ("ppo", dict(cispo_trust_region_mask=True), "cispo_trust_region_mask"),
        ("rloo", dict(rspo_gamma_min=0.5, rspo_apply="before_clip"), "rspo_apply"),
        ("ppo", dict(mismatch_high=3.0), "mismatch_high"),
        ("ppo", dict(mismatch_level="sequence"), "mismatch_level"),
    ],
)
def test_incompatible_combination_is_rejected(base, overrides, field):
    with pytest.raises(ObjectiveConfigError, match=field):
        get_preset(base, **overrides)


def test_config_is_frozen_and_revalidated_on_replace():
    cfg = get_preset("grpo")
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.eps_low = 0.3  # type: ignore[misc]
    with pytest.raises(ObjectiveConfigError, match="eps_low"):
        dataclasses.replace(cfg, eps_low=-1.0)
    assert ObjectiveConfig() == get_preset("ppo")


def test_unknown_preset_and_option_list_what_exists():
    with pytest.raises(UnknownNameError) as info:
        get_preset("ppo2")
    assert "unknown objective preset 'ppo2'" in str(info.value)
    for name in (
        "grpo",
        "dr_grpo",
        "dapo",
        "gspo",
        "gspo_token",
        "cispo",
        "gmpo",
        "sapo",
        "rspo",
        "entropy_8020",
        "stapo",
        "ppo",
        "rloo",
        "reinforce_pp",
    ):
        assert name in str(info.value)
    with pytest.raises(
        ObjectiveConfigError,
        match="unknown ObjectiveConfig option\\(s\\) \\['epsilon'\\]; available: .*eps_low",
    ):
        get_preset("ppo", epsilon=0.2)
