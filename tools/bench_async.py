"""Benchmark asynchronous and partial rollouts on CPU: RL steps per hour, held-out accuracy and router drift.

    python tools/bench_async.py [--steps 16] [--runs 3] [--token-latency-s 0.05] [--long-tail 0.05] \\
        [--max-new-tokens 48] [--configs 0,1,1p,2,2p,4,4p] [--server-nice 19] [--split-cores] \\
        [--out tools/results/bench_async] [key=value ...]

Each configuration is ``rollout.max_staleness`` k, with ``p`` partial rollouts (``rollout.partial
=true``, mode abort), run ``--runs`` times, run r with ``seed=1 + r`` (the seeds' spread is the
accuracy's noise). Runs go round-robin (run 1 of every configuration, then run 2, ...), so a
change in the machine's load spreads over all of them. The trainer is ``megatron-rl-train`` on
``configs/demo_cpu.yaml`` (EP2, two processes; dynamic sampling off, ``objective.mismatch=tis``);
one rollout server, the stand-in (SGLang's protocol over the HF engine), serves every run (each
run pushes its own weights first).

**The task is long-tailed**: the stand-in's ``--long-tail`` share of requests ignore their stop
tokens and run to ``rollout.max_new_tokens`` (``--max-new-tokens``), the rest stop where the
model stops (most arithmetic answers: 8-12 tokens). **The server models a disaggregated GPU**:
a response's tokens come one per ``--token-latency-s`` after it is computed, responses decoding
side by side (continuous batching); its compute (one thread) is real CPU work that a GPU would
do, run at ``--server-nice`` on the cores the trainer leaves idle. So a synchronous step waits
for its longest response (a few at the cap in nearly every batch), which partial rollouts let
run on under the next weights. With ``--split-cores`` the server has the last core to itself and
the trainer (both ranks) the others, as inference and training GPUs are apart in a
disaggregated run: the server's compute then takes nothing from the trainer's, in every
configuration alike.

Steps per hour are measured from outside, by when each step's row appears in ``metrics.jsonl``:
steps 1 .. N-1 (evaluation only runs at step 0, before the clock starts, and at step N, after
it stops). Held-out accuracy (``eval/accuracy``) is compared at step N, after the same number of
samples in every configuration. Router drift per version lag (``drift/*/lag<d>``) is averaged
over the steps of the deepest partial configuration that trained tokens of that lag. Load
averages are recorded per run, and the CPU seconds the server used over the timed steps (its
compute, ``/proc/<pid>/stat``): with the modelled latency, what a synchronous step's generation
is made of.
Writes ``<out>/results.json``, ``<out>/results.md``, ``<out>/throughput.png`` and ``<out>/drift.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "demo_cpu.yaml"
DRIFT = ("flip_rate", "router_shift", "gamma", "train_rollout_abs_diff")


def _start_server(args, log: Path) -> tuple[subprocess.Popen, str]:
    """The stand-in on a port this process binds and hands it (nothing else can take it meanwhile); its url."""
    from megatron_rl.rollout.sglang.control import probe_servers
    from megatron_rl.rollout.sglang.sockets import LISTEN_FD_ENV, bound_socket

    sock = bound_socket("127.0.0.1", 0)
    port = sock.getsockname()[1]
    cmd = [sys.executable, "-m", "megatron_rl.sglang_standin.server", "--config", str(CONFIG), "--port", str(port),
           "--threads", "1", "--token-latency-s", str(args.token_latency_s), "--long-tail", str(args.long_tail)]
    if args.server_nice:
        cmd = ["nice", "-n", str(args.server_nice), *cmd]  # nice execs the server: same pid, same group
    if args.split_cores:
        cmd = ["taskset", "-c", str(_cores()[-1]), *cmd]  # taskset execs it too
    with sock:
        proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True,
                                pass_fds=(sock.fileno(),),
                                env={**os.environ, "PYTHONWARNINGS": "ignore", LISTEN_FD_ENV: str(sock.fileno())})
    url = f"http://127.0.0.1:{port}"
    try:
        probe_servers([url], timeout_s=10, wait_s=600, poll_s=0.5)
    except BaseException:  # stopped (SIGTERM) or never up: the server goes too
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait()
        raise
    return proc, url


def _cores() -> list[int]:
    return sorted(os.sched_getaffinity(0))


def _trainer_cores(args) -> list[str]:
    """``taskset`` for the trainer with ``--split-cores``: every core but the server's (its ranks inherit it)."""
    return ["taskset", "-c", ",".join(map(str, _cores()[:-1]))] if args.split_cores else []


