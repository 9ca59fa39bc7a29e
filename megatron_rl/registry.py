"""One registry implementation for everything selected by name.

Objective presets, advantage estimators and any other pluggable piece are looked up
through a :class:`Registry` instance, never through an ``if name == ...`` chain. A name
can be registered once; asking for an unknown name fails with the list of known ones.

This module owns only the name -> object mapping. It does not know what the registered
objects are, and it holds no global registry of registries: each owner creates its own
instance next to the things it registers (for example ``algos.presets.OBJECTIVE_PRESETS``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T")


class UnknownNameError(KeyError):
    """A name was looked up that no one registered; the message lists the known names."""

    def __str__(self) -> str:
        # KeyError.__str__ quotes its argument; a sentence reads better unquoted.
        return str(self.args[0]) if self.args else ""


class Registry(Generic[T]):
    """A name -> object mapping filled by a decorator.

    Example:
        >>> PRESETS = Registry("objective preset")
        >>> @PRESETS.register("grpo")
        ... def grpo(): ...
        >>> PRESETS.get("grpo") is grpo
        True

    Args:
        kind: What the registered objects are, in words; used in error messages.
    """

    def __init__(self, kind: str) -> None:
        if not kind:
            raise ValueError("Registry kind must be a non-empty string")
        self.kind = kind
        self._entries: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        """Returns a decorator that registers its argument under ``name``.

        Raises:
            ValueError: ``name`` is empty or not a string, or is already registered.
        """
        if not isinstance(name, str) or not name:
            raise ValueError(f"{self.kind} name must be a non-empty string, got {name!r}")
        if name in self._entries:
            raise ValueError(
                f"{self.kind} {name!r} is already registered "
                f"(by {_describe(self._entries[name])}); names must be unique"
            )

        def decorator(obj: T) -> T:
            # Checked again here: two decorators may be created before either is applied.
            if name in self._entries:
                raise ValueError(
                    f"{self.kind} {name!r} is already registered; names must be unique"
                )
            self._entries[name] = obj
            return obj

        return decorator

    def get(self, name: str) -> T:
        """Returns the object registered under ``name``.

        Raises:
            UnknownNameError: no such name; the message lists the registered names.
        """
        try:
            return self._entries[name]
        except (KeyError, TypeError):
            known = ", ".join(self.names()) or "(none registered)"
            raise UnknownNameError(f"unknown {self.kind} {name!r}; available: {known}") from None

    def names(self) -> tuple[str, ...]:
        """Returns the registered names, sorted."""
        return tuple(sorted(self._entries))

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, names={list(self.names())})"


def _describe(obj: object) -> str:
    module = getattr(obj, "__module__", None)
    qualname = getattr(obj, "__qualname__", None)
    return f"{module}.{qualname}" if module and qualname else repr(obj)
