"""Advantage estimators for outcome rewards on packed sequences.

Owns the group-relative estimators (GRPO, Dr. GRPO, RLOO), plain REINFORCE returns,
REINFORCE++ (token returns, global whitening) and REINFORCE++-baseline (group mean, then
global whitening), plus the k1 KL-in-reward penalty they can fold in. Every estimator is
registered in ``ADVANTAGE_ESTIMATORS`` and returns per-token advantages ``[T]``.

Conventions, chosen and documented once here:

* GRPO std: ``std_estimator='sample'`` (N - 1, what ``torch.std`` and verl/TRL/oat use)
  or ``'population'`` (N); the advantage is ``(R - mean) / (std + eps)``, eps 1e-6.
* A group of one has advantage 0 under every group-relative estimator (GRPO, Dr. GRPO,
  RLOO, REINFORCE++-baseline's mean subtraction): one sample carries no baseline. This
  differs from verl's GRPO, which gives such a group its raw reward.
* A group whose rewards are all equal has advantage 0 (also with eps = 0).
* Whitening (REINFORCE++) is over the kept tokens of the whole batch passed in, like verl's
  ``masked_whiten``: ``(x - mean) * rsqrt(var + eps)`` with the sample (N - 1) or
  population variance; fewer than 2 kept tokens give advantage 0. Compute advantages
  once on the whole rollout batch, before splitting it into micro-batches.
* Returns are undiscounted reward-to-go: ``R_i + sum_{s >= t} token_reward_s``; they
  need tokens of a sequence contiguous and in order (packed order).
* Tokens outside ``loss_mask_T`` get advantage 0 from the token-level estimators; the
  group estimators broadcast the sequence value to every token of the sequence.
* KL in the reward (``kl_in_reward_coef``, k1 at the sampling policy) enters the token
  estimators per token and the group estimators as the sequence total
  ``R_i + sum_t penalty_t`` before the baseline.

* Per-turn credit (``turn_credit='turn'``): the estimator runs on the turns of a
  ``TurnLayout`` as if they were sequences, with each turn's discounted return as its
  reward and (prompt, turn position) as its group (``algos.turn_credit``).

This module does not touch the policy loss; apart from the optional input check it never
synchronises with the host.

Shape legend: T tokens, S sequences, G groups.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, Protocol

import torch
from torch import Tensor

from ..registry import Registry
from .distill import with_distillation_T
from .kl import kl_reward_penalty_T
from .segments import segment_count, segment_first_index, segment_sum
from .turn_credit import (
    TurnLayout,
    check_turn_layout,
    discounted_returns_U,
    split_rewards_U,
    turn_groups_U,
)
from .validation import (
    InputError,
    check_shapes,
    finite_checks,
    id_checks,
    range_check,
    run_value_checks,
)


class AdvantageSettings(Protocol):
    """The objective fields the estimators read (``ObjectiveConfig`` has them all); a protocol
    so that this module does not import the config, which lists the estimators registered here."""

    advantage: str
    std_estimator: Literal["population", "sample"]
    adv_std_eps: float
    whiten_eps: float
    kl_in_reward_coef: float
    turn_credit: Literal["trajectory", "turn"]
    turn_discount: float
    check_inputs: bool
    rl_coef: float
    distill_coef: float
    distill_estimator: Literal["sampled", "topk"]


@dataclass(frozen=True)
class AdvantageBatch:
    """What an estimator sees. All tensors on one device."""

    rewards_S: Tensor
    """[S] float outcome reward per sequence."""
    group_ids_S: Tensor
    """[S] int64 group (prompt) id per sequence, in [0, num_groups)."""
    num_groups: int
    """Number of groups G."""
    seq_ids_T: Tensor
    """[T] int64 sequence id per token, tokens of a sequence contiguous and in order."""
    loss_mask_T: Tensor
    """[T] bool response-token mask."""
    token_rewards_T: Tensor | None
    """[T] float per-token reward (the k1 KL penalty) or None."""

    def total_rewards_S(self) -> Tensor:
        """[S] outcome reward plus the sequence's summed per-token rewards (kept tokens)."""
        if self.token_rewards_T is None:
            return self.rewards_S
        kept_T = torch.where(
            self.loss_mask_T, self.token_rewards_T, torch.zeros_like(self.token_rewards_T)
        )
        return self.rewards_S + segment_sum(kept_T, self.seq_ids_T, self.rewards_S.numel()).to(
            self.rewards_S.dtype
        )


