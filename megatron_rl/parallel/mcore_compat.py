"""Every Megatron-Core internal this project relies on, in one place, with the versions it holds for.

Supported: megatron-core 0.16.1 up to 0.19.x (:data:`SUPPORTED`); the check runs when this
module is imported. 0.16.1 (Python 3.11) and 0.19.2 (Python 3.12, ``tools/py312_env.sh``)
are the versions the unit and parallel suites run on; 0.17 and 0.18 lie inside the range
but no suite has run on them (their touch points were not read either).
``MEGATRON_RL_ALLOW_ANY_MCORE=1`` turns the refusal of another version into a warning
(then ``tests/unit/test_mcore_contract.py`` says what moved).

The rule (enforced by ``tests/unit/test_mcore_source_rule.py``): outside this module and
``parallel/cpu_platform.py`` (the CPU shims, which patch Megatron's CUDA assumptions by
nature), code imports from Megatron-Core only its *public* API, the names a package's
``__init__`` re-exports and that we use through their constructor or call signature
(:data:`PUBLIC_API`). Everything else comes from here: classes reached in a submodule,
instance internals we read, override or rewrite (``TopKRouter.routing``,
``RouterReplay.get_replay_topk`` and its queues, the class-level instance list),
module flags we correct, private (underscore) names, and facts about Megatron's on-disk
checkpoint format. Each entry of :data:`INTERNALS` carries its reason and the versions it
is known to hold for; the helpers below (router and replay internals, replay hazards, MLA
build fixes) give their reason in their docstring and hold for 0.16.1 and
0.19.2 unless it says otherwise; the optimizer and training-state helpers live in its
optimizer half, :mod:`megatron_rl.parallel.mcore_optimizer`, the stored shards and the
checkpoint writer in :mod:`megatron_rl.parallel.mcore_checkpoint`, and ``parallel_state``'s
globals in :mod:`megatron_rl.parallel.mcore_state`, under the same rule. ``test_mcore_contract.py`` checks every one of them.

Names resolve lazily (PEP 562 ``__getattr__``): importing this module imports no Megatron-Core
(the checkpoint-format constants serve the input checks, which run first)."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import importlib
import importlib.metadata
import inspect
import os
import re
import warnings
from typing import Any, Callable, Iterator, Mapping

SUPPORTED = ((0, 16, 1), (0, 20, 0))
"""Supported megatron-core versions: at least the first, below the second."""
SUPPORTED_TEXT = "0.16.1 ... 0.19.x"
ALLOW_ENV = "MEGATRON_RL_ALLOW_ANY_MCORE"


def _version_tuple(text: str) -> tuple[int, int, int]:
    numbers = [int(n) for n in re.findall(r"\d+", text)[:3]]
    return tuple(numbers + [0] * (3 - len(numbers)))  # type: ignore[return-value]


def check_version(version: str) -> str | None:
    """The refusal message for ``version``, or None when it is supported."""
    low, high = SUPPORTED
    if low <= _version_tuple(version) < high:
        return None
    return (
        f"megatron-core {version} is installed; megatron-rl supports {SUPPORTED_TEXT} "
        f"(megatron_rl/parallel/mcore_compat.py; set {ALLOW_ENV}=1 to try it anyway)"
    )


MCORE_VERSION = importlib.metadata.version("megatron-core")
"""The installed megatron-core version."""
MCORE = _version_tuple(MCORE_VERSION)
"""The installed version as (major, minor, patch), for the version branches below."""

_refusal = check_version(MCORE_VERSION)
if _refusal is not None:
    if os.environ.get(ALLOW_ENV) != "1":
        raise ImportError(_refusal)
    warnings.warn(_refusal, RuntimeWarning, stacklevel=2)


@dataclasses.dataclass(frozen=True)
class Internal:
    """One Megatron-Core name we depend on beyond its public API."""

    module: str
    """Module that defines it."""
    attribute: str
    """Its name there."""
    reason: str
    """Why we need it (one line)."""
    versions: str = "0.16.1-0.19.2"
    """Versions it is known to hold for (checked by the contract tests)."""


PUBLIC_API: dict[str, frozenset[str]] = {
    "megatron.core": frozenset({"parallel_state", "tensor_parallel", "dist_checkpointing"}),
    "megatron.core.transformer": frozenset({"TransformerConfig", "MLATransformerConfig", "MegatronModule", "ModuleSpec"}),
    "megatron.core.models.gpt": frozenset({"GPTModel"}),
    "megatron.core.optimizer": frozenset({"OptimizerConfig", "get_megatron_optimizer"}),
    "megatron.core.distributed": frozenset(
        {"DistributedDataParallel", "DistributedDataParallelConfig", "finalize_model_grads"}),
    "megatron.core.pipeline_parallel": frozenset({"get_forward_backward_func"}),
}
"""What any module may import from Megatron-Core directly: names these package ``__init__``
files re-export (0.16.1-0.19.2), used through their constructor or call signature (and the
public functions of ``parallel_state``, ``tensor_parallel`` and ``dist_checkpointing``)."""

INTERNAL_ATTRIBUTES = frozenset({
    "global_router_replay_instances", "get_replay_topk", "replay_backward_list", "target_topk_idx",
    "router_replay_action", "set_router_replay_action", "clear_router_replay_action", "record_indices",
    "HAVE_TE", "TELinear", "te_general_gemm", "prepend_axis_num", "merge_fn", "unique_key",
    "is_mtp_layer", "chained_optimizers", "ddp_config", "HAVE_APEX_OR_TE", "expert_parallel_buffers",
    "param_data", "grad_data", "HAVE_FLA",
})
"""Instance and module internals that only this module (its optimizer half ``mcore_optimizer``, and
``cpu_platform``) may touch."""

INTERNALS: dict[str, Internal] = {
    "TopKRouter": Internal(
        "megatron.core.transformer.moe.router", "TopKRouter",
        "routing record wraps its per-instance ``routing`` and keys routers by ``layer_number``"),
    "RouterReplay": Internal(
        "megatron.core.transformer.moe.router_replay", "RouterReplay",
        "R2/R3 hand each router's RouterReplay the experts to dispatch"),
    "RouterReplayAction": Internal(
        "megatron.core.transformer.moe.router_replay", "RouterReplayAction",
        "replay picks REPLAY_FORWARD or REPLAY_BACKWARD per call"),
    "is_checkpointing": Internal(
        "megatron.core.tensor_parallel.random", "is_checkpointing",
        "tells the backward recompute of a checkpointed layer from its first forward"),
    "topk_routing_with_score_function": Internal(
        "megatron.core.transformer.moe.moe_utils", "topk_routing_with_score_function",
        "the router's own top-K: the reference our selection and replay are tested against"),
    "get_gpt_decoder_block_spec": Internal(
        "megatron.core.models.gpt.gpt_layer_specs", "get_gpt_decoder_block_spec",
        "the block spec whose local layers we copy with our norms and packed attention"),
    "TransformerBlockSubmodules": Internal(
        "megatron.core.transformer.transformer_block", "TransformerBlockSubmodules",
        "rebuilds the block spec from the edited layer specs"),
    "IdentityOp": Internal(
        "megatron.core.transformer.identity_op", "IdentityOp",
        "replaces the q/k norms of models without QK-norm"),
    "MoELayer": Internal(
        "megatron.core.transformer.moe.moe_layer", "MoELayer",
        "tells MoE layer specs from dense ones (their checkpoint key maps differ)"),
    "MLASelfAttention": Internal(
        "megatron.core.transformer.multi_latent_attention", "MLASelfAttention",
        "tells MLA layer specs from GQA ones (their checkpoint key maps differ)"),
    "ReplicatedLinear": Internal(
        "megatron.core.post_training.modelopt.layers", "Linear",
        "the replicated linear MLA's down projections need under TP on the local spec"),
    "AttnMaskType": Internal(
        "megatron.core.transformer.enums", "AttnMaskType",
        "PackedCoreAttention checks the mask type Megatron builds it with"),
    "DotProductAttention": Internal(
        "megatron.core.transformer.dot_product_attention", "DotProductAttention",
        "the core attention PackedCoreAttention stands in for (same constructor contract)"),
    "PackedSeqParams": Internal(
        "megatron.core.packed_seq_params", "PackedSeqParams",
        "THD packing: segment boundaries handed to attention"),
    "ShardedTensor": Internal(
        "megatron.core.dist_checkpointing.mapping", "ShardedTensor",
        "the checkpoint reader reads key, offsets, shapes and prepended axes of each shard"),
    "ShardedTensorFactory": Internal(
        "megatron.core.dist_checkpointing.mapping", "ShardedTensorFactory",
        "the checkpoint reader builds a factory's parts and merges them back"),
    "ShardedObject": Internal(
        "megatron.core.dist_checkpointing.mapping", "ShardedObject",
        "the checkpoint reader tells stored objects from tensors"),
    "StrictHandling": Internal(
        "megatron.core.dist_checkpointing.validation", "StrictHandling",
        "loads that name absent tensors instead of failing on TE's _extra_state objects"),
    "DistributedOptimizer": Internal(
        "megatron.core.optimizer.distrib_optimizer", "DistributedOptimizer",
        "its torch-Adam 'step' handling is corrected around checkpoint loads (adam_step_fix)",
        versions="0.16.1 (0.19.1 source read: same code)"),
}
"""Megatron-Core names imported through this module (``from mcore_compat import TopKRouter``)."""

DIST_CHECKPOINT_LOGGER = "megatron.core.dist_checkpointing.serialization"
"""Logger whose 'old incomplete checkpoint' warning a fresh conversion silences (0.16.1-0.19.2)."""
ASYNC_WRITER_LOGGER = "megatron.core.dist_checkpointing.strategies.filesystem_async"
"""Logger of a failed write worker's error, which the save then raises ('Local process N encountered ...')."""
SHARDED_OBJECT_SEPARATOR = "/shard_"
"""A ShardedObject is stored as ``<key>/shard_<offset>_<shape>`` (``ShardedObject.unique_key``)."""
MEGATRON_METADATA_NAME = "metadata.json"
"""Megatron's own metadata file beside torch DCP's ``.metadata`` (torch_dist format)."""
MEGATRON_COMMON_NAME = "common.pt"
"""Megatron's file of the common (non-sharded) state: 0.16.1 writes it; 0.19.2 writes
:data:`COMMON_STATE_KEY` instead and still reads it (0.17 and 0.18 not checked)."""
COMMON_STATE_KEY = "common_state"
"""0.19.2 stores the common state as one ShardedObject of this key inside the DCP files."""
WRITES_COMMON_FILE = MCORE < (0, 19, 0)
"""Whether this version's ``dist_checkpointing.save`` writes :data:`MEGATRON_COMMON_NAME`."""
OPTIMIZER_KEY = re.compile(r"^(chained_\d+\.)?optimizer\.")
"""Keys of Megatron's optimizer state: ``optimizer.state.<name>.<param>``, ``chained_<i>.``
per member of a ChainedOptimizer (0.16.1-0.19.2; tests/parallel/test_trainer_export.py)."""


