"""Per-turn credit assignment for multi-turn trajectories (``ObjectiveConfig.turn_credit='turn'``).

Owns :class:`TurnLayout` (which turn each token belongs to, and each turn's reward), the
per-turn rewards and their discounted returns-to-go, and the "unit" view the advantage
estimators then run on: every model turn becomes one unit, grouped with the turns at the
same position of the other trajectories of its prompt. ``advantages.compute_advantages``
dispatches here; this module runs no estimator itself.

The formulas (docs/agentic.md, "Per-turn credit"): trajectory i of prompt g has turns
k = 1..K_i with environment rewards e_{i,k}. Its reward R_i (the trajectory reward the
trainer scores today: reward function, environment rewards, shaping) is split over its turns
so that nothing is lost or counted twice:

    r_{i,k} = e_{i,k} for k < K_i,    r_{i,K_i} = R_i - sum_{k < K_i} e_{i,k}

(plus, with KL in the reward, the k1 penalty summed over the turn's generated tokens). The
return of turn k is the discounted reward-to-go (GiGPO's step-level return, Feng et al.
2025, arXiv:2505.10978, section 4.2):

    G_{i,k} = sum_{j = k..K_i} gamma^(j - k) r_{i,j}

so with gamma = 1 the first turn's return is R_i. The estimator then compares G_{i,k} with
the returns of turn k of the group's other trajectories (group (g, k); MT-GRPO's per-turn
group normalisation, Zeng et al. 2025, arXiv:2505.11821) and gives the result to every token
of turn k (the environment's tokens after a turn belong to it and stay masked by the loss).

Shape legend: T tokens, S sequences (trajectories), U turns of all trajectories (units).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .segments import segment_count, segment_first_index, segment_sum
from .validation import InputError, range_check, run_value_checks


@dataclass(frozen=True)
class TurnLayout:
    """The turns of a packed batch of trajectories (a single-turn sample is one turn)."""

    turn_rewards_U: Tensor
    """[U] float reward the environment gave after each turn (e_{i,k}; the last turn's is
    replaced by what the trajectory reward leaves, see the module docstring)."""
    turn_seq_ids_U: Tensor
    """[U] int64 trajectory of each turn; turns of a trajectory contiguous and in order."""
    turn_ids_T: Tensor
    """[T] int64 turn of each token in [0, U): a turn's generated tokens and the environment
    tokens written after it; nondecreasing, and ``turn_seq_ids_U[turn_ids_T] == seq_ids_T``."""


def turn_positions_U(turn_seq_ids_U: Tensor, num_seqs: int) -> Tensor:
    """[U] int64 position k - 1 of each turn within its trajectory (0 for the first turn)."""
    first_S = segment_first_index(turn_seq_ids_U, num_seqs)
    return torch.arange(turn_seq_ids_U.numel(), device=turn_seq_ids_U.device) - first_S[turn_seq_ids_U]


def split_rewards_U(rewards_S: Tensor, layout: TurnLayout) -> Tensor:
    """[U] r_{i,k}: each turn's environment reward, the last turn of a trajectory taking
    ``R_i`` minus its earlier turns' rewards (so each trajectory's turn rewards sum to R_i)."""
    seq_U = layout.turn_seq_ids_U
    num_seqs = rewards_S.numel()
    env_U = layout.turn_rewards_U.to(rewards_S.dtype)
    count_S = segment_count(torch.ones_like(seq_U, dtype=torch.bool), seq_U, num_seqs)
    is_last_U = turn_positions_U(seq_U, num_seqs) == count_S[seq_U] - 1
    before_last_S = segment_sum(torch.where(is_last_U, torch.zeros_like(env_U), env_U), seq_U, num_seqs)
    return torch.where(is_last_U, (rewards_S - before_last_S)[seq_U], env_U)


def discounted_returns_U(rewards_U: Tensor, turn_seq_ids_U: Tensor, num_seqs: int, discount: float) -> Tensor:
    """[U] G_{i,k} = sum_{j >= k} discount^(j - k) r_{i,j}, within each trajectory.

    One host sync (the most turns of a trajectory): the recursion G_k = r_k + discount G_{k+1}
    runs once per turn position, backwards, over all trajectories at once; a closed form with
    discount^(-k) would overflow for small discounts and many turns.
    """
    returns_U = rewards_U.clone()
    pos_U = turn_positions_U(turn_seq_ids_U, num_seqs)
    has_next_U = torch.zeros_like(turn_seq_ids_U, dtype=torch.bool)
    has_next_U[:-1] = turn_seq_ids_U[1:] == turn_seq_ids_U[:-1]
    for k in range(int(pos_U.max()) - 1 if pos_U.numel() else -1, -1, -1):
        at_k = torch.nonzero(has_next_U & (pos_U == k)).squeeze(1)
        returns_U[at_k] = returns_U[at_k] + discount * returns_U[at_k + 1]
    return returns_U


def turn_groups_U(group_ids_S: Tensor, layout: TurnLayout, num_seqs: int) -> tuple[Tensor, int]:
    """[U] id of group (g, k) of each turn, in [0, n), and n: a turn competes with the turns
    at the same position of its prompt's other trajectories."""
    pos_U = turn_positions_U(layout.turn_seq_ids_U, num_seqs)
    key_U = group_ids_S[layout.turn_seq_ids_U] * (int(pos_U.max()) + 1 if pos_U.numel() else 1) + pos_U
    unique, inverse_U = torch.unique(key_U, return_inverse=True)
    return inverse_U, int(unique.numel())


def check_turn_layout(layout: TurnLayout, seq_ids_T: Tensor, num_seqs: int) -> None:
    """Shapes and ids of ``layout`` against the batch's ``seq_ids_T`` (names the tensor at fault).

    Raises:
        InputError: a turn id out of range or out of order, a token whose turn belongs to
            another trajectory, or a trajectory without a turn.
    """
    seq_U, turn_T = layout.turn_seq_ids_U, layout.turn_ids_T
    if layout.turn_rewards_U.shape != seq_U.shape or turn_T.shape != seq_ids_T.shape or seq_U.numel() == 0:
        raise InputError(f"turns: turn_rewards_U {tuple(layout.turn_rewards_U.shape)}, turn_seq_ids_U "
                         f"{tuple(seq_U.shape)} and turn_ids_T {tuple(turn_T.shape)} do not fit seq_ids_T "
                         f"{tuple(seq_ids_T.shape)}")
    seq_ok_U = (seq_U >= 0) & (seq_U < num_seqs)
    in_order_U = torch.ones_like(seq_ok_U)
    in_order_U[1:] = seq_U[1:] >= seq_U[:-1]
    turn_ok_T = (turn_T >= 0) & (turn_T < seq_U.numel())
    owner_T = seq_U[turn_T.clamp(0, seq_U.numel() - 1)]
    has_turn_S = segment_count(seq_ok_U, seq_U.clamp(0, num_seqs - 1), num_seqs) > 0
    run_value_checks([
        range_check("turn_seq_ids_U", seq_U, seq_ok_U, f"has an id outside [0, {num_seqs})"),
        range_check("turn_seq_ids_U", seq_U, in_order_U, "decreases (turns not in packed order)"),
        range_check("turn_ids_T", turn_T, turn_ok_T, f"has an id outside [0, {seq_U.numel()})"),
        range_check("turn_ids_T", turn_T, owner_T == seq_ids_T, "names a turn of another sequence"),
        range_check("turns_S", has_turn_S, has_turn_S, "has no turn (turn_seq_ids_U never names it)"),
    ])
