"""Collectives go through ``megatron_rl.parallel``: no other module calls a ``torch.distributed``
collective or point-to-point transfer itself.

The parallel layer's helpers (``parallel/comm.py``) take their group explicitly and move
host tensors to the group's device, and ``raise_first_failure`` is the one way ranks agree
on a failure; a raw call elsewhere skips both. The walker reads every module's AST and
follows how ``torch.distributed`` was imported (``import torch``, ``import torch.distributed
as dist``, ``from torch import distributed``, ``from torch.distributed import broadcast``),
so renaming the module does not hide a call. Process-group setup and rank queries are not
collectives and stay allowed. A planted source shows the walker sees every spelling.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("megatron_rl", "moe_routing")
ALLOWED_PREFIX = "megatron_rl/parallel/"


COLLECTIVE = re.compile(
    r"^(all_reduce\w*|all_gather\w*|all_to_all\w*|broadcast\w*|reduce\w*|gather\w*|scatter\w*"
    r"|\w*barrier|send|recv|isend|irecv|batch_isend_irecv|send_object_list|recv_object_list)$"
)
"""``torch.distributed`` functions that communicate (collectives and point-to-point)."""

DIST_MODULES = ("torch.distributed", "torch.distributed.distributed_c10d")
"""Modules that export the collectives (``torch.distributed.checkpoint`` and others do not)."""


def collective_calls(source: str) -> list[tuple[int, str]]:
    """``(line, dotted call)`` of every ``torch.distributed`` collective called in ``source``."""
    tree = ast.parse(source)
    modules: dict[str, str] = {}  # local name -> the module it names ("torch", "torch.distributed")
    functions: dict[str, str] = {}  # local name -> collective imported by name
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    modules[alias.asname] = alias.name
                else:
                    top = alias.name.split(".")[0]
                    modules[top] = top
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                local = alias.asname or alias.name
                if full in DIST_MODULES or full == "torch.distributed":
                    modules[local] = full
                elif node.module in DIST_MODULES and COLLECTIVE.match(alias.name):
                    functions[local] = full
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        dotted = _dotted(node.func)
        if dotted is None:
            continue
        head, _, rest = dotted.partition(".")
        if not rest:
            if head in functions:
                found.append((node.lineno, functions[head]))
            continue
        path = f"{modules[head]}.{rest}" if head in modules else None
        if path is None:
            continue
        module, _, name = path.rpartition(".")
        if module in DIST_MODULES and COLLECTIVE.match(name):
            found.append((node.lineno, path))
    return sorted(found)


def _dotted(node: ast.expr) -> str | None:
    """``a.b.c`` for a chain of names and attributes, else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return ".".join([node.id, *reversed(parts)])


def offenders() -> dict[str, list[str]]:
    """File -> ``"file:line call"`` of every raw collective outside the parallel layer."""
    found: dict[str, list[str]] = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel.startswith(ALLOWED_PREFIX):
                continue
            calls = collective_calls(path.read_text())
            if calls:
                found[rel] = [f"{rel}:{line} {call}" for line, call in calls]
    return found


def test_no_raw_collective_outside_the_parallel_layer():
    found = offenders()
    bad = [line for lines in found.values() for line in lines]
    assert not bad, (
        "torch.distributed collectives outside megatron_rl/parallel/ (use megatron_rl.parallel.comm, "
        "with the group named):\n" + "\n".join(bad)
    )


def test_the_walker_sees_every_spelling():
    planted = """
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import distributed as tdist
from torch.distributed import all_gather_object as gather_all, get_rank

dist.all_reduce(x, group=g)
torch.distributed.barrier()
tdist.send(x, dst=1)
gather_all(out, obj)
dist.all_to_all_single(a, b)
dist.get_rank()
dist.init_process_group("gloo")
dcp.save(state, path)
get_rank()
group.broadcast(x)
"""
    assert [call for _, call in collective_calls(planted)] == [
        "torch.distributed.all_reduce",
        "torch.distributed.barrier",
        "torch.distributed.send",
        "torch.distributed.all_gather_object",
        "torch.distributed.all_to_all_single",
    ]
