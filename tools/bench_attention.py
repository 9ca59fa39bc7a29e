"""Core attention of one packed micro-batch: THD segments against the dense ``[T, T]`` mask.

Shape legend: T packed tokens of the micro-batch row, H query heads of one TP rank, G key/value
groups of one TP rank, D head dim, S sequences in the row.

One micro-batch row of ``T`` tokens (2K, 8K, 16K) is filled with sequences of log-normal
lengths (clipped to 32..4096, fixed seed; draws that do not fit in the room left are skipped, as
a token-budget packer would leave them for another row). The
heads are those of one TP rank of Qwen3-30B-A3B under the repository's preset
(``configs/qwen3_30b_a3b.yaml``: 32 query heads, 4 key/value groups, head dim 128, TP4), so
H = 8, G = 1, D = 128. Two core attentions run forward and backward on the same random
``q [T, H, D]``, ``k, v [T, G, D]``:

- packed: :class:`~megatron_rl.parallel.packed_attention.PackedCoreAttention` with the
  row's THD ``PackedSeqParams`` (``PackedMicroBatch.packed_seq_params``), what the local
  layer spec runs today;
- dense: Megatron-Core's ``DotProductAttention`` with the block-diagonal causal bool mask
  ``[1, 1, T, T]`` (True = blocked) that packing built before THD (commit 83c7737).

Every case (path, T, dtype) runs in a fresh subprocess in a gloo world of one rank (Megatron's
attention reads the TP group). Peak memory is the process's peak RSS (``ru_maxrss``) minus
its RSS just before the first attention call, i.e. what the forward and backward added on
top of the inputs. Time is the median wall time of ``--repeats`` forward+backward runs
after one warm-up. For every size where both run, the output and the input gradients of
the two paths are compared in the parent (max abs difference over the four tensors, from
one more run of each whose results the subprocess saves).

Usage (from a checkout, with the venv active)::

    python tools/bench_attention.py                                  # 2K, 8K (16K dense estimated)
    python tools/bench_attention.py --tokens 2048 8192 16384 --dtypes float32 bfloat16
    python tools/bench_attention.py --dense-max-tokens 16384         # try the dense 16K case too
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
HEADS, GROUPS, HEAD_DIM = 8, 1, 128
"""One TP rank of Qwen3-30B-A3B at TP4 (32 query heads, 4 key/value groups, head dim 128)."""


def lognormal_row_lengths(total: int, seed: int, median: float = 600.0, sigma: float = 1.0) -> list[int]:
    """Sequence lengths that fill a row of ``total`` tokens, as a token-budget packer fills it.

    Lengths are drawn log-normal (clipped to 32..4096); a draw longer than the room left is
    skipped, and the last few tokens (fewer than 32 left) become one short sequence.
    """
    import torch

    gen = torch.Generator().manual_seed(seed)
    lengths: list[int] = []
    room = total
    while room >= 32:
        draw = float(torch.empty(1).log_normal_(mean=float(torch.tensor(median).log()), std=sigma, generator=gen))
        length = min(max(round(draw), 32), 4096)
        if length <= room:
            lengths.append(length)
            room -= length
    return lengths + ([room] if room else [])


def dense_block_causal_mask(cu_seqlens, total: int):
    """``[1, 1, T, T]`` bool, True where attention is blocked: the mask packing built before THD."""
    import torch

    boundaries = torch.cat([cu_seqlens, cu_seqlens.new_tensor([total])]).unique_consecutive()
    block_id_T = torch.bucketize(torch.arange(total), boundaries[1:], right=True)
    allowed_TT = (block_id_T[:, None] == block_id_T[None, :]) & torch.ones(total, total, dtype=torch.bool).tril()
    return (~allowed_TT)[None, None]


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _case_in_world(path: str, tokens: int, dtype_name: str, repeats: int, seed: int, save: str | None) -> dict:
    """One case, inside a one-rank gloo world: timings, peak memory, and optionally the outputs."""
    import torch

    from megatron_rl.parallel.cpu_platform import cpu_platform
    from megatron_rl.parallel.groups import model_parallel
    from megatron_rl.parallel.mcore_compat import AttnMaskType, DotProductAttention
    from megatron_rl.parallel.model import build_transformer_config
    from megatron_rl.parallel.packed_attention import PackedCoreAttention
    from megatron_rl.parallel.packing import pack_sequences
    from megatron_rl.sections import ModelConfig, ParallelConfig

    dtype = getattr(torch, dtype_name)
    model = ModelConfig(
        hidden_size=HEADS * HEAD_DIM, num_attention_heads=HEADS, num_query_groups=GROUPS, head_dim=HEAD_DIM,
        params_dtype=dtype_name,
    )
    lengths = lognormal_row_lengths(tokens, seed)
    mb = pack_sequences([torch.zeros(n, dtype=torch.int64) for n in lengths])
    gen = torch.Generator().manual_seed(seed)
    q_THD, k_TGD, v_TGD = (
        torch.randn(tokens, h, HEAD_DIM, generator=gen).to(dtype) for h in (HEADS, GROUPS, GROUPS)
    )
    grad_out = torch.randn(tokens, HEADS * HEAD_DIM, generator=gen).to(dtype)
    with cpu_platform(), model_parallel(ParallelConfig(), seed=seed):
        config = build_transformer_config(model, ParallelConfig())
        if path == "packed":
            attention = PackedCoreAttention(config, 1, AttnMaskType.causal, "self")
            params = mb.packed_seq_params()

            def forward(q, k, v):
                return attention(q, k, v, None, packed_seq_params=params)
        else:
            attention = DotProductAttention(config, 1, AttnMaskType.causal, "self")

            def forward(q, k, v):
                # THD -> [s, b=1, heads, D]; the mask is built inside, as packing did per row.
                mask = dense_block_causal_mask(mb.cu_seqlens, tokens)
                return attention(q[:, None], k[:, None], v[:, None], mask, attn_mask_type=AttnMaskType.causal)[:, 0]

        def run() -> tuple:
            q, k, v = (t.detach().requires_grad_() for t in (q_THD, k_TGD, v_TGD))
            out = forward(q, k, v)
            out.backward(grad_out)
            return out.detach(), q.grad, k.grad, v.grad

        base = _rss_bytes()
        seconds = []
        for _ in range(repeats + 1):
            start = time.perf_counter()
            outputs = run()
            seconds.append(time.perf_counter() - start)
            del outputs
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        if save:
            torch.save(dict(zip(("out", "dq", "dk", "dv"), run())), save)
    return {
        "path": path, "tokens": tokens, "dtype": dtype_name, "sequences": len(lengths),
        "longest": max(lengths), "median_s": statistics.median(seconds[1:]), "runs_s": seconds[1:],
        "peak_mib": (peak - base) / 2**20, "threads": torch.get_num_threads(),
    }


def _run_case(path: str, tokens: int, dtype: str, repeats: int, seed: int, save: str | None) -> dict:
    """One case in a fresh subprocess (so its peak RSS is its own); ``{'error': ...}`` if it died.

    A world whose rendezvous port was taken meanwhile by another process is started again.
    """
    cmd = [sys.executable, __file__, "--case", path, str(tokens), dtype, "--repeats", str(repeats),
           "--seed", str(seed)] + (["--save", save] if save else [])
    for _ in range(3):
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
        if proc.returncode == 0 or "EADDRINUSE" not in proc.stderr:
            break
    if proc.returncode != 0:
        return {"path": path, "tokens": tokens, "dtype": dtype,
                "error": f"exit {proc.returncode}: {proc.stderr.strip().splitlines()[-1:] or 'killed'}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _max_abs_diff(packed_file: str, dense_file: str) -> float:
    import torch

    packed, dense = torch.load(packed_file), torch.load(dense_file)
    return max(float((packed[k].float() - dense[k].float()).abs().max()) for k in packed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[2048, 8192, 16384])
    parser.add_argument("--dtypes", nargs="+", default=["float32"], choices=["float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per case (after one warm-up)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dense-max-tokens", type=int, default=8192,
                        help="longer dense cases are not run; their memory and time are extrapolated (x T^2)")
    parser.add_argument("--case", nargs=3, metavar=("PATH", "TOKENS", "DTYPE"), help=argparse.SUPPRESS)
    parser.add_argument("--save", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.case:
        from megatron_rl.parallel.world import run_world

        path, tokens, dtype = args.case[0], int(args.case[1]), args.case[2]
        (result,) = run_world(_case_in_world, 1, path, tokens, dtype, args.repeats, args.seed, args.save,
                              threads_per_rank=os.cpu_count())
        print(json.dumps(result))
        return
    print(f"core attention fwd+bwd, H={HEADS} G={GROUPS} D={HEAD_DIM} (Qwen3-30B-A3B, one TP4 rank); "
          f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}", flush=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for dtype in args.dtypes:
            for tokens in sorted(args.tokens):
                check = tokens <= args.dense_max_tokens
                case = {}
                for path in ("packed", "dense"):
                    save = f"{tmp}/{path}.pt" if check else None
                    if path == "dense" and tokens > args.dense_max_tokens:
                        case[path] = {"skipped": True}
                        continue
                    case[path] = _run_case(path, tokens, dtype, args.repeats, args.seed, save)
                if check and "median_s" in case["packed"] and "median_s" in case.get("dense", {}):
                    case["max_abs_diff"] = _max_abs_diff(f"{tmp}/packed.pt", f"{tmp}/dense.pt")
                rows.append((dtype, tokens, case))
                print(json.dumps({"dtype": dtype, "tokens": tokens, **case}), flush=True)
    _print_table(rows)


def _print_table(rows: list[tuple[str, int, dict]]) -> None:
    """Markdown table; a dense case not run is extrapolated from the largest dense case run (x T^2)."""
    measured = {}
    print("\n| dtype | T | seqs | packed peak MiB | dense peak MiB | mem ratio | packed s | dense s | speed-up | max abs diff |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for dtype, tokens, case in rows:
        packed, dense = case["packed"], case["dense"]
        if "median_s" in dense:
            measured[dtype] = (tokens, dense)
            mark = ""
        elif dtype in measured:
            ref_tokens, ref = measured[dtype]
            scale = (tokens / ref_tokens) ** 2
            dense = {"peak_mib": ref["peak_mib"] * scale, "median_s": ref["median_s"] * scale}
            mark = "~"
        else:
            print(f"| {dtype} | {tokens} | dense: {dense.get('error', 'not run')} |")
            continue
        if "median_s" not in packed:
            print(f"| {dtype} | {tokens} | packed: {packed.get('error')} |")
            continue
        diff = f"{case['max_abs_diff']:.2e}" if "max_abs_diff" in case else "-"
        print(f"| {dtype} | {tokens} | {packed['sequences']} | {packed['peak_mib']:.0f} | {mark}{dense['peak_mib']:.0f} "
              f"| {mark}{dense['peak_mib'] / max(packed['peak_mib'], 1e-3):.0f}x | {packed['median_s']:.3f} "
              f"| {mark}{dense['median_s']:.3f} | {mark}{dense['median_s'] / packed['median_s']:.1f}x | {diff} |")
    print("~: not run, extrapolated from the largest dense case measured as x (T / T_measured)^2")


if __name__ == "__main__":
    main()
