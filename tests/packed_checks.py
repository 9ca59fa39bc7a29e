"""Checks that packed micro-batches compute what one sequence at a time computes (any device).

The model is the shipped pretrained tiny Qwen3-MoE (``megatron_rl/assets/tiny_qwen3_moe``),
so attention carries information and a sequence that saw its neighbours would show it; the
samples are ChatML-formatted arithmetic prompts and answers from the shipped train set.
Two checks, each the same function on every device:

1. the log-prob pass (``compute_logprobs``, routing recorded) of all samples packed into
   one THD row equals the pass with one sample per micro-batch: log-probs and the router
   records (experts and probabilities; see below for near-ties);
2. one train step (``forward_backward``, RSPO objective, ``RoutingPlan(mode="R2")``
   replaying the packed old pass's record, routers perturbed first so that replay matters)
   on the packed batch equals the step with one sample per micro-batch: loss and every
   parameter's gradient.

And a control, so that check 1 can fail: the samples concatenated into ONE sequence (what
attention across the packed boundaries would compute) must differ from the one-at-a-time
pass by far more than the tolerance.

Runners: ``tests/gpu/test_packed_te.py`` and ``tests/parallel/test_packed_checks_cpu.py``.
Devices: ``gpu`` runs the Transformer Engine spec (TE fused attention reading
``PackedSeqParams``, grouped-GEMM experts, Megatron's default there) in bfloat16, on one
GPU (skipped without CUDA); ``cpu-*`` run the local spec (``PackedCoreAttention``, sequential
experts) in a spawned one-process gloo world, in float32 and in bfloat16, so that the helper
logic and the bfloat16 bounds below are exercised wherever the suite runs.

Tolerances (packing changes only the order and blocking of floating-point sums: GEMMs
over a different number of rows, attention over a varlen batch):

- float32: log-probs 1e-4, router probabilities 1e-5 (the HF-parity bounds of
  ``tests/parallel/test_init_from_hf.py``), gradients 1e-5 relative per tensor and loss
  1e-6 relative (the layout-invariance bounds of ``tests/parallel/test_train_step.py``).
- bfloat16: one rounding is 2^-9 relative (8 stored mantissa bits); a sum computed in a
  different order rounds differently at each of the ~10 bf16 tensors a token passes per
  layer (norms, projections, attention, expert GEMMs, residual adds), so the hidden state
  of the last of the 4 layers may differ by ~10 x 4 x 2^-9 = 8% relative in the worst case
  and ~1% typically (errors of independent roundings add in quadrature). Bounds: log-probs
  mean 0.02 and max 0.25 nats, router probabilities 0.02 at the positions checked,
  gradients 5e-2 relative per tensor (norm of the difference over the norm), loss 1e-2
  relative. The control must differ by more than 10x the mean bound.
- Router records: the same top-K experts at >= 98% of the (position, layer) pairs, their
  probabilities within the bound; where the sets differ, only near-tied experts may have
  swapped: both runs' K-th probabilities agree within twice the bound.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

ASSETS = Path(__file__).resolve().parents[1] / "megatron_rl" / "assets"
CHECKPOINT = ASSETS / "tiny_qwen3_moe"
SAMPLES = 6
PROMPT_TOKENS = 4
"""Log-probs are taken from this position on: nearly the whole sample is compared."""


@dataclass(frozen=True)
class Bounds:
    """What packed and one-at-a-time runs may differ by, in one dtype."""

    logprob_mean: float
    logprob_max: float
    router_prob: float
    grad_rel: float
    loss_rel: float


BOUNDS = {
    "float32": Bounds(logprob_mean=1e-4, logprob_max=1e-4, router_prob=1e-5, grad_rel=1e-5, loss_rel=1e-6),
    "bfloat16": Bounds(logprob_mean=0.02, logprob_max=0.25, router_prob=0.02, grad_rel=5e-2, loss_rel=1e-2),
}
MIN_SAME_EXPERTS = 0.98
CONTROL_FACTOR = 10.0


def chat_samples(count: int = SAMPLES) -> list[torch.Tensor]:
    """Token ids of ``count`` ChatML conversations (prompt and answer) of the shipped train set."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(CHECKPOINT / "tokenizer.json"))
    rows = [json.loads(line) for line in (ASSETS / "arithmetic" / "train.jsonl").read_text().splitlines()[:count]]
    texts = [
        f"<|im_start|>user\n{r['prompt']}<|im_end|>\n<|im_start|>assistant\nThe answer is {r['answer']}.<|im_end|>"
        for r in rows
    ]
    return [torch.tensor(tokenizer.encode(t, add_special_tokens=False).ids) for t in texts]


