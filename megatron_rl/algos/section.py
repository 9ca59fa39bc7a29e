"""The ``objective`` section of a run config: a named preset plus typed overrides.

Owns :class:`ObjectiveSection` and how it becomes an :class:`ObjectiveConfig`
(``ObjectiveSection.resolve``). The section holds ``preset`` and one option per
ObjectiveConfig field, generated from that field: the same name, in the same order, typed
as the field's type or :data:`FROM_PRESET` (``"preset"``, the default), which means "the
preset's value". Each option's meaning is its ObjectiveConfig field's docstring, written
there once. Null keeps ObjectiveConfig's meaning (for ``rspo_gamma_min`` it disables RSPO,
for ``max_len`` it unsets the length), so any preset value can be overridden, None
included, and a written-out config (``to_dict``) loads back as the same section.

Types are checked by the generic loader (``megatron_rl.config_loading``) when the run config
is read; the rules across options are ObjectiveConfig's own. This module imports nothing
from ``megatron_rl.config``: it raises :class:`ObjectiveConfigError` and the run config
turns that into its ``ConfigError``.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass, fields
from typing import Any, Literal

from .config import ObjectiveConfig, ObjectiveConfigError
from .presets import OBJECTIVE_PRESETS, get_preset

FROM_PRESET = "preset"
"""Value of an option left to the preset (the default of every option)."""

FromPreset = Literal["preset"]


def _with_objective_options(cls: type) -> type:
    """Adds to ``cls`` (before ``@dataclass``) one option per ObjectiveConfig field, in order:
    typed as the field or :data:`FROM_PRESET`, defaulting to :data:`FROM_PRESET`."""
    types = typing.get_type_hints(ObjectiveConfig)
    for f in fields(ObjectiveConfig):
        cls.__annotations__[f.name] = typing.Union[types[f.name], FromPreset]
        setattr(cls, f.name, FROM_PRESET)
    return cls


@dataclass(kw_only=True)
@_with_objective_options
class ObjectiveSection:
    """Objective: ``preset`` (``algos.presets``) and overrides of its ObjectiveConfig fields.

    An option set to ``preset`` (the default) keeps the preset's value; any other value,
    null included, replaces it. The options are generated from ObjectiveConfig's fields
    (``_with_objective_options``); each is documented there.
    """

    preset: str = "grpo"
    """Named objective preset the other options start from (``OBJECTIVE_PRESETS``)."""

    def overrides(self) -> dict[str, Any]:
        """The options this section sets, by ObjectiveConfig field name."""
        return {
            f.name: getattr(self, f.name)
            for f in fields(self)
            if f.name != "preset" and getattr(self, f.name) != FROM_PRESET
        }

    def resolve(self, prefix: str = "objective") -> ObjectiveConfig:
        """The preset with this section's overrides applied, validated.

        Raises:
            ObjectiveConfigError: the message starts with ``<prefix>.<option>: `` (the
                option the rule names; ``<prefix>.preset`` for an unknown preset).
        """
        if self.preset not in OBJECTIVE_PRESETS.names():
            raise ObjectiveConfigError(
                f"{prefix}.preset: unknown objective {self.preset!r}; "
                f"available: {sorted(OBJECTIVE_PRESETS.names())}"
            )
        try:
            return get_preset(self.preset, **self.overrides())
        except ObjectiveConfigError as err:
            option, rule = _split_error(str(err))
            raise ObjectiveConfigError(f"{prefix}.{option}: {rule}") from None


_FIELD_NAMES = tuple(f.name for f in fields(ObjectiveConfig))


def _split_error(message: str) -> tuple[str, str]:
    """(option, rule) of an ObjectiveConfig validation message.

    ObjectiveConfig writes ``ObjectiveConfig.<field>: <rule>`` for ranges and combinations
    and ``<field>=<value> is not one of ...`` or ``<field> is NaN`` for single values.
    """
    head, sep, rule = message.partition(": ")
    if sep and head.startswith("ObjectiveConfig.") and head.split(".", 1)[1] in _FIELD_NAMES:
        return head.split(".", 1)[1], rule
    word = message.replace("=", " ").split(" ", 1)[0]
    return (word, message) if word in _FIELD_NAMES else ("preset", message)
