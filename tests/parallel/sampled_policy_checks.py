"""The sampled policy and the mismatch breakdown, run inside ``test_hf_engine.py``'s EP2 world.

Shape legend: T response tokens of this rank's samples, L MoE layers, K top-K.

On the demo checkpoint (both DP ranks, their own prompts), at T = 0.7 and top-p 0.9:

- the megatron engine's rollout log-probs and the trainer's old-policy pass at T (the run's
  packing) are the same numbers; replaying the engine's experts and gate weights (R3w) keeps
  the gap at exactly zero; the truncation top-p leaves out is reported;
- the hf replica's log-probs at T match the Megatron pass at T (fp32);
- a router of one layer perturbed in the hf replica only: the breakdown puts the gap on that
  layer, stages (a) and (b); the bf16 replica: stage (c) dominates and the flip rates are the
  positions whose routes differ; in both, the stage parts sum to the gap measured apart (another
  packing) within 1%;
- the gap under no replay, R3 and R3w, for the fp32 and bf16 replicas (docs/routing.md).

Every number comes back as sums over this rank's tokens, so the host adds the DP ranks.
"""

from __future__ import annotations

import torch

TEMPERATURE = 0.7
TOP_P = 0.9
PACKING = 32
"""Sequences per micro-batch of the engine's pass and the trainer's (``train.micro_batch_sequences``)."""
PERTURBED_LAYER = 2
"""Megatron layer number (1-based) whose router the hf replica alone gets perturbed."""


def _pass(gpt, groups, samples, packing=PACKING, **replay):
    from megatron_rl.parallel.logprobs import compute_logprobs

    return compute_logprobs(gpt, groups, [s.tokens for s in samples], [len(s.prompt_ids) for s in samples],
                            micro_batch_sequences=packing, record_routing=True,
                            temperature_T=torch.cat([s.temperatures() for s in samples]), **replay)


def _gap_sums(lp_T: torch.Tensor, samples) -> list[float]:
    """``[sum |lp - rollout|, tokens]`` over this rank's response tokens."""
    rollout_T = torch.cat([s.output_logprobs for s in samples])
    return [float((lp_T.double() - rollout_T.double()).abs().sum()), float(rollout_T.numel())]


def _replay_gaps(gpt, groups, samples) -> dict[str, list[float]]:
    """Gap sums under no replay, R3 (the engine's experts) and R3w (its experts and gate weights)."""
    from megatron_rl.parallel.families import moe_layer_numbers
    from megatron_rl.parallel.rollout_routes import rollout_gates_TLK, rollout_ids_TLK

    layers = moe_layer_numbers(gpt.config)
    routes = [s.routed_experts for s in samples]
    ids = rollout_ids_TLK(routes, [s.tokens for s in samples], num_experts=gpt.config.num_moe_experts,
                          topk=gpt.config.moe_router_topk, layer_numbers=layers, local_layers=layers)
    gates = rollout_gates_TLK([s.routed_gates for s in samples], routes, len(layers))
    return {
        "none": _gap_sums(_pass(gpt, groups, samples).logprobs_T, samples),
        "R3": _gap_sums(_pass(gpt, groups, samples, replay_ids_TLK=ids, replay_layer_numbers=layers).logprobs_T,
                        samples),
        "R3w": _gap_sums(_pass(gpt, groups, samples, replay_ids_TLK=ids, replay_layer_numbers=layers,
                               replay_gates_TLK=gates).logprobs_T, samples),
    }


def _breakdown(gpt, groups, samples) -> dict:
    """The breakdown's metrics, with what the host checks them against: the gap of an old-policy
    pass packed otherwise, and the flipped positions per layer counted here."""
    from megatron_rl.parallel.logprobs import response_positions
    from megatron_rl.train.mismatch import run_breakdown

    result = run_breakdown(gpt, groups, samples, policy_temperature="sampling", per_layer=True, worst=4,
                           micro_batch_sequences=PACKING, micro_batch_tokens=None)
    old = _pass(gpt, groups, samples)
    rows = response_positions(old.record.cu_seqlens_S1, [len(s.prompt_ids) for s in samples])
    engine_NLK = torch.cat([torch.cat([s.routed_experts, s.routed_experts[-1:]]) for s in samples])[rows]
    flips_NL = (engine_NLK.long().sort(-1).values != old.record.expert_ids_TLK[rows].long().sort(-1).values).any(-1)
    return {"metrics": {k: float(v) for k, v in result.metrics.items()}, "worst": result.worst,
            "apart": _gap_sums(_pass(gpt, groups, samples, packing=4).logprobs_T, samples),
            "flips": flips_NL.double().sum(0).tolist(), "positions": float(rows.numel())}


def sampled_policy_checks(cfg, groups, gpt, hf_engine, prompts, stops) -> dict:
    """Everything the host asserts (module docstring), for this rank."""
    from megatron_rl.rollout.engine import SamplingParams
    from megatron_rl.rollout.local.embedded import EmbeddedEngine
    from megatron_rl.rollout.local.hf_engine import HFEngine
    from megatron_rl.train.mismatch import truncation_metrics

    params = SamplingParams(temperature=TEMPERATURE, top_p=TOP_P, max_new_tokens=12, stop_token_ids=stops)
    out: dict = {}
    megatron = EmbeddedEngine(gpt, groups, PACKING).generate(prompts, params, seed=5)
    rollout_T = torch.cat([s.output_logprobs for s in megatron])
    old_T = _pass(gpt, groups, megatron).logprobs_T
    out["megatron"] = {"equal": torch.equal(rollout_T, old_T), "max_diff": float((rollout_T - old_T).abs().max()),
                       "tokens": rollout_T.numel(), "gaps": _replay_gaps(gpt, groups, megatron),
                       "truncation": {k: float(v) for k, v in truncation_metrics(
                           megatron, torch.ones(rollout_T.numel(), dtype=torch.bool)).items()}}
    hf = hf_engine.generate(prompts, params, seed=5)
    hf_T = torch.cat([s.output_logprobs for s in hf])
    out["hf_fp32"] = {"max_diff": float((hf_T - _pass(gpt, groups, hf).logprobs_T).abs().max()),
                      "gaps": _replay_gaps(gpt, groups, hf)}
    router = hf_engine.hf_model.model.layers[PERTURBED_LAYER - 1].mlp.gate.weight
    saved = router.detach().clone()
    with torch.no_grad():
        router.add_(0.5 * saved.std() * torch.randn(saved.shape, generator=torch.Generator().manual_seed(9)))
    out["perturbed"] = _breakdown(gpt, groups, hf_engine.generate(prompts, params, seed=5))
    with torch.no_grad():
        router.copy_(saved)
    bf16 = HFEngine(gpt, groups, architecture="qwen3_moe", model_config=cfg.model, dtype="bfloat16")
    low = bf16.generate(prompts, params, seed=5)
    out["bf16"] = {**_breakdown(gpt, groups, low), "gaps": _replay_gaps(gpt, groups, low)}
    bf16.close()
    return out
