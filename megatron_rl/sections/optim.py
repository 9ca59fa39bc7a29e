"""The ``optim`` section: hyperparameters of Megatron-Core's optimizer."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


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
