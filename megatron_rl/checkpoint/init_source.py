"""Where a run's policy starts: an HF checkpoint directory or a Megatron checkpoint, read from the config alone.

Owns: recognizing what ``init_checkpoint`` names (an HF checkpoint: ``config.json`` plus
safetensors; a Megatron distributed checkpoint written by ``megatron-rl-convert-hf-to-megatron``,
which carries ``conversion.json``; or a trainer checkpoint), validating it with the
converter's own checks (every tensor mapped, shapes as the config says), and turning its
config into the run's ``model`` section. A ``model`` key that the YAML or the command line
sets must agree with the checkpoint: the error names the key and both values. Only run
choices that do not change what the weights compute may differ (:data:`RUN_CHOICES`; over
an HF checkpoint also :data:`HF_RUN_CHOICES`).

Runs before any process group or model exists (headers and JSON only, no Megatron import);
the config loader calls :func:`checkpoint_model_section` (and :func:`teacher_model_sections` for the
distillation teachers). Does not own filling the model
(``megatron_rl.checkpoint.megatron_io.fill_from_hf``, called by the trainer), reading the
config (``megatron_rl.config``) or resuming (a run's own checkpoint always takes precedence).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

from megatron_rl.checkpoint.convert import RECORD_NAME, read_export_source
from megatron_rl.checkpoint.errors import CheckpointMismatchError
from megatron_rl.checkpoint.hf_source import HFSource, inspect_hf_checkpoint
from megatron_rl.checkpoint.trainer_source import is_trainer_checkpoint
from megatron_rl.config_loading import ConfigError, unknown_key_message

RUN_CHOICES = ("params_dtype", "init_method_std", "moe_aux_loss_coeff")
"""``model`` keys a run may set freely on top of a checkpoint: the dtype it trains in (weights
are cast on load), the initialization scale (unused: every weight is loaded) and the
load-balancing loss coefficient (a training choice that HF configs do not record faithfully)."""

HF_RUN_CHOICES = ("vocab_padding_multiple",)
"""``model`` keys a run may also set on top of an HF checkpoint: the vocabulary padding (HF
has none; the padded rows are zeros, masked out of every softmax). A Megatron checkpoint
stores its padded rows, so there it must agree like any other key."""


@dataclass(kw_only=True)
class InitSource:
    """A validated starting checkpoint."""

    kind: Literal["hf", "megatron"]
    """hf: safetensors streamed into the run's layout; megatron: a distributed checkpoint resharded on load."""
    path: Path
    """The checkpoint directory."""
    hf: HFSource
    """Architecture, model config and HF side files (config, tokenizer, generation config)."""


def _is_hf_dir(path: Path) -> bool:
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def inspect_init_checkpoint(path: str | Path, key: str = "init_checkpoint") -> InitSource:
    """Validate the directory ``key`` names; headers and JSON only.

    Raises:
        ConfigError: missing path, not a directory, not a checkpoint, unsupported
            architecture or tensors that do not fit the architecture (all named).
    """
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"{key}: {path} does not exist")
    if not path.is_dir():
        raise ConfigError(f"{key}: {path} is not a directory")
    try:
        if _is_hf_dir(path):
            return InitSource(kind="hf", path=path, hf=inspect_hf_checkpoint(path))
        if (path / RECORD_NAME).is_file() or is_trainer_checkpoint(path):
            return InitSource(kind="megatron", path=path, hf=read_export_source(path))
    except CheckpointMismatchError as err:
        raise ConfigError(f"{key}: {err}") from None
    raise ConfigError(
        f"{key}: {path} is neither an HF checkpoint (config.json + *.safetensors) nor a Megatron "
        f"checkpoint written by megatron-rl-convert-hf-to-megatron ({RECORD_NAME})"
    )


def model_section(source: InitSource, requested: dict[str, Any] | None, prefix: str = "model") -> dict[str, Any]:
    """The run's ``model`` section: the checkpoint's, with the allowed run choices applied.

    Args:
        source: the validated checkpoint.
        requested: the ``model`` keys the YAML preset and the overrides set (may be None).
        prefix: the section's dotted key (a distillation teacher's: ``distill.teachers[i].model``).

    Raises:
        ConfigError: a requested key contradicts the checkpoint (names the key, both
            values and the checkpoint), or is not a model key at all.
    """
    section = asdict(source.hf.model)
    where = source.path / ("config.json" if source.kind == "hf" else RECORD_NAME)
    for key, value in (requested or {}).items():
        if key not in section:
            raise ConfigError(unknown_key_message(f"{prefix}.{key}", section, "ModelConfig"))
        if key in RUN_CHOICES or (source.kind == "hf" and key in HF_RUN_CHOICES):
            section[key] = value
            continue
        if not _same(value, section[key]):
            raise ConfigError(
                f"{prefix}.{key}: the config sets {value!r} but the checkpoint {where} says {section[key]!r}; "
                "remove the key (the model section is read from the checkpoint) or use another checkpoint"
            )
    return section


def teacher_model_sections(data: dict[str, Any], *, absent_ok: bool = False) -> None:
    """Each distillation teacher's ``model`` section, read from its checkpoint (``distill.teachers[i].path``),
    set in ``data`` (the config as read from the YAML and the overrides), as :func:`checkpoint_model_section`
    does for the policy. ``absent_ok`` (a plan for another machine): a teacher whose checkpoint is not
    here keeps the ``model`` section the config gives it."""
    teachers = (data.get("distill") or {}).get("teachers") if isinstance(data.get("distill"), dict) else None
    for i, teacher in enumerate(teachers if isinstance(teachers, list) else []):
        path = teacher.get("path") if isinstance(teacher, dict) else None
        if not isinstance(path, str):
            continue
        key = f"distill.teachers[{i}]"
        requested = teacher.get("model")
        if requested is not None and not isinstance(requested, dict):
            raise ConfigError(f"{key}.model: expected a mapping")
        if absent_ok and requested and not Path(path).exists():
            continue
        teacher["model"] = model_section(inspect_init_checkpoint(path, key=f"{key}.path"), requested,
                                         prefix=f"{key}.model")


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        return float(a) == float(b)
    return a == b


def checkpoint_model_section(init: Any, requested: Any) -> dict[str, Any]:
    """The ``model`` section of a run that starts from ``init`` (the ``init_checkpoint`` value as
    read from the YAML and the overrides): the one function through which a checkpoint's model
    settings reach the config loader (``megatron_rl.config.load_config``).

    Args:
        init: the ``init_checkpoint`` value.
        requested: the ``model`` keys the YAML preset and the overrides set (may be None).

    Raises:
        ConfigError: not a path or not a checkpoint (:func:`inspect_init_checkpoint`), or a
            requested key that contradicts it (:func:`model_section`).
    """
    if not isinstance(init, str):
        raise ConfigError(f"init_checkpoint: expected a directory path, got {init!r}")
    if requested is not None and not isinstance(requested, dict):
        raise ConfigError("model: expected a mapping")
    return model_section(inspect_init_checkpoint(init), requested)