AdvantageEstimator = Callable[[AdvantageBatch, AdvantageSettings], Tensor]
ADVANTAGE_ESTIMATORS: Registry[AdvantageEstimator] = Registry("advantage estimator")


def _group_mean_and_size(
    rewards_S: Tensor, group_ids_S: Tensor, num_groups: int
) -> tuple[Tensor, Tensor]:
    size_G = segment_count(torch.ones_like(group_ids_S, dtype=torch.bool), group_ids_S, num_groups)
    mean_G = segment_sum(rewards_S, group_ids_S, num_groups) / size_G.clamp(min=1).to(
        rewards_S.dtype
    )
    return mean_G, size_G


def grpo_advantages_S(
    rewards_S: Tensor,
    group_ids_S: Tensor,
    num_groups: int,
    *,
    std_estimator: str = "sample",
    eps: float = 1e-6,
) -> Tensor:
    """GRPO: ``(R - mean_g) / (std_g + eps)`` within each group.

    Args:
        rewards_S: [S] rewards.
        group_ids_S: [S] group ids in [0, num_groups).
        num_groups: G.
        std_estimator: 'sample' (N - 1) or 'population' (N).
        eps: added to the std.

    Returns:
        [S] advantages; 0 for a group of one and for a group of equal rewards.
    """
    mean_G, size_G = _group_mean_and_size(rewards_S, group_ids_S, num_groups)
    dev_S = rewards_S - mean_G[group_ids_S]
    sq_G = segment_sum(dev_S * dev_S, group_ids_S, num_groups)
    dof_G = size_G - 1 if std_estimator == "sample" else size_G
    std_G = (sq_G / dof_G.clamp(min=1).to(sq_G.dtype)).sqrt()
    std_S, size_S = std_G[group_ids_S], size_G[group_ids_S]
    # A zero std means a zero deviation; returning 0 there keeps eps = 0 free of 0/0.
    valid_S = (size_S > 1) & (std_S > 0)
    return torch.where(valid_S, dev_S / (std_S + eps), torch.zeros_like(dev_S))


def dr_grpo_advantages_S(rewards_S: Tensor, group_ids_S: Tensor, num_groups: int) -> Tensor:
    """Dr. GRPO: ``R - mean_g`` (no std division). [S] -> [S]; 0 for a group of one."""
    mean_G, _ = _group_mean_and_size(rewards_S, group_ids_S, num_groups)
    return rewards_S - mean_G[group_ids_S]


def rloo_advantages_S(rewards_S: Tensor, group_ids_S: Tensor, num_groups: int) -> Tensor:
    """RLOO: ``R_i - mean_{j != i} R_j = (n R_i - sum_g R) / (n - 1)``; 0 for a group of one."""
    sum_G = segment_sum(rewards_S, group_ids_S, num_groups)
    size_S = segment_count(torch.ones_like(group_ids_S, dtype=torch.bool), group_ids_S, num_groups)[
        group_ids_S
    ]
    n_S = size_S.to(rewards_S.dtype)
    loo_S = (n_S * rewards_S - sum_G[group_ids_S]) / (n_S - 1).clamp(min=1)
    return torch.where(size_S > 1, loo_S, torch.zeros_like(loo_S))


