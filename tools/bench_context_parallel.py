"""Context parallelism on CPU: memory per rank and time of one long sample at CP 1, 2, 4.

Shape legend: T tokens of the sample (prompt + response), CP context-parallel ranks.

One sample of T tokens (16K and 32K by default; a 512-token prompt, the rest response) runs
through the log-prob pass (``compute_logprobs``, routing recorded) and one training step
(``forward_backward``, GRPO objective, no probe pass, so the step is one forward and one
backward) in a gloo world of CP ranks (CP x DP1, the local layer spec: CP core attention with
the key/value all-gather, ``megatron_rl.parallel.packed_attention``). The model is the tests'
MoE model made narrow and long-context: hidden 64, 2 layers of 8 experts (top-2, width 32),
2 query heads sharing 1 key/value group of 16, vocabulary 256, 64K positions, float32 (two
layers and two heads keep the 32K CP1 step to minutes on two cores; memory per token and its
division by CP do not depend on the depth).

Memory per rank, method: the process's resident set measured by Linux. The ranks run with
``MALLOC_MMAP_THRESHOLD_=65536``: glibc then maps every allocation above 64 KiB (every tensor
that matters) on its own and unmaps it when freed, so RSS follows the live tensors; with
glibc's default (a threshold that grows to 32 MiB as blocks are freed) freed tensors stay in
the heap and the peak RSS measures the allocator's cache as much as the pass (CP1 -> CP2 at
32K looked like 1.3x that way; the tensors' own peak halves). Before each measured pass every
rank collects garbage, returns freed heap to the kernel (``malloc_trim``), reads its RSS
(``VmRSS``) and resets its peak RSS (writing 5 to ``/proc/self/clear_refs``); after the pass
it reads the peak (``VmHWM``). ``pass MiB`` is
peak - RSS before: what the pass itself held at its peak (activations, autograd state,
gathered keys and values, logits), the part that grows with T and that CP divides. ``peak
MiB`` is the whole process at that peak (interpreter, torch, Megatron and the weights add a
constant ~0.5 GiB per rank). The figure per CP is the largest over its ranks. Time is the
wall time of the pass on rank 0 (2 cores shared by all ranks here: CP > 1 costs time on
this machine; the figure that matters is memory).

Checks printed at the end: every doubling of CP divides the train step's ``pass MiB`` of the
longest sample by at least 1.7; the longest sample that fits a fixed per-rank budget (by
default the CP1 train step's pass memory at the shortest length), from a straight-line fit
of each CP's pass memory over the two lengths; and, as a sanity check, each CP's log-probs
against CP1's (max abs difference).

Usage (from a checkout, with the venv active)::

    python tools/bench_context_parallel.py                          # 16K and 32K at CP 1, 2, 4
    python tools/bench_context_parallel.py --tokens 4096 8192 --cp 1 2
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

PROMPT = 512
WARMUP_TOKENS = 1024
MIN_RATIO = 1.7


def model_config():
    from megatron_rl.sections import ModelConfig

    return ModelConfig(vocab_size=256, hidden_size=64, num_layers=2, num_attention_heads=2, num_query_groups=1,
                       head_dim=16, num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=32,
                       max_position_embeddings=65536)


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def measured(run) -> dict:
    """Run ``run()`` and return its wall time, the RSS before and the peak RSS (MiB)."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    before = _status_kib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # peak RSS := current RSS
    start = time.perf_counter()
    value = run()
    seconds = time.perf_counter() - start
    peak = _status_kib("VmHWM")
    return {"seconds": seconds, "before_mib": before / 1024, "peak_mib": peak / 1024,
            "pass_mib": (peak - before) / 1024, "value": value}


def _sample(tokens: int):
    import torch

    return torch.randint(0, 256, (tokens,), generator=torch.Generator().manual_seed(tokens))


