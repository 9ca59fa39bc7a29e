"""Generic loading of nested config dataclasses: strict types, dotted overrides, merging.

Owns the mechanics only (mapping -> dataclass with unknown keys and wrong types rejected, the
closest known key suggested for an unknown one, ``key.path=value`` parsing, dict merging,
:func:`require`, the attribute docstrings of a section, and YAML written with a comment per
value); the sections live with their owners (``megatron_rl.sections`` for the shared ones) and
``megatron_rl.config`` composes them.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import inspect
import json
import textwrap
import types
import typing
from typing import Any, Literal, Sequence, TypeVar, Union, get_args, get_origin

import yaml

T = TypeVar("T")


class ConfigError(ValueError):
    """A configuration value is missing, unknown, mistyped or breaks a rule."""


def require(ok: bool, key: str, rule: str) -> None:
    """Raise :class:`ConfigError` ``"<key>: <rule>"`` unless ``ok``."""
    if not ok:
        raise ConfigError(f"{key}: {rule}")


def _field_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _coerce(value: Any, annotation: Any, key: str) -> Any:
    """Check ``value`` against a field annotation, converting only lossless cases."""
    origin = get_origin(annotation)
    if origin in (Union, types.UnionType):
        options = get_args(annotation)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _coerce(value, option, key)
            except ConfigError as err:
                errors.append(err)
        # The first member is the field's own type (``int | None``, ``float | Literal["preset"]``);
        # what it expected says more than the whole union would.
        raise errors[0] from None
    if origin is Literal:
        allowed = get_args(annotation)
        if value not in allowed:
            raise ConfigError(f"{key}: {value!r} is not one of {list(allowed)}")
        return value
    if dataclasses.is_dataclass(annotation):
        if isinstance(value, annotation):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping for section {annotation.__name__}")
        return from_dict(annotation, value, prefix=key)
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {value!r}")
        return dict(value)
    if origin in (list, tuple, Sequence):
        (item_type, *_) = get_args(annotation) or (Any,)
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        items = [_coerce(v, item_type, f"{key}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if annotation is Any:
        return value
    if annotation is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected true/false, got {value!r}")
    if annotation is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected an integer, got {value!r}")
    if annotation is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            # YAML 1.1 reads "1e-3" (no dot) as a string; the user meant a number.
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{key}: expected a number, got {value!r}")
    if annotation is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{key}: expected a string, got {value!r}")
    if isinstance(annotation, type) and isinstance(value, annotation):
        return value
    raise ConfigError(f"{key}: cannot interpret {value!r} as {annotation}")


def from_dict(cls: type[T], data: dict[str, Any], prefix: str = "") -> T:
    """Build dataclass ``cls`` from a nested mapping; unknown keys are errors."""
    hints = _field_types(cls)
    names = {f.name for f in dataclasses.fields(cls) if f.init}
    kwargs = {}
    for key, value in data.items():
        dotted = f"{prefix}.{key}" if prefix else key
        if key not in names:
            raise ConfigError(unknown_key_message(dotted, names, cls.__name__))
        kwargs[key] = _coerce(value, hints[key], dotted)
    return cls(**kwargs)


def unknown_key_message(dotted: str, names: typing.Iterable[str], owner: str) -> str:
    """``"<dotted>: unknown key; did you mean <closest>? <owner> accepts [...]"`` (the
    suggestion only when a known key is close: ``train.stepz`` -> ``train.steps``)."""
    names = sorted(names)
    prefix, _, key = dotted.rpartition(".")
    close = difflib.get_close_matches(key, names, n=1)
    hint = f"did you mean {prefix + '.' if prefix else ''}{close[0]}? " if close else ""
    return f"{dotted}: unknown key; {hint}{owner} accepts {names}"


def to_dict(cfg: Any) -> dict[str, Any]:
    """Nested plain-dict form of a config (for logging and checkpoints)."""
    return dataclasses.asdict(cfg)


def parse_overrides(overrides: Sequence[str]) -> dict[str, Any]:
    """Turn ``["a.b=1", "c=x"]`` into a nested dict, values parsed as YAML scalars."""
    nested: dict[str, Any] = {}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r}: expected key.path=value")
        key, raw = item.split("=", 1)
        key = key.strip().lstrip("-")
        if not key:
            raise ConfigError(f"override {item!r}: empty key")
        value = _override_value(key, raw) if raw.strip() else ""
        node = nested
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r}: {part} is not a section")
        node[parts[-1]] = value
    return nested


def _override_value(key: str, raw: str) -> Any:
    """``raw`` read as YAML, or a :class:`ConfigError` naming ``key`` in one line."""
    try:
        return yaml.safe_load(raw)
    except yaml.YAMLError as err:
        problem = ": ".join(filter(None, (getattr(err, "context", None), getattr(err, "problem", None))))
        reason = problem or type(err).__name__
        raise ConfigError(f"{key}: override value {raw!r} is not valid YAML ({reason})") from None


def merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def attribute_docs(cls: type) -> dict[str, str]:
    """The docstrings written under the attributes of dataclass ``cls`` (its own class body,
    read from the source), each joined into one line; attributes without one are absent, and
    all are when the source is not installed."""
    try:
        source = inspect.getsource(cls)
    except (OSError, TypeError):
        return {}
    tree = ast.parse(textwrap.dedent(source))
    body = next(node for node in tree.body if isinstance(node, ast.ClassDef)).body
    docs = {}
    for target, doc in zip(body, body[1:]):
        if (isinstance(target, ast.AnnAssign) and isinstance(target.target, ast.Name)
                and isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant)
                and isinstance(doc.value.value, str)):
            docs[target.target.id] = " ".join(doc.value.value.split())
    return docs


def flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}, "c": []}`` -> ``{"a.b": 1, "c": []}`` (lists and empty mappings are values)."""
    flat = {}
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            flat.update(flatten(value, dotted + "."))
        else:
            flat[dotted] = value
    return flat


def yaml_with_comments(data: dict[str, Any], comments: dict[str, str], indent: int = 0, prefix: str = "") -> str:
    """Block YAML of a nested mapping with ``  # <comment>`` after each value that has one
    (looked up by dotted key); lists and scalars are written in flow style on one line, so
    the text loads back (``yaml.safe_load``) as ``data``."""
    lines = []
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        pad = " " * indent
        if isinstance(value, dict) and value:
            lines.append(f"{pad}{key}:")
            lines.append(yaml_with_comments(value, comments, indent + 2, dotted + "."))
            continue
        text = yaml.safe_dump(value, default_flow_style=True, width=float("inf")).removesuffix("...\n").strip()
        if "\n" in text:  # a string with line breaks: JSON's escaped form is a one-line YAML flow scalar
            text = json.dumps(value)
        comment = f"  # {comments[dotted]}" if dotted in comments else ""
        lines.append(f"{pad}{key}: {text}{comment}")
    return "\n".join(lines)
