"""The ``optim`` section: hyperparameters of Megatron-Core's optimizer, and whether it is
Megatron's distributed optimizer (state sharded over the data-parallel ranks)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from megatron_rl.config_loading import require


@dataclass(kw_only=True)
class OptimConfig:
    """Optimizer hyperparameters (Megatron-Core's optimizer)."""

    optimizer: Literal["adam", "sgd"] = "adam"
    """Adam (decoupled weight decay) or SGD with momentum."""
    lr: float = 1e-6
    """Learning rate."""
    weight_decay: float = 0.0
    """Decoupled weight decay."""
    adam_beta1: float = 0.9
    """Adam beta1."""
    adam_beta2: float = 0.999
    """Adam beta2."""
    adam_eps: float = 1e-8
    """Adam epsilon."""
    sgd_momentum: float = 0.0
    """SGD momentum."""
    clip_grad: float = 1.0
    """Clip the global gradient norm to this (0 disables)."""
    distributed: bool = False
    """Megatron's distributed optimizer: fp32 main weights and Adam state sharded over each
    parameter's data-parallel ranks (dense weights over DP, experts over expert-DP)."""
    overlap_grad_reduce: bool = False
    """(distributed) Reduce-scatter gradients bucket by bucket while the backward pass runs."""
    overlap_param_gather: bool = False
    """(distributed) All-gather updated weights bucket by bucket in the next forward pass."""
    bucket_size: int | None = None
    """(overlap) Elements per gradient bucket; None: Megatron's max(40M, 1M x DP)."""
    checkpoint_sharding: Literal["fully_reshardable", "dp_reshardable"] = "fully_reshardable"
    """(distributed) How checkpoints store the sharded state: ``fully_reshardable`` (model
    space, gathered over DP at save; resumes at any TP/PP/DP/EP>1) or ``dp_reshardable``
    (buffer space, no gather; resumes at another DP size only)."""


def validate_optim(o: OptimConfig, prefix: str = "optim") -> None:
    """The distributed optimizer's own rules (Megatron-LM's ``arguments.py`` and what we test)."""
    require(not o.distributed or o.optimizer == "adam", f"{prefix}.distributed",
            "Megatron's distributed optimizer checkpoints Adam's state (exp_avg, exp_avg_sq) only; "
            f"set {prefix}.optimizer=adam")
    require(not o.overlap_grad_reduce or o.distributed, f"{prefix}.overlap_grad_reduce",
            f"overlaps the distributed optimizer's reduce-scatter; set {prefix}.distributed=true")
    # Megatron-LM refuses it too: the gather of a bucket is launched once its gradients are reduced.
    require(not o.overlap_param_gather or o.overlap_grad_reduce, f"{prefix}.overlap_param_gather",
            f"needs {prefix}.overlap_grad_reduce=true (as in Megatron-LM)")
    require(o.bucket_size is None or o.bucket_size > 0, f"{prefix}.bucket_size", "must be > 0 or null")