def cp_worker(cp: int, lengths: list[int]) -> dict:
    """Every length's log-prob pass and train step on this rank of a CP world."""
    import torch

    from megatron_rl.algos.presets import get_preset
    from megatron_rl.parallel.cpu_platform import cpu_platform
    from megatron_rl.parallel.groups import model_parallel
    from megatron_rl.parallel.logprobs import compute_logprobs
    from megatron_rl.parallel.model import build_model
    from megatron_rl.parallel.schedule import wrap_for_training
    from megatron_rl.parallel.train_step import (
        RoutingPlan,
        TrainBatch,
        forward_backward,
    )
    from megatron_rl.sections import ParallelConfig

    parallel = ParallelConfig(context_parallel_size=cp)
    out = {}
    with cpu_platform(), model_parallel(parallel, seed=1234) as groups:
        ddp = wrap_for_training(build_model(model_config(), parallel))

        def logprob_pass(sample):
            return compute_logprobs(ddp, groups, [sample], [PROMPT], micro_batch_sequences=1, record_routing=True)

        def train_step(sample, old):
            batch = TrainBatch(sequences=[sample], prompt_lengths=[PROMPT], old_logprobs_T=old.logprobs_T,
                               advantages_T=torch.linspace(-1, 1, old.logprobs_T.numel()),
                               ref_logprobs_T=old.logprobs_T)  # GRPO's KL term
            plan = RoutingPlan(mode="none", diagnostics=False)
            return float(forward_backward(ddp, groups, batch, get_preset("grpo"), plan, micro_batch_sequences=1).loss)

        warm = _sample(WARMUP_TOKENS)
        train_step(warm, logprob_pass(warm))
        for tokens in lengths:
            sample = _sample(tokens)
            lp = measured(lambda: logprob_pass(sample))
            old = lp.pop("value")
            step = measured(lambda: train_step(sample, old))
            out[tokens] = {"logprob_pass": lp, "train_step": step, "logprobs": old.logprobs_T}
            print(f"  CP{cp} rank {groups.cp_rank}: {tokens} tokens done "
                  f"({lp['seconds']:.1f}s + {step['seconds']:.1f}s)", flush=True)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[16384, 32768], help="sample lengths")
    parser.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4], help="context-parallel sizes")
    parser.add_argument("--budget-mib", type=float, help="per-rank pass budget of the fit (default: CP1's "
                        "train step at the shortest length)")
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()

    from megatron_rl.parallel.world import run_world

    # Read by glibc when each rank's process starts (the ranks are spawned): see the docstring.
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"
    results = {}
    for cp in args.cp:
        print(f"CP{cp}: a world of {cp} process(es) ...", flush=True)
        per_rank = run_world(cp_worker, cp, cp, args.tokens, timeout_s=3600)
        results[cp] = {
            tokens: {
                kind: {"seconds": per_rank[0][tokens][kind]["seconds"],
                       "peak_mib": max(r[tokens][kind]["peak_mib"] for r in per_rank),
                       "pass_mib": max(r[tokens][kind]["pass_mib"] for r in per_rank)}
                for kind in ("logprob_pass", "train_step")
            } | {"logprobs": per_rank[0][tokens]["logprobs"]}
            for tokens in args.tokens
        }
    return report(results, args)


def report(results: dict, args) -> int:
    """Print the table and the checks; 0 when every doubling of CP met the memory bound."""
    cps, lengths = sorted(results), sorted(args.tokens)
    print(f"\n{'CP':>3} {'tokens':>7} {'pass':<13} {'time s':>8} {'pass MiB':>9} {'peak MiB':>9} {'vs CP/2':>8}")
    for cp in cps:
        for tokens in lengths:
            for kind in ("logprob_pass", "train_step"):
                row = results[cp][tokens][kind]
                half = results.get(cp // 2, {}).get(tokens, {}).get(kind)
                ratio = f"{half['pass_mib'] / row['pass_mib']:.2f}x" if half else ""
                print(f"{cp:>3} {tokens:>7} {kind:<13} {row['seconds']:>8.1f} {row['pass_mib']:>9.0f} "
                      f"{row['peak_mib']:>9.0f} {ratio:>8}")
    ok = True
    longest = lengths[-1]
    for cp in cps:
        if cp // 2 in results:
            ratio = results[cp // 2][longest]["train_step"]["pass_mib"] / results[cp][longest]["train_step"]["pass_mib"]
            ok &= ratio >= MIN_RATIO
            print(f"train step, {longest} tokens: CP{cp // 2} -> CP{cp} divides pass memory per rank by {ratio:.2f} "
                  f"({'>=' if ratio >= MIN_RATIO else '<'} {MIN_RATIO})")
    if len(lengths) >= 2:
        budget = args.budget_mib or results[cps[0]][lengths[0]]["train_step"]["pass_mib"]
        print(f"longest sample whose train step fits {budget:.0f} MiB of pass memory per rank "
              f"(straight line through {lengths[0]} and {longest} tokens):")
        for cp in cps:
            low, high = (results[cp][t]["train_step"]["pass_mib"] for t in (lengths[0], longest))
            per_token = (high - low) / (longest - lengths[0])
            fits = lengths[0] + (budget - low) / per_token
            print(f"  CP{cp}: {per_token * 1024:.1f} KiB per token -> about {fits / 1024:.1f}K tokens")
    for cp in cps[1:]:
        diff = max(float((results[cp][t]["logprobs"] - results[cps[0]][t]["logprobs"]).abs().max()) for t in lengths)
        print(f"log-probs CP{cp} vs CP{cps[0]}: max |diff| {diff:.2e}")
    if args.json:
        figures = {cp: {t: {k: v for k, v in row.items() if k != "logprobs"} for t, row in by_t.items()}
                   for cp, by_t in results.items()}
        Path(args.json).write_text(json.dumps(figures, indent=1))
    print("memory bound met" if ok else "memory bound NOT met")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
