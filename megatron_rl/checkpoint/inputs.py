"""Files a checkpoint tool (or a resuming run) reads and writes, checked before any rank starts.

Owns: reading a JSON file, a safetensors header or a ``torch.save`` file so that a missing,
truncated or corrupt one stops with a :class:`CheckpointMismatchError` naming the file (not
an EOFError, a JSONDecodeError or "Weights only load failed" naming nothing); checking that
every file of a Megatron / torch distributed checkpoint is present and as long as its
``.metadata`` says (a truncated ``.distcp`` shard is found from its size, no data is read);
and checking that an output directory can be created (no parent is a file, the nearest
existing one is writable). Does not own what the files mean (``hf_io``, ``convert``,
``megatron_rl.train.checkpoint``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from megatron_rl.checkpoint.errors import CheckpointMismatchError, format_names

# Megatron's torch_dist format facts live with its other internals (importing it loads no Megatron).
from megatron_rl.parallel.mcore_compat import (
    MEGATRON_COMMON_NAME,
    MEGATRON_METADATA_NAME,
    SHARDED_OBJECT_SEPARATOR,
)

DCP_METADATA_NAME = ".metadata"


def read_json(path: str | Path, required: tuple[str, ...] = ()) -> Any:
    """The contents of a JSON file; an object when ``required`` keys are asked for.

    Raises:
        CheckpointMismatchError: the file is missing, unreadable, not JSON (line and column
            named), or lacks a required key.
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointMismatchError(f"{path}: missing" if not path.exists() else f"{path}: not a file")
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as err:
        raise CheckpointMismatchError(f"{path}: cannot be read ({_reason(err)})") from None
    try:
        body = json.loads(text)
    except json.JSONDecodeError as err:
        what = "empty" if not text.strip() else f"line {err.lineno} column {err.colno}: {err.msg}"
        raise CheckpointMismatchError(f"{path}: not valid JSON ({what}); truncated or corrupt?") from None
    if required:
        if not isinstance(body, dict):
            raise CheckpointMismatchError(f"{path}: expected a JSON object, found {type(body).__name__}")
        missing = [key for key in required if key not in body]
        if missing:
            raise CheckpointMismatchError(f"{path}: key(s) {format_names(missing)} missing")
    return body


def load_torch_file(path: str | Path, weights_only: bool = True) -> Any:
    """``torch.load`` of a small file on the CPU (RNG states, Megatron's ``common.pt``).

    Raises:
        CheckpointMismatchError: the file is missing, truncated or not a torch file.
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointMismatchError(f"{path}: missing")
    try:
        return torch.load(path, map_location="cpu", weights_only=weights_only)
    except Exception as err:  # noqa: BLE001 - torch raises a different type per kind of damage
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise CheckpointMismatchError(
            f"{path}: not a readable torch file ({type(err).__name__}: {first[:160]}); truncated or corrupt?"
        ) from None


def check_dist_checkpoint(directory: str | Path) -> None:
    """Check that a distributed checkpoint's metadata reads and every shard file is whole.

    Each ``.distcp`` file must exist and be at least as long as the furthest byte the
    ``.metadata`` places in it; Megatron's ``metadata.json`` and ``common.pt``, when the
    checkpoint has them, must read.

    Raises:
        CheckpointMismatchError: naming the directory or the first damaged file.
    """
    import torch.distributed.checkpoint as dcp

    directory = Path(directory)
    if not directory.is_dir():
        what = "does not exist" if not directory.exists() else "is not a directory"
        raise CheckpointMismatchError(f"{directory}: {what}")
    if not (directory / DCP_METADATA_NAME).is_file():
        raise CheckpointMismatchError(
            f"{directory}: not a distributed checkpoint ({DCP_METADATA_NAME} is missing)"
        )
    try:
        metadata = dcp.FileSystemReader(str(directory)).read_metadata()
    except Exception as err:  # noqa: BLE001 - a damaged pickle raises anything
        raise CheckpointMismatchError(
            f"{directory / DCP_METADATA_NAME}: cannot be read ({type(err).__name__}); truncated or corrupt?"
        ) from None
    needed: dict[str, int] = {}
    holders: dict[str, list[str]] = {}
    for index, info in (metadata.storage_data or {}).items():
        end = info.offset + info.length
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
        # Megatron's per-shard byte objects (``.../shard_<i>``) would crowd the tensor names out.
        if SHARDED_OBJECT_SEPARATOR not in index.fqn:
            holders.setdefault(info.relative_path, []).append(index.fqn)
    for name in sorted(needed):
        path = directory / name
        if not path.is_file():
            raise CheckpointMismatchError(
                f"{path}: shard missing (it holds {format_names(set(holders.get(name, ['objects'])), 3)})"
            )
        size = path.stat().st_size
        if size < needed[name]:
            raise CheckpointMismatchError(
                f"{path}: shard truncated ({size} bytes, {DCP_METADATA_NAME} places data up to byte {needed[name]})"
            )
    if (directory / MEGATRON_METADATA_NAME).exists():
        read_json(directory / MEGATRON_METADATA_NAME)
    if (directory / MEGATRON_COMMON_NAME).exists():
        load_torch_file(directory / MEGATRON_COMMON_NAME, weights_only=False)


def missing_parents(final: str | Path) -> list[Path]:
    """The ancestors of ``final`` that do not exist yet, outermost first."""
    missing = []
    for parent in Path(final).absolute().parents:
        if parent.exists():
            break
        missing.append(parent)
    return missing[::-1]


def check_output_dir(final: str | Path) -> None:
    """Check that ``final`` is new and can be created (missing parents included).

    Raises:
        FileExistsError: ``final`` exists.
        CheckpointMismatchError: a parent is a file, or the nearest existing parent is not
            a writable directory (permissions or a read-only file system).
    """
    final = Path(final)
    if final.exists():
        raise FileExistsError(f"{final} already exists; choose a new output directory")
    for parent in final.absolute().parents:
        if not parent.exists():
            continue
        if not parent.is_dir():
            raise CheckpointMismatchError(f"output {final}: its parent {parent} is a file, not a directory")
        if not os.access(parent, os.W_OK | os.X_OK):
            raise CheckpointMismatchError(
                f"output {final}: cannot create it in {parent} (not writable: permissions or a read-only file system)"
            )
        return


def remove_created_parents(created: list[Path]) -> None:
    """Remove the parents :func:`missing_parents` listed, innermost first, where still empty."""
    for parent in reversed(created):
        try:
            parent.rmdir()
        except OSError:
            return


def _reason(err: BaseException) -> str:
    if isinstance(err, OSError) and err.strerror:
        return err.strerror
    return f"{type(err).__name__}: {err}"


def describe_os_error(err: OSError) -> str:
    """One line for an OSError that names the file (``strerror: filename``)."""
    if err.filename is None:
        return str(err)
    names = f"{err.filename} -> {err.filename2}" if err.filename2 else str(err.filename)
    return f"{names}: {err.strerror or type(err).__name__}"
