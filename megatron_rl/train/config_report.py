"""What ``megatron-rl-train`` shows about a run's config: ``--print-config`` (the resolved config
as YAML with every default filled in and each value's source) and ``--help``'s list of sections
and keys with their one-line docs.

A value's source is ``default`` (the section's dataclass), the preset file that set it (the
last file of its ``base:`` chain to do so), ``override`` (a ``key=value`` argument) or
``init_checkpoint`` (the ``model`` section read from the starting checkpoint); an objective
option left to its preset also shows the preset's value. The printed YAML loads back, with
``--config``, as the same config: input paths are written absolute, since a relative one
would be read relative to the printed file.

Does not own loading or validating the config (``megatron_rl.config``,
``megatron_rl.config.load_config``) nor the docs themselves (the sections' attribute docstrings).
"""

from __future__ import annotations

import dataclasses
import os
import textwrap
from pathlib import Path
from typing import Any, Sequence

from megatron_rl.algos.config import ObjectiveConfig
from megatron_rl.algos.section import FROM_PRESET, ObjectiveSection
from megatron_rl.checkpoint.init_source import RUN_CHOICES
from megatron_rl.config import RunConfig, load_config, map_paths, preset_chain, read_preset, resolve_objective
from megatron_rl.config_loading import (
    ConfigError,
    attribute_docs,
    flatten,
    parse_overrides,
    to_dict,
    yaml_with_comments,
)
from megatron_rl.plan.params import model_params


def value_sources(path: str | Path | None, overrides: Sequence[str], cfg: RunConfig) -> dict[str, str]:
    """Dotted key -> where its value came from, for every value of ``cfg``'s YAML form."""
    sources: dict[str, str] = {}
    for file, loaded in preset_chain(path) if path is not None else []:
        sources.update(dict.fromkeys(flatten(loaded), str(file)))
    sources.update(dict.fromkeys(flatten(parse_overrides(overrides)), "override"))
    data = to_dict(cfg)
    if cfg.init_checkpoint is not None:
        for key in flatten({"model": data["model"]}):
            sources.setdefault(key, "init_checkpoint")
    return {key: sources.get(key, "default") for key in flatten(data)}


def resolved_config_yaml(path: str | Path | None, overrides: Sequence[str] = (), world_size: int | None = None) -> str:
    """The run config ``--config path`` and ``overrides`` give, as YAML that loads back as it,
    each value followed by a comment naming its source.

    Raises:
        ConfigError: the config is invalid (the same error a run would stop with).
    """
    cfg = load_config(path, overrides, world_size)
    comments = value_sources(path, overrides, cfg)
    objective = resolve_objective(cfg)
    for f in dataclasses.fields(ObjectiveConfig):
        if getattr(cfg.objective, f.name) == FROM_PRESET:
            key = f"objective.{f.name}"
            comments[key] += f"; {cfg.objective.preset} gives {getattr(objective, f.name)!r}"
    data = to_dict(cfg)
    map_paths(data, lambda value: os.path.abspath(value) if isinstance(value, str) else
              [os.path.abspath(v) for v in value] if isinstance(value, list) else value)
    header = [f"# megatron-rl-train resolved config: --config {path}" if path is not None
              else "# megatron-rl-train resolved config (no --config)"]
    if overrides:
        header.append(f"# overrides: {' '.join(overrides)}")
    header.append("# each value's source follows it: default, a preset file, override or init_checkpoint")
    return "\n".join(header) + "\n" + yaml_with_comments(data, comments) + "\n"


LARGE_MODEL_PARAMS = 1_000_000_000
"""A starting checkpoint this large (total parameters) is no demo: the demo's sizes do not suit it."""
DEMO_SIZED = ("rollout.max_new_tokens", "rollout.engine", "train.steps", "parallel.world_size")
"""Keys whose defaults size the tiny CPU demo (8-token answers, the hf engine, 30 steps, one process)."""
PRESETS = Path(__file__).resolve().parents[2] / "configs"


def matching_presets(cfg: RunConfig, presets: Path = PRESETS) -> list[Path]:
    """The presets in ``presets`` whose ``model`` section ``cfg.model`` agrees with (every key they set)."""
    model = to_dict(cfg)["model"]
    found = []
    for path in sorted(presets.glob("*.yaml")) if presets.is_dir() else []:
        try:
            section = read_preset(path).get("model") or {}
        except ConfigError:
            continue
        if section and all(model.get(k) == v or k in RUN_CHOICES for k, v in section.items()):
            found.append(path)
    return found


def demo_sized_warning(path: str | Path | None, overrides: Sequence[str], cfg: RunConfig,
                       launched: bool) -> str | None:
    """One line when a large starting checkpoint runs with the demo's sizes left at their defaults
    (a key no preset file or override set; one process only counts when not launched), naming the
    preset(s) to start from with ``base:``; None otherwise."""
    if cfg.init_checkpoint is None:
        return None
    params = model_params(cfg.model).total
    if params < LARGE_MODEL_PARAMS:
        return None
    sources = value_sources(path, overrides, cfg)
    left = [k for k in DEMO_SIZED if sources.get(k) == "default" and not (launched and k == "parallel.world_size")]
    if not left:
        return None
    values = ", ".join(f"{k}={flatten(to_dict(cfg))[k] or 1}" for k in left)
    presets = matching_presets(cfg)
    start = (" or ".join(os.path.relpath(p) for p in presets) if presets
             else f"the preset in {os.path.relpath(PRESETS)}/ nearest your model and machines")
    return (f"megatron-rl-train: warning: {cfg.init_checkpoint} has {params / 1e9:.1f}B parameters but keeps the "
            f"tiny demo's defaults {values}; start your file from {start} (base: <preset>)")


def _docs(cls: type) -> dict[str, str]:
    if cls is ObjectiveSection:
        # Its options are generated from ObjectiveConfig's fields and documented there once.
        return {**attribute_docs(ObjectiveConfig), **attribute_docs(ObjectiveSection)}
    return attribute_docs(cls)


def _default(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def config_help(width: int = 100) -> str:
    """Every section of :class:`RunConfig` with its doc, and under it each key with its doc and
    default, for ``--help``."""
    lines = ["config keys (override any with key=value; --print-config shows the values a run gets):"]

    def section(cls: type, prefix: str, depth: int) -> None:
        docs = _docs(cls)
        for f in dataclasses.fields(cls):
            name, doc, default = f"{prefix}{f.name}", docs.get(f.name, ""), _default(f)
            pad = "  " * depth
            if dataclasses.is_dataclass(default):
                lines.append("")
                lines.extend(textwrap.wrap(f"{name}: {doc}", width, initial_indent=pad, subsequent_indent=pad + "    "))
                section(type(default), name + ".", depth + 1)
                continue
            text = f"{name} (default {default!r}): {doc}"
            lines.extend(textwrap.wrap(text, width, initial_indent=pad, subsequent_indent=pad + "    "))

    section(RunConfig, "", 1)
    return "\n".join(lines)
