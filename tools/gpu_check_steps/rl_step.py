"""Step ``rl_step``: one bf16 RL step of a ~2.4B-parameter Qwen3-MoE-family model on one GPU.

The model is ``common.MADE_MODELS["rl"]`` (random weights, local layer spec: no Transformer
Engine), built, wrapped and optimized as the trainer does (``build_model`` with routing replay,
Megatron DDP, Adam). A batch of 32 random samples of 256 prompt + 768 response tokens goes
through the old-policy log-prob pass with routing records (``compute_logprobs``) and one Dr. GRPO
update under R2 replay of those records (``forward_backward`` + ``optimizer_step``), packed
in micro-batches of 8192 tokens. Each is run once to warm
up, then timed twice (median).

Reported: tokens/s of each (every prompt and response token forwarded), and MFU, the model
FLOP/s over the GPU's peak:

* forward FLOPs of a batch = 2 x P_mm x T + 4 x L x (n_heads x head_dim) x sum_s n_s (n_s + 1) / 2,
  P_mm the parameters a token's matrix products use (``plan.params.model_params(...).active``
  less the input embedding, a lookup, and the norms' weight vectors), T tokens, L layers, n_s
  each sample's length (causal attention: QK^T and AV over the positions each token attends to);
  (the dry run checks the first term against torch's FLOP counter on the tiny model);
* the update = 3 x forward (backward twice the forward; recompute is not counted);
* peak: the datasheet's dense bf16 rate for the card (:data:`DATASHEET_BF16_TFLOPS`: H100 /
  H200 SXM 989.4 TFLOP/s), and beside it the bf16 GEMM rate measured here (``cuda_up``).

Status ``measured``: no pass criterion beyond running; the step fails if a loss or log-prob is
not finite or the optimizer skipped the step.
"""

from __future__ import annotations

import torch

from gpu_check_steps.common import (
    Context,
    Outcome,
    device_world,
    gib,
    made_model,
    median_seconds,
    random_samples,
    timed,
)
from megatron_rl.sections import ModelConfig, OptimConfig, ParallelConfig

SAMPLES, PROMPT, RESPONSE, MICRO_BATCH_TOKENS = 32, 256, 768, 8192
DRY_SHAPE = (4, 8, 8, 32)
DATASHEET_BF16_TFLOPS = (("H200 NVL", 835.0), ("H200", 989.4), ("H100 NVL", 835.0), ("H100 PCIe", 756.0),
                         ("H100", 989.4), ("A100", 312.0))
"""Dense bf16 TFLOP/s by the vendor's datasheets (no sparsity), first name matched in the device's."""


def matmul_params(m: ModelConfig) -> int:
    """P_mm: the active parameters less the input embedding (a lookup, no product; when untied) and
    the RMSNorm weights (vectors: each layer's two, its q and k norms, the final one)."""
    from megatron_rl.plan.params import embedding_params, model_params

    norms = m.num_layers * (2 * m.hidden_size + (2 * m.head_dim if m.qk_layernorm else 0)) + m.hidden_size
    lookup = embedding_params(m).total if m.untie_embeddings_and_output_weights else 0
    return model_params(m).active - lookup - norms


