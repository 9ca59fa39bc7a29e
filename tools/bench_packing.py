"""Log-prob pass and train step at EP2: today's fixed-count micro-batches against token budgets.

Shape legend: S samples (prompt + response), R data-parallel ranks (2 here), T tokens of a row.

Workload: ``--responses`` (512) responses of log-normal lengths (median 600, sigma 1, clipped to
32..4096 tokens, fixed seed) after short prompts (16..64 tokens), random token ids. Model:
the architecture of the shipped demo model (``megatron_rl/assets/tiny_qwen3_moe``: Qwen3-MoE,
4 layers, hidden 64, 4 query heads / 2 key-value groups of dim 16, 8 experts top-2, vocab
512) with random weights and ``max_position_embeddings`` raised to 4,160 so that the longest
sample fits (RoPE, no position table: a limit, not a weight). Layout: EP2 on two gloo
processes (``ParallelConfig(expert_model_parallel_size=2)``, so dense DP = 2), default
``alltoall`` dispatcher, one thread per rank.

Each mode runs in its own subprocess (its own world, its own peak RSS):

- ``today``: the code of ``--baseline-commit`` (83c7737, before THD packing) from a git
  worktree: samples dealt round-robin to the ranks, ``--micro-batch-sequences`` consecutive
  samples per micro-batch (1: the largest count whose dense attention fits in 24 GiB for
  two ranks), every row padded to one length over DP, dense ``[T, T]`` mask;
- ``tokens-rr``: this checkout, ``micro_batch_tokens=--micro-batch-tokens``, samples dealt
  round-robin;
- ``tokens-kk``: the same, samples dealt by ``balance.balanced_partition`` on their token
  counts (equal counts per rank; what ``train/dp_balance.rebalance_over_dp`` does with whole
  groups, here groups of one sample).

Per mode: a log-prob pass (``compute_logprobs``, ``record_routing=True``) and a train step
(``forward_backward`` with the ``grpo`` preset and R2 replay of the pass's record, whose
routing probe pass is part of the step, then the optimizer step), each timed between
barriers on rank 0, median of ``--repeats``. Advantages are drawn per sample, so every
mode computes the same global loss: the first step's loss and gradient norm are printed as
a check that the modes do the same math. Token accounting, from the micro-batches that
``logprobs.pack_for_rank`` builds for both passes:

- padded fraction = (row tokens processed - real tokens) / row tokens processed, summed
  over ranks: padding inside rows plus padding-only rows;
- lockstep waste = 1 - real tokens / (R * sum over micro-batch steps of the longest row of
  any rank at that step): expert dispatch synchronises the ranks at every MoE layer of
  every micro-batch, so a rank with a shorter row idles; this adds rank imbalance.

Usage (from a checkout, with the venv active; 'today' alone takes ~45 minutes on 2 cores)::

    python tools/bench_packing.py
    python tools/bench_packing.py --modes tokens-kk --micro-batch-tokens 8192 --repeats 1
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ASSET_CONFIG = REPO / "megatron_rl" / "assets" / "tiny_qwen3_moe" / "config.json"
MAX_PROMPT, MAX_RESPONSE = 64, 4096
MODES = ("today", "tokens-rr", "tokens-kk")


def sample_lengths(num: int, seed: int) -> list[tuple[int, int]]:
    """``(prompt, response)`` token counts of ``num`` samples: short prompts, log-normal responses."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    responses_S = torch.empty(num).log_normal_(mean=float(torch.tensor(600.0).log()), std=1.0, generator=gen)
    responses_S = responses_S.round().clamp(32, MAX_RESPONSE).long()
    prompts_S = torch.randint(16, MAX_PROMPT + 1, (num,), generator=gen)
    return list(zip(prompts_S.tolist(), responses_S.tolist()))


def _mine(mode: str, totals: list[int], dp_size: int, dp_rank: int) -> list[int]:
    """Indices of the samples this DP rank holds: round-robin, or balanced by token counts."""
    if mode == "tokens-kk":
        from megatron_rl.parallel.balance import balanced_partition

        return balanced_partition(totals, dp_size, equal_size=True)[dp_rank]
    return list(range(dp_rank, len(totals), dp_size))


