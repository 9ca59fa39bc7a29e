"""Nothing in the package exists only for tests: no test endpoints, failure switches or
fault injection in ``megatron_rl/`` or ``moe_routing/``, in code, comments or docstrings.

Test support lives under ``tests/`` (e.g. ``tests/standin_faults.py`` adds fault injection
to the CPU SGLang stand-in by subclassing it). A match is reported as ``file:line``.
"""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("megatron_rl", "moe_routing")

HOOKS = {
    r"/_test/": "a test-only HTTP endpoint",
    r"\w*_test\w*": "a name for tests (_test)",
    r"(?i)fail_after": "a failure switch (FAIL_AFTER)",
    r"(?i)\bFAULT_(ENV|KINDS)\b": "a failure switch or fault table",
    r"(?i)\btest[- ]only\b": "TEST-ONLY behaviour",
    r"(?i)\b(for )?tests only\b|\bonly for tests?\b": "behaviour for tests only",
    r"(?i)fault[ _-]?inject|\binject\w* (fault|failure)": "fault injection",
}
"""Pattern -> what it finds."""

def hook_lines(path: str, text: str) -> list[str]:
    """``path:line: what (the line)`` for every line of ``text`` that matches a hook."""
    found = []
    for number, line in enumerate(text.splitlines(), start=1):
        for pattern, what in HOOKS.items():
            if re.search(pattern, line):
                found.append(f"{path}:{number}: {what}: {line.strip()}")
                break
    return found


def test_the_package_has_no_test_hooks():
    found = []
    for package in PACKAGES:
        for source in sorted((ROOT / package).rglob("*.py")):
            path = source.relative_to(ROOT).as_posix()
            found += hook_lines(path, source.read_text(encoding="utf-8"))
    assert not found, "test-only hooks in the package (move them under tests/):\n" + "\n".join(found)


def test_the_scan_finds_planted_hooks_and_passes_plain_code():
    planted = {
        'web.post("/_test/fault", self.arm_fault)': "endpoint",
        "async def _test_stats(self, request):": "name",
        'FAIL_AFTER = "MEGATRON_RL_FAIL_AFTER_STEP"': "switch",
        'FAULT_KINDS = ("http_500", "delay")': "table",
        '"""TEST-ONLY: make the next request fail."""': "docstring",
        "# used by tests only": "comment",
        "raise RuntimeError(f'injected failure after step {step}')": "fault",
    }
    for line, kind in planted.items():
        assert hook_lines("megatron_rl/x.py", line), (kind, line)
    plain = ('latest = read("checkpoints/latest")\n'
             '"""Checked by the contract tests; see tests/unit/test_world.py."""\n'
             "contest_score = 1.0  # the test of membership below\n")
    assert hook_lines("megatron_rl/x.py", plain) == []
