"""Step ``gap``: the bf16 train-vs-rollout log-prob gap on GPU kernels, and where routing flips.

One Megatron model (``common.MADE_MODELS["mid"]``, bf16, random weights with each router's weight
times 10 so that routing is decisive, as ``tests/gpu/test_sglang_real.py`` does) and the hf
engine's transformers replica of it (pushed bit for bit). The engine samples 32 prompts of 64
random tokens to 128 new tokens at temperature 1, returning each token's log-prob and every
position's top-K experts per layer; the trainer's log-prob pass (``compute_logprobs`` with
routing records) recomputes the same sequences. Both sides are bf16 and compute the same
function; what differs is the kernels (SDPA vs the packed core attention, transformers' MoE
block vs Megatron's, reductions). Reported: mean, 99th percentile and max of |engine - trainer|
over the response tokens; per layer, the share of positions whose top-K expert set differs;
the mean gap at response tokens whose position flipped in some layer and at the rest.
Status ``measured``; fails only if a figure is not finite or a shape disagrees.
"""

from __future__ import annotations

import torch

from gpu_check_steps.common import Context, Outcome, device_world, made_model
from gpu_check_steps.engine import random_prompts

PROMPTS, PROMPT_TOKENS, NEW_TOKENS = 32, 64, 128
DRY_SHAPE = (4, 8, 8)
ROUTER_SCALE = 10.0


def flips_per_layer(engine_routes: list[torch.Tensor], trainer_routes: list[torch.Tensor]) -> torch.Tensor:
    """``[N_all, L]`` bool: the position's top-K set differs (``[N - 1, L, K]`` per sample on both sides)."""
    rows = []
    for ours, theirs in zip(engine_routes, trainer_routes):
        if ours.shape != theirs.shape:
            raise ValueError(f"routes of one sample: engine {tuple(ours.shape)}, trainer {tuple(theirs.shape)}")
        rows.append((ours.long().sort(-1).values != theirs.long().sort(-1).values).any(-1))
    return torch.cat(rows)


def run(ctx: Context) -> Outcome:
    from megatron_rl.parallel.logprobs import compute_logprobs
    from megatron_rl.parallel.model import build_model
    from megatron_rl.rollout.engine import SamplingParams
    from megatron_rl.rollout.local.hf_engine import HFEngine
    from megatron_rl.sections import ParallelConfig

    count, prompt_tokens, new_tokens = DRY_SHAPE if ctx.dry else (PROMPTS, PROMPT_TOKENS, NEW_TOKENS)
    m = made_model(ctx, "mid")
    prompts = random_prompts(m.vocab_size, count, prompt_tokens, seed=9)
    with device_world(ctx) as groups:
        model = build_model(m, ParallelConfig(), moe_enable_routing_replay=True).eval()
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("router.weight"):
                    param.mul_(ROUTER_SCALE)
        engine = HFEngine(model, groups, architecture="qwen3_moe", model_config=m)
        samples = engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=new_tokens), seed=3)
        ours = compute_logprobs(model, groups, [torch.tensor(s.prompt_ids + s.output_ids) for s in samples],
                                [prompt_tokens] * count, record_routing=True)
    engine_T = torch.cat([s.output_logprobs.float().cpu() for s in samples])
    gap_T = (engine_T.double() - ours.logprobs_T.double().cpu()).abs()
    trainer_routes = [ours.record.sample(i).expert_ids_TLK[:-1].cpu() for i in range(count)]
    flips_NL = flips_per_layer([s.routed_experts.cpu() for s in samples], trainer_routes)
    # Response token t of a sample is predicted at position prompt + t - 1 of it.
    length = prompt_tokens + new_tokens - 1
    predicting = torch.cat([torch.arange(prompt_tokens - 1, length) + i * length for i in range(count)])
    flipped_T = flips_NL[predicting].any(-1)
    layers = list(ours.record.layer_numbers)
    figures = {
        "tokens": gap_T.numel(), "mean": float(gap_T.mean()), "p99": float(gap_T.quantile(0.99)),
        "max": float(gap_T.max()), "flip_rate": float(flips_NL.float().mean()),
        "flip_rate_per_layer": {f"layer{n}": float(v) for n, v in zip(layers, flips_NL.float().mean(0))},
        "mean_at_flipped": float(gap_T[flipped_T].mean()) if flipped_T.any() else None,
        "mean_elsewhere": float(gap_T[~flipped_T].mean()) if (~flipped_T).any() else None,
        "flipped_tokens": int(flipped_T.sum()),
    }
    table = [{"layer": n, "flip rate": f"{float(v):.4f}"} for n, v in zip(layers, flips_NL.float().mean(0))]
    if not torch.isfinite(gap_T).all() or gap_T.numel() != count * new_tokens:
        return Outcome("fail", f"{gap_T.numel()} log-probs compared, not all finite or not {count * new_tokens}",
                       figures, table)
    headline = (f"|engine - trainer| over {gap_T.numel()} tokens: mean {figures['mean']:.2e}, p99 "
                f"{figures['p99']:.2e}, max {figures['max']:.2e} nats; top-K flips {100 * figures['flip_rate']:.2f}% "
                f"of positions x layers (worst layer {100 * max(flips_NL.float().mean(0)):.2f}%)")
    return Outcome("dry" if ctx.dry else "measured", headline, figures, table)
