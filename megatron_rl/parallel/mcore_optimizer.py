"""Megatron-Core's optimizers and training state: the distributed optimizer's checkpoint
formats, how many optimizers Megatron chains for a layout, the torch-Adam ``step`` fixes,
and DDP's buffers (what the colocated offload moves).

The optimizer half of :mod:`megatron_rl.parallel.mcore_compat` (same rule, same contract
tests in ``tests/unit/test_mcore_contract.py``): the classes come from its
:data:`~megatron_rl.parallel.mcore_compat.INTERNALS`, the instance internals read here are
listed in its ``INTERNAL_ATTRIBUTES``. Each helper gives its reason in its docstring and holds
for 0.16.1 and 0.19.2 unless it says otherwise.
"""

from __future__ import annotations

import contextlib
import importlib
from typing import Any, Iterator

from megatron_rl.parallel import mcore_compat as mc

DISTRIBUTED_OPTIMIZER_SHARDINGS = ("fully_reshardable", "dp_reshardable")
"""The distributed optimizer's checkpoint formats we write (``distrib_optimizer.py``
``sharded_state_dict``, 0.16.1 :1175-1294). Its default when no metadata is given,
``fully_sharded_model_space``, cannot be saved in 0.16.1 (``ShardedTensor.flattened_range
is not supported``, ``dist_checkpointing/mapping.py:134``)."""


def distributed_optimizer_metadata(sharding: str) -> dict[str, Any]:
    """The sharded-state-dict metadata of a distributed-optimizer checkpoint, as Megatron-LM
    builds it (``training/checkpointing.py`` ``_build_sharded_state_dict_metadata``).

    Saved as the checkpoint's content metadata and read back with
    ``dist_checkpointing.load_content_metadata``, so a load uses the format it was written
    in. ``fully_reshardable`` gathers over DP with the DP group's own backend (Megatron-LM's
    default, ``mem_efficient`` off); ``chained_optim_avoid_prefix`` drops the
    ``chained_<i>.`` prefix of the model-space format, so its keys do not depend on how
    many optimizers the chain has.
    """
    if sharding not in DISTRIBUTED_OPTIMIZER_SHARDINGS:
        raise ValueError(f"unknown distributed-optimizer sharding {sharding!r}: one of {DISTRIBUTED_OPTIMIZER_SHARDINGS}")
    return {"distrib_optim_sharding_type": sharding, "distrib_optim_fully_reshardable_mem_efficient": False,
            "singleton_local_shards": False, "chained_optim_avoid_prefix": True}


def optimizer_members(optimizer: Any) -> list[Any]:
    """The optimizers a ``ChainedOptimizer`` runs (dense, then experts when EP > 1), or ``[optimizer]``."""
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


EXPERT_GROUPS_WHEN_ETP_DIFFERS = mc.MCORE >= (0, 19, 0)
"""From 0.19.0 expert weights also take the expert groups when ETP != TP (Megatron-LM
cd4afffa64, "Fix gradient-norm undercounting when using EP and TP"); before, only with EP > 1."""


def optimizer_member_count(expert_model_parallel_size: int, expert_tensor_parallel_size: int = 1,
                           tensor_model_parallel_size: int = 1) -> int:
    """How many optimizers ``get_megatron_optimizer`` chains for a layout: a second one for the
    expert weights exactly when they are not all-reduced with the dense ones (``allreduce``
    False): EP > 1 (0.16.1-0.18: ``tensor_parallel/layers.py``
    ``allreduce = not (is_expert and expert_parallel)``, ``expert_parallel = EP > 1``), or
    ETP != TP too (:data:`EXPERT_GROUPS_WHEN_ETP_DIFFERS`). A checkpoint's common optimizer
    state has one entry per member, so it does not load into a chain of the other length."""
    expert_groups = expert_model_parallel_size > 1 or (
        EXPERT_GROUPS_WHEN_ETP_DIFFERS and expert_tensor_parallel_size != tensor_model_parallel_size)
    return 2 if expert_groups else 1


def uses_distributed_optimizer(ddp: Any) -> bool:
    """Whether a DDP-wrapped model was built with the distributed optimizer's buffers."""
    return bool(ddp.ddp_config.use_distributed_optimizer)


def gathers_weights_lazily(ddp: Any) -> bool:
    """Whether the distributed optimizer's step leaves the weights to the next forward's
    all-gather (``overlap_param_gather``: ``distrib_optimizer.py`` ``step_with_ready_grads``
    gathers only without it, 0.16.1 :2598-2623)."""
    return bool(ddp.ddp_config.use_distributed_optimizer and ddp.ddp_config.overlap_param_gather)


