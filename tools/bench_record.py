"""Benchmark: cost of recording routing during the log-prob pass, and record size.

Runs the forward-only log-prob pass of a small MoE on one CPU process with routing
recording off and on (interleaved, median of ``--repeats``), and compares the bytes a
record takes per token with SGLang's int32 wire format for the same L and K, for this
model and for published MoE shapes. Prints a markdown table (and writes it with --out).

    python tools/bench_record.py --repeats 7
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch

warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")

from megatron_rl.config import ModelConfig, ParallelConfig  # noqa: E402
from megatron_rl.parallel.world import run_world  # noqa: E402

# (name, MoE layers L, top-K, experts E) of public checkpoints, for the size comparison.
PUBLISHED_SHAPES = [
    ("Qwen3-30B-A3B", 48, 8, 128),
    ("Qwen3-235B-A22B", 94, 8, 128),
    ("DeepSeek-V3", 58, 8, 256),
    ("Mixtral-8x7B", 32, 2, 8),
]


def _worker(model_cfg: ModelConfig, samples: int, length: int, repeats: int) -> dict:
    from megatron_rl.parallel.cpu_platform import cpu_platform
    from megatron_rl.parallel.groups import model_parallel
    from megatron_rl.parallel.logprobs import compute_logprobs
    from megatron_rl.parallel.model import build_model

    parallel = ParallelConfig()
    gen = torch.Generator().manual_seed(0)
    sequences = [torch.randint(0, model_cfg.vocab_size, (length,), generator=gen) for _ in range(samples)]
    prompts = [length // 4] * samples
    with cpu_platform(), model_parallel(parallel, seed=0) as groups:
        model = build_model(model_cfg, parallel)
        wall = {False: [], True: []}
        cpu = {False: [], True: []}
        record = None
        for rep in range(repeats + 1):
            for flag in (False, True) if rep % 2 == 0 else (True, False):
                start, start_cpu = time.perf_counter(), time.process_time()
                result = compute_logprobs(
                    model, groups, sequences, prompts, micro_batch_sequences=2, record_routing=flag,
                    probs_dtype=torch.bfloat16,
                )
                if rep > 0:  # the first round warms up allocator and caches
                    wall[flag].append(time.perf_counter() - start)
                    cpu[flag].append(time.process_time() - start_cpu)
                if flag:
                    record = result.record
        return {
            "off": statistics.median(wall[False]),
            "on": statistics.median(wall[True]),
            "cpu_off": statistics.median(cpu[False]),
            "cpu_on": statistics.median(cpu[True]),
            "bytes_per_token": record.bytes_per_token(),
            "ids_dtype": str(record.expert_ids_TLK.dtype),
            "tokens": sum(s.numel() for s in sequences),
        }


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
    overhead = res["on"] / res["off"] - 1
    cpu_overhead = res["cpu_on"] / res["cpu_off"] - 1
    l, k = model_cfg.num_layers, model_cfg.moe_router_topk
    lines = [
        f"Model: {l} MoE layers, E={model_cfg.num_experts}, top-{k}, hidden {model_cfg.hidden_size}, "
        f"vocab {model_cfg.vocab_size}; {args.samples} samples x {args.length} tokens "
        f"({res['tokens']} tokens), 1 CPU process with 1 thread, median of {args.repeats} interleaved runs.",
        "",
        "Process CPU time is the figure to trust on a shared machine (wall time also counts",
        "time the process waited for a core).",
        "",
        "| recording | wall (s) | wall overhead | CPU (s) | CPU overhead |",
        "|---|---|---|---|---|",
        f"| off | {res['off']:.3f} | | {res['cpu_off']:.3f} | |",
        f"| on (ids {res['ids_dtype']}, probs bf16) | {res['on']:.3f} | {100 * overhead:+.1f}% "
        f"| {res['cpu_on']:.3f} | {100 * cpu_overhead:+.1f}% |",
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
