"""Step ``engine``: the hf rollout engine's generation speed on the GPU.

The engine (``rollout.local.hf_engine.HFEngine``: a transformers replica with a KV cache, bf16)
takes its weights from the Megatron model of ``common.MADE_MODELS["rl"]`` (~2.4B, random), then
decodes 64 prompts of 128 random tokens to exactly 256 new tokens each (no stop token) at
temperature 1, routes returned; timed after an 8-token warm-up. Reported: generated tokens/s,
and the push's seconds (engine construction). Status ``measured``.
"""

from __future__ import annotations

import torch

from gpu_check_steps.common import Context, Outcome, device_world, made_model, timed

BATCH, PROMPT_TOKENS, NEW_TOKENS = 64, 128, 256
DRY_SHAPE = (4, 8, 8)


def random_prompts(vocab: int, count: int, length: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (length,), generator=gen).tolist() for _ in range(count)]


def run(ctx: Context) -> Outcome:
    from megatron_rl.parallel.model import build_model
    from megatron_rl.rollout.engine import SamplingParams
    from megatron_rl.rollout.local.hf_engine import HFEngine
    from megatron_rl.sections import ParallelConfig

    batch, prompt_tokens, new_tokens = DRY_SHAPE if ctx.dry else (BATCH, PROMPT_TOKENS, NEW_TOKENS)
    m = made_model(ctx, "rl")
    prompts = random_prompts(m.vocab_size, batch, prompt_tokens, seed=7)
    with device_world(ctx) as groups:
        model = build_model(m, ParallelConfig()).eval()
        push_s, engine = timed(ctx, lambda: HFEngine(model, groups, architecture="qwen3_moe", model_config=m))
        engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=min(8, new_tokens)), seed=0)
        seconds, samples = timed(ctx, lambda: engine.generate(
            prompts, SamplingParams(temperature=1.0, max_new_tokens=new_tokens), seed=1))
    tokens = sum(len(s.output_ids) for s in samples)
    figures = {"batch": batch, "prompt_tokens": prompt_tokens, "new_tokens": new_tokens, "generated": tokens,
               "seconds": seconds, "tokens_per_s": round(tokens / seconds, 1), "push_s": push_s}
    if tokens != batch * new_tokens or not all(s.routed_experts is not None for s in samples):
        return Outcome("fail", f"{tokens} tokens generated, {batch * new_tokens} asked for (or routes missing)",
                       figures)
    headline = (f"{tokens / seconds:,.0f} generated tokens/s ({batch} prompts x {new_tokens} new tokens in "
                f"{seconds:.1f} s, bf16, routes returned); weight push {push_s:.1f} s")
    return Outcome("dry" if ctx.dry else "measured", headline, figures)
