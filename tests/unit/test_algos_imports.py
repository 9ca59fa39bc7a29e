"""algos/ is pure torch: no torch.distributed, Megatron, network or file-I/O imports."""

from __future__ import annotations

import ast
from pathlib import Path

import megatron_rl.algos

ALGOS_DIR = Path(megatron_rl.algos.__file__).parent
# A module is forbidden together with everything below it ("megatron" does not cover "megatron_rl").
FORBIDDEN = (
    "torch.distributed",
    "megatron",
    "megatron_rl.parallel",
    "megatron_rl.config",
    "requests",
    "aiohttp",
    "httpx",
    "urllib",
    "socket",
    "yaml",
)


def _imports(path: Path, package: str = "megatron_rl.algos") -> list[str]:
    """Absolute names of everything ``path`` imports; relative imports are resolved against
    ``package``, so ``from ..parallel import comm`` counts as ``megatron_rl.parallel.comm``."""
    names = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            names.append(module)
            names += [f"{module}.{alias.name}" for alias in node.names]
    return names


def _forbidden(name: str) -> bool:
    return any(name == module or name.startswith(module + ".") for module in FORBIDDEN)


def test_algos_imports_no_distributed_megatron_or_network():
    files = sorted(ALGOS_DIR.glob("*.py"))
    assert len(files) >= 10
    offenders = {str(p.name): [n for n in _imports(p) if _forbidden(n)] for p in files}
    assert not any(offenders.values()), offenders


def test_scanner_catches_forbidden_imports(tmp_path):
    sample = tmp_path / "bad.py"
    sample.write_text(
        "import torch.distributed as dist\nfrom megatron.core import mpu\nimport requests\n"
        "from torch import distributed\nfrom megatron_rl.algos import loss\n"
        "from ..parallel import comm\nfrom .. import config\nfrom .kl import kl_estimate_T\n"
    )
    found = [n for n in _imports(sample) if _forbidden(n)]
    assert found == [
        "torch.distributed",
        "megatron.core",
        "megatron.core.mpu",
        "requests",
        "torch.distributed",
        "megatron_rl.parallel",
        "megatron_rl.parallel.comm",
        "megatron_rl.config",
    ]


def test_algos_has_no_item_calls_or_prints():
    for path in ALGOS_DIR.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                assert node.func.attr not in ("item", "tolist"), (
                    f"{path.name}:{node.lineno} calls .{node.func.attr}()"
                )
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                assert node.func.id not in ("print", "open"), (
                    f"{path.name}:{node.lineno} calls {node.func.id}()"
                )