def build_pretrained(use_te: bool, dtype: str, groups, parallel=None):
    """The shipped checkpoint in this rank's layout (TE or local spec; ``parallel`` defaults to
    the one-process layout), and its DDP wrapper."""
    from megatron_rl.checkpoint.hf_config import model_config_from_hf, read_config
    from megatron_rl.checkpoint.hf_io import HFCheckpoint
    from megatron_rl.checkpoint.mapping import ARCHITECTURES
    from megatron_rl.checkpoint.megatron_io import fill_from_hf
    from megatron_rl.parallel.model import build_model
    from megatron_rl.parallel.schedule import wrap_for_training
    from megatron_rl.sections import ParallelConfig

    cfg = model_config_from_hf(read_config(CHECKPOINT), dtype)
    model = build_model(cfg, parallel or ParallelConfig(), use_te=use_te, moe_enable_routing_replay=True)
    if torch.cuda.is_available():
        model = model.cuda()
    fill_from_hf(model, ARCHITECTURES.get("qwen3_moe"), cfg, HFCheckpoint(CHECKPOINT), groups.tp_rank,
                 groups.tp_size, cast=True)
    return model, wrap_for_training(model)


def logprob_comparison(model, groups, samples: list[torch.Tensor], bounds: Bounds) -> dict:
    """Packed vs one-at-a-time log-prob pass (with routing), and the concatenated control."""
    from megatron_rl.parallel.logprobs import compute_logprobs

    prompts = [PROMPT_TOKENS] * len(samples)
    packed = compute_logprobs(model, groups, samples, prompts, micro_batch_sequences=len(samples),
                              record_routing=True)
    single = compute_logprobs(model, groups, samples, prompts, micro_batch_sequences=1, record_routing=True)
    # The control: each sample glued behind its predecessor, one sequence per pair (a whole
    # concatenation would pass the model's 128 positions).
    pairs = [torch.cat([samples[j - 1], samples[j]]) for j in range(1, len(samples))]
    joined = compute_logprobs(model, groups, pairs, [PROMPT_TOKENS] * len(pairs), micro_batch_sequences=1)

    diff = (packed.logprobs_T - single.logprobs_T).abs()
    control = []
    for j in range(1, len(samples)):
        before, length = int(samples[j - 1].numel()), int(samples[j].numel())
        pair = joined.logprobs_T[int(joined.cu_seqlens_S1[j - 1]) : int(joined.cu_seqlens_S1[j])]
        inside = pair[before : before + length - PROMPT_TOKENS]
        alone = single.logprobs_T[int(single.cu_seqlens_S1[j]) : int(single.cu_seqlens_S1[j + 1])]
        control.append((inside - alone).abs())
    control = torch.cat(control)

    a, b = packed.record, single.record
    same = (a.expert_ids_TLK.sort(-1).values == b.expert_ids_TLK.sort(-1).values).all(-1)
    prob_diff = (a.probs_TLK.float() - b.probs_TLK.float()).abs().amax(-1)
    # Where the expert sets differ, rounding may only have swapped near-tied experts: the
    # K-th (smallest recorded) probability of each run, one run's last expert and the
    # other's, must then agree within twice the bound.
    swap_gap = (a.probs_TLK[..., -1].float() - b.probs_TLK[..., -1].float()).abs()
    return {
        "tokens": diff.numel(),
        "logprob_mean": float(diff.mean()),
        "logprob_max": float(diff.max()),
        "control_mean": float(control.mean()),
        "experts_equal_fraction": float(same.float().mean()),
        "router_prob_max_where_equal": float(prob_diff[same].max()),
        "swap_gap_max": float(swap_gap[~same].max()) if (~same).any() else 0.0,
    }