RANK_IMPORTS = ("megatron.core.models.gpt", "megatron.core.optimizer", "megatron.core.distributed",
                "megatron.core.dist_checkpointing", "megatron.core.pipeline_parallel")
"""The Megatron-Core modules a rank of ours imports (seconds on CPU), which the forkserver of
``parallel/world.py`` imports once for every rank."""


def __getattr__(name: str) -> Any:
    internal = INTERNALS.get(name)
    if internal is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(internal.module), internal.attribute)
    globals()[name] = value
    return value


# ------------------------------------------------------------------------ routers and replay


def override_routing(router: Any, routing: Callable) -> Callable[[], None]:
    """Make ``router.routing`` (``TopKRouter.routing(logits, ...) -> (probs_NE, map_NE)``) call
    ``routing`` for this instance only; returns the function that undoes it."""
    had_own = "routing" in vars(router)
    original = router.routing
    router.routing = routing

    def undo() -> None:
        if had_own:
            router.routing = original
        else:
            # Deleting the instance attribute re-exposes the class's method.
            del router.routing

    return undo


def router_replay(router: Any) -> Any:
    """The router's ``RouterReplay`` (None unless built with ``moe_enable_routing_replay``)."""
    return getattr(router, "router_replay", None)


def is_mtp_router(router: Any) -> bool:
    """Whether the router belongs to a multi-token-prediction layer (0.17+ marks them)."""
    return bool(getattr(router, "is_mtp_layer", False))


