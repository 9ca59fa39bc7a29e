"""Megatron side of the converters: fill a model of any layout from HF tensors, and read a
distributed checkpoint back one layer at a time.

Owns: building the Megatron model an architecture needs (local spec, on the meta device
when only its structure is wanted), the local -> global (TP1/EP1/PP1) parameter naming,
filling every local parameter of a rank from the HF tensors through the mapping table,
and reading boxes of a distributed checkpoint without a process group (torch DCP with a
planner that asks for exactly the slices one layer needs). Runs on the ranks of a world
(``megatron_rl.checkpoint.convert`` starts and finishes the work); does not own output
directories, HF config translation or the name tables.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from megatron.core.models.gpt import GPTModel
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    MetadataIndex,
)
from torch.distributed.checkpoint.planner import LoadPlan
from torch.distributed.checkpoint.planner_helpers import (
    create_read_items_for_chunk_list,
)
from tqdm import tqdm

from megatron_rl.checkpoint.errors import CheckpointMismatchError, format_names
from megatron_rl.checkpoint.families import mtp_tensor_names
from megatron_rl.checkpoint.weight_rules import passthrough_names
from megatron_rl.checkpoint.hf_config import read_config
from megatron_rl.checkpoint.hf_io import HFCheckpoint, ShardWriter
from megatron_rl.checkpoint.mapping import (
    Architecture,
    StackedExperts,
    bound_for_megatron_name,
    fuse,
    to_hf,
    tp_shard,
    weight_groups,
)
from megatron_rl.checkpoint.trainer_source import (
    is_optimizer_key,
    is_trainer_checkpoint,
)
from megatron_rl.parallel import mcore_checkpoint, mcore_compat as mc
from megatron_rl.parallel.checkpoint import load_model, load_sharded, save_model
from megatron_rl.parallel.comm import all_gather_objects
from megatron_rl.parallel.groups import ParallelGroups
from megatron_rl.parallel.model import build_model
from megatron_rl.parallel.te_names import canonical_name
from megatron_rl.sections import ModelConfig, ParallelConfig

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")
_LOCAL_EXPERT = re.compile(r"^(mlp\.experts\.local_experts\.)(\d+)(\..*)$")
# Grouped-GEMM experts (TE / GroupedMLP) name each local expert's weight ``linear_fc1.weight<i>``.
_GROUPED_EXPERT = re.compile(r"^(mlp\.experts\.linear_fc[12]\.(?:weight|bias))(\d+)()$")


def build_model_for(
    arch: Architecture, model: ModelConfig, parallel: ParallelConfig, meta: bool = False
) -> GPTModel:
    """This rank's model stage for ``arch`` (local spec: its parameter names are the table's).

    Args:
        arch: architecture (decides the QK norms).
        model: sizes.
        parallel: layout (parallel state must be initialized to match).
        meta: build on the meta device (structure and names only, no memory).
    """
    if arch.qk_layernorm is not None and model.qk_layernorm != arch.qk_layernorm:
        raise CheckpointMismatchError(
            f"model.qk_layernorm={model.qk_layernorm} does not match the architecture "
            f"(qk_layernorm={arch.qk_layernorm})"
        )
    if meta:
        with torch.device("meta"):
            return build_model(model, parallel, use_te=False)
    return build_model(model, parallel, use_te=False)


def named_weights(gpt: GPTModel) -> dict[str, torch.Tensor]:
    """Parameters and the persistent buffers a checkpoint holds (the routers' expert bias).

    Megatron keeps the aux-loss-free expert bias as a buffer: it is a checkpoint tensor
    like any weight, but no optimizer step changes it.
    """
    weights = dict(gpt.named_parameters())
    weights.update({n: b for n, b in gpt.named_buffers() if n.endswith(_PERSISTENT_BUFFERS)})
    return weights


_PERSISTENT_BUFFERS = (".router.expert_bias",)


def global_parameter_names(gpt: GPTModel) -> dict[str, str]:
    """Local weight name (:func:`named_weights`) -> its name in a TP1/EP1/PP1 local-spec model.

    Layer and expert indices become global; a TE-spec model's names become the local
    spec's (``te_names.canonical_name``).
    """
    names = {}
    for name in named_weights(gpt):
        match = _LAYER.match(name)
        if match is None:
            names[name] = name
            continue
        layer = gpt.decoder.layers[int(match.group(1))]
        rest = match.group(2)
        expert = _LOCAL_EXPERT.match(rest) or _GROUPED_EXPERT.match(rest)
        if expert is not None:
            index = layer.mlp.local_expert_indices[int(expert.group(2))]
            rest = f"{expert.group(1)}{index}{expert.group(3)}"
        # A Transformer Engine spec model's fused norms and grouped experts get the
        # local-spec names of the tables (te_names), so every consumer is spec-agnostic.
        names[name] = canonical_name(f"decoder.layers.{layer.layer_number - 1}.{rest}")
    return names


def fill_from_hf(
    gpt: GPTModel,
    arch: Architecture,
    model: ModelConfig,
    checkpoint: HFCheckpoint,
    tp_rank: int,
    tp_size: int,
    progress: bool = False,
    cast: bool = False,
) -> set[str]:
    """Copy every local parameter from its HF tensors; returns the HF names used.

    Experts are not split over tensor parallelism (expert-TP 1); every other weight takes
    its ``tp_axis`` shard. The embedding and output layer get zero rows past the vocabulary
    up to ``model.padded_vocab_size`` (``mapping.fuse``). ``cast`` converts each tensor to the parameter's dtype (a run
    that trains a bf16 checkpoint in fp32); without it a dtype difference is an error.

    Raises:
        CheckpointMismatchError: a parameter has no table entry, or the mapped tensor's
            shape or dtype differs from the parameter's (both named).
    """
    params = named_weights(gpt)
    used: set[str] = set()
    names = global_parameter_names(gpt)
    for local, name in tqdm(names.items(), desc="filling Megatron parameters", disable=not progress):
        weight = bound_for_megatron_name(arch, model, name)
        # A stacked HF tensor (every expert of a layer) is read at this expert's slice only.
        index = weight.expert if weight.rule.stacked else None
        full = fuse(weight, [checkpoint.get(n, index) for n in weight.hf], model)
        rank, size = (0, 1) if weight.rule.scope == "expert" else (tp_rank, tp_size)
        shard = tp_shard(weight, full, rank, size, model)
        param = params[local]
        if cast or weight.rule.buffer:
            # Buffers (the float32 expert bias) widen exactly from any checkpoint dtype.
            shard = shard.to(param.dtype)
        if tuple(shard.shape) != tuple(param.shape) or shard.dtype != param.dtype:
            raise CheckpointMismatchError(
                f"Megatron parameter {local} ({name}) is {tuple(param.shape)} {param.dtype}, but "
                f"{', '.join(weight.hf)} give {tuple(shard.shape)} {shard.dtype}"
            )
        with torch.no_grad():
            param.copy_(shard)
        used.update(weight.hf)
    return used


def hf_to_megatron_rank(
    arch: Architecture,
    model: ModelConfig,
    parallel: ParallelConfig,
    groups: ParallelGroups,
    hf_dir: str | Path,
    output_dir: str | Path,
    progress: bool = False,
) -> None:
    """Collective over the world: build this rank's stage, fill it from the HF checkpoint, save it.

    Parameters are allocated uninitialized (meta build, then ``to_empty``): each is
    overwritten from the checkpoint, which :func:`fill_from_hf` guarantees, and random
    initialization of a large model would cost minutes.

    Raises:
        CheckpointMismatchError: a parameter cannot be filled, the model has buffers that
            no checkpoint tensor fills, or HF tensors were left unused by every rank.
    """
    gpt = build_model_for(arch, model, parallel, meta=True)
    # Only persistent buffers reach the saved checkpoint; non-persistent ones (counters,
    # YaRN's cos/sin caches) are rebuilt by whoever builds the model to run it.
    saved = set(gpt.state_dict())
    buffers = [name for name, _ in gpt.named_buffers() if name in saved and not name.endswith(_PERSISTENT_BUFFERS)]
    if buffers:
        raise CheckpointMismatchError(f"model buffers would stay uninitialized: {format_names(buffers)}")
    on_gpu = torch.cuda.is_available()
    gpt.to_empty(device=torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu"))
    checkpoint = HFCheckpoint(hf_dir)
    # Multi-token-prediction layers are not part of the Megatron model (skipped, noted by
    # hf_source.inspect_hf_checkpoint).
    skipped = mtp_tensor_names(read_config(hf_dir), checkpoint.names())
    used = fill_from_hf(gpt, arch, model, checkpoint, groups.tp_rank, groups.tp_size, progress)
    everyone = all_gather_objects(used, groups.world)
    unused = set(checkpoint.names()) - set().union(*everyone) - set(skipped)
    unused -= set(passthrough_names(arch, checkpoint.names()))
    if unused:
        raise CheckpointMismatchError(f"HF tensors no Megatron parameter consumed: {format_names(unused)}")
    # The staging directory already holds the INCOMPLETE marker and the conversion record,
    # which Megatron's save would report as an "old incomplete / corrupted checkpoint".
    quiet = logging.getLogger(mc.DIST_CHECKPOINT_LOGGER)
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        save_model(gpt, output_dir)
    finally:
        quiet.setLevel(level)


# ------------------------------------------------------------------ reading a dist checkpoint


class _BoxPlanner(DefaultLoadPlanner):
    """Reads boxes of stored tensors into plain tensors.

    Megatron's loader needs every box of a tensor to belong to some rank of the world;
    torch DCP's planner interface can read any box directly, without a process group.
    """

    def __init__(self, boxes: list[tuple[mc.StoredBox, torch.Tensor]]) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._boxes = boxes
        self._targets = {(box.key, box.offsets): tensor for box, tensor in boxes}

    def create_local_plan(self) -> LoadPlan:
        items = []
        for box, _ in self._boxes:
            chunk = ChunkStorageMetadata(offsets=torch.Size(box.offsets), sizes=torch.Size(box.shape))
            stored = self.metadata.state_dict_metadata[box.key]
            items += create_read_items_for_chunk_list(box.key, stored, [chunk])
        return LoadPlan(items)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        return self._targets[(index.fqn, tuple(index.offset))]


class DistCheckpointReader:
    """Reads the full (TP1/EP1/PP1) parameters of a Megatron distributed checkpoint by name.

    Args:
        directory: the distributed checkpoint.
        template: a TP1/EP1/PP1 model of the checkpoint's architecture (meta is enough);
            its sharded state dict says where each parameter lives in the checkpoint.

    A trainer checkpoint (``trainer_state.json`` beside it) also holds Megatron's
    optimizer state; those keys (``[chained_<i>.]optimizer.*``) are skipped there and only
    there: in a model checkpoint they are unknown tensors like any other.

    Raises:
        CheckpointMismatchError: the checkpoint holds tensors the model does not have,
            lacks some it has, or stores one with another global shape (all named).
    """

    def __init__(self, directory: str | Path, template: GPTModel) -> None:
        self.directory = str(directory)
        sharded = template.sharded_state_dict()
        self._entries = {name: mcore_checkpoint.stored_boxes(sharded[name]) for name in named_weights(template)}
        objects = mcore_checkpoint.stored_object_keys(sharded)
        stored = dcp.FileSystemReader(self.directory).read_metadata().state_dict_metadata
        expected = mcore_checkpoint.stored_tensor_shapes(sharded)
        skip = is_optimizer_key if is_trainer_checkpoint(directory) else (lambda key: False)
        problems = []
        for key, meta in stored.items():
            if skip(key):
                continue
            if isinstance(meta, BytesStorageMetadata):
                base = mcore_checkpoint.object_base_key(key)
                # A TE-spec model's norms write ``_extra_state`` (FP8 scaling metadata, no
                # weights) that the local-spec template lacks; reading weights skips it.
                # Megatron's own common state (0.19: an object in the DCP files) is no weight either.
                if base not in objects and not base.endswith("_extra_state") and not mcore_checkpoint.is_megatron_object(base):
                    problems.append(f"unknown object {key}")
            elif key not in expected:
                problems.append(f"unknown tensor {key} {tuple(meta.size)}")
            elif tuple(meta.size) != expected[key]:
                problems.append(f"tensor {key} is {tuple(meta.size)}, the model needs {expected[key]}")
        problems += [f"missing tensor {key} {shape}" for key, shape in expected.items() if key not in stored]
        if problems:
            raise CheckpointMismatchError(
                f"Megatron checkpoint {directory} does not match the model: " + "; ".join(problems)
            )

    def read(self, names: list[str]) -> dict[str, torch.Tensor]:
        """The named parameters, full size, in one pass over the checkpoint files."""
        requests = []
        for name in names:
            boxes, _ = self._entries[name]
            requests += [(box, torch.empty(box.shape, dtype=box.dtype)) for box in boxes]
        reader = dcp.FileSystemReader(self.directory)
        dcp.load({}, storage_reader=reader, planner=_BoxPlanner(requests), no_dist=True)
        loaded = iter(t for _, t in requests)
        out = {}
        for name in names:
            boxes, merge = self._entries[name]
            out[name] = merge([next(loaded) for _ in boxes])
        return out


def load_megatron_model(
    arch: Architecture, model: ModelConfig, parallel: ParallelConfig, directory: str | Path
) -> GPTModel:
    """This rank's stage of ``parallel``, loaded (resharded) from a distributed checkpoint."""
    gpt = build_model_for(arch, model, parallel)
    load_megatron_model_into(gpt, directory)
    return gpt


