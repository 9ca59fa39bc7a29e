"""HF <-> Megatron checkpoint conversion: orchestration and the conversion record.

Owns: running a conversion on the ranks of a world (a local gloo world it starts, or the
caller's) after the inputs are checked (``hf_source.inspect_hf_checkpoint``); the
``conversion.json`` record, the copied HF side files and the tensors the family keeps aside
(``hf_passthrough.safetensors``: a vision tower, MTP layers) that let a Megatron checkpoint be
exported back to the very same HF layout, and where an export takes its HF config and
shard layout from (a checkpoint read dequantized exports without its ``quantization_config``);
and the all-or-nothing output directory.

A Megatron distributed checkpoint stores every tensor by its global offsets, so the
layout a conversion runs under only decides how the work and memory are split: the
result loads into any TP/EP/PP layout. Does not own the name tables (``mapping``), file
formats (``hf_io``), checking an HF checkpoint (``hf_source``) or Megatron internals
(``megatron_io``).
"""

from __future__ import annotations

import contextlib
import json
import shutil
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

import torch
from safetensors.torch import save_file

from megatron_rl.checkpoint.errors import CheckpointMismatchError
from megatron_rl.checkpoint.hf_config import (
    architecture_of,
    dequantized_config,
    hf_config_from_model,
    model_config_from_hf,
    read_config,
)
from megatron_rl.checkpoint.hf_io import (
    PASSTHROUGH_NAME,
    HFCheckpoint,
    ShardPlan,
    ShardWriter,
    atomic_output_dir,
    copy_files,
    named_sizes,
    read_named,
    staging_dir,
    tensor_bytes,
)
from megatron_rl.checkpoint.hf_source import (
    DTYPE_NAMES,
    HFSource,
    inspect_hf_checkpoint,
)
from megatron_rl.checkpoint.inputs import (
    check_dist_checkpoint,
    check_output_dir,
    missing_parents,
    read_json,
    remove_created_parents,
)
from megatron_rl.checkpoint.local_world import (
    check_layout,
    minimal_world_size,
    run_local,
)
from megatron_rl.checkpoint.mapping import all_weights
from megatron_rl.checkpoint.weight_rules import passthrough_names
from megatron_rl.checkpoint.trainer_source import (
    TRAINER_STATE_NAME,
    check_same_model,
    is_optimizer_key,
    is_trainer_checkpoint,
    read_trainer_model,
)
from megatron_rl.config_loading import ConfigError, from_dict
from megatron_rl.parallel import comm
from megatron_rl.sections import ModelConfig, ParallelConfig

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from megatron_rl.parallel.groups import ParallelGroups

RECORD_NAME = "conversion.json"
HF_FILES_DIR = "hf_files"


# ------------------------------------------------------------------ the conversion record


def write_record(directory: str | Path, source: HFSource) -> None:
    """Store ``conversion.json`` and copies of the HF side files in a Megatron checkpoint."""
    files_dir = Path(directory) / HF_FILES_DIR
    files_dir.mkdir()
    names = copy_files([Path(f) for f in source.files], files_dir)
    if source.passthrough:
        # Tensors kept aside (a vision tower, MTP layers) travel with the checkpoint, unchanged.
        save_file(dict(read_named(source.passthrough)), str(Path(directory) / PASSTHROUGH_NAME))
    record = {
        "architecture": source.architecture,
        "model": asdict(source.model),
        "hf_index": source.index,
        "hf_files": names,
        "hf_passthrough": sorted(source.passthrough),
    }
    (Path(directory) / RECORD_NAME).write_text(json.dumps(record, indent=1))


