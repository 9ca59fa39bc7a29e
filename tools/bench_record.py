"""Benchmark: cost of recording routing during the log-prob pass, and record size.

Runs the forward-only log-prob pass of a small MoE on one CPU process with routing
recording off and on (interleaved, median of ``--repeats``; also the on/off ratio paired
within each round, and the recorder's own work timed inside the on runs), and compares
the bytes a record takes per token with SGLang's int32 wire format for the same L and K,
for this model and for published MoE shapes. Prints a markdown table (and writes it with --out).

    python tools/bench_record.py --repeats 7
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch

warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")

from megatron_rl.parallel.world import run_world  # noqa: E402
from megatron_rl.sections import ModelConfig, ParallelConfig  # noqa: E402

# (name, MoE layers L, top-K, experts E) of public checkpoints, for the size comparison.
PUBLISHED_SHAPES = [
    ("Qwen3-30B-A3B", 48, 8, 128),
    ("Qwen3-235B-A22B", 94, 8, 128),
    ("DeepSeek-V3", 58, 8, 256),
    ("Mixtral-8x7B", 32, 2, 8),
]


def _timed(fn, spent: list[float]):
    """``fn`` that also adds the process CPU time of each call to ``spent[0]``."""

    def timed(*args, **kwargs):
        start = time.process_time()
        try:
            return fn(*args, **kwargs)
        finally:
            spent[0] += time.process_time() - start

    return timed


def _worker(model_cfg: ModelConfig, samples: int, length: int, repeats: int) -> dict:
    from megatron_rl.parallel import logprobs
    from megatron_rl.parallel.cpu_platform import cpu_platform
    from megatron_rl.parallel.groups import model_parallel
    from megatron_rl.parallel.model import build_model
    from megatron_rl.parallel.routing_record import RouterRecorder

    # The recorder's own work (finding and wrapping the routers, describing each router
    # call, assembling the record) is timed from inside the on passes: a direct figure
    # next to the on/off difference, which on a shared machine is mostly noise at this
    # size. The timers cost about a microsecond per call and are counted in the on time.
    own = [0.0]
    for name in ("__init__", "__enter__", "__exit__", "_describe"):
        setattr(RouterRecorder, name, _timed(getattr(RouterRecorder, name), own))
    logprobs.assemble_record = _timed(logprobs.assemble_record, own)

    parallel = ParallelConfig()
    gen = torch.Generator().manual_seed(0)
    sequences = [torch.randint(0, model_cfg.vocab_size, (length,), generator=gen) for _ in range(samples)]
    prompts = [length // 4] * samples
    with cpu_platform(), model_parallel(parallel, seed=0) as groups:
        model = build_model(model_cfg, parallel)
        wall = {False: [], True: []}
        cpu = {False: [], True: []}
        own_cpu = []
        record = None
        for rep in range(repeats + 1):
            # Each round runs off and on back to back, alternating which goes first, so
            # slow drifts in machine load hit both and can be paired out per round.
            for flag in (False, True) if rep % 2 == 0 else (True, False):
                own[0] = 0.0
                start, start_cpu = time.perf_counter(), time.process_time()
                result = logprobs.compute_logprobs(
                    model, groups, sequences, prompts, micro_batch_sequences=2, record_routing=flag,
                    probs_dtype=torch.bfloat16,
                )
                if rep > 0:  # the first round warms up allocator and caches
                    wall[flag].append(time.perf_counter() - start)
                    cpu[flag].append(time.process_time() - start_cpu)
                    if flag:
                        own_cpu.append(own[0])
                if flag:
                    record = result.record
        return {
            "wall": wall,
            "cpu": cpu,
            "own_cpu": own_cpu,
            "bytes_per_token": record.bytes_per_token(),
            "ids_dtype": str(record.expert_ids_TLK.dtype),
            "tokens": sum(s.numel() for s in sequences),
        }


def _paired(times: dict[bool, list[float]]) -> tuple[float, float, float]:
    """Median and quartiles over rounds of on / off - 1 (the two runs of one round)."""
    ratios = sorted(on / off - 1 for on, off in zip(times[True], times[False]))
    if len(ratios) < 2:
        return ratios[0], ratios[0], ratios[0]
    low, mid, high = statistics.quantiles(ratios, n=4, method="inclusive")
    return mid, low, high


def _pct(fraction: float, digits: int = 1) -> str:
    return f"{100 * fraction:+.{digits}f}%"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--out", default=None, help="also write the markdown here")
    args = parser.parse_args()
    model_cfg = ModelConfig(
        vocab_size=4096, hidden_size=512, num_layers=4, num_attention_heads=8, num_query_groups=4,
        head_dim=64, num_experts=16, moe_router_topk=4, moe_ffn_hidden_size=512,
        max_position_embeddings=4096,
    )
    # One thread: the process CPU time of a single-threaded run barely moves when other
    # jobs share the machine, so the on/off comparison stays meaningful there.
    res = run_world(_worker, 1, model_cfg, args.samples, args.length, args.repeats,
                    threads_per_rank=1, timeout_s=3600)[0]
    wall = {flag: statistics.median(v) for flag, v in res["wall"].items()}
    cpu = {flag: statistics.median(v) for flag, v in res["cpu"].items()}
    own = statistics.median(res["own_cpu"])
    pw, pc = _paired(res["wall"]), _paired(res["cpu"])
    l, k = model_cfg.num_layers, model_cfg.moe_router_topk
    lines = [
        f"Model: {l} MoE layers, E={model_cfg.num_experts}, top-{k}, hidden {model_cfg.hidden_size}, "
        f"vocab {model_cfg.vocab_size}; {args.samples} samples x {args.length} tokens "
        f"({res['tokens']} tokens), 1 CPU process with 1 thread, median of {args.repeats} interleaved runs.",
        "",
        "Process CPU time is the figure to trust on a shared machine (wall time also counts",
        "time the process waited for a core). The paired row takes on / off - 1 within each",
        "round (the two runs back to back) and gives the median and quartiles over rounds;",
        "the last row is the recorder's own work timed inside the on runs (router wrapping,",
        "per-call description, record assembly) as a share of the off run.",
        "",
        "| recording | wall (s) | wall overhead | CPU (s) | CPU overhead |",
        "|---|---|---|---|---|",
        f"| off | {wall[False]:.3f} | | {cpu[False]:.3f} | |",
        f"| on (ids {res['ids_dtype']}, probs bf16) | {wall[True]:.3f} | {_pct(wall[True] / wall[False] - 1)} "
        f"| {cpu[True]:.3f} | {_pct(cpu[True] / cpu[False] - 1)} |",
        f"| on vs off, paired per round: median [quartiles] | | {_pct(pw[0])} [{_pct(pw[1])}, {_pct(pw[2])}] "
        f"| | {_pct(pc[0])} [{_pct(pc[1])}, {_pct(pc[2])}] |",
        f"| recorder's own work (inside the on runs) | | | {own:.4f} | {_pct(own / cpu[False], 2)} |",
        "",
        "CPU s per run, off: " + ", ".join(f"{t:.3f}" for t in res["cpu"][False])
        + "; on: " + ", ".join(f"{t:.3f}" for t in res["cpu"][True]) + ".",
        "",
        "Record size per token (ids in the narrowest integer type + bf16 router probabilities,"
        " gates excluded) vs SGLang's routed_experts payload (int32 ids, before base64):",
        "",
        "| model | L | K | E | ids dtype | ids bytes/token | ids + bf16 probs | SGLang int32 ids | ids ratio |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    from moe_routing.types import compact_id_dtype

    for name, layers, topk, experts in [("this benchmark", l, k, model_cfg.num_experts), *PUBLISHED_SHAPES]:
        id_bytes = layers * topk * torch.empty(0, dtype=compact_id_dtype(experts)).element_size()
        sglang = layers * topk * 4
        lines.append(
            f"| {name} | {layers} | {topk} | {experts} | {str(compact_id_dtype(experts)).replace('torch.', '')} "
            f"| {id_bytes} | {id_bytes + layers * topk * 2} | {sglang} | {sglang / id_bytes:.0f}x smaller |"
        )
    assert res["bytes_per_token"] == l * k * 3, res
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as handle:
            handle.write(text + "\n")


if __name__ == "__main__":
    main()
