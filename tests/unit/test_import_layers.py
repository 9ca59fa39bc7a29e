"""Imports go one way: no cycles between modules nor between packages, and no import against
the layer order.

Every import of ``megatron_rl`` and ``moe_routing`` counts: module level, inside functions,
under ``TYPE_CHECKING``, relative ones, and the package ``__init__`` that importing a
submodule runs first. The layers, lowest first (a module may import its own layer or a
lower one):

0. pure: the objective library (``algos``), ``moe_routing`` (the routing record's math),
   the config mechanics, the registry, and the deferred optional imports (stdlib only; the
   package's ``__init__`` runs it first);
1. config sections: ``sections`` and each owner's ``config`` module (leaves);
2. parallel plumbing: ``parallel`` (the routing record, replay and layout included);
3. I/O: ``rollout``, ``checkpoint``, ``data``, ``rewards``, telemetry;
4. the run's composition: ``megatron_rl.config`` (the one loader; it reads the starting
   checkpoint's model through ``checkpoint``), and the memory planner's arithmetic over it
   (``megatron_rl.plan``);
5. the loop: ``train``;
6. programs: the launcher, the smoke command, the planner's command line and the SGLang stand-in.

Packages are held to the same rule as modules: within every package (and between the two
top-level ones), its sub-packages and modules, each taken whole, import one another without
a circle, so a package can be read, moved or replaced as one piece.

Tools and tests sit above all of them. A planted package shows the walker sees every kind
of fault.
"""

from __future__ import annotations

import ast
import textwrap
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("megatron_rl", "moe_routing")

LAYERS: dict[str, int] = {
    "megatron_rl.algos": 0,
    "megatron_rl.registry": 0,
    "megatron_rl.config_loading": 0,
    "megatron_rl.deferred_imports": 0,
    "moe_routing": 0,
    "megatron_rl.sections": 1,
    "megatron_rl.data.config": 1,
    "megatron_rl.rewards.config": 1,
    "megatron_rl.rollout.config": 1,
    "megatron_rl.rollout.sglang.config": 1,
    "megatron_rl.rollout.envs.config": 1,
    "megatron_rl.fp8": 1,
    "megatron_rl.parallel": 2,
    "megatron_rl.rollout": 3,
    "megatron_rl.checkpoint": 3,
    "megatron_rl.data": 3,
    "megatron_rl.rewards": 3,
    "megatron_rl.telemetry": 3,
    "megatron_rl.config": 4,
    "megatron_rl.plan": 4,
    "megatron_rl.train": 5,
    "megatron_rl.launcher": 6,
    "megatron_rl.smoke": 6,
    "megatron_rl.plan.cli": 6,
    "megatron_rl.mismatch_cli": 6,
    "megatron_rl.sglang_standin": 6,
}
"""Module (or package) prefix -> layer; the longest matching prefix decides."""

PACKAGE_ROOTS = ("megatron_rl", "moe_routing")
"""The top-level ``__init__`` files belong to no layer (docstrings; ``megatron_rl``'s also defers
optional imports through a layer-0 module)."""


