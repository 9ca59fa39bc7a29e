"""What an HF checkpoint holds, checked before anything is converted.

Owns :class:`HFSource` (an HF checkpoint's architecture, Megatron model, index and side
files) and :func:`inspect_hf_checkpoint`: checking an HF checkpoint against its config and
the architecture's table from the safetensors headers alone (every tensor mapped, every
expected tensor present, every shape and the expert count as the config says, one dtype),
naming every culprit. Does not own running a conversion or the conversion record
(``convert``), the name tables (``mapping``) or file formats (``hf_io``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from megatron_rl.checkpoint.errors import CheckpointMismatchError, format_names
from megatron_rl.checkpoint.families import mtp_tensor_names
from megatron_rl.checkpoint.hf_config import (
    architecture_of,
    experts_key,
    language_config,
    model_config_from_hf,
    read_config,
)
from megatron_rl.checkpoint.hf_io import HFCheckpoint
from megatron_rl.checkpoint.weight_rules import passthrough_names
from megatron_rl.checkpoint.mapping import (
    ARCHITECTURES,
    Architecture,
    hf_tensor_shapes,
    template_regex,
)
from megatron_rl.config_loading import ConfigError
from megatron_rl.sections import ModelConfig

DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
"""The weight dtypes a conversion reads and writes, by their config names."""


@dataclass(kw_only=True)
class HFSource:
    """What a Megatron checkpoint was (or will be) converted from or exported to."""

    architecture: str
    """HF model_type (key of ``mapping.ARCHITECTURES``)."""
    model: ModelConfig
    """The Megatron model the HF config describes."""
    index: dict | None
    """The HF index (None: a single ``model.safetensors``)."""
    files: list[str]
    """Paths of the non-weight HF files (config, tokenizer, ...) to carry along."""
    config: dict | None = None
    """A generated ``config.json`` to write (None: it is one of ``files``)."""
    passthrough: dict[str, str] = field(default_factory=dict)
    """Tensors kept aside (``Architecture.passthrough``: a vision tower, MTP layers), by name:
    the safetensors file that holds each, written back unchanged on export."""

    @property
    def arch(self) -> Architecture:
        """The mapping table."""
        return ARCHITECTURES.get(self.architecture)


def inspect_hf_checkpoint(hf_dir: str | Path, vocab_padding_multiple: int = 1) -> HFSource:
    """Validate an HF checkpoint against its config and the mapping table, reading headers only.

    Args:
        hf_dir: the HF checkpoint.
        vocab_padding_multiple: the Megatron model's ``model.vocab_padding_multiple`` (HF
            configs have no such key; 1 keeps the vocabulary unpadded).

    Raises:
        CheckpointMismatchError: unsupported config, expert count that disagrees with the
            tensors, missing / unknown / misshapen tensors, or mixed dtypes (all named).
    """
    config = read_config(hf_dir)
    arch = architecture_of(config)
    checkpoint = HFCheckpoint(hf_dir)
    kept = passthrough_names(arch, checkpoint.names())
    by_dtype: dict[torch.dtype, list[str]] = {}
    # The routers' expert bias stays float32 in both HF and Megatron whatever the weights' dtype;
    # tensors kept aside are copied as they are.
    float32_kept = [template_regex(t) for rule in arch.rules if rule.buffer for t in rule.hf]
    for name in checkpoint.names():
        if name not in kept and not any(pattern.match(name) for pattern in float32_kept):
            by_dtype.setdefault(checkpoint.dtype(name), []).append(name)
    if len(by_dtype) != 1 or next(iter(by_dtype)) not in DTYPE_NAMES:
        found = {str(d): format_names(n, 3) for d, n in by_dtype.items()}
        raise CheckpointMismatchError(
            f"{hf_dir}: tensors must share one dtype of {list(DTYPE_NAMES.values())}; found {found}"
        )
    model = model_config_from_hf(config, DTYPE_NAMES[next(iter(by_dtype))])
    if isinstance(vocab_padding_multiple, bool) or not (
        isinstance(vocab_padding_multiple, int) and vocab_padding_multiple >= 1
    ):
        raise ConfigError(f"--vocab-padding-multiple {vocab_padding_multiple!r}: must be an integer >= 1")
    model.vocab_padding_multiple = vocab_padding_multiple
    _check_expert_count(arch, language_config(config), model, checkpoint)
    _check_tensors(arch, model, checkpoint, skipped=_skipped_mtp_tensors(config, checkpoint) + kept)
    if kept:
        print(f"note: keeping {len(kept)} tensors aside ({format_names(kept, 2)}): no part of the Megatron "
              "model, never routed; written back unchanged on export", flush=True)
    return HFSource(
        architecture=arch.name,
        model=model,
        index=checkpoint.index,
        files=[str(p) for p in checkpoint.extra_files()],
        passthrough={name: str(checkpoint.directory / checkpoint.weight_map[name]) for name in kept},
    )



def _check_expert_count(
    arch: Architecture, config: dict, model: ModelConfig, checkpoint: HFCheckpoint
) -> None:
    """Name the config key when every layer holds other experts than 0..E-1."""
    # Stacked experts (one tensor per layer) have no expert index in their names: a wrong
    # count is their shape's first axis, which _check_tensors names.
    patterns = [template_regex(t) for rule in arch.rules if rule.scope == "expert" for t in rule.hf if "{expert}" in t]
    found: dict[int, set[int]] = {}
    for name in checkpoint.names():
        for pattern in patterns:
            match = pattern.match(name)
            if match:
                found.setdefault(int(match["layer"]), set()).add(int(match["expert"]))
    # Every layer holding the same wrong set means the config is wrong; a gap in some
    # layers is a missing tensor, which _check_tensors names.
    sets = {frozenset(ids) for ids in found.values()}
    uniform = len(sets) == 1 and len(found) == model.num_layers
    if uniform and set(next(iter(sets))) != set(range(model.num_experts)):
        ids = sorted(next(iter(sets)))
        raise CheckpointMismatchError(
            f"config.json {experts_key(arch, config)}={model.num_experts} disagrees with the checkpoint, "
            f"whose layers all hold {len(ids)} experts ({ids[0]}..{ids[-1]})"
        )


def _skipped_mtp_tensors(config: dict, checkpoint: HFCheckpoint) -> list[str]:
    """The checkpoint's multi-token-prediction tensors, announced on stdout (they are not converted)."""
    skipped = mtp_tensor_names(config, checkpoint.names())
    if skipped:
        print(
            f"note: skipping {len(skipped)} tensors of the multi-token-prediction layer(s) "
            f"(num_nextn_predict_layers={config['num_nextn_predict_layers']}, model.layers."
            f"{config['num_hidden_layers']}.* on): the Megatron model is the backbone only, and an "
            "exported checkpoint has no MTP layers",
            flush=True,
        )
    return skipped


def _check_tensors(
    arch: Architecture, model: ModelConfig, checkpoint: HFCheckpoint, skipped: list[str] = ()
) -> None:
    """Name every missing, unknown and misshapen tensor in one error (``skipped`` ones excepted)."""
    expected = hf_tensor_shapes(arch, model)
    present = set(checkpoint.names()) - set(skipped)
    problems = []
    missing = [n for n in expected if n not in present]
    unknown = sorted(present - set(expected))
    if missing:
        problems.append(f"missing tensors: {format_names(missing)}")
    if unknown:
        problems.append(f"unknown tensors (no {arch.name} mapping): {format_names(unknown)}")
    for name, shape in expected.items():
        if name in present and checkpoint.shape(name) != shape:
            problems.append(f"tensor {name} has shape {checkpoint.shape(name)}, the config implies {shape}")
    if problems:
        raise CheckpointMismatchError(f"{checkpoint.directory}: " + "; ".join(problems))
