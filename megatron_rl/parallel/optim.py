"""Megatron-Core's optimizer for a DDP-wrapped model stage, plain or distributed.

Owns: building Megatron's optimizer from the run's ``OptimConfig`` (a ``ChainedOptimizer``
over the dense and the expert parameters, gradient clipping over the right groups), one
optimizer step, and making the weights readable after a step when the distributed
optimizer gathers them lazily (``optim.overlap_param_gather``). With ``optim.distributed``
it is Megatron's distributed optimizer: each data-parallel rank keeps the fp32 main
weights and Adam moments of its slice of the DDP buffers only (dense weights sliced over
DP, experts over expert-DP), and the updated weights are all-gathered back into every
rank's parameter buffer. The DDP wrapper must be built for it
(``schedule.wrap_for_training(model, optim)``). On CPU it runs through the CPU platform
layer. Memory per parameter: :mod:`megatron_rl.parallel.optimizer_memory`.
"""

from __future__ import annotations

import torch
from megatron.core.distributed import DistributedDataParallel
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

from megatron_rl.parallel.mcore_optimizer import (
    gathers_weights_lazily,
    uses_distributed_optimizer,
)
from megatron_rl.sections import OptimConfig


def build_optimizer(model: DistributedDataParallel, cfg: OptimConfig):
    """Megatron optimizer over a DDP-wrapped stage (``schedule.wrap_for_training``).

    Raises:
        ValueError: ``cfg.distributed`` disagrees with how ``model`` was wrapped.
    """
    if uses_distributed_optimizer(model) != cfg.distributed:
        raise ValueError(f"build_optimizer: optim.distributed={cfg.distributed}, but the model was wrapped "
                         f"{'with' if not cfg.distributed else 'without'} the distributed optimizer's buffers "
                         "(pass the same OptimConfig to wrap_for_training)")
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
        use_distributed_optimizer=cfg.distributed,
        overlap_param_gather=cfg.overlap_param_gather,
    )
    return get_megatron_optimizer(config, [model])


def optimizer_step(optimizer) -> dict[str, torch.Tensor]:
    """Apply the reduced gradients; returns ``optim/grad_norm`` and ``optim/skipped``."""
    ok, grad_norm, _ = optimizer.step()
    return {
        "optim/grad_norm": torch.tensor(float(grad_norm if grad_norm is not None else 0.0)),
        "optim/skipped": torch.tensor(0.0 if ok else 1.0),
    }


def gather_updated_weights(model: torch.nn.Module) -> None:
    """Collective over the model's DP groups: make every parameter hold the updated weights.

    With ``optim.overlap_param_gather`` the distributed optimizer's step updates only this
    rank's slice; the rest arrives in the next forward's pre-hooks. Anything that reads the
    weights outside a forward (weight push to the rollout engine, checkpoint save, HF
    export) calls this first (Megatron-LM does the same around its checkpoint saves). A
    no-op otherwise; calling it twice gathers twice, harmlessly.
    """
    if isinstance(model, DistributedDataParallel) and gathers_weights_lazily(model):
        model.start_param_sync(force_sync=True)