def _uses_torch_adam() -> bool:
    """Megatron falls back to ``torch.optim.Adam`` without TE or apex (``distrib_optimizer.py``
    sets ``HAVE_APEX_OR_TE`` False); torch's Adam keeps a per-parameter ``'step'`` tensor."""
    return not importlib.import_module(mc.INTERNALS["DistributedOptimizer"].module).HAVE_APEX_OR_TE


def fill_adam_state(optimizer: Any) -> None:
    """Give a distributed optimizer that has not stepped the state Adam creates at its first
    step (zero moments; torch's Adam also step 0), which updates exactly like no state.

    Reasons: its checkpoint reads every parameter's ``exp_avg`` and ``exp_avg_sq``
    (``get_parameter_state_dp_zero``, 0.16.1 ``distrib_optimizer.py:1062-1071``), which Adam
    creates lazily; and with torch's Adam ``DistributedOptimizer.state_dict()`` asserts one
    common ``'step'`` over the per-parameter states (:640-642), which
    ``sharded_state_dict(is_loading=True)`` calls before allocating any state (:1246), so a
    fresh optimizer can build no load template either. With TE's or apex's FusedAdam (step
    in the param groups) Megatron's own ``init_state_fn`` allocates the moments, as its
    ``is_loading`` path does (not run here: no GPU).
    """
    import torch

    torch_adam = _uses_torch_adam()
    for member in optimizer_members(optimizer):
        if not isinstance(member, mc.DistributedOptimizer):
            continue
        if not torch_adam:
            member.init_state_fn(member.optimizer, member.config)
            continue
        for group in member.optimizer.param_groups:
            for param in group["params"]:
                state = member.optimizer.state[param]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)


@contextlib.contextmanager
def adam_step_fix(optimizer: Any) -> Iterator[None]:
    """Load a distributed optimizer's checkpoint with torch's Adam: inside the block
    ``DistributedOptimizer._set_main_param_and_optimizer_states`` leaves each state's
    ``'step'`` alone; on exit every state's step is set from its param group's ``'step'``,
    which ``DistributedOptimizer.load_state_dict`` restores from the checkpoint.

    Reasons (0.16.1 :911-940; 0.19.1 the same): the method copies every tensor of the live
    state from the loaded ones, ``'step'`` included, but a ``fully_reshardable`` load
    carries no step (``KeyError: 'step'``) and a ``dp_reshardable`` one carries the load
    template's (silently resetting Adam's step). And ``load_state_dict`` hands every state
    one shared step tensor (:822-829), which torch's Adam would then increment once per
    parameter. The class attribute is restored on exit.
    """
    if not _uses_torch_adam():
        yield
        return
    owner = mc.DistributedOptimizer
    original = owner.__dict__["_set_main_param_and_optimizer_states"]

    def set_states_but_step(self: Any, model_param: Any, tensors: dict) -> None:
        group_index, group_order = self.model_param_group_index_map[model_param]
        state = self.optimizer.state[self.optimizer.param_groups[group_index]["params"][group_order]]
        step = state.pop("step", None)
        try:
            original(self, model_param, tensors)
        finally:
            if step is not None:
                state["step"] = step

    owner._set_main_param_and_optimizer_states = set_states_but_step
    try:
        yield
    finally:
        owner._set_main_param_and_optimizer_states = original
    import torch

    for member in optimizer_members(optimizer):
        for group in member.optimizer.param_groups:
            if group.get("step") is None:
                continue
            for param in group["params"]:
                state = member.optimizer.state.get(param)
                if state and "step" in state:
                    state["step"] = torch.tensor(float(group["step"]), dtype=state["step"].dtype)


def ddp_buffers(ddp: Any) -> list[tuple[Any, Any]]:
    """``(grad_data, param_data)`` of each of DDP's buffers, dense then expert-parallel
    (0.16.1 ``distributed_data_parallel.py:291-302``): every ``param.main_grad`` is a view of a
    ``grad_data``; ``param_data`` exists with the distributed optimizer only, and then every
    ``param.data`` is a view of it (``param_and_grad_buffer.py:795-835``), else it is None.
    0.16.1 (0.19.2 not checked)."""
    return [(b.grad_data, b.param_data) for b in [*ddp.buffers, *ddp.expert_parallel_buffers]]
