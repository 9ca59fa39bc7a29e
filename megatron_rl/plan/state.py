"""The training state a rank holds per parameter, in the planner's terms.

The bytes per parameter (weights, gradient buffer, fp32 main weights, optimizer state; plain
or distributed optimizer) are Megatron-Core's allocations, and their one home is
:mod:`megatron_rl.parallel.optimizer_memory`, which ``tests/parallel/test_distributed_optimizer.py``
checks against the storages Megatron allocates. This module only hands it the run's optimizer
section; D is the data-parallel size of the parameters counted: DP x CP for dense parameters,
the expert data-parallel size ``world / (ETP x EP x PP)`` for routed experts with EP > 1.
"""

from __future__ import annotations

from megatron_rl.config import RunConfig, resolve_objective
from megatron_rl.parallel.optimizer_memory import BytesPerParam
from megatron_rl.parallel.optimizer_memory import optimizer_bytes_per_param as bytes_per_param
from megatron_rl.sections import OptimConfig


def optimizer_bytes_per_param(optim: OptimConfig, params_dtype: str, distributed: bool, dp_size: int) -> BytesPerParam:
    """Bytes per parameter of a rank's training state under the optimizer section ``optim``.

    Args:
        optim: the optimizer section (Adam: two moments; SGD: one momentum buffer or none).
        params_dtype: ``model.params_dtype``.
        distributed: Megatron's distributed optimizer shards main weights and state over D.
        dp_size: D, the data-parallel size of the parameters counted.
    """
    return bytes_per_param(params_dtype, distributed=distributed, data_parallel_size=dp_size,
                           optimizer=optim.optimizer, sgd_momentum=optim.sgd_momentum)


def distributed_optimizer(cfg: RunConfig) -> bool:
    """Whether the run builds Megatron's distributed optimizer (``optim.distributed``)."""
    return cfg.optim.distributed


def uses_reference(cfg: RunConfig) -> bool:
    """The objective's KL needs a frozen reference model beside the policy (``train.frozen``)."""
    return resolve_objective(cfg).uses_reference
