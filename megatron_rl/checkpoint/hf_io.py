"""Hugging Face safetensors checkpoints: streaming reads, planned shard writes, atomic output.

Owns: :class:`HFCheckpoint` (names, shapes and dtypes from the safetensors headers without
reading data; one tensor, or one expert's slice of a stacked one, at a time on request; MXFP4
block/scale pairs read as the bf16 weights they encode), the tensors a conversion keeps aside
(:func:`read_named`), :class:`ShardPlan` / :class:`ShardWriter`
(which tensor goes to which file; a file is written as soon as its last tensor arrives,
so memory holds at most the shards still being filled), and :func:`atomic_output_dir`
(a conversion writes into a hidden sibling directory marked ``INCOMPLETE`` that is
renamed into place only after the last byte, and removed on failure). Does not own the
HF <-> Megatron mapping or any Megatron state.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from megatron_rl.checkpoint import mxfp4
from megatron_rl.checkpoint.errors import CheckpointMismatchError, format_names
from megatron_rl.checkpoint.inputs import (
    check_output_dir,
    missing_parents,
    read_json,
    remove_created_parents,
)

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
INCOMPLETE_MARKER = "INCOMPLETE"
_SAFETENSORS_DTYPES = {
    "F32": torch.float32,
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F8_E4M3": torch.float8_e4m3fn,
    "U8": torch.uint8,
}


class HFCheckpoint:
    """Read-only view of an HF safetensors checkpoint (one file, or shards with an index).

    Args:
        directory: the checkpoint directory.

    Raises:
        CheckpointMismatchError: no weights, a shard named by the index is missing, or
            the index and the shard files disagree about which tensors exist.
    """

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        index_path = self.directory / INDEX_NAME
        if index_path.exists():
            self.index: dict | None = read_json(index_path, required=("weight_map",))
            if not isinstance(self.index["weight_map"], dict):
                raise CheckpointMismatchError(f"{index_path}: 'weight_map' is not an object")
            self.weight_map: dict[str, str] = dict(self.index["weight_map"])
        elif (self.directory / SINGLE_NAME).exists():
            self.index = None
            with _open_safetensors(self.directory / SINGLE_NAME) as f:
                self.weight_map = {name: SINGLE_NAME for name in f.keys()}
        else:
            raise CheckpointMismatchError(f"{self.directory}: neither {INDEX_NAME} nor {SINGLE_NAME} exists")
        self._headers: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        self._handles: dict[str, object] = {}
        for file in sorted(set(self.weight_map.values())):
            self._read_header(file)
        unlisted = set(self._headers) - set(self.weight_map)
        absent = set(self.weight_map) - set(self._headers)
        if unlisted or absent:
            raise CheckpointMismatchError(
                f"{self.directory}: index and shards disagree; in shards but not the index: "
                f"[{format_names(unlisted)}]; in the index but not in its shard: [{format_names(absent)}]"
            )
        self._mxfp4 = self._pair_mxfp4()

    def _read_header(self, file: str) -> None:
        path = self.directory / file
        if not path.exists():
            named = [n for n, f in self.weight_map.items() if f == file]
            raise CheckpointMismatchError(f"{path} is missing (it holds {format_names(named, 3)})")
        handle = _open_safetensors(path)
        self._handles[file] = handle
        for name in handle.keys():
            view = handle.get_slice(name)
            kind = view.get_dtype()
            if kind not in _SAFETENSORS_DTYPES:
                raise CheckpointMismatchError(f"tensor {name} in {file} has unsupported dtype {kind}")
            if self.weight_map.get(name, file) == file:
                self._headers[name] = (tuple(view.get_shape()), _SAFETENSORS_DTYPES[kind])

    def _pair_mxfp4(self) -> dict[str, tuple[str, str]]:
        """``{X: (X_blocks, X_scales)}`` of the MXFP4 weights (:mod:`~megatron_rl.checkpoint.mxfp4`),
        which read as ``X``; any other uint8 tensor is refused."""
        pairs, stray = {}, []
        for name, (shape, dtype) in self._headers.items():
            if dtype != torch.uint8:
                continue
            base = name.removesuffix(mxfp4.BLOCKS_SUFFIX).removesuffix(mxfp4.SCALES_SUFFIX)
            blocks, scales = base + mxfp4.BLOCKS_SUFFIX, base + mxfp4.SCALES_SUFFIX
            if base == name or self._headers.get(blocks, (None, None))[1] != torch.uint8 or \
                    self._headers.get(scales, (None, None))[1] != torch.uint8:
                stray.append(name)
                continue
            if tuple(self._headers[blocks][0][:-1]) != tuple(self._headers[scales][0]):
                raise CheckpointMismatchError(
                    f"{self.directory}: MXFP4 {blocks} {self._headers[blocks][0]} and {scales} "
                    f"{self._headers[scales][0]} do not match (scales are the blocks without their last axis)")
            pairs[base] = (blocks, scales)
        if stray:
            raise CheckpointMismatchError(f"{self.directory}: uint8 tensors that are not MXFP4 block/scale pairs: "
                                          f"{format_names(stray, 3)}")
        return pairs

    def names(self) -> list[str]:
        """Every tensor name, in index order (an MXFP4 weight by the name it encodes)."""
        hidden = {n for pair in self._mxfp4.values() for n in pair}
        out = [n for n in self.weight_map if n not in hidden]
        return out + [base for base in self._mxfp4 if base not in self.weight_map]

    def shape(self, name: str) -> tuple[int, ...]:
        """Shape from the header (no data read)."""
        if name in self._mxfp4:
            return mxfp4.dequantized_shape(self._headers[self._mxfp4[name][0]][0])
        return self._headers[name][0]

    def dtype(self, name: str) -> torch.dtype:
        """dtype from the header (no data read); MXFP4 weights read as bf16."""
        return torch.bfloat16 if name in self._mxfp4 else self._headers[name][1]

    def get(self, name: str, index: int | None = None) -> torch.Tensor:
        """One tensor, read from its shard (``index``: only its slice along axis 0)."""
        if name in self._mxfp4:
            blocks, scales = (self.get(n, index) for n in self._mxfp4[name])
            return mxfp4.dequantize(blocks, scales)
        if name not in self.weight_map:
            raise CheckpointMismatchError(f"tensor {name} is not in {self.directory}")
        file = self.weight_map[name]
        try:
            if index is None:
                return self._handles[file].get_tensor(name)
            return self._handles[file].get_slice(name)[index : index + 1][0]
        except SafetensorError as err:
            raise CheckpointMismatchError(f"{self.directory / file}: tensor {name} cannot be read ({err})") from None

    def extra_files(self) -> list[Path]:
        """Non-weight files beside the weights (config, generation config, tokenizer)."""
        weights = set(self.weight_map.values()) | {INDEX_NAME}
        return sorted(p for p in self.directory.iterdir() if p.is_file() and p.name not in weights)


PASSTHROUGH_NAME = "hf_passthrough.safetensors"
"""The file of a Megatron checkpoint that holds the HF tensors its conversion kept aside."""


def read_named(files: dict[str, str]) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` for each ``{name: safetensors file}``, one tensor at a time, in name order."""
    handles: dict[str, object] = {}
    for name in sorted(files):
        path = Path(files[name])
        handle = handles.setdefault(str(path), _open_safetensors(path))
        try:
            yield name, handle.get_tensor(name)
        except SafetensorError as err:
            raise CheckpointMismatchError(f"{path}: tensor {name} cannot be read ({err})") from None