def override_replay_topk(replay: Any, make: Callable[[Callable], Callable]) -> Callable:
    """Route ``replay.get_replay_topk`` (which Megatron's top-K calls with ``(scores, topk,
    num_groups, group_topk, default_compute_topk)`` and which returns ``(scores_NK, ids_NK)``)
    to ``make(original)`` for this instance; returns Megatron's own method, bound."""
    original = replay.get_replay_topk
    replay.get_replay_topk = make(original)
    return original


def reset_replay(replay: Any) -> None:
    """Undo :func:`override_replay_topk` and clear targets, queue and action."""
    if "get_replay_topk" in vars(replay):
        del replay.get_replay_topk
    replay.clear_indices()
    replay.clear_router_replay_action()


def set_replay_action(replay: Any, recompute: bool) -> None:
    """REPLAY_BACKWARD (pop the recompute queue) or REPLAY_FORWARD (the current target)."""
    action = __getattr__("RouterReplayAction")
    replay.set_router_replay_action(action.REPLAY_BACKWARD if recompute else action.REPLAY_FORWARD)


def queued_replay_ids(replay: Any, recompute: bool) -> Any:
    """The ``[N, K]`` ids the coming call will gather: the recompute queue's head or the target."""
    return replay.replay_backward_list[0] if recompute else replay.target_topk_idx


