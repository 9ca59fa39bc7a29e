"""Step ``gpu_tests``: ``pytest tests/gpu`` on the GPU.

The image has neither Transformer Engine nor SGLang, so the tests that need them skip (each says
why); the rest must pass: :data:`REQUIRED`. Pass: no test failed or erred, and every required
test passed. The dry run runs the same command on the CPU (every test imports, then skips) and
checks that nothing failed and every required test is still there.
"""

from __future__ import annotations

import subprocess
import sys
import xml.etree.ElementTree as ET

from gpu_check_steps.common import REPO, Context, Outcome, verdict

REQUIRED = (
    "tests/gpu/test_offload_gpu.py::test_offload_frees_the_gpu_and_restores_every_byte",
    "tests/gpu/test_phases_gpu.py::test_cuda_peaks_per_phase_and_kernels_in_the_trace",
    "tests/gpu/test_fp8_gpu.py::test_telemetry_reads_this_gpu",
)
"""The GPU tests that need neither Transformer Engine nor SGLang."""

PYTEST = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "tests/gpu"]


def outcomes(junit: str) -> dict[str, tuple[str, str]]:
    """``{node id: (passed | failed | skipped, message)}`` from pytest's JUnit XML."""
    found = {}
    for case in ET.fromstring(junit).iter("testcase"):
        path = case.get("classname", "").replace(".", "/")
        node = f"{path}.py::{case.get('name')}"
        status, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            child = case.find(tag)
            if child is not None:
                status = "skipped" if tag == "skipped" else "failed"
                message = (child.get("message") or "").splitlines()[0][:160] if child.get("message") else ""
                break
        found[node] = (status, message)
    return found


def run(ctx: Context) -> Outcome:
    junit = ctx.scratch / "junit.xml"
    proc = subprocess.run([*PYTEST, "-q", "-rs", f"--junitxml={junit}"], cwd=REPO, text=True)
    results = outcomes(junit.read_text()) if junit.exists() else {}
    counts = {k: sum(1 for s, _ in results.values() if s == k) for k in ("passed", "failed", "skipped")}
    required = {r: results.get(r, ("missing", ""))[0] for r in REQUIRED}
    if ctx.dry and (counts["failed"] or "missing" in required.values()):
        raise RuntimeError(f"pytest tests/gpu on the CPU: {counts}, required tests {required}")
    required_passed = set(required.values()) == {"passed"}
    ok = proc.returncode == 0 and counts["failed"] == 0 and required_passed
    table = [{"test": node, "outcome": status, "note": message} for node, (status, message) in sorted(results.items())]
    said = "present" if ctx.dry else ("all passed" if required_passed else "NOT all passed")
    headline = (f"{counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped "
                f"(pytest exit {proc.returncode}); the {len(REQUIRED)} required tests {said}")
    return Outcome(verdict(ctx, ok), headline, {**counts, "exit_code": proc.returncode}, table)
