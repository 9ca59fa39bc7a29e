"""The packed per-token inputs of the objective library, and the checks on them.

Owns :class:`TokenBatch`, the tensors that ``policy_loss``, ``build_loss_mask``, the
mismatch weights, the surrogate and the aggregation read, each named once with its shape,
and every check on them in one place:

* ranks, lengths and dtypes when the batch is built (free: no host synchronisation);
* which inputs a configuration reads (:meth:`TokenBatch.require`, names the missing one);
* values (:meth:`TokenBatch.value_checks`: NaN/inf, sequence ids in range, 0/1 masks, RSPO
  weights in (0, 1]), which ``policy_loss`` fetches in one host synchronisation when
  ``ObjectiveConfig.check_inputs`` is on.

It owns no objective math and no checks of the caller's global counts (``policy_loss``).

Shape legend: T tokens, S sequences.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
from torch import Tensor

from .config import ObjectiveConfig
from .validation import (
    InputError,
    ValueCheck,
    check_shapes,
    finite_checks,
    first_bad_message,
    id_checks,
)


@dataclass(frozen=True, kw_only=True, slots=True)
class TokenBatch:
    """One packed batch: per-token tensors on one token axis, plus per-sequence ones.

    Only ``loss_mask_T``, ``seq_ids_T`` and ``num_seqs`` are always needed; which of the
    others a call reads depends on the configuration (:meth:`require`). Ranks, lengths and
    dtypes are checked on construction (:class:`InputError` names the tensor). The field
    order is the order of the checks: the first tensor given sets T, and an error names
    the first failing tensor.
    """

    logprobs_T: Tensor | None = None
    """[T] current-policy log-probs of the sampled tokens; carries the gradient."""
    old_logprobs_T: Tensor | None = None
    """[T] old-policy log-probs (constant); unused by ratio_unit 'none' without mismatch."""
    advantages_T: Tensor | None = None
    """[T] advantages (``compute_advantages``), treated as constants."""
    loss_mask_T: Tensor
    """[T] bool (or 0/1 integer) response mask, or the full kept mask (``apply_filters=False``)."""
    seq_ids_T: Tensor
    """[T] int64 sequence id per token in [0, num_seqs) (``seq_ids_from_cu_seqlens``)."""
    num_seqs: int
    """S, the number of sequences."""
    rollout_logprobs_T: Tensor | None = None
    """[T] rollout-engine log-probs; read by ``mismatch`` (else only the metrics)."""
    ref_logprobs_T: Tensor | None = None
    """[T] reference-policy log-probs; read by ``kl_coef > 0`` (else only the metrics)."""
    entropy_T: Tensor | None = None
    """[T] current-policy entropies; the entropy bonus differentiates through them, filters not."""
    rspo_gamma_T: Tensor | None = None
    """[T] unfloored RSPO router-shift weights in (0, 1]; read by ``rspo_gamma_min``."""
    teacher_logprobs_T: Tensor | None = None
    """[T] the distillation teachers' log-probs of the sampled tokens (the ``distill/*`` metrics)."""
    distill_T: Tensor | None = None
    """[T] the top-k distillation term per token (``algos.distill.topk_reverse_kl_T``); carries the
    gradient; read by ``distill_coef > 0`` with ``distill_estimator='topk'``."""
    truncated_S: Tensor | None = None
    """[S] bool, True for samples cut at the length limit (overlong filter)."""

    def __post_init__(self) -> None:
        check_shapes(
            per_token={name: getattr(self, name) for name in _PER_TOKEN},
            per_seq={"truncated_S": self.truncated_S},
            num_seqs=self.num_seqs,
            floating=_FLOATING,
        )

    def require(self, cfg: ObjectiveConfig, *, loss: bool, filters: bool) -> None:
        """Raises :class:`InputError` naming the first input ``cfg`` reads that is missing.

        Args:
            cfg: the objective configuration.
            loss: the policy loss will be computed (surrogate, weights, KL, entropy bonus).
            filters: the configured masks will be built (overlong, 80/20, STAPO).
        """
        for name, reader in _needed_inputs(cfg, loss=loss, filters=filters):
            if getattr(self, name) is None:
                raise InputError(f"{name} is required by {reader} but was not given")

    def value_checks(self) -> list[ValueCheck]:
        """The value checks of the given tensors, for ``run_value_checks`` (one host sync)."""
        checks = finite_checks({name: getattr(self, name) for name in _FLOATING})
        checks += id_checks(
            self.seq_ids_T,
            self.num_seqs,
            {"loss_mask_T": self.loss_mask_T, "truncated_S": self.truncated_S},
        )
        gamma_T = self.rspo_gamma_T
        if gamma_T is not None:
            low, high = torch.aminmax(gamma_T.detach())
            message = first_bad_message(
                "rspo_gamma_T", lambda: (gamma_T <= 0) | (gamma_T > 1), "is outside (0, 1]"
            )
            checks.append(("rspo_gamma_T", (low > 0) & (high <= 1), message))
        return checks


def _needed_inputs(cfg: ObjectiveConfig, *, loss: bool, filters: bool) -> list[tuple[str, str]]:
    """(input, what reads it) for every optional input the configuration reads."""
    needs = []
    if loss:
        needs += [("logprobs_T", "policy_loss"), ("advantages_T", "policy_loss")]
        if cfg.ratio_unit != "none":
            needs.append(("old_logprobs_T", f"ObjectiveConfig.ratio_unit={cfg.ratio_unit!r}"))
        if cfg.mismatch != "none":
            reader = f"ObjectiveConfig.mismatch={cfg.mismatch!r}"
            needs += [("old_logprobs_T", reader), ("rollout_logprobs_T", reader)]
        if cfg.kl_coef > 0:
            needs.append(("ref_logprobs_T", "ObjectiveConfig.kl_coef > 0"))
        if cfg.entropy_coef > 0:
            needs.append(("entropy_T", "ObjectiveConfig.entropy_coef > 0"))
        if cfg.rspo_gamma_min is not None:
            needs.append(("rspo_gamma_T", "ObjectiveConfig.rspo_gamma_min"))
        if cfg.distill_coef > 0 and cfg.distill_estimator == "topk":
            needs.append(("distill_T", "ObjectiveConfig.distill_estimator='topk'"))
    if filters:
        if cfg.overlong_filter:
            needs.append(("truncated_S", "ObjectiveConfig.overlong_filter"))
        if cfg.entropy_top_rho is not None:
            needs.append(("entropy_T", "ObjectiveConfig.entropy_top_rho"))
        if cfg.stapo_tau_p is not None:
            needs += [
                (name, "ObjectiveConfig.stapo_tau_p")
                for name in ("entropy_T", "logprobs_T", "advantages_T")
            ]
    return needs


_PER_TOKEN = tuple(f.name for f in fields(TokenBatch) if f.name.endswith("_T"))
_FLOATING = tuple(name for name in _PER_TOKEN if name not in ("loss_mask_T", "seq_ids_T"))