def set_queued_replay_ids(replay: Any, recompute: bool, ids_NK: Any) -> None:
    """Replace what :func:`queued_replay_ids` returns."""
    if recompute:
        replay.replay_backward_list[0] = ids_NK
    else:
        replay.target_topk_idx = ids_NK


def drop_recompute_ids(replay: Any) -> None:
    """Drop the head of the recompute queue (a forward that will not be recomputed)."""
    if replay.replay_backward_list:
        replay.replay_backward_list.pop(0)


def forget_replay_instances(model: Any) -> None:
    """Drop ``model``'s RouterReplay objects from Megatron's class-level instance list.

    Replay here addresses routers by layer number; the class-level list would only keep
    every model ever built alive and ordered by construction (0.17+ also slices static
    buffers by that order, which we do not use).
    """
    replay_class = __getattr__("RouterReplay")
    mine = {id(r) for m in model.modules() if (r := router_replay(m)) is not None}
    instances = replay_class.global_router_replay_instances
    instances[:] = [r for r in instances if id(r) not in mine]


# ------------------------------------------------------------------------ replay hazards

VIRTUAL_PIPELINE_KEY = "virtual_pipeline_model_parallel_size"


def replay_hazards(config: Mapping[str, Any] | Any) -> list[str]:
    """TransformerConfig settings under which routing replay would be silently wrong.

    Args:
        config: a ``TransformerConfig`` or the dict of fields it is about to be built from.

    Returns:
        One ``key=value: reason`` line per hazard (empty when replay is sound). Known in
        every version from 0.16.1 to 0.19.2 unless said otherwise.
    """
    get = config.get if isinstance(config, Mapping) else (lambda key, default=None: getattr(config, key, default))
    balancing = get("moe_router_load_balancing_type", "aux_loss")
    balancing = list(balancing) if isinstance(balancing, (list, tuple)) else [balancing]
    found = []
    if get("moe_router_fusion", False):
        found.append("moe_router_fusion=True: the fused TE router returns before the replay hook runs")
    if "quantile_balancing" in balancing:
        found.append("moe_router_load_balancing_type=quantile_balancing: selects experts without "
                     "the replay hook (0.19+)")
    if "sinkhorn" in balancing:
        found.append("moe_router_load_balancing_type=sinkhorn: selects experts without the replay hook")
    if get("mtp_num_layers", None):
        found.append(f"mtp_num_layers={get('mtp_num_layers')}: MTP routers share layer numbers with "
                     "the backbone and would replay its routes")
    if (get(VIRTUAL_PIPELINE_KEY, None) or 1) > 1:
        found.append(f"{VIRTUAL_PIPELINE_KEY}={get(VIRTUAL_PIPELINE_KEY)}: interleaved chunks run "
                     "backwards out of the replay queue's order")
    if get("moe_expert_capacity_factor", None) is not None:
        found.append("moe_expert_capacity_factor set: token dropping discards replayed routes")
    return found


# ------------------------------------------------------------------------ context parallelism


def core_attention_cp_group(pg_collection: Any) -> Any:
    """The context-parallel group Megatron hands a core-attention module, or None.

    ``Attention.__init__`` builds ``core_attention(..., cp_comm_type=..., pg_collection=
    self.pg_collection)``; the collection's ``cp`` field is the CP group (0.16.1-0.19.2).
    """
    return getattr(pg_collection, "cp", None) if pg_collection is not None else None