def read_export_source(megatron_dir: str | Path, hf_config: str | Path | None = None) -> HFSource:
    """Where an export takes its architecture, HF config, side files and shard plan from.

    Args:
        megatron_dir: distributed checkpoint; its ``conversion.json`` is used by default,
            and a trainer checkpoint without one generates its HF config from the run
            config in ``trainer_state.json`` (``model``, ``rollout.sglang.hf_architecture``).
        hf_config: another converted Megatron checkpoint, or an HF checkpoint directory
            (its config.json, side files and index; the dtype is the Megatron checkpoint's).
            It wins over both defaults, but for a trainer checkpoint it must describe the
            model the trainer trained. The vocabulary padding (``vocab_padding_multiple``)
            is always the checkpoint's own (its run config or conversion record).

    Raises:
        CheckpointMismatchError: neither source has a record or an HF config, the run's
            model cannot be expressed in its architecture, or the given HF config
            describes another model than the trainer's (differing fields named).
    """
    check_dist_checkpoint(megatron_dir)
    trainer = is_trainer_checkpoint(megatron_dir)
    if trainer and hf_config is None and not (Path(megatron_dir) / RECORD_NAME).exists():
        return _trainer_source(megatron_dir)
    source = _recorded_or_hf_source(megatron_dir, hf_config)
    if trainer:
        where = Path(hf_config) if hf_config is not None else Path(megatron_dir) / RECORD_NAME
        trained = read_trainer_model(megatron_dir).model
        check_same_model(trained, source.model, where)
        stored = trained
    elif hf_config is not None and (Path(megatron_dir) / RECORD_NAME).exists():
        stored = _recorded_or_hf_source(megatron_dir, None).model
    else:
        stored = source.model
    # The stored rows are padded as the checkpoint's own run or conversion padded them; an
    # HF config knows no padding, and the export strips it anyway.
    source.model.vocab_padding_multiple = stored.vocab_padding_multiple
    carried = next((Path(f) for f in source.files if Path(f).name == "config.json"), None)
    if source.config is None and carried is not None:
        # A checkpoint read dequantized (MXFP4 experts) is exported in its stored dtype.
        source.config = dequantized_config(read_json(carried))
    return source


def _trainer_source(megatron_dir: str | Path) -> HFSource:
    """A trainer checkpoint with no HF origin: config.json generated from the run's model."""
    trained = read_trainer_model(megatron_dir)
    dtype = DTYPE_NAMES[stored_dtype(megatron_dir)]
    if dtype != trained.model.params_dtype:
        raise CheckpointMismatchError(
            f"{megatron_dir}: the model tensors are {dtype}, but {TRAINER_STATE_NAME} says "
            f"config.model.params_dtype={trained.model.params_dtype!r}"
        )
    return HFSource(
        architecture=trained.architecture,
        model=trained.model,
        index=None,
        files=[],
        config=hf_config_from_model(trained.architecture, trained.model, dtype),
    )


def _recorded_or_hf_source(megatron_dir: str | Path, hf_config: str | Path | None) -> HFSource:
    """The conversion record of ``hf_config`` (default: the checkpoint), or its HF config.json."""
    source = Path(hf_config) if hf_config is not None else Path(megatron_dir)
    record_path = source / RECORD_NAME
    if record_path.exists():
        record = read_json(record_path, required=("architecture", "model", "hf_index", "hf_files"))
        try:
            model = from_dict(ModelConfig, record["model"], prefix=f"{RECORD_NAME}.model")
        except ConfigError as err:
            raise CheckpointMismatchError(f"{record_path}: {err}") from None
        return HFSource(
            architecture=record["architecture"],
            model=model,
            index=record["hf_index"],
            files=[str(source / HF_FILES_DIR / name) for name in record["hf_files"]],
            passthrough={name: str(source / PASSTHROUGH_NAME) for name in record.get("hf_passthrough", [])},
        )
    if not (source / "config.json").exists():
        raise CheckpointMismatchError(
            f"{source} has neither {RECORD_NAME} (written by convert_hf_to_megatron) nor an HF config.json; "
            "pass the HF checkpoint the model came from"
        )
    config = read_config(source)
    model = model_config_from_hf(config, DTYPE_NAMES[stored_dtype(megatron_dir)])
    checkpoint = HFCheckpoint(source) if any(source.glob("*.safetensors")) else None
    extra = checkpoint.extra_files() if checkpoint else sorted(p for p in source.iterdir() if p.is_file())
    arch = architecture_of(config)
    kept = passthrough_names(arch, checkpoint.names()) if checkpoint else []
    return HFSource(
        architecture=arch.name,
        model=model,
        index=checkpoint.index if checkpoint else None,
        files=[str(p) for p in extra],
        passthrough={name: str(source / checkpoint.weight_map[name]) for name in kept},
    )


def stored_dtype(megatron_dir: str | Path) -> torch.dtype:
    """The one dtype of a distributed checkpoint's model tensors.

    A trainer checkpoint's optimizer state is left out: under bf16 training it holds the
    float32 main parameters next to the bf16 model.
    """
    import torch.distributed.checkpoint as dcp

    metadata = dcp.FileSystemReader(str(megatron_dir)).read_metadata().state_dict_metadata
    skip = is_optimizer_key if is_trainer_checkpoint(megatron_dir) else (lambda key: False)
    dtypes = {m.properties.dtype for k, m in metadata.items() if hasattr(m, "properties") and not skip(k)}
    if len(dtypes) != 1 or next(iter(dtypes)) not in DTYPE_NAMES:
        raise CheckpointMismatchError(
            f"{megatron_dir}: tensors must share one float dtype, found {sorted(map(str, dtypes))}"
        )
    return next(iter(dtypes))