def token_returns_T(
    rewards_S: Tensor, seq_ids_T: Tensor, loss_mask_T: Tensor, token_rewards_T: Tensor | None = None
) -> Tensor:
    """Undiscounted reward-to-go per token: ``R_i + sum_{s >= t, s in i, kept} token_reward_s``.

    Args:
        rewards_S: [S] outcome rewards (credited at the end of each sequence).
        seq_ids_T: [T] sequence ids, tokens of a sequence contiguous and in order.
        loss_mask_T: [T] bool; masked tokens add no reward and get return 0.
        token_rewards_T: [T] per-token rewards (e.g. ``kl_reward_penalty_T``) or None.

    Returns:
        [T] returns in the dtype of ``rewards_S``.
    """
    returns_T = rewards_S[seq_ids_T]
    if token_rewards_T is not None:
        num_seqs = rewards_S.numel()
        # float64 prefix sums: a float32 cumsum over ~1M tokens loses the small per-token terms.
        x_T = torch.where(loss_mask_T, token_rewards_T, torch.zeros_like(token_rewards_T)).double()
        incl_T = torch.cumsum(x_T, 0)
        before_S = (incl_T - x_T)[
            segment_first_index(seq_ids_T, num_seqs).clamp(max=max(x_T.numel() - 1, 0))
        ]
        total_S = segment_sum(x_T, seq_ids_T, num_seqs)
        suffix_T = total_S[seq_ids_T] - (incl_T - x_T - before_S[seq_ids_T])
        returns_T = returns_T + suffix_T.to(returns_T.dtype)
    return torch.where(loss_mask_T, returns_T, torch.zeros_like(returns_T))


def masked_whiten_T(
    values_T: Tensor, mask_T: Tensor, *, std_estimator: str = "sample", eps: float = 1e-8
) -> Tensor:
    """Whitens ``values_T`` over the kept tokens: ``(x - mean) * rsqrt(var + eps)``.

    Args:
        values_T: [T] values.
        mask_T: [T] bool; statistics over these tokens, output 0 elsewhere.
        std_estimator: 'sample' (N - 1, as verl's ``masked_whiten``) or 'population' (N).
        eps: added to the variance.

    Returns:
        [T] whitened values; all 0 when fewer than 2 tokens are kept.
    """
    zeros_T = torch.zeros_like(values_T)
    n = mask_T.sum()
    kept_T = torch.where(mask_T, values_T, zeros_T)
    mean = kept_T.sum() / n.clamp(min=1).to(values_T.dtype)
    dev_T = torch.where(mask_T, values_T - mean, zeros_T)
    dof = n - 1 if std_estimator == "sample" else n
    var = (dev_T * dev_T).sum() / dof.clamp(min=1).to(values_T.dtype)
    return torch.where(mask_T & (n >= 2), dev_T * torch.rsqrt(var + eps), zeros_T)


@ADVANTAGE_ESTIMATORS.register("grpo")
def _grpo(batch: AdvantageBatch, cfg: AdvantageSettings) -> Tensor:
    adv_S = grpo_advantages_S(
        batch.total_rewards_S(),
        batch.group_ids_S,
        batch.num_groups,
        std_estimator=cfg.std_estimator,
        eps=cfg.adv_std_eps,
    )
    return adv_S[batch.seq_ids_T]


@ADVANTAGE_ESTIMATORS.register("dr_grpo")
def _dr_grpo(batch: AdvantageBatch, cfg: AdvantageSettings) -> Tensor:
    return dr_grpo_advantages_S(batch.total_rewards_S(), batch.group_ids_S, batch.num_groups)[
        batch.seq_ids_T
    ]


@ADVANTAGE_ESTIMATORS.register("rloo")
def _rloo(batch: AdvantageBatch, cfg: AdvantageSettings) -> Tensor:
    return rloo_advantages_S(batch.total_rewards_S(), batch.group_ids_S, batch.num_groups)[
        batch.seq_ids_T
    ]


@ADVANTAGE_ESTIMATORS.register("reinforce")
def _reinforce(batch: AdvantageBatch, cfg: AdvantageSettings) -> Tensor:
    return token_returns_T(
        batch.rewards_S, batch.seq_ids_T, batch.loss_mask_T, batch.token_rewards_T
    )


