"""Optional packages that Megatron-Core imports only to see whether they are there, executed when used.

Megatron-Core 0.16.1-0.19.2 runs ``try: import wandb`` at import time in ``megatron/core/timers.py``
and an inference module (``inference/contexts/dynamic_context.py`` in 0.16.1,
``inference/engines/dynamic_engine.py`` in 0.19.2), reached through ``megatron.core`` itself, so
every process that builds a model pays it, only to know whether wandb is there and to log to it
when a Megatron-LM run asks (we log through our own trackers). Executing
wandb's package is ~40% of importing Megatron-Core's GPT model on a CPU (``python -X importtime
-c "import megatron.core.models.gpt"``: its ``wandb.apis`` / ``wandb.sdk`` modules), paid by every
rank, forkserver, rollout server and converter, with or without a wandb tracker.

:func:`defer_optional_imports` puts such a package in ``sys.modules`` unexecuted: its module
object carries what the import system set from its spec (``__file__``, ``__path__``,
``__spec__``, ...) and a module ``__getattr__`` (PEP 562) that executes the package, in that
same object, at the first other attribute asked (our wandb tracker's ``wandb.init``, Megatron's
timers writing to wandb). ``import wandb`` then finds it installed, as before. A submodule
imported first (``import wandb.sdk``) executes the package before it is found
(:class:`_PackageFirst`), so nothing runs twice. The standard library's
:class:`importlib.util.LazyLoader` is not used because it executes the module at *any*
attribute access, and ``inspect.getmodule`` (which torch calls while registering its custom
ops) reads ``__file__`` of every module in ``sys.modules``. A package that is not installed
stays absent (Megatron sees it missing, as before); one already imported is left as it is.
Runs when :mod:`megatron_rl` is imported.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import threading
import types

DEFERRED = ("wandb",)
"""Packages Megatron-Core imports at import time only to know they are installed."""


def defer_optional_imports(names: tuple[str, ...] = DEFERRED) -> None:
    """Make each installed, not yet imported package of ``names`` execute on first use."""
    for name in names:
        if name in sys.modules:
            continue
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            continue
        module = importlib.util.module_from_spec(spec)
        module.__getattr__ = _executor(module)
        sys.modules[name] = module
    if not any(isinstance(finder, _PackageFirst) for finder in sys.meta_path):
        sys.meta_path.insert(0, _PackageFirst())


def _executor(module: types.ModuleType):
    def __getattr__(attr: str):
        if id(module) not in _running_here():  # (while it runs, a missing name is missing, as in any import)
            execute(module)
            return getattr(module, attr)
        raise AttributeError(f"module {module.__name__!r} has no attribute {attr!r}")

    __getattr__.runs = module  # what :func:`is_deferred` recognises
    return __getattr__


def is_deferred(module: object) -> bool:
    """A module :func:`defer_optional_imports` put in ``sys.modules`` that has not run yet."""
    hook = getattr(module, "__dict__", {}).get("__getattr__")
    return hook is not None and getattr(hook, "runs", None) is module


_RUNNING = threading.RLock()
"""Held while a deferred module runs: another thread's first attribute waits for it (as CPython
3.12's ``LazyLoader`` does) rather than reading a half-run module."""
_THREAD = threading.local()


def _running_here() -> set[int]:
    """The deferred modules this thread is running now."""
    if not hasattr(_THREAD, "running"):
        _THREAD.running = set()
    return _THREAD.running


def execute(module: types.ModuleType) -> None:
    """Run a deferred module's code in its module object (once); a failed run leaves it out of
    ``sys.modules``, as a failed import does."""
    with _RUNNING:
        running = _running_here()
        if not is_deferred(module) or id(module) in running:
            return
        running.add(id(module))
        try:
            module.__spec__.loader.exec_module(module)
        except BaseException:
            sys.modules.pop(module.__name__, None)
            raise
        finally:
            running.discard(id(module))
            module.__dict__.pop("__getattr__", None)


class _PackageFirst(importlib.abc.MetaPathFinder):
    """``import pkg.sub`` of a deferred ``pkg``: runs ``pkg`` first; a submodule that ``pkg``
    imported while it ran is handed back as it is (the import system would run it again)."""

    def find_spec(self, fullname, path, target=None):
        parent = sys.modules.get(fullname.partition(".")[0])
        if "." not in fullname or not is_deferred(parent) or id(parent) in _running_here():
            return None
        execute(parent)
        loaded = sys.modules.get(fullname)
        if loaded is None:
            return None
        spec = importlib.machinery.ModuleSpec(fullname, _AlreadyLoaded(loaded), origin=getattr(loaded, "__file__", None))
        # The import system takes a module's own spec over ours when the module is loaded by
        # then, and runs it again (importlib._bootstrap._find_spec); without one it takes ours.
        loaded.__spec__ = None
        return spec


class _AlreadyLoaded(importlib.abc.Loader):
    """Hands the import system a module that has run already, its own ``__spec__`` given back."""

    def __init__(self, module: types.ModuleType) -> None:
        self.module, self.spec = module, module.__spec__

    def create_module(self, spec):
        return self.module

    def exec_module(self, module) -> None:
        module.__spec__ = self.spec  # the import system set the finder's on it