def export_plan(source: HFSource, max_shard_bytes: int | None = None) -> ShardPlan:
    """The carried HF shard layout when it names exactly the expected tensors, else shards by size."""
    weights = all_weights(source.arch, source.model)
    names = [n for w in weights for n in w.hf] + list(source.passthrough)
    if max_shard_bytes is None:
        carried = ShardPlan.from_index(source.index, names)
        if set(carried.weight_map) == set(names):
            return carried
        max_shard_bytes = 5 * 2**30
    dtype = getattr(torch, source.model.params_dtype)
    sizes = {n: tensor_bytes(s, dtype) for w in weights for n, s in zip(w.hf, w.hf_shapes)}
    return ShardPlan.by_size({**sizes, **named_sizes(source.passthrough)}, max_shard_bytes)


# ------------------------------------------------------------------ running the conversions


@contextlib.contextmanager
def collective_output_dir(final: str | Path, group: ProcessGroup) -> Iterator[Path]:
    """:func:`~megatron_rl.checkpoint.hf_io.atomic_output_dir` owned by rank 0 of ``group``
    (every rank of the world that writes).

    Every rank gets the staging path; it is renamed into place after all ranks leave the
    block, and deleted by rank 0 when the block raises there.
    """
    rank0 = comm.rank(group) == 0
    owner = atomic_output_dir(final) if rank0 else contextlib.nullcontext()
    error = None
    try:
        owner.__enter__()
    except Exception as err:  # noqa: BLE001 - every rank must learn of it below
        error = err
    comm.raise_first_failure(error, group, "creating the output directory")
    try:
        yield staging_dir(final)
        comm.barrier(group)
    except BaseException as exc:
        owner.__exit__(type(exc), exc, exc.__traceback__)
        raise
    owner.__exit__(None, None, None)
    comm.barrier(group)


def hf_to_megatron_collective(
    hf_dir: str | Path,
    out_dir: str | Path,
    parallel: ParallelConfig,
    groups: ParallelGroups,
    progress: bool = False,
    vocab_padding_multiple: int = 1,
) -> None:
    """Every rank of a world whose Megatron parallel state is ``parallel`` (``groups``) calls this.

    Validates the HF checkpoint, then writes the distributed checkpoint (plus the
    conversion record, which keeps ``vocab_padding_multiple``) to ``out_dir`` all-or-nothing.
    """
    from megatron_rl.checkpoint.megatron_io import hf_to_megatron_rank

    source = inspect_hf_checkpoint(hf_dir, vocab_padding_multiple)
    check_layout(source.model, parallel, comm.size(groups.world))
    rank0 = comm.rank(groups.world) == 0
    with collective_output_dir(out_dir, groups.world) as staging:
        if rank0:
            write_record(staging, source)
        hf_to_megatron_rank(source.arch, source.model, parallel, groups, hf_dir, staging, progress and rank0)


def megatron_to_hf_collective(
    megatron_dir: str | Path,
    out_dir: str | Path,
    group: ProcessGroup,
    hf_config: str | Path | None = None,
    max_shard_bytes: int | None = None,
    progress: bool = False,
) -> None:
    """Export in a world of one process (``group``) whose Megatron parallel state is TP1/EP1/PP1."""
    from megatron_rl.checkpoint.megatron_io import megatron_to_hf_rank

    if comm.size(group) != 1:
        raise RuntimeError(f"export runs in a world of 1 process, not {comm.size(group)}")
    source = read_export_source(megatron_dir, hf_config)
    with atomic_output_dir(out_dir) as staging:
        copy_files([Path(f) for f in source.files], staging)
        if source.config is not None:
            (staging / "config.json").write_text(json.dumps(source.config, indent=2) + "\n")
        writer = ShardWriter(staging, export_plan(source, max_shard_bytes), progress)
        megatron_to_hf_rank(source.arch, source.model, megatron_dir, writer, progress)
        for name, tensor in read_named(source.passthrough):
            writer.add(name, tensor)
        writer.finish()