def forward_flops(m: ModelConfig, lengths: list[int]) -> float:
    """Model FLOPs of one forward over packed samples of ``lengths`` (module docstring)."""
    attended = sum(n * (n + 1) // 2 for n in lengths)
    return 2.0 * matmul_params(m) * sum(lengths) + 4.0 * m.num_layers * m.num_attention_heads * m.head_dim * attended


def check_matmul_flops(m: ModelConfig, tokens: int, logprob_pass) -> int:
    """Dry run: torch's FLOP counter over one log-prob pass must count exactly 2 x P_mm x T in
    matrix products (it counts no attention on the CPU), so the formula's main term is the model's."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        logprob_pass()
    counted, expected = counter.get_total_flops(), 2 * matmul_params(m) * tokens
    if counted != expected:
        raise AssertionError(f"matrix-product FLOPs of the log-prob pass: counted {counted}, formula {expected}")
    return counted


def datasheet_tflops(device_name: str) -> float | None:
    return next((rate for name, rate in DATASHEET_BF16_TFLOPS if name in device_name), None)


def _mfu(flops: float, seconds: float, peak_tflops: float | None) -> float | None:
    return None if not peak_tflops else round(flops / seconds / (peak_tflops * 1e12), 4)


def run(ctx: Context) -> Outcome:
    from gpu_check_steps.cuda_up import gemm_tflops
    from megatron_rl.algos.presets import get_preset
    from megatron_rl.parallel.logprobs import compute_logprobs
    from megatron_rl.parallel.model import build_model
    from megatron_rl.parallel.optim import build_optimizer, optimizer_step
    from megatron_rl.parallel.schedule import wrap_for_training
    from megatron_rl.parallel.train_step import RoutingPlan, TrainBatch, forward_backward
    from megatron_rl.plan.params import model_params

    samples, prompt, response, budget = DRY_SHAPE if ctx.dry else (SAMPLES, PROMPT, RESPONSE, MICRO_BATCH_TOKENS)
    m = made_model(ctx, "rl")
    optim = OptimConfig(lr=1e-6)
    with device_world(ctx) as groups:
        model = build_model(m, ParallelConfig(), moe_enable_routing_replay=True)
        ddp = wrap_for_training(model, optim)
        optimizer = build_optimizer(ddp, optim)
        sequences = random_samples(m.vocab_size, samples, prompt, response, seed=1)
        prompts = [prompt] * samples
        ctx.log(f"{model_params(m).total / 1e9:.2f}B parameters built; {samples} x {prompt + response} tokens")

        def logprob_pass():
            return compute_logprobs(ddp, groups, sequences, prompts, micro_batch_tokens=budget, record_routing=True)

        first_s, old = timed(ctx, logprob_pass)  # on the GPU a warm-up; the dry run's only call
        advantages_T = torch.randn(old.logprobs_T.shape, generator=torch.Generator().manual_seed(2))
        batch = TrainBatch(sequences=sequences, prompt_lengths=prompts, old_logprobs_T=old.logprobs_T.cpu(),
                           advantages_T=advantages_T, old_record=old.record)
        steps: list[dict] = []

        def update():
            result = forward_backward(ddp, groups, batch, get_preset("dr_grpo"),
                                      RoutingPlan(mode="R2", diagnostics=False), micro_batch_tokens=budget)
            steps.append({"loss": float(result.loss), **{k: float(v) for k, v in optimizer_step(optimizer).items()}})

        if ctx.dry:
            check_matmul_flops(m, samples * (prompt + response), logprob_pass)
            logprob_s, update_s = first_s, timed(ctx, update)[0]
        else:
            logprob_s, update_s = median_seconds(ctx, logprob_pass, 2), median_seconds(ctx, update, 2)
        peak_memory = 0 if ctx.dry else torch.cuda.max_memory_allocated()
    tokens = samples * (prompt + response)
    fwd = forward_flops(m, [prompt + response] * samples)
    device = "cpu" if ctx.dry else torch.cuda.get_device_name(0)
    sheet, measured = datasheet_tflops(device), gemm_tflops(ctx, 64 if ctx.dry else 8192)
    figures = {
        "device": device, "params_total": model_params(m).total, "params_active": model_params(m).active,
        "tokens": tokens, "micro_batch_tokens": budget, "logprob_pass_s": logprob_s, "update_s": update_s,
        "logprob_tokens_per_s": round(tokens / logprob_s), "update_tokens_per_s": round(tokens / update_s),
        "forward_tflop": fwd / 1e12, "datasheet_bf16_tflops": sheet, "measured_gemm_bf16_tflops": round(measured, 1),
        "mfu_logprob": _mfu(fwd, logprob_s, sheet), "mfu_update": _mfu(3 * fwd, update_s, sheet),
        "mfu_update_vs_measured_gemm": _mfu(3 * fwd, update_s, measured),
        "peak_allocated_gib": gib(peak_memory), "steps": steps,
    }
    finite = bool(torch.isfinite(old.logprobs_T).all()) and all(
        torch.isfinite(torch.tensor(s["loss"])) and s["optim/skipped"] == 0 for s in steps)
    headline = (f"{model_params(m).total / 1e9:.2f}B ({model_params(m).active / 1e9:.2f}B active), {tokens} tokens: "
                f"log-prob pass {tokens / logprob_s:,.0f} tok/s (MFU {figures['mfu_logprob']}), update "
                f"{tokens / update_s:,.0f} tok/s (MFU {figures['mfu_update']} of {sheet} TFLOP/s, "
                f"{figures['mfu_update_vs_measured_gemm']} of the measured GEMM), peak {gib(peak_memory)} GiB")
    status = "dry" if ctx.dry else ("measured" if finite else "fail")
    return Outcome(status, headline, figures)
