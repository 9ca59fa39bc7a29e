"""Files a newcomer can read: no package file over 500 lines, no function over 80 lines
unless its docstring says why (a paragraph starting ``Length:``)."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("megatron_rl", "moe_routing")
MAX_FILE_LINES = 500
MAX_FUNCTION_LINES = 80


def _sources():
    for package in PACKAGES:
        yield from sorted((ROOT / package).rglob("*.py"))


def long_files() -> list[str]:
    """``path (N lines)`` for every package file over the limit."""
    found = []
    for path in _sources():
        lines = path.read_text(encoding="utf-8").count("\n")
        if lines > MAX_FILE_LINES:
            found.append(f"{path.relative_to(ROOT)} ({lines} lines)")
    return found


def long_functions(source: str, name: str) -> list[str]:
    """``name:line function (N lines)`` for every function over the limit whose docstring
    has no ``Length:`` paragraph saying why it is one function."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            length = node.end_lineno - node.lineno + 1
            reason = "\nLength:" in "\n" + (ast.get_docstring(node) or "")
            if length > MAX_FUNCTION_LINES and not reason:
                found.append(f"{name}:{node.lineno} {node.name} ({length} lines)")
    return found


def test_no_package_file_is_over_500_lines():
    assert long_files() == []


def test_no_function_is_over_80_lines_without_a_reason():
    found = [hit for path in _sources()
             for hit in long_functions(path.read_text(encoding="utf-8"), str(path.relative_to(ROOT)))]
    assert found == []


def test_the_function_check_sees_a_long_function_and_its_reason():
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES))
    plain = f"def f():\n{body}"
    explained = f'def f():\n    """Does one thing.\n\n    Length: one table, read top to bottom."""\n{body}'
    assert long_functions(plain, "m.py") == [f"m.py:1 f ({MAX_FUNCTION_LINES + 1} lines)"]
    assert long_functions(explained, "m.py") == []
