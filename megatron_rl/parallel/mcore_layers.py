"""Megatron-Core's layer internals that the GPT-OSS and Gated DeltaNet families use.

The layer half of :mod:`megatron_rl.parallel.mcore_compat` (same rule, same contract tests in
``tests/unit/test_mcore_contract.py``): names resolve lazily from :data:`LAYER_INTERNALS`
(``mcore_layers.GatedDeltaNet``), the module flag rewritten here is listed in its
``INTERNAL_ATTRIBUTES``. Each entry says why and for which versions it holds (read in
0.16.1 and 0.19.2).
"""

from __future__ import annotations

import contextlib
import importlib
from typing import Any, Iterator

from megatron_rl.parallel.mcore_compat import Internal

LAYER_INTERNALS: dict[str, Internal] = {
    "quick_gelu": Internal(
        "megatron.core.activations", "quick_gelu",
        "GPT-OSS's GLU activation x sigmoid(1.702 x) (TransformerConfig.activation_func takes the function)"),
    "is_layer_window_attention": Internal(
        "megatron.core.transformer.utils", "is_layer_window_attention",
        "PackedCoreAttention decides a layer's sliding window by Megatron's own rule"),
    "GatedDeltaNet": Internal(
        "megatron.core.ssm.gated_delta_net", "GatedDeltaNet",
        "the Gated DeltaNet layer (parameters, initialization, sharded checkpoint) whose forward "
        "parallel.gated_delta_net replaces for packed rows without the FLA kernels"),
    "GatedDeltaNetSubmodules": Internal(
        "megatron.core.ssm.gated_delta_net", "GatedDeltaNetSubmodules",
        "the spec of a Gated DeltaNet layer's projections and output norm"),
    "torch_chunk_gated_delta_rule": Internal(
        "megatron.core.ssm.gated_delta_net", "torch_chunk_gated_delta_rule",
        "Megatron's torch implementation of the chunked gated delta rule (no FLA kernel, any device)"),
}
"""Megatron-Core names imported through this module (``from mcore_layers import GatedDeltaNet``)."""


def __getattr__(name: str) -> Any:
    internal = LAYER_INTERNALS.get(name)
    if internal is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(internal.module), internal.attribute)
    globals()[name] = value
    return value


@contextlib.contextmanager
def gated_delta_net_without_fla() -> Iterator[None]:
    """Build Megatron's ``GatedDeltaNet`` where flash-linear-attention is absent.

    Its constructor refuses to run without FLA (0.16.1 ``ssm/gated_delta_net.py``, 0.19.2
    ``ssm/gated_delta_net/common.py``: ``if not HAVE_FLA: raise ImportError``) because its own
    forward calls FLA's kernels; :mod:`megatron_rl.parallel.gated_delta_net` replaces that
    forward with one that calls none, so the flag is set for the build only.
    """
    cls = __getattr__("GatedDeltaNet")
    owner = next(c for c in cls.__mro__ if "__init__" in vars(c))
    module = importlib.import_module(owner.__module__)
    saved = module.HAVE_FLA
    module.HAVE_FLA = True
    try:
        yield
    finally:
        module.HAVE_FLA = saved


def expert_biases_trainable(model: Any) -> None:
    """Make the local spec's biased experts trainable: each expert's ``linear_fc2`` returns a copy.

    Megatron's MLP adds an expert's output bias in place, ``output += output_bias *
    per_token_scale`` (``transformer/mlp.py:247``; 0.19.2 at its line 354), on what
    ``RowParallelLinear`` returns; at expert-TP 1 that is the reduce Function's input returned
    as is, and autograd refuses the in-place update when gradients are on ("Output 0 of
    _ReduceFromModelParallelRegion is a view and is being modified inplace"). The forward of
    those layers (this instance's only) copies its output first; names and parameters stay.
    """
    for name, module in model.named_modules():
        if ".experts.local_experts." not in name or not name.endswith(".linear_fc2"):
            continue
        if getattr(module, "bias", None) is None and not getattr(module, "skip_bias_add", False):
            continue
        forward = module.forward

        def copied(*args, _forward=forward, **kwargs):
            output, bias = _forward(*args, **kwargs)
            return output.clone(), bias

        module.forward = copied


def sum_replicated_expert_grads_over_tp(model: Any, config: Any, experts_take_expert_groups: bool) -> int:
    """Flag expert weights replicated over TP so that their gradients are summed over TP.

    With TP > 1, sequence parallelism, EP 1 and expert-TP 1 every TP rank holds each expert
    whole and routes its own sequence shard through it, so its gradient is that shard's part
    only. Before 0.19.0 Megatron-Core treats such experts as dense weights (``allreduce``
    True: ``tensor_parallel/layers.py``, ``expert_parallel = EP > 1``) reduced over the
    data-parallel group alone, and the TP ranks' copies drift apart from the first update
    (Megatron-LM cd4afffa64 gives them the expert groups from 0.19.0). Flagged
    ``sequence_parallel``, ``finalize_model_grads`` sums them over TP as it does the norms'; and,
    no longer split over TP (``tensor_model_parallel`` False: each rank holds them whole), the
    gradient norm counts them on TP rank 0 only (``param_is_not_tensor_parallel_duplicate``),
    as it does the norms'. Returns how many parameters were flagged.
    """
    replicated = (config.tensor_model_parallel_size > 1 and config.sequence_parallel
                  and config.expert_model_parallel_size == 1 and config.expert_tensor_parallel_size == 1)
    if experts_take_expert_groups or not replicated:
        return 0
    flagged = 0
    for name, param in model.named_parameters():
        if ".experts." in name:
            param.sequence_parallel = True
            param.tensor_model_parallel = False
            flagged += 1
    return flagged