def hf_to_megatron_world_entry(
    hf_dir: str, out_dir: str, parallel: ParallelConfig, progress: bool, vocab_padding_multiple: int = 1
) -> None:
    """Per-rank body of a conversion world: CPU platform, parallel state, then the conversion."""
    from megatron_rl.parallel.cpu_platform import cpu_platform
    from megatron_rl.parallel.groups import model_parallel

    enable = parallel.use_cpu_platform is not False
    with cpu_platform(enable=enable), model_parallel(parallel, seed=0) as groups:
        hf_to_megatron_collective(hf_dir, out_dir, parallel, groups, progress, vocab_padding_multiple)


def megatron_to_hf_world_entry(
    megatron_dir: str, out_dir: str, hf_config: str | None, max_shard_bytes: int | None, progress: bool
) -> None:
    """Body of an export world of one process: CPU platform, TP1 parallel state, then the export."""
    from megatron_rl.parallel.cpu_platform import cpu_platform
    from megatron_rl.parallel.groups import model_parallel

    with cpu_platform(), model_parallel(ParallelConfig(), seed=0) as groups:
        megatron_to_hf_collective(megatron_dir, out_dir, groups.world, hf_config, max_shard_bytes, progress)


def _run_into(out_dir: str | Path, entry, world_size: int, *args, timeout_s: float) -> Path:
    """Run the world that writes ``out_dir``; on any failure nothing of it is left, parents included."""
    check_output_dir(out_dir)
    if staging_dir(out_dir).exists():
        raise FileExistsError(f"{staging_dir(out_dir)} already exists; choose a new output directory")
    created = missing_parents(out_dir)
    try:
        run_local(entry, world_size, *args, timeout_s=timeout_s)
    except BaseException:
        # A rank killed mid-write cannot clean up; the staging directory is this run's.
        shutil.rmtree(staging_dir(out_dir), ignore_errors=True)
        remove_created_parents(created)
        raise
    return Path(out_dir)


def convert_hf_to_megatron(
    hf_dir: str | Path,
    out_dir: str | Path,
    parallel: ParallelConfig | None = None,
    *,
    world_size: int | None = None,
    progress: bool = True,
    timeout_s: float = 24 * 3600.0,
    vocab_padding_multiple: int = 1,
) -> Path:
    """Convert an HF checkpoint into a Megatron distributed checkpoint, in a local gloo world.

    One process converts in this process; a larger layout spawns one process per rank.

    Args:
        hf_dir: HF checkpoint (safetensors, single file or sharded with an index).
        out_dir: new directory for the distributed checkpoint.
        parallel: layout the conversion runs under (memory per process shrinks with it).
        world_size: processes to start; defaults to the fewest the layout needs.
        progress: show progress bars.
        timeout_s: wall-clock limit for the world.
        vocab_padding_multiple: pad the vocabulary rows to a multiple of this (zeros,
            stripped again on export); TP must divide the padded size.

    Raises:
        CheckpointMismatchError: the HF checkpoint does not fit its config or the table.
        ConfigError: the layout does not divide the model (padded vocabulary included).
        FileExistsError: ``out_dir`` (or its staging directory) exists.
    """
    parallel = parallel or ParallelConfig()
    source = inspect_hf_checkpoint(hf_dir, vocab_padding_multiple)
    world_size = world_size or minimal_world_size(parallel)
    check_layout(source.model, parallel, world_size)
    args = (str(hf_dir), str(out_dir), parallel, progress, vocab_padding_multiple)
    return _run_into(out_dir, hf_to_megatron_world_entry, world_size, *args, timeout_s=timeout_s)


def convert_megatron_to_hf(
    megatron_dir: str | Path,
    out_dir: str | Path,
    *,
    hf_config: str | Path | None = None,
    max_shard_bytes: int | None = None,
    progress: bool = True,
    timeout_s: float = 24 * 3600.0,
) -> Path:
    """Export a Megatron distributed checkpoint (any layout) as an HF checkpoint.

    Args:
        megatron_dir: distributed checkpoint written by :func:`convert_hf_to_megatron` or
            by the trainer, or any model checkpoint of a supported architecture with ``hf_config``.
        out_dir: new directory for the HF checkpoint.
        hf_config: where the HF config, side files and shard layout come from (see
            :func:`read_export_source`); default: the checkpoint's own record.
        max_shard_bytes: re-shard by size instead of reproducing the recorded layout.
        progress: show progress bars.
        timeout_s: wall-clock limit.
    """
    read_export_source(megatron_dir, hf_config)
    template = None if hf_config is None else str(hf_config)
    args = (str(megatron_dir), str(out_dir), template, max_shard_bytes, progress)
    return _run_into(out_dir, megatron_to_hf_world_entry, 1, *args, timeout_s=timeout_s)
