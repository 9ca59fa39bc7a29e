"""Prompt sets for RL: read prompt files or a built-in task, tokenize, filter, order.

Owns the data section of the run config (:class:`DataConfig`), the prompt record
(:class:`PromptRecord`), the loaded split (:class:`PromptSet`) with its endless seeded
order, :func:`load_prompts` and the config-time check :func:`check_data_config`.

It does not own tokenization rules (``megatron_rl.data.tokenizer``), the built-in tasks
themselves (``megatron_rl.data.tasks``), rewards, or which rank uses which prompt (the
trainer splits the positions). Files are read with Hugging Face ``datasets``; every call
uses its own temporary cache and keeps the table in memory, so processes reading the same
file at once never share cache files.

Row numbers in messages are 0-based positions in the file as ``datasets`` reads it (for
JSONL: the n-th non-empty line). A JSON file that ``datasets`` cannot parse (a malformed line,
bytes that are not UTF-8) is reported by its 1-based line number, as an editor shows it:
the parser's own message gives only a byte offset within a block.
"""

from __future__ import annotations

import contextlib
import json
import tempfile
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from megatron_rl.config_loading import ConfigError
from megatron_rl.data.config import DataConfig
from megatron_rl.data.tasks import TASKS, build_task
from megatron_rl.data.tokenizer import (
    CharPromptTokenizer,
    PromptTokenizer,
    normalized_prompt,
)

Split = Literal["train", "eval"]

_FORMAT_OF_SUFFIX = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}
"""Supported file suffixes and the ``datasets`` builder that reads each."""


@dataclass(frozen=True, kw_only=True)
class PromptRecord:
    """One prompt, tokenized, with what the reward needs to score a response to it."""

    sample_id: str
    """Unique within its split: the id column, "<file stem>:<row>", or "<task>:<problem id>"."""
    prompt: str | list[dict]
    """The prompt as read: a string or chat messages."""
    prompt_ids: tuple[int, ...]
    """What the policy is conditioned on (chat template and generation prompt applied)."""
    ground_truth: str
    """The answer column converted with str(), or the task's answer text."""
    metadata: dict
    """The ``metadata_keys`` columns of the row; for a task, ``{"problem_id": id}``."""


@dataclass
class PromptSet:
    """One split's prompts in file order, after the length filter."""

    records: list[PromptRecord]
    """Kept prompts, in file (or task draw) order."""
    num_filtered: int
    """Prompts dropped because they exceed the prompt-token budget."""
    _order: tuple[int, torch.Tensor] | None = field(default=None, init=False, repr=False, compare=False)

    def __len__(self) -> int:
        return len(self.records)

    def at(self, position: int, seed: int) -> PromptRecord:
        """The ``position``-th prompt of an endless order: a fresh permutation per epoch.

        ``epoch, index = divmod(position, len(records))``; epoch ``e`` is
        ``torch.randperm`` seeded with ``seed + e``. A function of its arguments only, so
        a resumed run that knows its position continues exactly.

        Raises:
            IndexError: the set is empty or ``position`` is negative.
        """
        if not self.records:
            raise IndexError("PromptSet.at: the prompt set is empty")
        if position < 0:
            raise IndexError(f"PromptSet.at: position must be >= 0, got {position}")
        epoch, index = divmod(position, len(self.records))
        # One permutation is kept: consecutive positions share an epoch, and redrawing a
        # large permutation per prompt would dominate a step.
        epoch_seed = seed + epoch
        if self._order is None or self._order[0] != epoch_seed:
            generator = torch.Generator().manual_seed(epoch_seed)
            self._order = (epoch_seed, torch.randperm(len(self.records), generator=generator))
        return self.records[int(self._order[1][index])]


def check_data_config(cfg: DataConfig) -> None:
    """Config-only checks, before any process exists; reads no file contents.

    Raises:
        ConfigError: naming the key, e.g. ``data.train_files[0]: /x.jsonl does not exist``.
    """
    if cfg.max_prompt_tokens is not None and cfg.max_prompt_tokens < 1:
        raise ConfigError(f"data.max_prompt_tokens: must be >= 1 or null, got {cfg.max_prompt_tokens}")
    if cfg.source == "task":
        if cfg.task.name not in TASKS:
            raise ConfigError(
                f"data.task.name: unknown task {cfg.task.name!r}; available: {', '.join(TASKS.names())}"
            )
        for key in ("train_files", "eval_files"):
            if getattr(cfg, key):
                raise ConfigError(f"data.{key}: set, but data.source is 'task', which reads no files")
        return
    if not cfg.train_files:
        raise ConfigError("data.train_files: empty; data.source 'files' needs at least one prompt file")
    for key in ("prompt_key", "answer_key"):
        if not getattr(cfg, key):
            raise ConfigError(f"data.{key}: must be a non-empty column name")
    for key in ("train_files", "eval_files"):
        for i, path in enumerate(getattr(cfg, key)):
            _file_format(path, f"data.{key}[{i}]")
            if not Path(path).is_file():
                raise ConfigError(f"data.{key}[{i}]: {path} does not exist")


