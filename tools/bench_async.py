"""Benchmark asynchronous rollouts on CPU: RL steps per hour and held-out accuracy, staleness 1 vs 0.

    python tools/bench_async.py [--steps 60] [--token-latency-s 0.06] [--out tools/results/bench_async] \\
        [key=value ...]

For each ``rollout.max_staleness`` in (0, 1): one rollout-server process (the protocol
server, SGLang's HTTP protocol over the HF engine, fresh per run) and the trainer
(``megatron-rl-train`` on ``configs/demo_cpu.yaml``: EP2, two processes) with
``rollout.engine=sglang`` and tensor weight sync. Two CPU cores cannot run a trainer and a
generation server side by side at full speed, so the server models a disaggregated GPU:
after computing a batch it SLEEPS ``--token-latency-s`` per token of the batch's longest
response (``protocol_server --token-latency-s``): generation occupies wall time the way a
separate accelerator would, without taking the trainer's cores (its own compute, one
thread, still does). Batches sleep side by side, as requests that arrive a little apart
decode together in SGLang's continuous batching. Choose the latency so that generation and
training take similar time per step (the synchronous run's ``time/rollout`` vs
``time/update + time/old_logprobs``).

Dynamic sampling is off in both runs (``objective.dynamic_sampling=false``; a later
override wins): its extra rounds are generated synchronously under staleness 1 too, so
they would only dilute the comparison of the overlapped part.

Steps per hour are measured from outside, by when each step's row appears in
``metrics.jsonl``: steps 1 .. N-1 (evaluation only runs at step 0, before the clock starts,
and at step N, after it stops). Held-out accuracy (``eval/*``) is compared at step N.
Writes ``<out>/results.json``, ``<out>/results.md`` and ``<out>/curves.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "demo_cpu.yaml"


def _start_server(args, log: Path):
    """The stand-in, serving on a socket bound here (no other process can take its port first)."""
    from megatron_rl.rollout.sglang.control import probe_servers
    from megatron_rl.rollout.sglang.server import ManagedServer

    cmd = [sys.executable, "-m", "megatron_rl.sglang_standin.server", "--config", str(CONFIG), "--port", "0",
           "--threads", "1", "--token-latency-s", str(args.token_latency_s)]
    if args.server_nice:
        cmd = ["nice", "-n", str(args.server_nice), *cmd]  # nice execs the server: same pid, same group
    log.unlink(missing_ok=True)
    server = ManagedServer(cmd, "http://127.0.0.1:0", env={"PYTHONWARNINGS": "ignore"}, log_path=log,
                           listen="127.0.0.1").start()
    probe_servers([server.url], timeout_s=5, wait_s=300, poll_s=0.5)
    return server


def _run(k: int, args, out: Path) -> dict:
    run_dir = out / f"staleness{k}"
    run_dir.mkdir(parents=True, exist_ok=True)
    server = _start_server(args, run_dir / "server.log")
    overrides = [f"train.run_dir={run_dir}", f"train.steps={args.steps}", f"train.eval_every={args.steps}",
                 f"train.save_every={args.steps}", "train.save_hf=false", "train.progress=false",
                 "train.resume=false", "rollout.engine=sglang", f"rollout.sglang.urls=[{server.url}]",
                 f"rollout.max_staleness={k}", "objective.dynamic_sampling=false", *args.overrides]
    metrics = run_dir / "metrics.jsonl"
    metrics.unlink(missing_ok=True)
    seen: dict[int, float] = {}
    started = time.monotonic()
    try:
        with (run_dir / "trainer.log").open("w") as log:
            trainer = subprocess.Popen([sys.executable, "-m", "megatron_rl.train.main", "--config", str(CONFIG),
                                        *overrides], stdout=log, stderr=subprocess.STDOUT,
                                       env={**os.environ, "PYTHONWARNINGS": "ignore"})
            while trainer.poll() is None:
                if metrics.exists():
                    for line in metrics.read_text().splitlines():
                        try:
                            step = json.loads(line)["step"]
                        except (ValueError, KeyError):
                            continue  # a line being written
                        seen.setdefault(step, time.monotonic())
                time.sleep(0.05)
        if trainer.returncode != 0:
            raise SystemExit(f"staleness {k}: the trainer failed (exit {trainer.returncode}); "
                             f"see {run_dir}/trainer.log")
    finally:
        server.stop()
    rows = {r["step"]: r for r in map(json.loads, metrics.read_text().splitlines())}
    n = args.steps
    clock = seen[n - 1] - seen[0]
    return {
        "max_staleness": k, "steps_timed": n - 1, "seconds": clock, "steps_per_hour": (n - 1) / clock * 3600,
        "total_wall_s": time.monotonic() - started,
        "eval_start": {key: v for key, v in rows[0].items() if key.startswith("eval/")},
        "eval_end": {key: v for key, v in rows[n].items() if key.startswith("eval/")},
        "reward_mean": [rows[s]["reward/mean"] for s in range(1, n + 1)],
        "row_seconds": [seen[s] - seen[0] for s in range(1, n)],
        "phase_means": {key: sum(rows[s].get(key, 0.0) for s in range(2, n)) / (n - 2)
                        for key in ("time/rollout", "time/rollout_join", "time/reward", "time/weight_sync",
                                    "time/old_logprobs", "time/update")},
        "staleness_mean": [rows[s].get("rollout/staleness_mean", 0.0) for s in range(1, n + 1)],
        "mismatch_abs_diff": [rows[s]["mismatch/train_rollout_abs_diff"] for s in range(1, n + 1)],
    }


def _report(results: list[dict], args, out: Path) -> str:
    sync, ahead = results
    nan = float("nan")
    gpu = f"--token-latency-s {args.token_latency_s}" + (f" --server-nice {args.server_nice}" * bool(args.server_nice))
    model = (f"the rollout server sleeps {args.token_latency_s} s per generated token of a batch after computing it, "
             "batches side by side (a modelled GPU with continuous batching; its CPU compute, one thread, is added "
             + ("and competes with the trainer's)" if not args.server_nice else
                f"and runs at nice {args.server_nice}, on the cores the trainer leaves idle)"))
    lines = [
        f"Command: `python tools/bench_async.py --steps {args.steps} {gpu}" + "".join(f" {o}" for o in args.overrides)
        + "`",
        f"Machine: {os.cpu_count()} CPU cores, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {model}.",
        "",
        "| max_staleness | steps/hour (steps 1..N-1) | s/step | rollout s (join / reward / weight push) "
        "| old log-probs s | update s | eval/accuracy start -> end | greedy end |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        p = r["phase_means"]
        lines.append(
            f"| {r['max_staleness']} | {r['steps_per_hour']:.0f} | {r['seconds'] / r['steps_timed']:.2f} "
            f"| {p['time/rollout']:.2f} ({p['time/rollout_join']:.2f} / {p['time/reward']:.2f} / "
            f"{p['time/weight_sync']:.2f}) | {p['time/old_logprobs']:.2f} | {p['time/update']:.2f} "
            f"| {r['eval_start'].get('eval/accuracy', nan):.3f} -> {r['eval_end'].get('eval/accuracy', nan):.3f} "
            f"| {r['eval_end'].get('eval/accuracy_greedy', nan):.3f} |")
    lines += ["", f"Speed-up (steps/hour, staleness 1 over 0): {ahead['steps_per_hour'] / sync['steps_per_hour']:.2f}x"]
    return "\n".join(lines) + "\n"


def _plot(results: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for r in results:
        label = f"max_staleness {r['max_staleness']}"
        steps = list(range(1, len(r["reward_mean"]) + 1))
        line, = left.plot(steps, r["reward_mean"], marker=".", label=label)
        right.plot(r["row_seconds"], list(range(1, len(r["row_seconds"]) + 1)), label=label)
        left.scatter([0, len(steps)], [r["eval_start"].get("eval/accuracy", float("nan")),
                                       r["eval_end"].get("eval/accuracy", float("nan"))],
                     marker="*", s=120, color=line.get_color())
    left.set(xlabel="RL step", ylabel="reward/mean (train); * held-out accuracy", title="Learning")
    right.set(xlabel="seconds since step 0", ylabel="RL steps done", title="Throughput (CPU, modelled GPU server)")
    left.legend(), right.legend()
    fig.tight_layout()
    fig.savefig(out / "curves.png", dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=60, help="RL steps per run (>= 4)")
    parser.add_argument("--token-latency-s", type=float, default=0.06, help="server sleep per generated token")
    parser.add_argument("--server-nice", type=int, default=0,
                        help="run the server at this niceness (19: its CPU compute, which a GPU would do, takes "
                             "only the cores the trainer leaves idle)")
    parser.add_argument("--out", default=str(REPO / "tools" / "results" / "bench_async"))
    parser.add_argument("overrides", nargs="*", help="extra config overrides for both runs")
    args = parser.parse_args(argv)
    if args.steps < 4:
        parser.error("--steps: at least 4 (steps 1..N-1 are timed)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = [_run(k, args, out) for k in (0, 1)]
    (out / "results.json").write_text(json.dumps(results, indent=1))
    report = _report(results, args, out)
    (out / "results.md").write_text(report)
    _plot(results, out)
    print(report, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