def load_megatron_model_into(gpt: GPTModel, directory: str | Path) -> None:
    """Collective: load a model or trainer checkpoint (model part only) into ``gpt``, resharded."""
    if not is_trainer_checkpoint(directory):
        load_model(gpt, directory)
        return
    # The trainer saved {"model": ..., "optimizer": ...}; the optimizer's common state
    # (param groups) would be unexpected keys of the model, so read the model's part only.
    state = load_sharded({"model": gpt.sharded_state_dict()}, directory)["model"]
    result = gpt.load_state_dict(state, strict=False)
    wrong = [k for k in (*result.missing_keys, *result.unexpected_keys) if not k.endswith("_extra_state")]
    if wrong:
        raise CheckpointMismatchError(f"trainer checkpoint {directory} does not match the model: {format_names(wrong)}")


def megatron_to_hf_rank(
    arch: Architecture,
    model: ModelConfig,
    megatron_dir: str | Path,
    writer: ShardWriter,
    progress: bool = False,
) -> None:
    """Stream a distributed checkpoint into HF tensors, one layer group at a time.

    Needs initialized TP1/EP1/PP1 parallel state (for the meta template model).
    """
    template = build_model_for(arch, model, ParallelConfig(), meta=True)
    groups = weight_groups(arch, model)
    table = {w.megatron for group in groups.values() for w in group}
    params = set(named_weights(template))
    if table != params:
        raise CheckpointMismatchError(
            f"the {arch.name} table and the Megatron model disagree: only in the table "
            f"[{format_names(table - params)}], only in the model [{format_names(params - table)}]"
        )
    reader = DistCheckpointReader(megatron_dir, template)
    stacked = StackedExperts()
    for group in tqdm(groups.values(), desc="exporting layers", disable=not progress):
        tensors = reader.read([w.megatron for w in group])
        for weight in group:
            for part, (name, tensor) in enumerate(to_hf(weight, tensors[weight.megatron], model)):
                if weight.rule.stacked and (tensor := stacked.add(weight, name, part, tensor)) is None:
                    continue
                writer.add(name, tensor)

