"""Pure-torch RL policy objectives on packed token batches.

Tensors and floats in, tensors out: no ``torch.distributed``, no Megatron, no I/O, no
``.item()`` inside a loss. Typical use::

    cfg = get_preset("dapo")                       # or get_preset("gspo", stapo_tau_p=0.002)
    adv_T = compute_advantages(cfg, rewards_S=..., group_ids_S=..., seq_ids_T=...,
                               loss_mask_T=..., num_groups=G)
    batch = TokenBatch(logprobs_T=..., old_logprobs_T=..., advantages_T=adv_T,
                       loss_mask_T=..., seq_ids_T=..., num_seqs=S)
    loss, metrics = policy_loss(cfg, batch)

Modules: ``config`` (ObjectiveConfig), ``presets`` (named configs), ``batch`` (TokenBatch,
the packed inputs and their checks), ``loss`` (entry point),
``surrogate`` (ratio units and gates), ``weights`` (RSPO, TIS/MIS/IcePop), ``masks``
(overlong, 80/20, STAPO), ``aggregation``, ``kl``, ``advantages``, ``turn_credit`` (per-turn returns), ``shaping``,
``distill`` (on-policy distillation terms), ``segments`` (packed-axis kernels), ``log_ratio`` (the overflow-safe exp of every ratio),
``validation``.
"""

from .advantages import (
    ADVANTAGE_ESTIMATORS,
    compute_advantages,
    dr_grpo_advantages_S,
    grpo_advantages_S,
    masked_whiten_T,
    rloo_advantages_S,
    token_returns_T,
)
from .aggregation import aggregate_loss, kept_counts
from .batch import TokenBatch
from .config import ObjectiveConfig, ObjectiveConfigError
from .distill import distill_advantages_T, topk_reverse_kl_T
from .kl import kl_estimate_T, kl_reward_penalty_T
from .loss import policy_loss
from .masks import build_loss_mask
from .presets import OBJECTIVE_PRESETS, get_preset
from .segments import seq_ids_from_cu_seqlens
from .shaping import dynamic_sampling_keep_S, soft_overlong_penalty_S
from .turn_credit import TurnLayout
from .validation import InputError

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "OBJECTIVE_PRESETS",
    "InputError",
    "ObjectiveConfig",
    "ObjectiveConfigError",
    "TokenBatch",
    "TurnLayout",
    "aggregate_loss",
    "build_loss_mask",
    "compute_advantages",
    "distill_advantages_T",
    "dr_grpo_advantages_S",
    "dynamic_sampling_keep_S",
    "get_preset",
    "grpo_advantages_S",
    "kept_counts",
    "kl_estimate_T",
    "kl_reward_penalty_T",
    "masked_whiten_T",
    "policy_loss",
    "rloo_advantages_S",
    "seq_ids_from_cu_seqlens",
    "soft_overlong_penalty_S",
    "token_returns_T",
    "topk_reverse_kl_T",
]