def load_prompts(
    cfg: DataConfig, split: Split, tokenizer: PromptTokenizer, max_prompt_tokens: int,
    limit_set_by: str = "data.max_prompt_tokens",
) -> PromptSet:
    """Reads, tokenizes and length-filters one split.

    Args:
        cfg: The data section.
        split: "train" or "eval". With source files and no ``eval_files`` the eval split
            is empty.
        tokenizer: Encodes the prompts; for source task it must be
            :func:`~megatron_rl.data.tokenizer.char_tokenizer_adapter` of the task tokenizer.
        max_prompt_tokens: Prompts with more ids are dropped and counted.
        limit_set_by: what set ``max_prompt_tokens`` (keys and values), named when it drops
            every prompt.

    Raises:
        ConfigError: a file cannot be read, a row lacks the prompt or answer, a prompt is
            malformed, a sample id repeats, or the split is empty after filtering.
        ValueError: bad ``split``, ``max_prompt_tokens`` or tokenizer for a task.
    """
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    if max_prompt_tokens < 1:
        raise ValueError(f"max_prompt_tokens must be >= 1, got {max_prompt_tokens}")
    if cfg.source == "task":
        candidates = _task_records(cfg, split, tokenizer)
    else:
        candidates = _file_records(cfg, split, tokenizer)
    records = [r for r in candidates if len(r.prompt_ids) <= max_prompt_tokens]
    if candidates and not records:
        raise ConfigError(
            f"{limit_set_by}: all {len(candidates)} {split} prompts are longer than "
            f"{max_prompt_tokens} tokens"
        )
    return PromptSet(records=records, num_filtered=len(candidates) - len(records))


def _task_records(cfg: DataConfig, split: Split, tokenizer: PromptTokenizer) -> list[PromptRecord]:
    task = build_task(cfg.task)
    # The records carry the task's own ids; a different tokenizer would decode them wrongly.
    if not (
        isinstance(tokenizer, CharPromptTokenizer)
        and tokenizer.char_tokenizer.alphabet == task.tokenizer.alphabet
    ):
        raise ValueError(
            f"data.source 'task' needs char_tokenizer_adapter(task.tokenizer), got {tokenizer!r}"
        )
    problems = task.train_prompts if split == "train" else task.eval_prompts
    return [
        PromptRecord(
            sample_id=f"{task.name}:{p.problem_id}",
            prompt=p.prompt_text,
            prompt_ids=p.prompt_ids,
            ground_truth=p.answer_text,
            metadata={"problem_id": p.problem_id},
        )
        for p in problems
    ]


def _file_records(cfg: DataConfig, split: Split, tokenizer: PromptTokenizer) -> list[PromptRecord]:
    key = f"data.{split}_files"
    records: list[PromptRecord] = []
    first_seen: dict[str, str] = {}
    files = cfg.train_files if split == "train" else cfg.eval_files
    for i, path in enumerate(files):
        rows = _read_rows(cfg, path, f"{key}[{i}]")
        for row_index, row in enumerate(rows):
            record = _row_record(cfg, row, row_index, path, tokenizer)
            where = f"row {row_index} of {path}"
            if record.sample_id in first_seen:
                raise ConfigError(
                    f"data.id_key: sample id {record.sample_id!r} repeats "
                    f"({first_seen[record.sample_id]} and {where}); {split} sample ids must be unique"
                )
            first_seen[record.sample_id] = where
            records.append(record)
    if files and not records:
        raise ConfigError(f"{key}: the files hold no rows")
    return records


def _read_rows(cfg: DataConfig, path: str, key: str) -> list[dict[str, Any]]:
    """The needed columns of every row; the id column only if the file has it."""
    fmt = _file_format(path, key)
    if not Path(path).is_file():
        raise ConfigError(f"{key}: {path} does not exist")
    if Path(path).stat().st_size == 0:
        raise ConfigError(f"{key}: {path} is empty")
    with (
        _quiet_datasets() as datasets,
        tempfile.TemporaryDirectory(prefix="megatron_rl_data_") as cache,
    ):
        try:
            table = datasets.load_dataset(
                fmt, data_files=str(path), split="train", keep_in_memory=True, cache_dir=cache
            )
        except Exception as err:  # datasets/pyarrow raise many types; the user needs the file
            raise _unreadable(key, path, fmt, err) from err
    columns = table.column_names
    for name, config_key in ((cfg.prompt_key, "data.prompt_key"), (cfg.answer_key, "data.answer_key")):
        if name not in columns:
            raise ConfigError(f"{config_key}: row 0 of {path} has no {name!r} (columns: {columns})")
    for j, name in enumerate(cfg.metadata_keys):
        if name not in columns:
            raise ConfigError(
                f"data.metadata_keys[{j}]: {path} has no column {name!r} (columns: {columns})"
            )
    wanted = [cfg.prompt_key, cfg.answer_key, *cfg.metadata_keys]
    if cfg.id_key is not None and cfg.id_key in columns:
        wanted.append(cfg.id_key)
    try:
        return table.select_columns(list(dict.fromkeys(wanted))).to_list()
    except UnicodeDecodeError as err:  # arrow's JSON reader passes bytes that are not UTF-8 through
        raise _unreadable(key, path, fmt, err) from err