def _accounting(micro_batches: list, groups) -> dict:
    """Token bookkeeping of one pass, over all DP ranks (a collective)."""
    import torch.distributed as dist

    rows = [(mb.padded_length, mb.num_tokens) for mb in micro_batches]
    everyone: list = [None] * groups.dp_size
    dist.all_gather_object(everyone, rows, group=groups.dp)
    processed = sum(t for rank in everyone for t, _ in rank)
    real = sum(n for rank in everyone for _, n in rank)
    steps = max(len(rank) for rank in everyone)
    lockstep = sum(max(rank[i][0] if i < len(rank) else 0 for rank in everyone) for i in range(steps))
    return {
        "micro_batches_per_rank": [len(rank) for rank in everyone],
        "padding_only_rows": sum(1 for rank in everyone for _, n in rank if n == 0),
        "real_tokens": real,
        "processed_tokens": processed,
        "padded_fraction": (processed - real) / processed,
        "lockstep_waste": 1 - real / (groups.dp_size * lockstep),
        "longest_row": max(t for rank in everyone for t, _ in rank),
        "rank_tokens": [sum(t for t, _ in rank) for rank in everyone],
    }


def _timed(fn, repeats: int) -> tuple[list[float], object]:
    """Wall seconds of ``repeats`` calls of ``fn``, each between barriers, and the last result."""
    import torch.distributed as dist

    seconds, result = [], None
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        result = fn()
        dist.barrier()
        seconds.append(time.perf_counter() - start)
    return seconds, result


def _worker(mode: str, responses: int, seed: int, per_micro_batch: int, budget: int | None, repeats: int) -> dict:
    """One rank of the EP2 world: accounting, then the timed log-prob pass and train step."""
    import dataclasses

    import torch

    from megatron_rl.algos.presets import get_preset
    from megatron_rl.checkpoint.hf_config import model_config_from_hf
    from megatron_rl.parallel.cpu_platform import cpu_platform
    from megatron_rl.parallel.groups import model_parallel
    from megatron_rl.parallel.logprobs import compute_logprobs, pack_for_rank
    from megatron_rl.parallel.model import build_model
    from megatron_rl.parallel.optim import build_optimizer, optimizer_step
    from megatron_rl.parallel.schedule import wrap_for_training
    from megatron_rl.parallel.train_step import (
        RoutingPlan,
        TrainBatch,
        forward_backward,
    )
    from megatron_rl.sections import OptimConfig, ParallelConfig

    model_cfg = model_config_from_hf(json.loads(ASSET_CONFIG.read_text()), "float32")
    model_cfg = dataclasses.replace(model_cfg, max_position_embeddings=MAX_PROMPT + MAX_RESPONSE)
    parallel = ParallelConfig(expert_model_parallel_size=2)
    lengths = sample_lengths(responses, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    sequences = [torch.randint(0, model_cfg.vocab_size, (p + r,), generator=gen) for p, r in lengths]
    with cpu_platform(), model_parallel(parallel, seed=seed) as groups:
        model = build_model(model_cfg, parallel, moe_enable_routing_replay=True)
        ddp = wrap_for_training(model)
        optimizer = build_optimizer(ddp, OptimConfig(optimizer="adam", lr=1e-6))
        mine = _mine(mode, [p + r for p, r in lengths], groups.dp_size, groups.dp_rank)
        seqs, prompts = [sequences[i] for i in mine], [lengths[i][0] for i in mine]
        packing: dict = {"micro_batch_sequences": per_micro_batch}
        pack_options: dict = {}
        if budget is not None:
            from megatron_rl.parallel.logprobs import needs_common_length

            packing["micro_batch_tokens"] = budget
            pack_options = {"max_tokens": budget, "common_length": needs_common_length(ddp, groups)}
        tokens = _accounting(pack_for_rank(seqs, groups, per_micro_batch, **pack_options), groups)

        logprob_s, old = _timed(lambda: compute_logprobs(ddp, groups, seqs, prompts, record_routing=True, **packing),
                                repeats)
        # Advantages belong to samples, not ranks: every mode computes the same global loss.
        adv_gen = torch.Generator().manual_seed(seed + 2)
        advantages = [torch.randn(r, generator=adv_gen) for _, r in lengths]
        batch = TrainBatch(
            sequences=seqs, prompt_lengths=prompts, old_logprobs_T=old.logprobs_T,
            advantages_T=torch.cat([advantages[i] for i in mine]),
            ref_logprobs_T=old.logprobs_T, old_record=old.record,
        )

        steps: list[dict] = []

        def train_step() -> None:
            result = forward_backward(ddp, groups, batch, get_preset("grpo"), RoutingPlan(mode="R2"), **packing)
            steps.append({"loss": float(result.loss), **optimizer_step(optimizer)})

        step_s, _ = _timed(train_step, repeats)
    return {
        "mode": mode, "tokens": tokens, "logprob_s": logprob_s, "step_s": step_s,
        "loss": steps[0]["loss"], "grad_norm": float(steps[0]["optim/grad_norm"]),
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "threads": torch.get_num_threads(),
    }


def _baseline_worktree(commit: str, root: Path) -> Path:
    """A detached git worktree of ``commit`` under ``root`` (the code of 'today')."""
    path = root / f"baseline_{commit}"
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", "--quiet", str(path), commit], check=True)
    return path


def _run_mode(mode: str, args: argparse.Namespace, pythonpath: Path | None) -> dict:
    """One mode in a fresh subprocess (its own gloo world of 2 ranks); ``{'error': ...}`` if it failed."""
    budget = None if mode == "today" else args.micro_batch_tokens
    repeats = args.baseline_repeats if mode == "today" and args.baseline_repeats else args.repeats
    cmd = [sys.executable, __file__, "--worker", mode, "--responses", str(args.responses), "--seed", str(args.seed),
           "--micro-batch-sequences", str(args.micro_batch_sequences), "--repeats", str(repeats)]
    if budget is not None:
        cmd += ["--micro-batch-tokens", str(budget)]
    env = dict(os.environ)
    if pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(pythonpath), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    start = time.perf_counter()
    for _ in range(3):  # a rendezvous port taken meanwhile by another process: start the world again
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=env)
        if proc.returncode == 0 or "EADDRINUSE" not in proc.stderr:
            break
    if proc.returncode != 0:
        tail = proc.stderr.strip().splitlines()[-3:] or [f"killed (exit {proc.returncode})"]
        return {"mode": mode, "error": " | ".join(tail)}
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["wall_s"] = time.perf_counter() - start
    return result