def named_sizes(files: dict[str, str]) -> dict[str, int]:
    """Bytes of each ``{name: safetensors file}`` tensor, from the headers."""
    sizes = {}
    for name in sorted(files):
        view = _open_safetensors(Path(files[name])).get_slice(name)
        sizes[name] = tensor_bytes(tuple(view.get_shape()), _SAFETENSORS_DTYPES[view.get_dtype()])
    return sizes


def _open_safetensors(path: Path):
    """``safe_open`` that names the file when its header is damaged or the file is truncated."""
    try:
        return safe_open(path, framework="pt")
    except (SafetensorError, OSError) as err:
        raise CheckpointMismatchError(
            f"{path}: not a readable safetensors file ({err}); truncated or corrupt?"
        ) from None


@dataclass(kw_only=True)
class ShardPlan:
    """Where each tensor of an HF checkpoint goes."""

    weight_map: dict[str, str]
    """Tensor name -> shard file name, in write order."""
    sharded: bool
    """Write an index file (False: a single ``model.safetensors`` and no index)."""
    metadata: dict | None = None
    """Index ``metadata`` to reproduce; sizes are recomputed and must agree with it."""

    @classmethod
    def from_index(cls, index: dict | None, names: list[str]) -> "ShardPlan":
        """The plan of an existing checkpoint (``index`` None: its single file)."""
        if index is None:
            return cls(weight_map={n: SINGLE_NAME for n in names}, sharded=False)
        metadata = dict(index.get("metadata", {}))
        return cls(weight_map=dict(index["weight_map"]), sharded=True, metadata=metadata)

    @classmethod
    def by_size(cls, sizes: dict[str, int], max_shard_bytes: int) -> "ShardPlan":
        """Fill shards in order up to ``max_shard_bytes`` each (HF file naming)."""
        shards: list[list[str]] = [[]]
        filled = 0
        for name, size in sizes.items():
            if shards[-1] and filled + size > max_shard_bytes:
                shards.append([])
                filled = 0
            shards[-1].append(name)
            filled += size
        if len(shards) == 1:
            return cls(weight_map={n: SINGLE_NAME for n in shards[0]}, sharded=False)
        files = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
        return cls(weight_map={n: file for file, s in zip(files, shards) for n in s}, sharded=True)


def tensor_bytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    """Bytes a tensor of ``shape`` and ``dtype`` takes on disk."""
    return math.prod(shape) * torch.empty((), dtype=dtype).element_size()


