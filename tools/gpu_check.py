"""The GPU proof in one command: everything of this project that one H100 / H200 can show, in
under 8 minutes, each step in its own process with its own time limit.

    python tools/gpu_check.py --out DIR [--only STEP ...] [--commit SHA]
    python tools/gpu_check.py --dry-run --out DIR      # CPU: every step at a tiny size, nothing on CUDA

Steps, in order (``tools/gpu_check_steps/__init__.py`` has their limits; docs/gpu.md what each
proves and its pass criterion): ``cuda``, ``gpu_tests``, ``rl_step``, ``planner``, ``colocate``,
``engine``, ``gap``, ``ipc``. A step that fails, raises or runs past its limit (its process group
is killed) is recorded so, and the next one runs; the whole check stops starting steps once
``--budget-s`` (480) is spent. The dry run runs ``gpu_tests`` beside one process for all the
others. Writes ``DIR/results.md`` (a summary table, then one table per step that has rows),
``DIR/results.json`` (every figure) and ``DIR/gpu_check.log`` (every step's output). Exit code
0 when every step passed (or, with ``--dry-run``, ran), else 1.

On the GPU machine the image lacks megatron-core, a recent enough transformers and a few small
packages: ``tools/gpu_wheels.sh`` downloads them here into ``.whl``; docs/gpu.md gives the exact
command that installs them there and runs this. The dry run is a test of the suite
(``tests/e2e/test_gpu_check.py``), so the
script cannot rot between the rare times a GPU is lent.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

TOOLS = Path(__file__).resolve().parent
REPO = TOOLS.parent
sys.path[:0] = [str(REPO), str(TOOLS)]

from gpu_check_steps import BUDGET_S, DRY_LIMIT_S, STEPS, Step, step  # noqa: E402

KILL_GRACE_S = 10.0


def worker(names: list[str], scratch: Path, dry: bool) -> int:
    """In a step's own process: run each named step, writing ``<scratch>/<name>.json`` as it ends."""
    import importlib

    if dry:
        # As on the GPU image, which has no wandb: Megatron's inference context imports it when it
        # is installed (2-3 s of a CPU machine's time, for nothing a step uses).
        sys.modules.setdefault("wandb", None)
    from gpu_check_steps.common import Context, Outcome

    for name in names:
        start, cpu = time.perf_counter(), time.process_time()
        folder = scratch / f"{name}.files"
        folder.mkdir(parents=True, exist_ok=True)
        ctx = Context(name=name, dry=dry, scratch=folder)
        try:
            module = importlib.import_module(f"gpu_check_steps.{step(name).module}")
            outcome = module.run(ctx)
        except Exception as err:  # noqa: BLE001 - one step's failure is its result, not the check's
            traceback.print_exc()
            outcome = Outcome("fail", f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}")
        result = {**outcome.to_json(), "seconds": round(time.perf_counter() - start, 1),
                  "cpu_s": round(time.process_time() - cpu, 1)}
        (scratch / f"{name}.json").write_text(json.dumps(result))
        print(f"[{name}] {result['status']} in {result['seconds']} s: {result['headline']}", flush=True)
    return 0


def _end_group(proc: subprocess.Popen) -> None:
    """SIGTERM the step's process group (it and anything it started), SIGKILL after a grace."""
    for sig, wait_s in ((signal.SIGTERM, KILL_GRACE_S), (signal.SIGKILL, KILL_GRACE_S)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def run_group(group: list[Step], limit_s: float, scratch: Path, log, dry: bool) -> dict[str, dict]:
    """Run ``group``'s steps in one new process (its own process group) for at most ``limit_s``;
    their results by name. A step with no result is ``timeout`` (the limit passed) or ``fail``."""
    names = [s.name for s in group]
    # Offline: the GPU machine reaches no network, and nothing here downloads (no hub lookups to time out).
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])}
    if dry:
        env["CUDA_VISIBLE_DEVICES"] = ""  # nothing on CUDA, even on a GPU machine
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", ",".join(names), "--scratch", str(scratch)]
    log.write(f"\n===== {', '.join(names)} (limit {limit_s:.0f} s) =====\n")
    log.flush()
    start = time.monotonic()
    proc = subprocess.Popen(cmd + (["--dry-run"] if dry else []), stdout=log, stderr=subprocess.STDOUT,
                            env=env, cwd=REPO, start_new_session=True)
    timed_out = False
    try:
        proc.wait(timeout=limit_s)
    except subprocess.TimeoutExpired:
        timed_out = True
    finally:
        _end_group(proc)
    elapsed = round(time.monotonic() - start, 1)
    results = {}
    for name in names:
        path = scratch / f"{name}.json"
        if path.exists():
            results[name] = json.loads(path.read_text())
        elif timed_out:
            results[name] = {"status": "timeout", "headline": f"killed at its {limit_s:.0f} s limit",
                             "seconds": elapsed, "figures": {}, "table": []}
        else:
            results[name] = {"status": "fail", "headline": f"its process ended (exit code {proc.returncode}) "
                             "without a result; see gpu_check.log", "seconds": elapsed, "figures": {}, "table": []}
    return results