def _parse_config(name: str) -> tuple[int, bool]:
    return int(name.rstrip("p")), name.endswith("p")


def _cpu_s(pid: int) -> float:
    """CPU seconds (user + system, every thread) process ``pid`` has used."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _run(name: str, seed: int, server: int, url: str, args, out: Path) -> dict:
    k, partial = _parse_config(name)
    run_dir = out / "runs" / f"{name}_seed{seed}"
    run_dir.mkdir(parents=True, exist_ok=True)
    overrides = [f"train.run_dir={run_dir}", f"train.steps={args.steps}", f"train.eval_every={args.steps}",
                 f"train.save_every={args.steps}", "train.save_hf=false", "train.progress=false", "train.resume=false",
                 "rollout.engine=sglang", f"rollout.sglang.urls=[{url}]", f"rollout.max_staleness={k}",
                 f"rollout.partial={str(partial).lower()}", f"rollout.max_new_tokens={args.max_new_tokens}",
                 "objective.dynamic_sampling=false", "objective.mismatch=tis", f"seed={seed}", *args.overrides]
    metrics = run_dir / "metrics.jsonl"
    metrics.unlink(missing_ok=True)
    seen: dict[int, float] = {}
    server_cpu: dict[int, float] = {}
    load_before, started = os.getloadavg(), time.monotonic()
    with (run_dir / "trainer.log").open("w") as log:
        trainer = subprocess.Popen([*_trainer_cores(args), sys.executable, "-m", "megatron_rl.train.main",
                                    "--config", str(CONFIG), *overrides], stdout=log, stderr=subprocess.STDOUT,
                                   env={**os.environ, "PYTHONWARNINGS": "ignore"})
        try:
            while trainer.poll() is None:
                if metrics.exists():
                    for line in metrics.read_text().splitlines():
                        try:
                            step = json.loads(line)["step"]
                        except (ValueError, KeyError):
                            continue  # a line being written
                        if step not in seen:
                            seen[step], server_cpu[step] = time.monotonic(), _cpu_s(server)
                time.sleep(0.05)
        finally:
            if trainer.poll() is None:  # the bench was stopped: the trainer stops too (it ends every rank)
                trainer.terminate()
                trainer.wait()
    if trainer.returncode != 0:
        raise SystemExit(f"{name} seed {seed}: the trainer failed (exit {trainer.returncode}); see {run_dir}/trainer.log")
    rows = {r["step"]: r for r in map(json.loads, metrics.read_text().splitlines())}
    n = args.steps
    clock = seen[n - 1] - seen[0]
    steps = range(2, n)

    def mean(key: str) -> float:
        return statistics.fmean(rows[s].get(key, 0.0) for s in steps)

    return {
        "config": name, "max_staleness": k, "partial": partial, "seed": seed, "steps_timed": n - 1,
        "seconds": clock, "steps_per_hour": (n - 1) / clock * 3600, "total_wall_s": time.monotonic() - started,
        "server_cpu_s_per_step": (server_cpu[n - 1] - server_cpu[0]) / (n - 1),
        "load_average": [load_before[0], os.getloadavg()[0]],
        "eval_start": {key: v for key, v in rows[0].items() if key.startswith("eval/")},
        "eval_end": {key: v for key, v in rows[n].items() if key.startswith("eval/")},
        "row_seconds": [seen[s] - seen[0] for s in range(1, n)],
        "phase_means": {key: mean(key) for key in ("time/step", "time/rollout", "time/rollout_join", "time/weight_sync",
                                                    "time/old_logprobs", "time/ref_logprobs", "time/update")},
        "rollout": {key: mean(key) for key in ("rollout/staleness_mean", "rollout/token_staleness_mean",
                                                "rollout/mixed_version_frac", "rollout/response_length",
                                                "sglang/continued", "mismatch/train_rollout_abs_diff",
                                                "reward/mean")},
        **drift_by_lag(rows, steps, k),
    }


def drift_by_lag(rows: dict[int, dict], steps: range, k: int) -> dict:
    """``drift``: each ``drift/<m>/lag<d>`` averaged over the steps that trained tokens d
    versions old (the trainer logs a lag only where it had tokens; NaN where no step had);
    ``drift_share``: the share of samples at each lag, averaged over all steps (none at k = 0:
    the synchronous loop logs neither)."""
    drift = {}
    if k == 0:
        return {"drift": drift, "drift_share": {}}
    for d in range(k + 1):
        for m in DRIFT:
            logged = [rows[s][f"drift/{m}/lag{d}"] for s in steps if f"drift/{m}/lag{d}" in rows[s]]
            drift[f"{m}/lag{d}"] = statistics.fmean(logged) if logged else float("nan")
    return {"drift": drift, "drift_share": {f"lag{d}": statistics.fmean(rows[s][f"rollout/staleness/lag{d}"]
                                                                         for s in steps) for d in range(k + 1)}}


def _summary(results: list[dict], configs: list[str]) -> dict[str, dict]:
    by = {c: runs for c in configs if (runs := [r for r in results if r["config"] == c])}
    base = statistics.median(r["steps_per_hour"] for r in by[configs[0]])
    out = {}
    for c, runs in by.items():
        speed = [r["steps_per_hour"] for r in runs]
        acc = [r["eval_end"].get("eval/accuracy", float("nan")) for r in runs]
        out[c] = {"runs": len(runs), "steps_per_hour_median": statistics.median(speed), "steps_per_hour": speed,
                  "speedup_vs_first": statistics.median(speed) / base, "accuracy_end": acc,
                  "accuracy_mean": statistics.fmean(acc),
                  "accuracy_start": statistics.fmean(r["eval_start"].get("eval/accuracy", float("nan")) for r in runs),
                  "phase_means": {k: statistics.fmean(r["phase_means"][k] for r in runs) for k in runs[0]["phase_means"]},
                  "rollout": {k: statistics.fmean(r["rollout"][k] for r in runs) for k in runs[0]["rollout"]},
                  "server_cpu_s_per_step": statistics.fmean(r["server_cpu_s_per_step"] for r in runs),
                  "load_average": [min(r["load_average"][0] for r in runs), max(r["load_average"][1] for r in runs)]}
    return out


def _report(summary: dict[str, dict], results: list[dict], args) -> str:
    first = next(iter(summary))
    knobs = (f"--steps {args.steps} --runs {args.runs} --configs {args.configs} --token-latency-s {args.token_latency_s} --long-tail "
             f"{args.long_tail} --max-new-tokens {args.max_new_tokens} --server-nice {args.server_nice}"
             + (" --split-cores" if args.split_cores else ""))
    loads = [x for r in results for x in r["load_average"]]
    resumed = " (`--resume`: runs of earlier invocations of the same options kept)" if args.resume else ""
    lines = [f"Command: `python tools/bench_async.py {knobs}" + "".join(f" {o}" for o in args.overrides) + "`" + resumed,
             f"Machine: {os.cpu_count()} CPU cores, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; 1-minute "
             f"load average {min(loads):.1f}-{max(loads):.1f} over the runs.", "",
             "| config | steps/hour, median (runs) | vs " + first + " | held-out accuracy at step N, mean (seeds) "
             "| s/step: step = rollout (join) + push + old/ref log-probs + update | server CPU s/step "
             "| staleness mean (tokens) | mixed-version responses | continued / step |",
             "|---|---|---|---|---|---|---|---|---|"]
    for c, s in summary.items():
        p = s["phase_means"]
        ro = s["rollout"]
        lines.append(
            f"| {c} | {s['steps_per_hour_median']:.0f} ({', '.join(f'{v:.0f}' for v in s['steps_per_hour'])}) "
            f"| {s['speedup_vs_first']:.2f}x | {s['accuracy_mean']:.3f} ({', '.join(f'{v:.3f}' for v in s['accuracy_end'])}) "
            f"| {p['time/step']:.1f} = {p['time/rollout']:.1f} ({p['time/rollout_join']:.1f}) + "
            f"{p['time/weight_sync']:.1f} + {p['time/old_logprobs'] + p['time/ref_logprobs']:.1f} + "
            f"{p['time/update']:.1f} | {s['server_cpu_s_per_step']:.1f} "
            f"| {ro['rollout/staleness_mean']:.2f} ({ro['rollout/token_staleness_mean']:.2f}) "
            f"| {ro['rollout/mixed_version_frac']:.3f} | {ro['sglang/continued']:.1f} |")
    return "\n".join(lines) + "\n"


def _plot(results: list[dict], summary: dict[str, dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for c in summary:
        runs = [r for r in results if r["config"] == c]
        run = sorted(runs, key=lambda r: r["steps_per_hour"])[len(runs) // 2]
        ax.plot(run["row_seconds"], list(range(1, len(run["row_seconds"]) + 1)), label=c)
    ax.set(xlabel="seconds since step 0", ylabel="RL steps done", title="Throughput, median run (k, p: partial)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "throughput.png", dpi=110)
    deepest = max((r for r in results if r["partial"]), key=lambda r: r["max_staleness"], default=None)
    if deepest is None:
        return
    k = deepest["max_staleness"]
    runs = [r for r in results if r["config"] == deepest["config"]]
    fig, axes = plt.subplots(1, len(DRIFT), figsize=(14, 3.4))
    for ax, m in zip(axes, DRIFT):
        values = [statistics.fmean(r["drift"][f"{m}/lag{d}"] for r in runs) for d in range(k + 1)]
        share = [statistics.fmean(r["drift_share"][f"lag{d}"] for r in runs) for d in range(k + 1)]
        ax.bar(range(k + 1), values)
        ax.set(xlabel="version lag (share of samples)", title=m)
        ax.set_xticks(range(k + 1), [f"{d}\n({s:.2f})" for d, s in enumerate(share)])
    fig.suptitle(f"Router drift against staleness, {deepest['config']} ({len(runs)} runs, mean over steps)")
    fig.tight_layout()
    fig.savefig(out / "drift.png", dpi=110)


def _earlier_runs(path: Path, knobs: dict) -> list[dict]:
    """The runs a bench with the same options (``knobs``) saved in ``path`` (none if there is no such file)."""
    if not path.exists():
        return []
    saved = json.loads(path.read_text())
    if saved.get("knobs", knobs) != knobs:
        raise SystemExit(f"--resume: {path} holds runs made with {saved['knobs']}, not {knobs}")
    return saved["results"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=16, help="RL steps per run (>= 4)")
    parser.add_argument("--runs", type=int, default=3, help="runs (seeds) per configuration")
    parser.add_argument("--configs", default="0,1,1p,2,2p,4,4p", help="max_staleness values, p: partial rollouts")
    parser.add_argument("--token-latency-s", type=float, default=0.05, help="modelled decode time per token")
    parser.add_argument("--long-tail", type=float, default=0.05, help="share of responses that run to the cap")
    parser.add_argument("--max-new-tokens", type=int, default=48, help="the length cap (rollout.max_new_tokens)")
    parser.add_argument("--server-nice", type=int, default=19, help="the server's niceness")
    parser.add_argument("--split-cores", action="store_true",
                        help="the server on the last core alone, the trainer on the others (disaggregated placement)")
    parser.add_argument("--out", default=str(REPO / "tools" / "results" / "bench_async"))
    parser.add_argument("--resume", action="store_true",
                        help="keep the runs already in <out>/results.json (same options) and make only the missing ones")
    parser.add_argument("--report", action="store_true", help="with --resume: make no run, report the saved ones")
    parser.add_argument("overrides", nargs="*", help="extra config overrides for every run")
    args = parser.parse_args(argv)
    if args.steps < 4:
        parser.error("--steps: at least 4 (steps 1..N-1 are timed)")
    if args.split_cores and len(_cores()) < 2:
        parser.error("--split-cores: needs at least 2 cores (the server takes one)")
    configs = args.configs.split(",")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.report and not args.resume:
        parser.error("--report: only with --resume")
    knobs = {key: value for key, value in vars(args).items()
             if key not in ("runs", "configs", "out", "resume", "report") and not (key == "split_cores" and not value)}
    results = _earlier_runs(out / "results.json", knobs) if args.resume else []
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))  # the finally clauses run
    todo = [(name, 1 + run) for run in range(args.runs) for name in configs
            if not args.report and not any(r["config"] == name and r["seed"] == 1 + run for r in results)]
    if todo:
        server, url = _start_server(args, out / "server.log")
        try:
            for name, seed in todo:
                results.append(_run(name, seed, server.pid, url, args, out))
                print(f"{name} seed {seed}: {results[-1]['steps_per_hour']:.0f} steps/hour, accuracy "
                      f"{results[-1]['eval_end'].get('eval/accuracy', float('nan')):.3f}, load "
                      f"{results[-1]['load_average']}", flush=True)
                (out / "results.json").write_text(json.dumps({"knobs": knobs, "results": results}, indent=1))
        finally:
            os.killpg(server.pid, signal.SIGTERM)
            server.wait()
    summary = _summary(results, configs)
    (out / "results.json").write_text(json.dumps({"knobs": knobs, "summary": summary, "results": results}, indent=1))
    results = [r for r in results if r["config"] in configs]
    report = _report(summary, results, args)
    (out / "results.md").write_text(report)
    _plot(results, summary, out)
    print(report, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