@ADVANTAGE_ESTIMATORS.register("reinforce_pp")
def _reinforce_pp(batch: AdvantageBatch, cfg: AdvantageSettings) -> Tensor:
    returns_T = token_returns_T(
        batch.rewards_S, batch.seq_ids_T, batch.loss_mask_T, batch.token_rewards_T
    )
    return masked_whiten_T(
        returns_T, batch.loss_mask_T, std_estimator=cfg.std_estimator, eps=cfg.whiten_eps
    )


@ADVANTAGE_ESTIMATORS.register("reinforce_pp_baseline")
def _reinforce_pp_baseline(batch: AdvantageBatch, cfg: AdvantageSettings) -> Tensor:
    centred_S = dr_grpo_advantages_S(batch.total_rewards_S(), batch.group_ids_S, batch.num_groups)
    return masked_whiten_T(
        centred_S[batch.seq_ids_T],
        batch.loss_mask_T,
        std_estimator=cfg.std_estimator,
        eps=cfg.whiten_eps,
    )


def compute_advantages(
    cfg: AdvantageSettings,
    *,
    rewards_S: Tensor,
    group_ids_S: Tensor,
    seq_ids_T: Tensor,
    loss_mask_T: Tensor,
    num_groups: int,
    old_logprobs_T: Tensor | None = None,
    ref_logprobs_T: Tensor | None = None,
    turns: TurnLayout | None = None,
    teacher_logprobs_T: Tensor | None = None,
) -> Tensor:
    """Per-token advantages with the estimator named by ``cfg.advantage``.

    Weighted by ``cfg.rl_coef``, plus the sampled distillation advantage (``algos.distill``).

    With ``cfg.turn_credit == 'turn'`` the estimator runs on the turns of ``turns`` instead
    of the sequences (``_per_turn``; formulas in ``algos.turn_credit``).

    With ``cfg.kl_in_reward_coef > 0`` the k1 penalty ``-beta (log pi_old - log pi_ref)`` is
    added per token (token estimators: into the reward-to-go; group estimators: summed
    into the sequence reward before the baseline).

    Args:
        cfg: objective configuration (advantage, std_estimator, eps, kl_in_reward_coef).
        rewards_S: [S] outcome rewards (soft overlong penalty already added if used).
        group_ids_S: [S] int64 group ids in [0, num_groups).
        seq_ids_T: [T] int64 sequence ids, tokens of a sequence contiguous and in order.
        loss_mask_T: [T] bool (or 0/1 integer) response mask.
        num_groups: G.
        old_logprobs_T: [T] needed for KL in the reward.
        ref_logprobs_T: [T] needed for KL in the reward.
        turns: the turns of each sequence; required by (and only read under) per-turn credit.
        teacher_logprobs_T: [T] teachers' log-probs (the sampled distillation estimator).

    Returns:
        [T] advantages, detached, in the dtype of ``rewards_S``.
    """
    estimator = ADVANTAGE_ESTIMATORS.get(cfg.advantage)
    use_kl = cfg.kl_in_reward_coef > 0
    if use_kl and (old_logprobs_T is None or ref_logprobs_T is None):
        raise InputError(
            "old_logprobs_T and ref_logprobs_T are required by "
            "ObjectiveConfig.kl_in_reward_coef > 0"
        )
    num_seqs = rewards_S.numel() if isinstance(rewards_S, Tensor) else 0
    if cfg.check_inputs:
        _check_advantage_inputs(
            rewards_S,
            group_ids_S,
            seq_ids_T,
            loss_mask_T,
            num_groups,
            num_seqs,
            old_logprobs_T if use_kl else None,
            ref_logprobs_T if use_kl else None,
        )
    per_turn = cfg.turn_credit == "turn"
    if per_turn and turns is None:
        raise InputError("turns (a TurnLayout) is required by ObjectiveConfig.turn_credit='turn'")
    if per_turn and cfg.check_inputs:
        check_turn_layout(turns, seq_ids_T, num_seqs)
    token_rewards_T = (
        kl_reward_penalty_T(old_logprobs_T, ref_logprobs_T, cfg.kl_in_reward_coef)
        if use_kl
        else None
    )
    batch = AdvantageBatch(
        rewards_S=rewards_S.detach(),
        group_ids_S=group_ids_S,
        num_groups=num_groups,
        seq_ids_T=seq_ids_T,
        loss_mask_T=loss_mask_T.bool(),
        token_rewards_T=token_rewards_T,
    )
    if per_turn:
        batch = _per_turn(batch, turns, cfg.turn_discount)
    return with_distillation_T(cfg, estimator(batch, cfg).detach(), teacher_logprobs_T, old_logprobs_T, loss_mask_T)