THD_CONTEXT_PARALLEL = (
    "THD rows under CP: each sequence's padded length a multiple of 2 x CP, cut into 2 x CP chunks, "
    "CP rank r holding chunks r and 2 x CP - 1 - r, sequence after sequence (TE thd_get_partitioned_indices, "
    "used by megatron.core.utils.get_thd_batch_on_this_cp_rank); Attention hands RoPE cu_seqlens_q_padded "
    "(else cu_seqlens_q) and the unfused THD RoPE rebuilds every rank's positions from them and the CP group"
)
"""The layout ``packing.cp_partition_indices`` produces because Megatron-Core's THD path (RoPE,
and Transformer Engine's attention on a GPU) assumes it; ``test_mcore_contract`` runs
Megatron's RoPE on each rank's share to hold us to it (0.16.1-0.19.2)."""


# ------------------------------------------------------------------------ layer specs


def spec_fields(use_te: bool) -> dict[str, Any]:
    """TransformerConfig fields that say which layer spec builds the model.

    0.19.2 resolves some submodules (MLA's q/kv norms and projections) from
    ``transformer_impl``, default ``transformer_engine``; 0.16.1 has no such field.
    """
    from megatron.core.transformer import TransformerConfig

    if "transformer_impl" not in {f.name for f in dataclasses.fields(TransformerConfig)}:
        return {}
    return {"transformer_impl": "transformer_engine" if use_te else "local"}


def spec_class(spec: Any) -> type | None:
    """The module class a layer-spec entry builds.

    0.16.1 describes every submodule as a ``ModuleSpec`` (``.module``); from 0.17 on, the MLP
    of a layer spec is an ``ExpertsBuilder``-style ``functools.partial`` of ``MoELayer`` or of
    ``MLP.as_mlp_submodule`` (a bound class method). A bare class stands for itself.
    """
    target = spec.func if isinstance(spec, functools.partial) else getattr(spec, "module", spec)
    if inspect.ismethod(target):
        target = target.__self__
    return target if isinstance(target, type) else None


@contextlib.contextmanager
def mla_without_transformer_engine() -> Iterator[None]:
    """Build MLA layers where Transformer Engine is absent.

    0.16.1's ``multi_latent_attention`` sets ``HAVE_TE`` when its TE extension module
    imports, which it does without TE, with a placeholder (not a class) for ``TELinear``;
    its constructor then calls ``isinstance`` on that placeholder: the flag is corrected.
    0.19.2 takes ``HAVE_TE`` from the TE extension itself, but then leaves its module-level
    ``Linear`` (the replicated linear it accepts for the down projections) None, so the
    local spec's :data:`ReplicatedLinear` is refused: it is set to that class. Both only
    for the build.
    """
    mla = importlib.import_module("megatron.core.transformer.multi_latent_attention")
    fixes: list[tuple[Any, str, Any]] = []
    if mla.HAVE_TE and not isinstance(mla.TELinear, type):
        fixes.append((mla, "HAVE_TE", False))
    if hasattr(mla, "Linear") and mla.Linear is None:
        fixes.append((mla, "Linear", __getattr__("ReplicatedLinear")))
    owner = next((c for c in mla.MLASelfAttention.__mro__ if "_resolve_qk_norm_config" in vars(c)), None)
    if owner is not None:
        fixes.append((owner, "_resolve_qk_norm_config", _resolve_qk_norm_without_q_latent))
    saved = [(owner, name, owner.__dict__[name]) for owner, name, _ in fixes]
    for owner, name, value in fixes:
        setattr(owner, name, value)
    try:
        yield
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)


def _resolve_qk_norm_without_q_latent(attention: Any, submodules: Any) -> dict:
    """0.19's ``MLASelfAttention._resolve_qk_norm_config`` with 0.16.1's meaning of QK norm
    when queries have no LoRA latent (``q_lora_rank`` None, e.g. Moonlight).

    0.16.1 then norms the kv latent only (as HF does); 0.19 demands a fused norm+linear
    for ``linear_q_proj``, which the local spec has none of. Resolved here as QK norm off
    for the queries and the spec's own kv norm kept (local spec only).
    """
    resolver_class = importlib.import_module("megatron.core.transformer.mla_qk_norm_config").QKNormConfigResolver
    config = attention.config
    # Only the local spec: the TE spec fuses its norms into the projections, as 0.19 expects.
    local = getattr(config, "transformer_impl", "local") == "local"
    if not (local and config.qk_layernorm and config.q_lora_rank is None):
        return resolver_class(config, submodules).resolve()
    identity = __getattr__("IdentityOp")
    without = copy.copy(config)
    without.qk_layernorm = False
    resolved = resolver_class(without, dataclasses.replace(submodules, q_layernorm=identity, kv_layernorm=identity)).resolve()
    resolved["kv_layernorm"] = submodules.kv_layernorm
    return resolved
