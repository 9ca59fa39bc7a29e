"""Named objective presets: each is an ``ObjectiveConfig`` with the paper's defaults.

Every preset is a function registered in ``OBJECTIVE_PRESETS``; ``get_preset(name,
**overrides)`` builds it and applies overrides, which is how pieces are combined (for
example ``get_preset("gspo", stapo_tau_p=0.002, rspo_gamma_min=0.8, mismatch="tis")``).
Values and their sources are in ``shared/reference/objectives.md``; where a paper does not
state a value, the docstring says which framework default stands in.

This module owns the names and defaults only; the math lives in ``algos.loss``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import fields, replace
from typing import Any

from ..registry import Registry
from .config import ObjectiveConfig, ObjectiveConfigError

OBJECTIVE_PRESETS: Registry[Callable[[], ObjectiveConfig]] = Registry("objective preset")


def get_preset(name: str, **overrides: Any) -> ObjectiveConfig:
    """Builds the preset ``name`` and applies ``overrides`` (ObjectiveConfig fields).

    Raises:
        UnknownNameError: no such preset; the message lists the available ones.
        ObjectiveConfigError: an override is not a field, or the result is invalid.
    """
    cfg = OBJECTIVE_PRESETS.get(name)()
    known = {f.name for f in fields(ObjectiveConfig)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ObjectiveConfigError(
            f"unknown ObjectiveConfig option(s) {unknown}; available: {', '.join(sorted(known))}"
        )
    return replace(cfg, **overrides)


@OBJECTIVE_PRESETS.register("ppo")
def ppo() -> ObjectiveConfig:
    """PPO clipped surrogate, eps = 0.2, token mean. PPO's GAE needs a critic, which this
    project does not train, so the preset pairs the surrogate with group advantages."""
    return ObjectiveConfig(
        ratio_unit="token",
        gate="clip",
        eps_low=0.2,
        eps_high=0.2,
        aggregation="token_mean",
        advantage="grpo",
    )


@OBJECTIVE_PRESETS.register("grpo")
def grpo() -> ObjectiveConfig:
    """GRPO (DeepSeekMath): seq-mean-token-mean, k3 KL loss beta = 0.04, sample std + 1e-6.
    The paper gives no eps; 0.2 as verl/oat."""
    return ObjectiveConfig(
        ratio_unit="token",
        gate="clip",
        eps_low=0.2,
        eps_high=0.2,
        aggregation="seq_mean_token_mean",
        kl_estimator="k3",
        kl_coef=0.04,
        advantage="grpo",
        std_estimator="sample",
        adv_std_eps=1e-6,
    )


@OBJECTIVE_PRESETS.register("dr_grpo")
def dr_grpo() -> ObjectiveConfig:
    """Dr. GRPO: R - mean advantages, per-sequence sum / L_max = 3000 (oat), eps = 0.2, no KL."""
    return ObjectiveConfig(
        ratio_unit="token",
        gate="clip",
        eps_low=0.2,
        eps_high=0.2,
        aggregation="constant_normalizer",
        max_len=3000,
        advantage="dr_grpo",
    )


@OBJECTIVE_PRESETS.register("dapo")
def dapo() -> ObjectiveConfig:
    """DAPO: clip-higher (0.2, 0.28), token mean, dynamic sampling, soft overlong punishment
    (L_max 20480, L_cache 4096). Overlong filtering off: the best run did not use it."""
    return ObjectiveConfig(
        ratio_unit="token",
        gate="clip",
        eps_low=0.2,
        eps_high=0.28,
        aggregation="token_mean",
        advantage="grpo",
        dynamic_sampling=True,
        overlong_penalty_max_len=20480,
        overlong_penalty_cache_len=4096,
    )


@OBJECTIVE_PRESETS.register("gspo")
def gspo() -> ObjectiveConfig:
    """GSPO: sequence ratio exp(mean log r), sequence clip (1 - 3e-4, 1 + 4e-4), 1/G sum_i."""
    return ObjectiveConfig(
        ratio_unit="sequence",
        gate="clip",
        eps_low=3e-4,
        eps_high=4e-4,
        aggregation="seq_mean_token_mean",
        advantage="grpo",
    )


@OBJECTIVE_PRESETS.register("gspo_token")
def gspo_token() -> ObjectiveConfig:
    """GSPO-token: sg[s_i] * pi / sg[pi], clip and aggregation as GSPO; token advantages allowed."""
    return replace(gspo(), ratio_unit="sequence_token")


@OBJECTIVE_PRESETS.register("cispo")
def cispo() -> ObjectiveConfig:
    """CISPO (MiniMax-M1): sg(clip(r, -, 1 + eps_high_is)) * A * log pi, no lower bound, token
    mean, dynamic sampling. eps_high_is is unpublished; 0.2 as verl's example."""
    return ObjectiveConfig(
        ratio_unit="token",
        gate="cispo",
        eps_low_is=None,
        eps_high_is=0.2,
        aggregation="token_mean",
        advantage="grpo",
        dynamic_sampling=True,
    )


