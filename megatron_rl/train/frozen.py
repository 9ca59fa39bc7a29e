"""Frozen models scored beside the policy: the KL reference and the distillation teachers.

The reference is a model of the run's architecture in the policy's TP/EP/PP layout, loaded
once from a Megatron checkpoint and never trained; each step it scores the batch's sequences
with the same log-prob pass as the policy (one log-probability per token, on the packed token
axis). In colocated runs it leaves the devices with the trainer while the engine generates
(``EngineTurns.add_frozen``).

The reference (``ObjectiveConfig.uses_reference``: a KL loss or reward term) is the policy as
the run starts, after the warm start: saved next to the run's checkpoints when the run starts
(``<run_dir>/checkpoints/reference``), so a resumed run keeps the same reference. Does not own
how its log-probs enter the objective (``megatron_rl.algos``: KL as a loss or in the reward).

The teachers (:meth:`FrozenModels.teachers`) have architectures, layouts or SGLang servers of
their own: :mod:`megatron_rl.train.teachers` owns them; they leave the devices the same way
unless they are offloaded between their passes.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch
from megatron.core import dist_checkpointing

from megatron_rl.fp8 import transformer_config_fields
from megatron_rl.parallel.checkpoint import load_model, save_model
from megatron_rl.parallel.logprobs import compute_logprobs
from megatron_rl.parallel.model import build_model

if TYPE_CHECKING:
    from megatron_rl.algos import ObjectiveConfig
    from megatron_rl.config import RunConfig
    from megatron_rl.parallel.groups import ParallelGroups
    from megatron_rl.train.colocate import EngineTurns
    from megatron_rl.train.teachers import Teachers


class FrozenModel:
    """A model that scores the batch and is never trained.

    Args:
        name: what it is to the run (``reference``).
        model: the model chunk of this rank.
        groups: this rank's parallel groups.
    """

    def __init__(self, name: str, model: torch.nn.Module, groups: ParallelGroups) -> None:
        self.name, self.model, self.groups = name, model, groups

    def logprobs_T(self, sequences: list[torch.Tensor], prompt_lengths: list[int], **packing) -> torch.Tensor:
        """``[T]`` log-probabilities of each sequence's response tokens, on the policy's token axis."""
        return compute_logprobs(self.model, self.groups, sequences, prompt_lengths, **packing).logprobs_T


class FrozenModels:
    """Builds the run's frozen models once the run's starting weights are known.

    Args:
        cfg: the run config (model, layout, FP8, ``train.run_dir``).
        objective: the resolved objective (whether a KL reference is needed).
        policy: the policy's bare model chunk (the reference's weights at the start).
        groups: this rank's parallel groups.
        turns: the engine's turns, which offload frozen models with the trainer.
    """

    def __init__(self, cfg: RunConfig, objective: ObjectiveConfig, policy: torch.nn.Module,
                 groups: ParallelGroups, turns: EngineTurns) -> None:
        self.cfg, self.objective, self.policy, self.groups, self.turns = cfg, objective, policy, groups, turns

    def reference(self, start_step: int) -> FrozenModel | None:
        """The KL reference (None when the objective has no KL). Collective: a run that starts
        at step 0 saves the policy's current weights as the reference, unless an earlier start
        of the same run saved them already."""
        if not self.objective.uses_reference:
            return None
        ref_dir = Path(self.cfg.train.run_dir) / "checkpoints" / "reference"
        if start_step == 0 and not dist_checkpointing.check_is_distributed_checkpoint(str(ref_dir)):
            save_model(self.policy, ref_dir)
        model = build_model(self.cfg.model, self.cfg.parallel, **transformer_config_fields(self.cfg.fp8))
        load_model(model, ref_dir)
        self.turns.add_frozen(model)
        return FrozenModel("reference", model, self.groups)

    def teachers(self) -> Teachers | None:
        """The distillation teachers (None without ``distill.teachers``). Collective: each is built
        in its own layout and streamed from its checkpoint, drawing nothing from the policy's
        random streams (``train.teachers``)."""
        if not self.cfg.distill.teachers:
            return None
        from megatron_rl.train.teachers import Teachers

        return Teachers(self.cfg, self.groups, self.turns)
