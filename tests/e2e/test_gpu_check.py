"""``tools/gpu_check.py`` cannot rot between the rare times a GPU is lent: its dry run builds every
step's config and objects at a tiny size on the CPU and runs them there (nothing on CUDA), so a
renamed function, a changed signature or a config key that no longer exists fails here; and a
step that runs past its limit costs only itself."""

import dataclasses
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tools" / "gpu_check.py"
_spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
gpu_check = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpu_check)


def test_the_dry_run_builds_and_runs_every_step(tmp_path):
    done = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--out", str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=900)
    log = (tmp_path / "gpu_check.log").read_text() if (tmp_path / "gpu_check.log").exists() else ""
    assert done.returncode == 0, done.stdout[-3000:] + log[-6000:]
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["meta"]["dry_run"] is True
    assert {name: r["status"] for name, r in results["steps"].items()} == {s.name: "dry" for s in gpu_check.STEPS}
    report = (tmp_path / "results.md").read_text()
    assert all(f"| {s.name} | dry |" in report for s in gpu_check.STEPS)
    from gpu_check_steps.planner import CASES

    assert [row["case"] for row in results["steps"]["planner"]["table"]] == [c.name for c in CASES]


def test_a_step_past_its_limit_is_killed_and_the_next_one_runs(tmp_path):
    """The real run's loop on this CPU machine: ``rl_step`` given 1 s is killed with its process
    group, and ``cuda`` runs next (and fails: there is no GPU here)."""
    late = dataclasses.replace(gpu_check.step("rl_step"), limit_s=1)
    with (tmp_path / "log").open("w") as log:
        results = gpu_check._real_run([late, gpu_check.step("cuda")], tmp_path, log, budget_s=300)
    assert results["rl_step"]["status"] == "timeout" and "1 s limit" in results["rl_step"]["headline"]
    assert results["cuda"] == {**results["cuda"], "status": "fail", "headline": "torch.cuda.is_available() is False"}
    left = [p.pid for p in psutil.process_iter(["cmdline"]) if str(tmp_path) in " ".join(p.info["cmdline"] or [])]
    assert left == []