@OBJECTIVE_PRESETS.register("gmpo")
def gmpo() -> ObjectiveConfig:
    """GMPO: geometric-mean sequence ratio, per-token log-space clip [-0.4, 0.4], 1/G sum_i."""
    return ObjectiveConfig(
        ratio_unit="geometric",
        gate="clip",
        eps_low=0.4,
        eps_high=0.4,
        aggregation="seq_mean_token_mean",
        advantage="grpo",
    )


@OBJECTIVE_PRESETS.register("rspo")
def rspo() -> ObjectiveConfig:
    """RSPO (GMPO + router shift): gamma inside the geometric mean after the token clip.
    gamma_min is unpublished; 0.8 is objectives.md's illustrative floor (§19.13)."""
    return replace(gmpo(), rspo_gamma_min=0.8, rspo_apply="after_clip")


@OBJECTIVE_PRESETS.register("sapo")
def sapo() -> ObjectiveConfig:
    """SAPO: soft gate sigma(tau (r - 1)) 4 / tau, tau_pos 1.0, tau_neg 1.05, seq-mean-tok-mean."""
    return ObjectiveConfig(
        ratio_unit="token",
        gate="soft",
        tau_pos=1.0,
        tau_neg=1.05,
        aggregation="seq_mean_token_mean",
        advantage="grpo",
    )


@OBJECTIVE_PRESETS.register("entropy_8020")
def entropy_8020() -> ObjectiveConfig:
    """Beyond the 80/20 rule: DAPO, gradient only on the top 20 % entropy tokens of the batch,
    token mean over the kept tokens (official code)."""
    return replace(dapo(), entropy_top_rho=0.2)


@OBJECTIVE_PRESETS.register("stapo")
def stapo() -> ObjectiveConfig:
    """STAPO: S2T mask tau_p = 0.002, q = 0.75, clip [0.8, 1.28], token mean over unmasked
    tokens, no KL, dynamic sampling off."""
    return ObjectiveConfig(
        ratio_unit="token",
        gate="clip",
        eps_low=0.2,
        eps_high=0.28,
        aggregation="token_mean",
        advantage="grpo",
        stapo_tau_p=0.002,
        stapo_q=0.75,
    )


@OBJECTIVE_PRESETS.register("rloo")
def rloo() -> ObjectiveConfig:
    """RLOO: REINFORCE on whole sequences (sum of token log-probs, mean over samples) with the
    leave-one-out baseline and k1 KL in the reward, beta = 0.03."""
    return ObjectiveConfig(
        ratio_unit="none",
        gate="none",
        aggregation="seq_mean_token_sum",
        advantage="rloo",
        kl_in_reward_coef=0.03,
    )


@OBJECTIVE_PRESETS.register("reinforce_pp")
def reinforce_pp() -> ObjectiveConfig:
    """REINFORCE++: token reward-to-go with k1 KL in the reward, global whitening, PPO clip 0.2,
    token mean. beta is not in our references; 0.01 as OpenRLHF's init_kl_coef."""
    return ObjectiveConfig(
        ratio_unit="token",
        gate="clip",
        eps_low=0.2,
        eps_high=0.2,
        aggregation="token_mean",
        advantage="reinforce_pp",
        kl_in_reward_coef=0.01,
    )