def _commit(given: str | None) -> str:
    if given:
        return given
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown (no git here: pass --commit)"


def _cell(value) -> str:
    return str(value).replace("|", "\\|").replace("\n", " ")


def markdown(meta: dict, results: dict[str, dict]) -> str:
    """The summary table, then one table per step that has rows."""
    lines = [f"# GPU check, {meta['date']}", "",
             f"Commit `{meta['commit']}`; {meta['device']}; Python {meta['python']}, torch {meta['torch']}, "
             f"megatron-core {meta['megatron-core']}, transformers {meta['transformers']}; "
             f"{'dry run (CPU, tiny sizes)' if meta['dry_run'] else 'real run'}; {meta['seconds']} s in all.", "",
             "| step | verdict | s | result | proves |", "|---|---|---|---|---|"]
    for s in STEPS:
        if s.name in results:
            r = results[s.name]
            lines.append(f"| {s.name} | {r['status']} | {r['seconds']} | {_cell(r['headline'])} | {_cell(s.proves)} |")
    for name, r in results.items():
        if r.get("table"):
            columns = list(dict.fromkeys(c for row in r["table"] for c in row))
            lines += ["", f"## {name}", "", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
            lines += ["| " + " | ".join(_cell(row.get(c, "")) for c in columns) + " |" for row in r["table"]]
    return "\n".join(lines) + "\n"


def _real_run(selected: list[Step], scratch: Path, log, budget_s: float) -> dict[str, dict]:
    """Each step in a process of its own, one after the other, none started once the budget is spent."""
    start, results = time.monotonic(), {}
    for s in selected:
        left = budget_s - (time.monotonic() - start)
        if left < 5:
            results[s.name] = {"status": "skipped", "headline": f"the {budget_s:.0f} s budget was spent",
                               "seconds": 0, "figures": {}, "table": []}
            continue
        results.update(run_group([s], min(left, s.limit_s), scratch, log, dry=False))
        print(f"{s.name}: {results[s.name]['status']} ({results[s.name]['seconds']} s) {results[s.name]['headline']}",
              flush=True)
    return results


def _dry_run(selected: list[Step], scratch: Path, log) -> dict[str, dict]:
    """``gpu_tests`` (a pytest process of its own) beside one process running every other step, at the
    same time (a CPU machine's cores); their logs one after the other."""
    pytest = [s for s in selected if s.name == "gpu_tests"]
    groups = [g for g in (pytest, [s for s in selected if s not in pytest]) if g]

    def run_logged(group: list[Step], index: int) -> dict[str, dict]:
        with (scratch / f"group{index}.log").open("w") as group_log:
            return run_group(group, DRY_LIMIT_S, scratch, group_log, dry=True)

    with ThreadPoolExecutor(len(groups)) as pool:
        done = list(pool.map(run_logged, groups, range(len(groups))))
    for index in range(len(groups)):
        log.write((scratch / f"group{index}.log").read_text())
    results = {name: r for part in done for name, r in part.items()}
    return {s.name: results[s.name] for s in selected}


def check(selected: list[Step], out: Path, dry: bool, budget_s: float, commit: str | None) -> int:
    """Run the steps and write the results; 0 when every step passed (the dry run: ran)."""
    out.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="gpu_check.") as scratch, (out / "gpu_check.log").open("w") as log:
        if dry:
            results = _dry_run(selected, Path(scratch), log)
        else:
            results = _real_run(selected, Path(scratch), log, budget_s)
    cuda = results.get("cuda", {}).get("figures", {})
    meta = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "commit": _commit(commit), "dry_run": dry,
            "device": cuda.get("device", "cpu" if dry else "unknown"), "python": platform.python_version(),
            "torch": cuda.get("torch", "-"), "megatron-core": cuda.get("megatron-core", "-"),
            "transformers": cuda.get("transformers", "-"), "seconds": round(time.monotonic() - start, 1)}
    (out / "results.json").write_text(json.dumps({"meta": meta, "steps": results}, indent=1) + "\n")
    (out / "results.md").write_text(markdown(meta, results))
    good = {"dry"} if dry else {"pass", "measured"}
    return 0 if all(r["status"] in good for r in results.values()) else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="results folder (created)")
    parser.add_argument("--only", nargs="+", metavar="STEP", help=f"steps to run: {' '.join(s.name for s in STEPS)}")
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes, nothing on CUDA (the suite's test)")
    parser.add_argument("--budget-s", type=float, default=BUDGET_S, help="stop starting steps after this long")
    parser.add_argument("--commit", help="the commit checked (default: git rev-parse HEAD, where git is)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--scratch", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args.worker.split(","), args.scratch, args.dry_run)
    if args.out is None:
        parser.error("--out DIR is required")
    try:
        selected = [step(name) for name in args.only] if args.only else list(STEPS)
    except KeyError as err:
        parser.error(err.args[0])
    status = check(selected, args.out, args.dry_run, args.budget_s, args.commit)
    print((args.out / "results.md").read_text(), flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
