"""Generation throughput of the HF rollout engine against the Megatron engine, on the demo model.

Both engines serve the same weights (the shipped ``tiny_qwen3_moe`` loaded into a
Megatron model in a gloo world of one process, the HF engine's replica pushed from it)
and decode the same batch of the demo's own prompts (chat template applied) to exactly
``--new-tokens`` tokens (no stop tokens), sampling at temperature 1. The model's
``max_position_embeddings`` (128) is raised for the run so that 256 new tokens fit: the
model has RoPE and no position table, so this changes a limit, not a weight. Reported:
seconds and generated tokens per second of each engine (``generate`` only; the HF
engine's weight push is timed on its own) and the speed-up.

Usage (from a checkout, with the venv active)::

    python tools/bench_engine.py                       # 256 new tokens, batch 64
    python tools/bench_engine.py --new-tokens 64 --batch 16
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "configs" / "demo_cpu.yaml"
ASSET = REPO / "megatron_rl" / "assets" / "tiny_qwen3_moe"


def _bench(batch: int, new_tokens: int, engines: list[str]) -> dict:
    import torch

    from megatron_rl.checkpoint.init_source import inspect_init_checkpoint
    from megatron_rl.config import load_config
    from megatron_rl.data.prompts import load_prompts
    from megatron_rl.parallel.cpu_platform import cpu_platform
    from megatron_rl.parallel.groups import model_parallel
    from megatron_rl.parallel.model import build_model
    from megatron_rl.rollout.engine import SamplingParams
    from megatron_rl.rollout.local.embedded import EmbeddedEngine
    from megatron_rl.rollout.local.hf_engine import HFEngine
    from megatron_rl.train.init_weights import load_initial_weights
    from megatron_rl.train.prepare import run_tokenizer

    length = 512
    cfg = load_config(str(DEMO), ["parallel.expert_model_parallel_size=1", "parallel.world_size=1"], world_size=1)
    cfg.model = dataclasses.replace(cfg.model, max_position_embeddings=length)
    result: dict = {"batch": batch, "new_tokens": new_tokens, "threads": torch.get_num_threads()}
    with cpu_platform(), model_parallel(cfg.parallel, cfg.seed) as groups:
        gpt = build_model(cfg.model, cfg.parallel)
        load_initial_weights(gpt, inspect_init_checkpoint(str(ASSET)), cfg.model, groups)
        records = load_prompts(cfg.data, "train", run_tokenizer(cfg), length - new_tokens).records
        prompts = [list(records[i % len(records)].prompt_ids) for i in range(batch)]
        result["mean_prompt_tokens"] = sum(map(len, prompts)) / batch
        params = SamplingParams(temperature=1.0, max_new_tokens=new_tokens)
        for name in engines:
            start = time.perf_counter()
            if name == "hf":
                engine = HFEngine(gpt, groups, architecture="qwen3_moe", model_config=cfg.model)
                result["hf_push_s"] = time.perf_counter() - start
            else:
                engine = EmbeddedEngine(gpt, groups, micro_batch_sequences=batch)
            start = time.perf_counter()
            samples = engine.generate(prompts, params, return_routed_experts=True, seed=1)
            seconds = time.perf_counter() - start
            tokens = sum(len(s.output_ids) for s in samples)
            result[name] = {"seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds}
    if "hf" in result and "megatron" in result:
        result["speedup"] = result["hf"]["tokens_per_s"] / result["megatron"]["tokens_per_s"]
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64, help="prompts decoded together (default 64)")
    parser.add_argument("--new-tokens", type=int, default=256, help="tokens generated per prompt (default 256)")
    parser.add_argument("--engines", default="hf,megatron", help="comma-separated: hf, megatron")
    parser.add_argument("--json", type=Path, help="also write the result here")
    args = parser.parse_args(argv)
    engines = [e for e in args.engines.split(",") if e]
    bad = [e for e in engines if e not in ("hf", "megatron")]
    if bad or args.batch < 1 or not 1 <= args.new_tokens <= 400:
        print(f"bench_engine: error: --engines {bad} / --batch {args.batch} / --new-tokens {args.new_tokens} "
              "(engines hf, megatron; batch >= 1; 1 <= new tokens <= 400)", file=sys.stderr)
        return 2
    from megatron_rl.parallel.world import run_world

    result = run_world(_bench, 1, args.batch, args.new_tokens, engines, timeout_s=3600)[0]
    for name in engines:
        r = result[name]
        print(f"{name:9s} {r['tokens']:6d} tokens in {r['seconds']:8.2f} s = {r['tokens_per_s']:9.1f} tokens/s")
    if "hf_push_s" in result:
        print(f"hf weight push (engine construction): {result['hf_push_s']:.2f} s")
    if "speedup" in result:
        print(f"speed-up hf / megatron: {result['speedup']:.1f}x  (batch {args.batch}, {args.new_tokens} new tokens, "
              f"mean prompt {result['mean_prompt_tokens']:.1f} tokens, {result['threads']} threads)")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
