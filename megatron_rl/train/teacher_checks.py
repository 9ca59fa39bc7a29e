"""Distillation's checks that need files, run before any process group or model exists.

Owns: each teacher's tokenizer against the run's (the same token for every id, both named
when they differ; a teacher whose model has another vocabulary size but the same tokens is
fine, :mod:`megatron_rl.train.teachers` masks the ids past the shorter one as the converter's
vocabulary padding is masked), the teacher's vocabulary holding every token of the tokenizer,
and every training prompt's value of the routing column (``distill.teacher_key``) reaching a
teacher (:func:`teacher_of_values`).
Does not own the rules the config alone decides (``megatron_rl.sections.distill``).
Imports no Megatron.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from megatron_rl.config_loading import ConfigError
from megatron_rl.sections.distill import DistillConfig, teacher_prefix

if TYPE_CHECKING:
    from megatron_rl.config import RunConfig
    from megatron_rl.data.prompts import PromptRecord
    from megatron_rl.data.tokenizer import PromptTokenizer


def teacher_of_values(distill: DistillConfig, values: Sequence[Any], where: Sequence[str] | None = None) -> list[int]:
    """The teacher index of each sample, from its ``distill.teacher_key`` value.

    A value listed in a teacher's ``sources`` goes to that teacher; any other to the teacher
    with no ``sources`` (with one teacher, every sample goes to it).

    Args:
        distill: the section.
        values: per sample, its value of the routing column (None: no column configured).
        where: per sample, how to name it in an error (default: its index).

    Raises:
        ConfigError: a value no teacher takes (names the sample, the value and what is taken).
    """
    owner = {str(v): i for i, t in enumerate(distill.teachers) for v in t.sources}
    default = next((i for i, t in enumerate(distill.teachers) if not t.sources), None)
    out = []
    for j, value in enumerate(values):
        index = owner.get(str(value), default) if value is not None else default
        if index is None:
            name = where[j] if where is not None else f"sample {j}"
            raise ConfigError(f"distill.teacher_key: {name} has {distill.teacher_key} {value!r}, which no teacher "
                              f"takes (distill.teachers[*].sources: {sorted(owner)})")
        out.append(index)
    return out


def record_teachers(distill: DistillConfig, records: Sequence[PromptRecord]) -> list[int]:
    """The teacher index of each prompt record (:func:`teacher_of_values` on its column value)."""
    key = distill.teacher_key
    values = [r.metadata.get(key) if key is not None else None for r in records]
    return teacher_of_values(distill, values, [f"sample {r.sample_id}" for r in records])


def check_teacher_inputs(cfg: RunConfig, tokenizer: PromptTokenizer, train: Sequence[PromptRecord]) -> None:
    """Every teacher's tokenizer and vocabulary, and the routing of every training prompt.

    Raises:
        ConfigError: one line naming the key, and for a tokenizer mismatch both tokenizers.
    """
    d = cfg.distill
    if not d.teachers:
        return
    ours = getattr(tokenizer, "hf_tokenizer", None)
    ours_dir = cfg.tokenizer.path or cfg.init_checkpoint
    for i, teacher in enumerate(d.teachers):
        key = teacher_prefix(i)
        theirs = _teacher_tokenizer(Path(teacher.path), key)
        mismatch = tokenizer_mismatch(ours, theirs)
        if mismatch is not None:
            raise ConfigError(f"{key}.path: the teacher's tokenizer ({teacher.path}) is not the run's ({ours_dir}): "
                              f"{mismatch}; distillation compares log-probs of the same token ids")
        if len(theirs) > teacher.model.vocab_size:
            raise ConfigError(f"{key}.model.vocab_size: the teacher's model has {teacher.model.vocab_size} ids, fewer "
                              f"than its tokenizer's {len(theirs)}")
    record_teachers(d, train)


def _teacher_tokenizer(path: Path, key: str) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as err:  # transformers raises many types; the user needs the directory
        text = str(err).strip()
        raise ConfigError(f"{key}.path: cannot load the teacher's tokenizer from {path}: "
                          f"{text.splitlines()[0] if text else type(err).__name__}") from err


def tokenizer_mismatch(ours: Any, theirs: Any) -> str | None:
    """Why two HF tokenizers do not give the same ids (None: same tokens at the same ids,
    same special tokens)."""
    if ours is None:
        return "the run's tokenizer is not a Hugging Face tokenizer"
    a, b = ours.get_vocab(), theirs.get_vocab()
    if len(a) != len(b):
        return f"{len(b)} tokens against {len(a)}"
    for token, index in sorted(a.items(), key=lambda item: item[1]):
        if b.get(token) != index:
            there = b.get(token)
            return (f"token {token!r} is id {index} in the run's and "
                    f"{'absent' if there is None else f'id {there}'} in the teacher's")
    for name in ("eos_token_id", "pad_token_id", "bos_token_id"):
        if getattr(ours, name, None) != getattr(theirs, name, None):
            return f"{name} is {getattr(ours, name, None)} in the run's and {getattr(theirs, name, None)} in the teacher's"
    return None