def r2_step_comparison(model, ddp, groups, samples: list[torch.Tensor]) -> dict:
    """One R2 RSPO step on the packed batch vs the same step one sample per micro-batch."""
    from megatron_rl.algos.presets import get_preset
    from megatron_rl.parallel.logprobs import compute_logprobs
    from megatron_rl.parallel.train_step import (
        RoutingPlan,
        TrainBatch,
        forward_backward,
    )

    prompts = [PROMPT_TOKENS] * len(samples)
    old = compute_logprobs(ddp, groups, samples, prompts, micro_batch_sequences=len(samples), record_routing=True)
    with torch.no_grad():  # the policy moved since the rollout: routers differ, replay matters
        for layer in model.decoder.layers:
            gen = torch.Generator().manual_seed(100 + layer.layer_number)
            weight = layer.mlp.router.weight
            weight += (0.05 * torch.randn(weight.shape, generator=gen)).to(weight) * weight.float().std()
    advantages = torch.randn(old.logprobs_T.numel(), generator=torch.Generator().manual_seed(7))
    batch = TrainBatch(sequences=samples, prompt_lengths=prompts, old_logprobs_T=old.logprobs_T,
                       advantages_T=advantages, old_record=old.record)
    runs = {}
    for name, per_micro_batch in (("packed", len(samples)), ("single", 1)):
        result = forward_backward(ddp, groups, batch, get_preset("rspo"), RoutingPlan(mode="R2"),
                                  micro_batch_sequences=per_micro_batch)
        grads = {n: p.main_grad.detach().float().clone() for n, p in model.named_parameters()}
        runs[name] = (float(result.loss), grads)
    (loss_p, grads_p), (loss_s, grads_s) = runs["packed"], runs["single"]
    rel = {n: float((grads_p[n] - g).norm() / g.norm().clamp_min(1e-30)) for n, g in grads_s.items()}
    worst = max(rel, key=rel.get)
    return {
        "loss_packed": loss_p,
        "loss_single": loss_s,
        "loss_rel": abs(loss_p - loss_s) / max(abs(loss_s), 1e-30),
        "grad_rel_max": rel[worst],
        "grad_rel_worst": worst,
        # Experts no token was routed to have none; everything else must have one.
        "zero_grads": sorted(n for n, g in grads_s.items() if float(g.norm()) == 0 and ".experts." not in n),
    }


def run_checks(use_te: bool, dtype: str, groups) -> dict:
    """Both comparisons on a fresh pretrained model of this device and dtype."""
    samples = chat_samples()
    model, ddp = build_pretrained(use_te, dtype, groups)
    out = {"logprobs": logprob_comparison(ddp, groups, samples, BOUNDS[dtype])}
    out["r2_step"] = r2_step_comparison(model, ddp, groups, samples)
    return out


def cpu_worker(dtypes: tuple[str, ...]) -> dict:
    """One-rank CPU world body: the checks on the local spec, per dtype."""
    from megatron_rl.parallel.cpu_platform import cpu_platform
    from megatron_rl.parallel.groups import model_parallel
    from megatron_rl.sections import ParallelConfig

    with cpu_platform(), model_parallel(ParallelConfig(), seed=1234) as groups:
        return {dtype: run_checks(use_te=False, dtype=dtype, groups=groups) for dtype in dtypes}


def assert_within(measured: dict, dtype: str) -> None:
    bounds = BOUNDS[dtype]
    lp, step = measured["logprobs"], measured["r2_step"]
    print(f"\n{dtype}: {json.dumps(measured, indent=1)}")
    assert lp["logprob_mean"] <= bounds.logprob_mean and lp["logprob_max"] <= bounds.logprob_max
    assert lp["control_mean"] > CONTROL_FACTOR * bounds.logprob_mean, "the control did not see the other samples"
    assert lp["experts_equal_fraction"] >= MIN_SAME_EXPERTS
    assert lp["router_prob_max_where_equal"] <= bounds.router_prob
    assert lp["swap_gap_max"] <= 2 * bounds.router_prob
    assert step["loss_rel"] <= bounds.loss_rel
    assert step["grad_rel_max"] <= bounds.grad_rel, step["grad_rel_worst"]
    assert step["zero_grads"] == []
