"""Only ``parallel/mcore_compat.py`` (with its optimizer, layer, checkpoint and parallel-state halves
``mcore_optimizer.py``, ``mcore_layers.py``, ``mcore_checkpoint.py`` and ``mcore_state.py``, and
the CPU shims) may name Megatron-Core internals.

The rule (``mcore_compat`` docstring): other modules import from Megatron-Core only the
names of ``mcore_compat.PUBLIC_API``; they do not name a private (underscore) Megatron-Core
symbol, nor one of ``mcore_compat.INTERNAL_ATTRIBUTES``, nor a Megatron-Core module path in
a string. Scanned: the product's source (megatron_rl, moe_routing, tools, launch).
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import re
from pathlib import Path

from megatron_rl.parallel import mcore_compat as mc

REPO = Path(__file__).resolve().parents[2]
ROOTS = ("megatron_rl", "moe_routing", "tools", "launch")
EXEMPT = {Path("megatron_rl/parallel/mcore_compat.py"), Path("megatron_rl/parallel/mcore_optimizer.py"),
          Path("megatron_rl/parallel/mcore_layers.py"), Path("megatron_rl/parallel/mcore_state.py"),
          Path("megatron_rl/parallel/mcore_checkpoint.py"),
          Path("megatron_rl/parallel/cpu_platform.py")}
_PRIVATE_DEFINITION = re.compile(
    r"^\s*(?:async\s+def|def|class)\s+(_[A-Za-z]\w*)|^(_[A-Za-z]\w*)\s*[:=]|self\.(_[A-Za-z]\w*)\s*=", re.M
)


def _private_names(root: Path) -> set[str]:
    """Underscore names defined (functions, classes, module globals, instance attributes) under ``root``."""
    names = set()
    for path in root.rglob("*.py"):
        for match in _PRIVATE_DEFINITION.finditer(path.read_text(errors="ignore")):
            names.add(next(group for group in match.groups() if group))
    return names


@functools.lru_cache(maxsize=1)
def megatron_private_names() -> frozenset[str]:
    """Private names of Megatron-Core that our own code does not define too."""
    megatron = Path(importlib.util.find_spec("megatron.core").origin).parent
    ours = set().union(*(_private_names(REPO / root) for root in ROOTS))
    return frozenset(_private_names(megatron) - ours)


def _docstrings(tree: ast.AST) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
            ids.add(id(body[0].value))
    return ids


_ATTRIBUTE_CALLS = ("getattr", "setattr", "hasattr", "delattr")


def violations(source: str, private: frozenset[str]) -> list[str]:
    """Each place ``source`` breaks the rule, as ``line: what``."""
    tree = ast.parse(source)
    docstrings = _docstrings(tree)
    found = []
    for node in ast.walk(tree):
        line = getattr(node, "lineno", 0)
        if isinstance(node, ast.Import):
            found += [f"{line}: import {a.name}" for a in node.names if a.name.split(".")[0] == "megatron"]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "megatron":
            allowed = mc.PUBLIC_API.get(node.module, frozenset())
            found += [f"{line}: from {node.module} import {a.name}" for a in node.names if a.name not in allowed]
        elif isinstance(node, ast.Attribute) and (node.attr in mc.INTERNAL_ATTRIBUTES or node.attr in private):
            found.append(f"{line}: .{node.attr}")
        elif isinstance(node, ast.Name) and (node.id in mc.INTERNAL_ATTRIBUTES or node.id in private):
            found.append(f"{line}: {node.id}")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            if "megatron.core" in node.value and node.value not in mc.PUBLIC_API:
                found.append(f"{line}: string {node.value!r}")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _ATTRIBUTE_CALLS:
            name = node.args[1] if len(node.args) > 1 else None
            if isinstance(name, ast.Constant) and (name.value in mc.INTERNAL_ATTRIBUTES or name.value in private):
                found.append(f"{line}: {node.func.id}(..., {name.value!r})")
    return found


def test_only_the_compat_module_names_megatron_internals():
    private = megatron_private_names()
    assert {"_get_cuda_rng_state", "_set_cuda_rng_state"} <= private  # the scan sees Megatron's privates
    offenders = {}
    files = [p for root in ROOTS for p in sorted((REPO / root).rglob("*.py"))]
    assert len(files) > 100
    for path in files:
        relative = path.relative_to(REPO)
        if relative in EXEMPT:
            continue
        found = violations(path.read_text(), private)
        if found:
            offenders[str(relative)] = found
    assert not offenders, (
        "Megatron-Core internals named outside megatron_rl/parallel/mcore_compat.py "
        f"(move them there, with a reason and versions): {offenders}"
    )


def test_scanner_catches_planted_internals(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text(
        '"""A docstring may say megatron.core.transformer.moe.router_replay."""\n'
        "import megatron.core.tensor_parallel.random as random\n"
        "from megatron.core.transformer.moe.router_replay import RouterReplay\n"
        "from megatron.core import parallel_state, mpu\n"
        "from megatron.core.transformer import TransformerConfig\n"
        "random._set_cuda_rng_state(None)\n"
        "RouterReplay.global_router_replay_instances.clear()\n"
        "setattr(router, 'get_replay_topk', None)\n"
        "logger = logging.getLogger('megatron.core.dist_checkpointing.serialization')\n"
        "from megatron_rl.parallel.mcore_compat import RouterReplay as Fine\n"
    )
    found = violations(planted.read_text(), megatron_private_names())
    expected = {
        "2: import megatron.core.tensor_parallel.random",
        "3: from megatron.core.transformer.moe.router_replay import RouterReplay",
        "4: from megatron.core import mpu",
        "6: ._set_cuda_rng_state",
        "7: .global_router_replay_instances",
        "8: setattr(..., 'get_replay_topk')",
        "9: string 'megatron.core.dist_checkpointing.serialization'",
    }
    assert set(found) == expected, found


def test_warnings_are_accepted_one_by_one(pytestconfig):
    """No warning category is silenced wholesale: every ignore names a message and a module."""
    lines = pytestconfig.getini("filterwarnings")
    assert lines, "tests/conftest.py's ACCEPTED_WARNINGS are not installed"
    for line in lines:
        action, message, category, module = (line.split(":") + ["", "", "", ""])[:4]
        if action == "ignore":
            assert message and category and module, f"filterwarnings {line!r} silences too much"