def _default_file_mode() -> int:
    """Mode a newly created file gets under this process's umask (read without changing it)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return 0o666 & ~int(line.split()[1], 8)
    except OSError:
        pass
    return 0o644


_FILE_MODE = _default_file_mode()


class ShardWriter:
    """Writes the tensors of a :class:`ShardPlan` as they arrive, in any order.

    Args:
        directory: output directory (exists).
        plan: which tensor goes to which file.
        progress: show a progress bar over the tensors.
    """

    def __init__(self, directory: str | Path, plan: ShardPlan, progress: bool = False) -> None:
        self.directory = Path(directory)
        self.plan = plan
        self._pending: dict[str, dict[str, torch.Tensor]] = {}
        self._remaining: dict[str, set[str]] = {}
        for name, file in plan.weight_map.items():
            self._remaining.setdefault(file, set()).add(name)
        self._written: set[str] = set()
        self._total_bytes = 0
        self._total_params = 0
        self._bar = tqdm(
            total=len(plan.weight_map), desc="writing HF tensors", unit="tensor", disable=not progress
        )

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """Queue one tensor; its shard is written once complete.

        Raises:
            CheckpointMismatchError: ``name`` is not in the plan or was added before.
        """
        file = self.plan.weight_map.get(name)
        if file is None:
            raise CheckpointMismatchError(f"tensor {name} is not part of the output checkpoint's plan")
        if name in self._written or name in self._pending.get(file, {}):
            raise CheckpointMismatchError(f"tensor {name} was produced twice")
        self._pending.setdefault(file, {})[name] = tensor.contiguous()
        self._total_bytes += tensor.numel() * tensor.element_size()
        self._total_params += tensor.numel()
        self._remaining[file].discard(name)
        if not self._remaining[file]:
            tensors = self._pending.pop(file)
            path = self.directory / file
            save_file(tensors, str(path), metadata={"format": "pt"})
            # safetensors creates the file owner-only (0600); a checkpoint should be as
            # readable as the config files written beside it.
            os.chmod(path, _FILE_MODE)
            self._written.update(tensors)
        self._bar.update(1)

    def finish(self) -> None:
        """Check that every planned tensor was written; write the index.

        Raises:
            CheckpointMismatchError: planned tensors were never produced (named).
        """
        self._bar.close()
        missing = [n for names in self._remaining.values() for n in names]
        if missing:
            raise CheckpointMismatchError(f"output tensors never produced: {format_names(missing)}")
        if not self.plan.sharded:
            return
        metadata = dict(self.plan.metadata or {})
        if metadata.get("total_size") != self._total_bytes:
            # The carried plan came from a checkpoint of another dtype: sizes are recomputed.
            metadata.update(total_size=self._total_bytes, total_parameters=self._total_params)
        index = {"metadata": metadata, "weight_map": self.plan.weight_map}
        # transformers' own formatting, so an unchanged checkpoint round-trips byte for byte.
        (self.directory / INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


@contextlib.contextmanager
def atomic_output_dir(final: str | Path) -> Iterator[Path]:
    """A staging directory that becomes ``final`` only if the block succeeds.

    The staging directory is a hidden sibling holding an ``INCOMPLETE`` marker; on an
    exception it is deleted, so ``final`` is either complete or absent. A process killed
    mid-write leaves only the marked staging directory behind.

    Parents that did not exist are created, and removed again on failure.

    Raises:
        FileExistsError: ``final`` exists, or a staging directory from an earlier,
            interrupted run is still there (remove it after checking nothing writes to it).
        CheckpointMismatchError: a parent of ``final`` is a file or cannot be written in.
    """
    final = Path(final)
    check_output_dir(final)
    staging = staging_dir(final)
    if staging.exists():
        raise FileExistsError(f"{staging} exists: another conversion is writing there or one was interrupted")
    created = missing_parents(final)
    try:
        staging.mkdir(parents=True)
        (staging / INCOMPLETE_MARKER).write_text("written by an unfinished or failed conversion; do not use\n")
        yield staging
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        remove_created_parents(created)
        raise
    (staging / INCOMPLETE_MARKER).unlink()
    os.replace(staging, final)


def staging_dir(final: str | Path) -> Path:
    """The hidden sibling that :func:`atomic_output_dir` writes ``final`` into."""
    final = Path(final)
    return final.parent / f".{final.name}.incomplete"


def interrupted_staging_dirs(parent: str | Path) -> list[Path]:
    """Staging directories in ``parent`` that :func:`atomic_output_dir` left marked incomplete
    (their writer was killed). Whether one may be removed is the caller's call: only an owner
    of ``parent`` knows that nothing is writing there now."""
    return sorted(p for p in Path(parent).glob(".*.incomplete") if (p / INCOMPLETE_MARKER).is_file())


def copy_files(files: list[Path], directory: str | Path) -> list[str]:
    """Copy files into ``directory`` keeping their names; returns the names."""
    for path in files:
        shutil.copyfile(path, Path(directory) / path.name)
    return [p.name for p in files]
