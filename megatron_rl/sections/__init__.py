"""Config sections shared by many owners: ``model``, ``parallel``, ``optim``; and the RL loop's
own, ``train`` (with ``eval``) and ``logging`` (with ``profile``), whose owner ``megatron_rl.train``
sits above the config loader.

Leaves of the import graph: they import only ``megatron_rl.config_loading``. Sections with a
single owner below the loader live next to it (``data.config``, ``rewards.config``,
``rollout.config``, ``rollout.sglang.config``, ``fp8``, ``algos.section``);
``megatron_rl.config`` composes them all into one run.
"""

from megatron_rl.sections.model import ModelConfig, validate_model, vocab_padding_hint
from megatron_rl.sections.optim import OptimConfig, validate_optim
from megatron_rl.sections.parallel import (
    ParallelConfig,
    thd_row_multiple,
    thd_slot_multiple,
    validate_layout,
)

__all__ = ["ModelConfig", "OptimConfig", "ParallelConfig", "thd_row_multiple", "thd_slot_multiple", "validate_layout",
           "validate_model", "validate_optim", "vocab_padding_hint"]
