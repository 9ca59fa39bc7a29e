"""``rollout.env`` resolved into a factory of environments, and checked before any process starts.

Owns the built-in names (:data:`BUILTIN_ENVS`), importing ``package.module:Class``, and
:func:`check_env_config`, which ``megatron_rl.train.prepare`` runs with the other input
checks: the class must import, be an :class:`~megatron_rl.rollout.envs.base.Environment`
(or have callable ``reset`` and ``step``) and accept ``rollout.env.args``; a bad
configuration is one :class:`~megatron_rl.config_loading.ConfigError` line naming the key.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Callable

from megatron_rl.config_loading import ConfigError
from megatron_rl.rollout.envs.base import Environment
from megatron_rl.rollout.envs.config import EnvConfig

BUILTIN_ENVS = {
    "calculator": "megatron_rl.rollout.envs.builtin:CalculatorEnv",
    "feedback": "megatron_rl.rollout.envs.builtin:FeedbackEnv",
    "http": "megatron_rl.rollout.envs.http:HttpEnvironment",
}
"""Built-in environment names and the classes they stand for."""


def env_class(name: str) -> type:
    """The class ``name`` stands for (a built-in name or ``package.module:Class``).

    Raises:
        ConfigError: naming ``rollout.env.name`` and what is wrong.
    """
    path = BUILTIN_ENVS.get(name, name)
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"rollout.env.name: {name!r} is neither a built-in environment "
                          f"({', '.join(sorted(BUILTIN_ENVS))}) nor an import path 'package.module:Class'")
    try:
        module = importlib.import_module(module_name)
    except Exception as err:  # a user module may raise anything while importing
        raise ConfigError(f"rollout.env.name: cannot import {module_name!r}: {type(err).__name__}: {err}") from None
    cls = getattr(module, attr, None)
    if cls is None:
        raise ConfigError(f"rollout.env.name: module {module_name!r} has no attribute {attr!r}")
    if not inspect.isclass(cls):
        raise ConfigError(f"rollout.env.name: {path} is a {type(cls).__name__}, not a class")
    missing = [m for m in ("reset", "step") if not callable(getattr(cls, m, None))]
    if missing:
        raise ConfigError(f"rollout.env.name: {path} has no {' or '.join(missing)} method (see "
                          "megatron_rl.rollout.envs.base.Environment)")
    if inspect.isabstract(cls):
        raise ConfigError(f"rollout.env.name: {path} is abstract (it leaves "
                          f"{', '.join(sorted(cls.__abstractmethods__))} undefined)")
    return cls


def env_factory(cfg: EnvConfig) -> Callable[[], Environment]:
    """A function making one environment per trajectory (``cfg.name`` must be set; checked first)."""
    check_env_config(cfg)
    cls = env_class(cfg.name)
    if cfg.name == "http":
        return lambda: cls(cfg.http)
    args = dict(cfg.args)
    return lambda: cls(**args)


def check_env_config(cfg: EnvConfig) -> None:
    """The environment's class resolves and accepts its arguments (nothing is constructed).

    Raises:
        ConfigError: naming the key (``rollout.env.name`` or ``rollout.env.args``).
    """
    if cfg.name is None:
        return
    cls = env_class(cfg.name)
    if cfg.name == "http":
        if cfg.args:
            raise ConfigError("rollout.env.args: the http environment takes its settings from rollout.env.http")
        return
    try:
        inspect.signature(cls).bind(**cfg.args)
    except TypeError as err:
        raise ConfigError(f"rollout.env.args: {cfg.name} does not accept {dict(cfg.args)!r}: {err}") from None


def env_tools(cfg: EnvConfig) -> list[dict] | None:
    """The environment class's tool schemas (its ``tools`` class attribute; None without an environment)."""
    return None if cfg.name is None else getattr(env_class(cfg.name), "tools", None)