def _print_table(results: list[dict], args: argparse.Namespace) -> None:
    """Markdown table of the modes, speed-ups against 'today'."""
    base = next((r for r in results if r["mode"] == "today" and "error" not in r), None)
    print(f"\n{args.responses} responses, EP2; today: {args.micro_batch_sequences} sequences per micro-batch; "
          f"token budget {args.micro_batch_tokens}; median of {args.repeats} runs "
          f"(today: {args.baseline_repeats or args.repeats})")
    print("| mode | micro-batches per rank | longest row | padded | lockstep waste | log-prob pass s | speed-up "
          "| train step s | speed-up | peak RSS per rank MiB | loss |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        if "error" in r:
            print(f"| {r['mode']} | failed: {r['error']} |")
            continue
        t, lp, st = r["tokens"], statistics.median(r["logprob_s"]), statistics.median(r["step_s"])
        lp_x = f"{statistics.median(base['logprob_s']) / lp:.2f}x" if base else "-"
        st_x = f"{statistics.median(base['step_s']) / st:.2f}x" if base else "-"
        print(f"| {r['mode']} | {'/'.join(map(str, t['micro_batches_per_rank']))} | {t['longest_row']} "
              f"| {100 * t['padded_fraction']:.1f}% | {100 * t['lockstep_waste']:.1f}% | {lp:.1f} | {lp_x} "
              f"| {st:.1f} | {st_x} | {r['peak_rss_mib']:.0f} | {r['loss']:.6f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--responses", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--micro-batch-sequences", type=int, default=1,
                        help="today's consecutive samples per micro-batch: 2 already needs ~11 GB per rank for the "
                             "dense attention of the train step (rows up to 8.3K tokens)")
    parser.add_argument("--micro-batch-tokens", type=int, default=8192, help="token budget of the new modes")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of each pass (median reported)")
    parser.add_argument("--baseline-repeats", type=int, help="timed runs of 'today' (default: --repeats; it is slow)")
    parser.add_argument("--baseline-commit", default="83c7737", help="the code of 'today' (before THD packing)")
    parser.add_argument("--worker", choices=MODES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        from megatron_rl.parallel.world import run_world

        budget = None if args.worker == "today" else args.micro_batch_tokens
        ranks = run_world(_worker, 2, args.worker, args.responses, args.seed, args.micro_batch_sequences, budget,
                          args.repeats, timeout_s=6 * 3600.0)
        print(json.dumps({**ranks[0], "peak_rss_mib": max(r["peak_rss_mib"] for r in ranks)}))
        return
    lengths = sample_lengths(args.responses, args.seed)
    totals = sorted(p + r for p, r in lengths)
    print(f"{args.responses} samples, {sum(totals)} tokens (responses {sum(r for _, r in lengths)}), "
          f"median {totals[len(totals) // 2]}, longest {totals[-1]}; {os.cpu_count()} CPUs, "
          f"load average {os.getloadavg()[0]:.1f}", flush=True)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        worktree = _baseline_worktree(args.baseline_commit, Path(tmp)) if "today" in args.modes else None
        try:
            for mode in args.modes:
                results.append(_run_mode(mode, args, worktree if mode == "today" else None))
                print(json.dumps(results[-1]), flush=True)
        finally:
            if worktree is not None:
                subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(worktree)], check=False)
    _print_table(results, args)


if __name__ == "__main__":
    main()
