"""Bytes per parameter of a rank's training state: weights, gradient buffer, fp32 main weights
and optimizer state, with and without Megatron's distributed optimizer.

The figures are Megatron-Core 0.16.1's allocations as measured in the project's research
notes on the distributed optimizer (section A.3, "Memory facts for the planner"):

- weights: the parameter dtype (with the distributed optimizer they are views into the DDP
  parameter buffer, no second copy: ``param_and_grad_buffer.py:795-801``);
- gradient buffer (``main_grad``): fp32 on every rank, full size also with the distributed
  optimizer, because ``schedule.wrap_for_training`` sets ``grad_reduce_in_fp32=True``
  (``distributed_data_parallel.py:147``, ``param_and_grad_buffer.py:803-808``);
- fp32 main weights: for 16-bit parameters a full fp32 copy (``optimizer.py:674``), or with
  the distributed optimizer a copy of this rank's 1/D shard (``distrib_optimizer.py:399``);
  none for fp32 parameters (``FP32Optimizer``; a view of the buffer with the distributed one);
- Adam's two fp32 moments (``optimizer/__init__.py:391-398``), SGD's one momentum buffer when
  ``optim.sgd_momentum`` > 0: full size, or 1/D with the distributed optimizer.

D is the data-parallel size of that parameter: DP x CP for dense parameters, the expert
data-parallel size ``world / (ETP x EP x PP)`` for routed experts with EP > 1. The
distributed optimizer's padding (each bucket to a multiple of lcm(D, 128) elements,
+0.3% on the tiny model) is not counted.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_rl.config import RunConfig
from megatron_rl.plan.activations import DTYPE_BYTES
from megatron_rl.sections import OptimConfig

GRAD_BYTES = 4
"""The gradient buffer is fp32 (``grad_reduce_in_fp32=True`` in ``schedule.wrap_for_training``)."""


@dataclass(frozen=True)
class BytesPerParam:
    """Bytes one parameter costs its rank, by tensor."""

    weights: float
    """The parameter itself."""
    grads: float
    """Its share of the DDP gradient buffer."""
    main_weights: float
    """Its fp32 master copy (or this rank's share of it)."""
    optimizer: float
    """Its optimizer state (or this rank's share of it)."""

    @property
    def total(self) -> float:
        """All four."""
        return self.weights + self.grads + self.main_weights + self.optimizer


def optimizer_bytes_per_param(optim: OptimConfig, params_dtype: str, distributed: bool, dp_size: int) -> BytesPerParam:
    """Bytes per parameter of a rank's training state (research notes A.3, Megatron-Core 0.16.1).

    Args:
        optim: the optimizer section (Adam: two moments; SGD: one momentum buffer or none).
        params_dtype: ``model.params_dtype``.
        distributed: Megatron's distributed optimizer shards main weights and state over D.
        dp_size: D, the data-parallel size of the parameters counted.
    """
    weight = DTYPE_BYTES[params_dtype]
    shard = 1 / dp_size if distributed else 1
    main = 0 if weight == 4 else 4 * shard
    moments = 2 if optim.optimizer == "adam" else (1 if optim.sgd_momentum > 0 else 0)
    return BytesPerParam(weights=weight, grads=GRAD_BYTES, main_weights=main, optimizer=4 * moments * shard)


def distributed_optimizer(cfg: RunConfig) -> bool:
    """Whether the run builds Megatron's distributed optimizer (``optim.distributed``)."""
    return cfg.optim.distributed


def uses_reference(cfg: RunConfig) -> bool:
    """The objective's KL needs a frozen reference model beside the policy (``Trainer._setup_reference``)."""
    from megatron_rl.config import resolve_objective

    objective = resolve_objective(cfg)
    return objective.kl_coef > 0 or objective.kl_in_reward_coef > 0