def _per_turn(batch: AdvantageBatch, turns: TurnLayout, discount: float) -> AdvantageBatch:
    """The batch whose "sequences" are the turns: reward G_{i,k} (the turn's discounted
    return-to-go, KL penalty summed per turn), group (prompt, turn position)."""
    num_seqs = batch.rewards_S.numel()
    rewards_U = split_rewards_U(batch.rewards_S, turns)
    if batch.token_rewards_T is not None:
        kept_T = torch.where(batch.loss_mask_T, batch.token_rewards_T, torch.zeros_like(batch.token_rewards_T))
        rewards_U = rewards_U + segment_sum(kept_T, turns.turn_ids_T, rewards_U.numel()).to(rewards_U.dtype)
    group_ids_U, num_turn_groups = turn_groups_U(batch.group_ids_S, turns, num_seqs)
    return AdvantageBatch(
        rewards_S=discounted_returns_U(rewards_U, turns.turn_seq_ids_U, num_seqs, discount),
        group_ids_S=group_ids_U,
        num_groups=num_turn_groups,
        seq_ids_T=turns.turn_ids_T,
        loss_mask_T=batch.loss_mask_T,
        token_rewards_T=None,
    )


def _check_advantage_inputs(
    rewards_S: Tensor,
    group_ids_S: Tensor,
    seq_ids_T: Tensor,
    loss_mask_T: Tensor,
    num_groups: int,
    num_seqs: int,
    old_logprobs_T: Tensor | None,
    ref_logprobs_T: Tensor | None,
) -> None:
    if isinstance(num_groups, bool) or not isinstance(num_groups, int) or num_groups < 1:
        raise InputError(f"num_groups must be a positive int, got {num_groups!r}")
    if num_seqs == 0:
        raise InputError("empty batch: rewards_S has no sequences")
    floating = ("rewards_S", "old_logprobs_T", "ref_logprobs_T")
    check_shapes(
        per_token={
            "seq_ids_T": seq_ids_T,
            "loss_mask_T": loss_mask_T,
            "old_logprobs_T": old_logprobs_T,
            "ref_logprobs_T": ref_logprobs_T,
        },
        per_seq={"rewards_S": rewards_S, "group_ids_S": group_ids_S},
        num_seqs=num_seqs,
        floating=floating,
    )
    checks = finite_checks(
        {"rewards_S": rewards_S, "old_logprobs_T": old_logprobs_T, "ref_logprobs_T": ref_logprobs_T}
    )
    checks += id_checks(seq_ids_T, num_seqs, {"loss_mask_T": loss_mask_T})
    checks.append(
        range_check(
            "group_ids_S",
            group_ids_S,
            (group_ids_S >= 0) & (group_ids_S < num_groups),
            f"has an id outside [0, {num_groups})",
        )
    )
    # Reward-to-go reads the packed order; ids must not go backwards.
    in_order_T = torch.ones_like(seq_ids_T, dtype=torch.bool)
    in_order_T[1:] = seq_ids_T[1:] >= seq_ids_T[:-1]
    checks.append(
        range_check("seq_ids_T", seq_ids_T, in_order_T, "decreases (tokens not in packed order)")
    )
    run_value_checks(checks)
