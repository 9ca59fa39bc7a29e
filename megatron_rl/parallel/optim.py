"""Megatron-Core's distributed optimizer setup for a DDP-wrapped model stage.

Owns: building Megatron's optimizer from the run's ``OptimConfig``
(a ``ChainedOptimizer`` over the dense and the expert parameters, gradient clipping over
the right groups). On CPU it runs through the CPU platform layer.
"""

from __future__ import annotations

import torch
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

from megatron_rl.sections import OptimConfig


def build_optimizer(model: torch.nn.Module, cfg: OptimConfig):
    """Megatron optimizer over a DDP-wrapped stage (``schedule.wrap_for_training``)."""
    config = OptimizerConfig(
        optimizer=cfg.optimizer,
        lr=cfg.lr,
        weight_decay=cfg.weight_decay,
        adam_beta1=cfg.adam_beta1,
        adam_beta2=cfg.adam_beta2,
        adam_eps=cfg.adam_eps,
        sgd_momentum=cfg.sgd_momentum,
        clip_grad=cfg.clip_grad,
        bf16=model.config.bf16,
        fp16=model.config.fp16,
        params_dtype=model.config.params_dtype,
        use_distributed_optimizer=False,
    )
    return get_megatron_optimizer(config, [model])


def optimizer_step(optimizer) -> dict[str, torch.Tensor]:
    """Apply the reduced gradients; returns ``optim/grad_norm`` and ``optim/skipped``."""
    ok, grad_norm, _ = optimizer.step()
    return {
        "optim/grad_norm": torch.tensor(float(grad_norm if grad_norm is not None else 0.0)),
        "optim/skipped": torch.tensor(0.0 if ok else 1.0),
    }