def _unreadable(key: str, path: str, fmt: str, err: BaseException) -> ConfigError:
    """The error for a file ``datasets`` could not read: the culprit line when one is found."""
    culprit = _bad_json_line(Path(path)) if fmt == "json" else None
    return ConfigError(f"{key}: cannot read {path}: {culprit or _first_line(err)}")


def _bad_json_line(path: Path) -> str | None:
    """``"line N: <what is wrong>"`` for the first line of a JSON or JSON-lines file that is not
    UTF-8 or not JSON; None when every line reads."""
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        number = data.count(b"\n", 0, err.start) + 1
        column = err.start - data.rfind(b"\n", 0, err.start)
        return f"line {number}: not UTF-8 (byte 0x{data[err.start]:02x} at column {column}); save the file as UTF-8"
    lines = text.splitlines()
    first = next((line for line in lines if line.strip()), "")
    if not _is_json_object(first):
        # One JSON document (a list of rows, or rows under a key) rather than one row per line.
        try:
            json.loads(text)
        except json.JSONDecodeError as err:
            return f"line {err.lineno}: not valid JSON ({err.msg} at column {err.colno})"
        return None
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            return f"line {number}: not valid JSON ({err.msg} at column {err.colno})"
        if not isinstance(row, dict):
            return f"line {number}: a JSON {type(row).__name__}, not an object (one row per line)"
    return None


def _is_json_object(line: str) -> bool:
    try:
        return isinstance(json.loads(line), dict)
    except json.JSONDecodeError:
        return False


def _row_record(
    cfg: DataConfig, row: dict[str, Any], row_index: int, path: str, tokenizer: PromptTokenizer
) -> PromptRecord:
    where = f"row {row_index} of {path}"
    prompt = row.get(cfg.prompt_key)
    if prompt is None:
        raise ConfigError(f"data.prompt_key: {where} has no {cfg.prompt_key!r}")
    answer = row.get(cfg.answer_key)
    if answer is None:
        raise ConfigError(f"data.answer_key: {where} has no {cfg.answer_key!r}")
    try:
        prompt = normalized_prompt(prompt)
    except ValueError as err:
        raise ConfigError(f"data.prompt_key: {where}: {err}") from None
    if cfg.id_key is not None and cfg.id_key in row:
        if row[cfg.id_key] is None:
            raise ConfigError(f"data.id_key: {where} has no {cfg.id_key!r}")
        sample_id = str(row[cfg.id_key])
    else:
        sample_id = f"{Path(path).stem}:{row_index}"
    try:
        prompt_ids = tuple(tokenizer.encode_prompt(prompt))
    except ValueError as err:
        raise ConfigError(f"data.prompt_key: {where}: {err}") from err
    return PromptRecord(
        sample_id=sample_id,
        prompt=prompt,
        prompt_ids=prompt_ids,
        ground_truth=str(answer),
        metadata={name: row[name] for name in cfg.metadata_keys},
    )


def _file_format(path: str, key: str) -> str:
    suffix = Path(path).suffix.lower()
    if suffix not in _FORMAT_OF_SUFFIX:
        raise ConfigError(
            f"{key}: {path} has unsupported suffix {suffix!r} (use {', '.join(_FORMAT_OF_SUFFIX)})"
        )
    return _FORMAT_OF_SUFFIX[suffix]


@contextlib.contextmanager
def _quiet_datasets() -> Iterator[Any]:
    """Yields ``datasets`` with progress bars and logs off; restores both on exit."""
    # Imported here: datasets is only needed by source files, and its import is slow.
    import datasets

    bars_were_on = datasets.utils.logging.is_progress_bar_enabled()
    verbosity = datasets.logging.get_verbosity()
    with warnings.catch_warnings():
        # An environment variable forcing bars on wins, with a warning we do not need.
        warnings.simplefilter("ignore")
        datasets.disable_progress_bars()
    # Critical, not error: a file datasets cannot parse is logged there and also raised,
    # and the raise becomes our ConfigError with the same message.
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)
    try:
        yield datasets
    finally:
        datasets.logging.set_verbosity(verbosity)
        if bars_were_on:
            datasets.enable_progress_bars()


def _first_line(err: BaseException) -> str:
    """First line of the innermost cause: datasets wraps the parser's precise message."""
    while err.__cause__ is not None:
        err = err.__cause__
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__