def discover(root: Path, packages=PACKAGES) -> dict[str, tuple[Path, bool]]:
    """``module name -> (file, is_package)`` for every ``.py`` file of ``packages`` under ``root``."""
    modules = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            modules[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return modules


def _resolve(name: str, modules: dict) -> str | None:
    """The longest prefix of ``name`` that is one of ``modules``."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        candidate = ".".join(parts[:end])
        if candidate in modules:
            return candidate
    return None


def _parents(module: str) -> list[str]:
    """The packages whose ``__init__`` runs before ``module`` is imported."""
    parts = module.split(".")
    return [".".join(parts[:end]) for end in range(1, len(parts))]


def import_edges(modules: dict[str, tuple[Path, bool]]) -> dict[str, set[str]]:
    """``module -> modules it imports`` (ours only), every kind of import included."""
    edges: dict[str, set[str]] = defaultdict(set)
    for module, (path, is_package) in modules.items():
        package = module if is_package else module.rpartition(".")[0]
        targets: list[str] = []
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets += [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                # ``from pkg import submodule`` imports the submodule; ``from mod import name`` the module.
                targets += [f"{source}.{alias.name}" for alias in node.names] + [source]
        for target in targets:
            found = _resolve(target, modules)
            if found is None:
                continue
            for imported in (*_parents(found), found):
                if imported in modules and imported != module and imported not in _parents(module):
                    edges[module].add(imported)
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def package_cycles(edges: dict[str, set[str]], modules: dict[str, tuple[Path, bool]]) -> list[str]:
    """``"package: a -> b -> a"`` for every circle among the children of one package.

    The children of a package are its direct sub-packages and modules, each standing for
    everything under it; the two top-level packages are the children of one root.
    """
    packages = ["", *sorted(name for name, (_, is_package) in modules.items() if is_package)]
    found = []
    for package in packages:
        prefix = f"{package}." if package else ""

        def child(module: str) -> str | None:
            if not module.startswith(prefix) or module == package:
                return None
            return prefix + module[len(prefix):].split(".")[0]

        graph: dict[str, set[str]] = defaultdict(set)
        for module, targets in edges.items():
            for target in targets:
                a, b = child(module), child(target)
                if a is not None and b is not None and a != b:
                    graph[a].add(b)
        for component in cycles(graph):
            found.append(f"{package or '<root>'}: {' <-> '.join(component)}")
    return found


def layer_of(module: str) -> int | None:
    """The layer of ``module`` by its longest prefix in :data:`LAYERS` (None: a top-level ``__init__``)."""
    if module in PACKAGE_ROOTS:
        return None
    match = _resolve(module, LAYERS)
    if match is None:
        raise AssertionError(f"{module} is in no layer: add its package to LAYERS in {Path(__file__).name}")
    return LAYERS[match]


def upward_imports(edges: dict[str, set[str]], modules: dict[str, tuple[Path, bool]]) -> list[str]:
    """``"a (layer i) -> b (layer j)"`` for every import of a higher layer. A package whose
    ``__init__`` imports nothing of ours (a docstring) is in every layer: importing
    ``rollout.config`` runs ``rollout/__init__.py`` and nothing else of the rollout layer."""
    neutral = {name for name, (_, is_package) in modules.items() if is_package and not edges.get(name)}
    found = []
    for module in sorted(edges):
        for target in sorted(edges[module] - neutral):
            mine, theirs = layer_of(module), layer_of(target)
            if mine is not None and theirs is not None and theirs > mine:
                found.append(f"{module} (layer {mine}) -> {target} (layer {theirs})")
    return found


def test_no_import_cycles():
    assert cycles(import_edges(discover(ROOT))) == []


def test_no_package_cycles():
    modules = discover(ROOT)
    assert package_cycles(import_edges(modules), modules) == []


def test_no_import_goes_up_the_layers():
    modules = discover(ROOT)
    assert upward_imports(import_edges(modules), modules) == []


TRAINER_IMPORTS_AT_MOST = 13
"""Project modules ``train/trainer.py`` may import: the RL loop, not the services around it
(building, checkpoints, evaluation, frozen models, exports, logging live beside it). 13 since
``train/drift.py``: RSPO measured at the routes each token was produced with is part of a step."""


def test_the_trainer_imports_the_loop_only():
    modules = discover(ROOT)
    edges = import_edges(modules)
    # A package whose __init__ imports nothing (a docstring) is not a module the trainer uses.
    neutral = {name for name, (_, is_package) in modules.items() if is_package and not edges.get(name)}
    imported = edges["megatron_rl.train.trainer"] - neutral
    assert len(imported) <= TRAINER_IMPORTS_AT_MOST, sorted(imported)


def test_every_module_has_a_layer():
    for module in discover(ROOT):
        layer_of(module)


@pytest.mark.parametrize("plant, expected", [
    # A function-level import that closes a circle (of modules, so of the package's children too).
    ({"megatron_rl/parallel/a.py": "def f():\n    from megatron_rl.parallel.b import g\n",
      "megatron_rl/parallel/b.py": "from megatron_rl.parallel import a\n"}, {"cycle", "package"}),
    # A TYPE_CHECKING import that closes a circle only through the package __init__ that
    # importing a sibling module runs first.
    ({"megatron_rl/rollout/engine.py": "from megatron_rl.rollout.local.other import Y\n",
      "megatron_rl/rollout/local/__init__.py": "from megatron_rl.rollout.local import hf\n",
      "megatron_rl/rollout/local/other.py": "",
      "megatron_rl/rollout/local/hf.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                         "    from ..engine import RolloutEngine\n"}, {"cycle", "package"}),
    # Two packages of one layer that import each other through different modules (one of the
    # imports inside a function): no circle of modules, a circle of packages.
    ({"megatron_rl/rollout/a.py": "def f():\n    from megatron_rl.checkpoint.b import g\n",
      "megatron_rl/checkpoint/b.py": "",
      "megatron_rl/checkpoint/c.py": "from megatron_rl.rollout.d import h\n",
      "megatron_rl/rollout/d.py": ""}, {"package"}),
    # The pure top-level package reaching into parallel plumbing, which imports it.
    ({"moe_routing/record.py": "def f():\n    from megatron_rl.parallel.mcore_compat import override_routing\n",
      "megatron_rl/parallel/mcore_compat.py": "",
      "megatron_rl/parallel/logprobs.py": "from moe_routing.types import RouterRecord\n",
      "moe_routing/types.py": ""}, {"package", "upward"}),
    # A config section reaching up into the loop.
    ({"megatron_rl/sections/model.py": "from megatron_rl.train.trainer import Trainer\n",
      "megatron_rl/train/trainer.py": ""}, {"upward"}),
    # A relative import from the pure layer into parallel plumbing.
    ({"megatron_rl/algos/loss.py": "def f():\n    from ..parallel.comm import all_reduce\n",
      "megatron_rl/parallel/comm.py": ""}, {"upward"}),
])
def test_a_planted_package_shows_each_fault(tmp_path, plant, expected):
    for name, text in plant.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    for name in plant:
        for package in Path(name).parents:
            if package != Path(".") and not (tmp_path / package / "__init__.py").exists():
                (tmp_path / package / "__init__.py").write_text("")
    modules = discover(tmp_path)
    edges = import_edges(modules)
    found = {"cycle": cycles(edges), "package": package_cycles(edges, modules), "upward": upward_imports(edges, modules)}
    assert {kind for kind, faults in found.items() if faults} == expected, found
