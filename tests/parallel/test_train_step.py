"""Routing replay (R2, R3, R3w), RSPO router-shift weights and the parallel training step.

The single-process world checks replay and RSPO semantics against independent
computations from hooked router logits; every layout world (TP2+SP, EP2, PP2,
TP2+SP x EP2) then runs one training step per routing plan (none, R2, R3, R3w) with the RSPO
objective and must reproduce the single-process loss and gradients (1e-5 relative). A GRPO
step at per-sample temperatures (log-probs of ``softmax(logits / T)`` in every pass) is
layout invariant too, and in the single process its output-layer gradient equals the
gradient of the T-scaled policy written out by hand from the layer's inputs. Each
layout world also runs the 80/20 (``entropy_8020``) and STAPO (with the overlong filter)
objectives: their token selection is over the global mini-batch, so the kept mask, the mask
metrics, the loss and the router and output-layer gradients must equal the single-process
step's in the data-parallel layouts too (EP2 and TP2+SP x EP2 have dense DP = 2).
"""

import dataclasses
import functools

import pytest
import torch

from megatron_rl.parallel.smoke_worker import random_sequences, relative_error
from megatron_rl.parallel.world import run_world
from megatron_rl.sections import ModelConfig, ParallelConfig

pytestmark = pytest.mark.parallel

MODEL = ModelConfig(vocab_size=256, num_layers=4, num_experts=8, moe_router_topk=2)
SEQUENCES = random_sequences(8, MODEL.vocab_size, min_len=6, max_len=30, seed=1)
PROMPTS = [max(1, len(s) // 3) for s in SEQUENCES]
PLANS = ("none", "R2", "R3", "R3w")
TEMPERATURES = [0.5 + 0.1 * i for i in range(8)]
"""Sampling temperature of each sample of the temperature step (one per sample)."""
BUDGET = 48
"""Token budget of the token-budget step (sequences are 6-30 tokens: several re-ordered micro-batches)."""
TRUNCATED = (5,)
"""Samples cut at the length limit (read by the overlong filter of the STAPO run)."""
# tau_p above the tiny model's typical target probability (about 1/256), so the STAPO
# candidates are a sizeable part of the positive-advantage tokens.
FILTER_OBJECTIVES = {
    "entropy_8020": {},
    "stapo": {"stapo_tau_p": 0.005, "overlong_filter": True},
}
FILTER_RUNS = tuple(f"filter:{name}" for name in FILTER_OBJECTIVES)
LAYOUTS = {
    "TP2+SP": (ParallelConfig(tensor_model_parallel_size=2), 2),
    "EP2": (ParallelConfig(expert_model_parallel_size=2), 2),
    "PP2": (ParallelConfig(pipeline_model_parallel_size=2), 2),
    "TP2+SP x EP2": (ParallelConfig(tensor_model_parallel_size=2, expert_model_parallel_size=2), 4),
}


def _advantages(sample: int) -> torch.Tensor:
    n = SEQUENCES[sample].numel() - PROMPTS[sample]
    return torch.randn(n, generator=torch.Generator().manual_seed(50 + sample))


def _rollout_routes(sample: int) -> torch.Tensor:
    """Arbitrary valid experts per position in SGLang's layout [len - 1, L, K] (int32)."""
    gen = torch.Generator().manual_seed(1000 + sample)
    n = SEQUENCES[sample].numel() - 1
    scores = torch.rand(n, MODEL.num_layers, MODEL.num_experts, generator=gen)
    return scores.topk(MODEL.moe_router_topk, dim=-1).indices.to(torch.int32)


def _rollout_gates(sample: int) -> torch.Tensor:
    """Arbitrary gate weights (positive, summing to 1 per token) for ``_rollout_routes``' experts."""
    gen = torch.Generator().manual_seed(2000 + sample)
    raw = torch.rand(SEQUENCES[sample].numel() - 1, MODEL.num_layers, MODEL.moe_router_topk, generator=gen) + 0.1
    return raw / raw.sum(-1, keepdim=True)


def _temperature_step(model, ddp, groups, mine, capture=False):
    """One GRPO forward-backward at per-sample temperatures (old and reference log-probs at T too).

    Returns the loss, the gathered router and output-layer gradients and, with ``capture``, what
    a by-hand gradient needs: the output layer's inputs per micro-batch and the batch itself.
    """
    from megatron_rl.algos.presets import get_preset
    from megatron_rl.parallel.logprobs import compute_logprobs
    from megatron_rl.parallel.smoke_worker import _gathered_grads
    from megatron_rl.parallel.train_step import RoutingPlan, TrainBatch, forward_backward

    seqs, prompts = [SEQUENCES[i] for i in mine], [PROMPTS[i] for i in mine]
    temperature_T = torch.cat([torch.full((SEQUENCES[i].numel() - PROMPTS[i],), TEMPERATURES[i]) for i in mine])
    old_T = compute_logprobs(ddp, groups, seqs, prompts, micro_batch_sequences=2, temperature_T=temperature_T).logprobs_T
    # A reference policy other than the current one, so the KL term has a gradient (per sample:
    # data-parallel ranks hold different samples).
    ref_T = old_T - 0.3 * torch.cat([torch.rand(SEQUENCES[i].numel() - PROMPTS[i],
                                                generator=torch.Generator().manual_seed(300 + i)) for i in mine])
    batch = TrainBatch(sequences=seqs, prompt_lengths=prompts, old_logprobs_T=old_T, ref_logprobs_T=ref_T,
                       advantages_T=torch.cat([_advantages(i) for i in mine]), temperature_T=temperature_T)
    inputs = []
    hook = model.output_layer.register_forward_hook(lambda m, i, o: inputs.append(i[0].detach().clone())) if capture else None
    result = forward_backward(ddp, groups, batch, get_preset("grpo"), RoutingPlan(mode="none", diagnostics=False),
                              micro_batch_sequences=2)
    if hook is not None:
        hook.remove()
    grads = _gathered_grads(model, groups)
    out = {"loss": float(result.loss), "grads": grads if groups.tp_rank == 0 else {},
           "ratio": (float(result.metrics["objective/ratio/min"]), float(result.metrics["objective/ratio/max"]))}
    if capture:
        out.update(inputs=inputs, batch=batch, weight=model.output_layer.weight.detach().clone())
    return out


def by_hand_output_layer_grad(step: dict) -> torch.Tensor:
    """dL/dW of GRPO's loss at ratio 1 for the T-scaled policy, written out (fp64).

    Per response token t of sample i (n_i tokens, S samples, beta = 0.04, k3 KL):
    dL/dlogp_t = (-A_t + beta (1 - exp(ref_t - logp_t))) / (S n_i)   (the clip is inactive at r = 1),
    dlogp_t/dz_t = (onehot(y_t) - softmax(z_t / T_i)) / T_i   with z_t = W h_t,
    dL/dW = sum_t (dL/dz_t)^T h_t.
    """
    from megatron_rl.parallel.packing import pack_sequences, response_targets

    batch, weight = step["batch"], step["weight"].double()
    lengths = [s.numel() - p for s, p in zip(batch.sequences, batch.prompt_lengths)]
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    dlogp_T = torch.cat([
        (-batch.advantages_T[cu[i]:cu[i + 1]].double()
         + 0.04 * (1 - torch.exp(batch.ref_logprobs_T[cu[i]:cu[i + 1]].double()
                                 - batch.old_logprobs_T[cu[i]:cu[i + 1]].double()))) / (len(lengths) * lengths[i])
        for i in range(len(lengths))])
    grad = torch.zeros_like(weight)
    assert len(step["inputs"]) == (len(lengths) + 1) // 2  # GRPO without diagnostics: no probe pass
    for m, hidden in enumerate(step["inputs"]):
        ids = list(range(2 * m, min(2 * m + 2, len(lengths))))
        mb = pack_sequences([batch.sequences[i] for i in ids], sample_ids=ids)
        rows_R, targets_R = response_targets(mb, batch.prompt_lengths, torch.device("cpu"))
        h_RH = hidden.reshape(-1, hidden.shape[-1])[rows_R].double()
        token_rows = torch.cat([torch.arange(cu[i], cu[i + 1]) for i in ids])
        temperature_R = batch.temperature_T[token_rows].double()
        p_RV = torch.softmax((h_RH @ weight.T) / temperature_R[:, None], dim=-1)
        onehot_RV = torch.nn.functional.one_hot(targets_R, weight.shape[0]).double()
        dz_RV = dlogp_T[token_rows, None] * (onehot_RV - p_RV) / temperature_R[:, None]
        grad += dz_RV.T @ h_RH
    return grad


def _perturb_routers(model, scale=0.05):
    """Deterministic router change, identical in every layout (routers are replicated)."""
    for layer in model.decoder.layers:
        gen = torch.Generator().manual_seed(100 + layer.layer_number)
        weight = layer.mlp.router.weight
        weight.data += scale * torch.randn(weight.shape, generator=gen) * weight.data.std()


def _build(parallel, checkpoint, save, **overrides):
    from megatron_rl.parallel.checkpoint import load_model, save_model
    from megatron_rl.parallel.model import build_model
    from megatron_rl.parallel.schedule import wrap_for_training

    model = build_model(MODEL, parallel, moe_enable_routing_replay=True, **overrides)
    (save_model if save else load_model)(model, checkpoint)
    return model, wrap_for_training(model)


def _step_all_plans(model, ddp, groups, mine, old, filters=False):
    """Forward-backward of every plan from the same weights, then one optimizer step.

    Clipped objectives have gradients that jump where a ratio crosses a clip bound, so
    plans are compared from identical weights; the step after the last plan checks that
    the update itself (gradient norm, clipping, parameter change) is layout invariant.
    With ``filters`` the token-filter objectives run first (R2), from the same weights; the
    optimizer step then still applies the gradient of the last plan.
    """
    from megatron_rl.algos.presets import get_preset
    from megatron_rl.parallel.optim import build_optimizer, optimizer_step
    from megatron_rl.parallel.smoke_worker import _gathered_grads
    from megatron_rl.parallel.train_step import (
        RoutingPlan,
        TrainBatch,
        forward_backward,
    )
    from megatron_rl.sections import OptimConfig

    # SGD keeps the update linear in the gradient, so later steps stay comparable at 1e-5.
    optimizer = build_optimizer(ddp, OptimConfig(optimizer="sgd", lr=0.5, clip_grad=10.0))
    out = {}
    for name, overrides in (FILTER_OBJECTIVES.items() if filters else ()):
        batch = TrainBatch(
            sequences=[SEQUENCES[i] for i in mine],
            prompt_lengths=[PROMPTS[i] for i in mine],
            old_logprobs_T=old.logprobs_T,
            advantages_T=torch.cat([_advantages(i) for i in mine]),
            truncated_S=torch.tensor([i in TRUNCATED for i in mine]),
            old_record=old.record,
        )
        result = forward_backward(ddp, groups, batch, get_preset(name, **overrides), RoutingPlan(mode="R2"),
                                  micro_batch_sequences=2)
        grads = _gathered_grads(model, groups)  # routers and the TP-gathered output layer
        kept = result.kept_mask_T.split([SEQUENCES[i].numel() - PROMPTS[i] for i in mine])
        out[f"filter:{name}"] = {
            "loss": float(result.loss),
            "metrics": {k: float(v) for k, v in result.metrics.items() if k.startswith("mask/")},
            "grads": grads if groups.tp_rank == 0 else {},
            "kept": dict(zip(mine, kept)),
            "dp_size": groups.dp_size,
        }
    # The R2 step with token-budget micro-batches (re-ordered, uneven counts per rank): it
    # must give the fixed-count step's loss and gradients.
    budget_batch = TrainBatch(
        sequences=[SEQUENCES[i] for i in mine],
        prompt_lengths=[PROMPTS[i] for i in mine],
        old_logprobs_T=old.logprobs_T,
        advantages_T=torch.cat([_advantages(i) for i in mine]),
        old_record=old.record,
    )
    result = forward_backward(ddp, groups, budget_batch, get_preset("rspo"), RoutingPlan(mode="R2"),
                              micro_batch_tokens=BUDGET)
    out["budget:R2"] = {
        "loss": float(result.loss),
        "grads": {f"router.{l.layer_number}": l.mlp.router.weight.main_grad.clone() for l in model.decoder.layers}
        if groups.tp_rank == 0 else {},
    }
    for mode in PLANS:
        batch = TrainBatch(
            sequences=[SEQUENCES[i] for i in mine],
            prompt_lengths=[PROMPTS[i] for i in mine],
            old_logprobs_T=old.logprobs_T,
            advantages_T=torch.cat([_advantages(i) for i in mine]),
            old_record=old.record,
            rollout_routes=[_rollout_routes(i) for i in mine],
            rollout_gates=[_rollout_gates(i) for i in mine],
        )
        result = forward_backward(ddp, groups, batch, get_preset("rspo"), RoutingPlan(mode=mode),
                                  micro_batch_sequences=2)
        grads = {f"router.{l.layer_number}": l.mlp.router.weight.main_grad.clone() for l in model.decoder.layers}
        out[mode] = {
            "loss": float(result.loss),
            "metrics": {k: float(v) for k, v in result.metrics.items()},
            "grads": grads if groups.tp_rank == 0 else {},
        }
    before = model.decoder.layers[0].mlp.router.weight.detach().clone()
    step = optimizer_step(optimizer)
    after = {f"router.{l.layer_number}": l.mlp.router.weight.detach().clone() for l in model.decoder.layers}
    out["update"] = {
        "grad_norm": float(step["optim/grad_norm"]),
        "moved": float((next(iter(after.values())) - before).abs().max()),
        "weights": after if groups.tp_rank == 0 else {},
    }
    return out


def layout_step_worker(parallel, checkpoint):
    from megatron_rl.parallel.cpu_platform import cpu_platform
    from megatron_rl.parallel.groups import model_parallel
    from megatron_rl.parallel.logprobs import compute_logprobs

    with cpu_platform(), model_parallel(parallel, seed=1234) as groups:
        model, ddp = _build(parallel, checkpoint, save=False)
        mine = list(range(groups.dp_rank, len(SEQUENCES), groups.dp_size))
        old = compute_logprobs(ddp, groups, [SEQUENCES[i] for i in mine], [PROMPTS[i] for i in mine],
                               micro_batch_sequences=2, record_routing=True)
        temperature = _temperature_step(model, ddp, groups, mine)
        _perturb_routers(model)
        steps = _step_all_plans(model, ddp, groups, mine, old, filters=True)
        return {**steps, "temperature": temperature, "expert_spread_over_tp": _expert_spread_over_tp(model, groups)}


def _expert_spread_over_tp(model, groups) -> float | None:
    """Largest difference of the expert weights between TP ranks after the update (None: experts
    are not whole on every TP rank, or TP 1). Replicated experts must stay equal."""
    import torch.distributed as dist

    if groups.tp_size == 1 or groups.ep_size > 1 or groups.etp_size > 1:
        return None
    experts = torch.cat([p.detach().reshape(-1) for n, p in model.named_parameters() if ".experts." in n])
    copies = [torch.empty_like(experts) for _ in range(groups.tp_size)]
    dist.all_gather(copies, experts, group=groups.tp)
    return max(float((c - copies[0]).abs().max()) for c in copies)


def _hook_router_logits(model):
    logits, hooks = {}, []
    for layer in model.decoder.layers:
        def hook(module, inputs, output, number=layer.layer_number):
            hidden = inputs[0].reshape(-1, inputs[0].shape[-1]).double()
            logits.setdefault(number, []).append(hidden @ module.weight.double().t())

        hooks.append(layer.mlp.router.register_forward_hook(hook))
    return logits, hooks


def _real_rows(calls, micro_batch_tokens):
    return torch.cat([c[:n] for c, n in zip(calls, micro_batch_tokens)])


def _unchanged_r2_step(ddp, groups, old):
    """Metrics of one R2 RSPO forward-backward of the whole batch from the recording weights."""
    from megatron_rl.algos.presets import get_preset
    from megatron_rl.parallel.train_step import (
        RoutingPlan,
        TrainBatch,
        forward_backward,
    )

    batch = TrainBatch(
        sequences=SEQUENCES,
        prompt_lengths=PROMPTS,
        old_logprobs_T=old.logprobs_T,
        advantages_T=torch.cat([_advantages(i) for i in range(len(SEQUENCES))]),
        old_record=old.record,
    )
    result = forward_backward(ddp, groups, batch, get_preset("rspo"), RoutingPlan(mode="R2"), micro_batch_sequences=2)
    return {k: float(v) for k, v in result.metrics.items()}


def reference_worker(checkpoint):
    """Single process: semantics checks, then the reference step of every plan."""
    from megatron_rl.parallel.cpu_platform import cpu_platform
    from megatron_rl.parallel.groups import model_parallel
    from megatron_rl.parallel.logprobs import compute_logprobs

    parallel = ParallelConfig()
    mb_tokens = [sum(s.numel() for s in SEQUENCES[i : i + 2]) for i in range(0, len(SEQUENCES), 2)]
    numbers = tuple(range(1, MODEL.num_layers + 1))
    out = {}
    with cpu_platform(), model_parallel(parallel, seed=1234) as groups:
        model, ddp = _build(parallel, checkpoint, save=True)
        run = functools.partial(compute_logprobs, ddp, groups, SEQUENCES, PROMPTS, micro_batch_sequences=2)
        output_logits = []
        hook = model.output_layer.register_forward_hook(lambda m, i, o: output_logits.append(o[0].detach()))
        old = run(record_routing=True)
        ids = old.record.expert_ids_TLK
        out["temperature"] = _temperature_step(model, ddp, groups, list(range(len(SEQUENCES))), capture=True)

        # R2 with unchanged weights, exact by construction: the replay pass packs the same
        # rows, dispatches every real token to the experts it recorded, leaves padding to
        # the router's own top-K and feeds the gate function the same scores in the same
        # order, so each layer runs the same kernels on the same inputs as the recorded pass.
        same = run(replay_ids_TLK=ids, replay_layer_numbers=numbers, old_record=old.record)
        out["r2_unchanged_logprob_err"] = float((same.logprobs_T - old.logprobs_T).abs().max())
        out["gamma_unchanged_is_one"] = bool((same.rspo_gamma_T == 1).all())
        out["agreement_unchanged"] = float(same.routing_metrics["routing/replay_agreement"])
        # The training forward of the step (grad on, after its probe pass) is that pass too.
        step = _unchanged_r2_step(ddp, groups, old)
        hook.remove()
        recorded, trained = output_logits[: len(mb_tokens)], output_logits[-len(mb_tokens) :]
        out["r2_train_logits_err"] = max(float((a - b).abs().max()) for a, b in zip(trained, recorded))
        out["r2_train_ratio"] = (step["objective/ratio/min"], step["objective/ratio/max"])

        _perturb_routers(model)
        natural = run(record_routing=True)
        out["natural_changed_frac"] = float((natural.record.expert_ids_TLK != ids).any(-1).float().mean())

        # R2 after the perturbation: dispatch still equals the record; agreement drops.
        logits, hooks = _hook_router_logits(model)
        r2 = run(record_routing=True, replay_ids_TLK=ids, replay_layer_numbers=numbers, old_record=old.record)
        for handle in hooks:
            handle.remove()
        out["r2_dispatch_equals_record"] = torch.equal(r2.record.expert_ids_TLK.sort(-1).values, ids.sort(-1).values)
        out["r2_agreement"] = float(r2.routing_metrics["routing/replay_agreement"])

        # RSPO gamma against an independent per-token computation from hooked router logits.
        shift = torch.zeros(ids.shape[0], dtype=torch.float64)
        for col, number in enumerate(numbers):
            log_p = torch.log_softmax(_real_rows(logits[number], mb_tokens), dim=-1)
            current = log_p.gather(1, ids[:, col].long())
            shift += (current - old.record.probs_TLK[:, col].double().log()).abs().mean(-1)
        gamma_all = torch.exp(-shift / len(numbers))
        rows = torch.cat([torch.arange(int(old.record.cu_seqlens_S1[i]) + p - 1, int(old.record.cu_seqlens_S1[i + 1]) - 1)
                          for i, p in enumerate(PROMPTS)])
        out["gamma_err"] = float((r2.rspo_gamma_T.double() - gamma_all[rows]).abs().max())
        out["gamma_below_one"] = float(r2.rspo_gamma_T.min())
        out["gamma_requires_grad"] = r2.rspo_gamma_T.requires_grad

        # R3: arbitrary ids are dispatched exactly; gates = softmax restricted to them.
        routes = torch.cat([torch.cat([_rollout_routes(i), _rollout_routes(i)[-1:]]) for i in range(len(SEQUENCES))])
        logits, hooks = _hook_router_logits(model)
        r3 = run(record_routing=True, replay_ids_TLK=routes, replay_layer_numbers=numbers)
        for handle in hooks:
            handle.remove()
        out["r3_dispatch_equals_routes"] = torch.equal(
            r3.record.expert_ids_TLK.long().sort(-1).values, routes.long().sort(-1).values)
        gate_err = 0.0
        for col, number in enumerate(numbers):
            real = _real_rows(logits[number], mb_tokens)
            chosen = r3.record.expert_ids_TLK[:, col].long()
            expected = torch.softmax(real.gather(1, chosen), dim=-1)
            gate_err = max(gate_err, float((r3.record.gates_TLK[:, col].double() - expected).abs().max()))
        out["r3_gate_err"] = gate_err
        # R3w: gates equal to R3's recomputed ones reproduce R3 bit for bit; other gates change the pass.
        same_gates = run(replay_ids_TLK=r3.record.expert_ids_TLK, replay_layer_numbers=numbers,
                         replay_gates_TLK=r3.record.gates_TLK)
        out["r3w_same_gates_equal"] = torch.equal(same_gates.logprobs_T, r3.logprobs_T)
        gates = torch.cat([torch.cat([_rollout_gates(i), _rollout_gates(i)[-1:]]) for i in range(len(SEQUENCES))])
        other = run(replay_ids_TLK=routes, replay_layer_numbers=numbers, replay_gates_TLK=gates)
        out["r3w_other_gates_change"] = float((other.logprobs_T - r3.logprobs_T).abs().max())

        out["steps"] = _step_all_plans(model, ddp, groups, list(range(len(SEQUENCES))), old, filters=True)

        # Activation recomputation replays the same experts in the backward recompute.
        recompute_model, recompute_ddp = _build(
            parallel, checkpoint, save=False,
            recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1,
        )
        _perturb_routers(recompute_model)
        out["recompute_steps"] = _step_all_plans(recompute_model, recompute_ddp, groups, list(range(len(SEQUENCES))), old)
        out.update(_rspo_against_the_producing_routes(model, ddp, groups, run, routes, numbers, mb_tokens))
    return out


def _rspo_against_the_producing_routes(model, ddp, groups, run, routes, numbers, mb_tokens) -> dict:
    """Asynchronous rollouts: RSPO's gamma of a token measured at the experts it was produced
    with (``routes``, as a stale rollout engine chose them) against the same step measured at
    the proximal pass's own top-K: the two training steps differ only in that choice."""
    from megatron_rl.algos.presets import get_preset
    from megatron_rl.parallel.train_step import RoutingPlan, TrainBatch, forward_backward
    from megatron_rl.train.drift import shift_record

    logits, hooks = _hook_router_logits(model)
    proximal = run(record_routing=True, query_ids_TLK=routes, query_layer_numbers=numbers)
    for handle in hooks:
        handle.remove()
    at_routes = torch.stack([torch.softmax(_real_rows(logits[n], mb_tokens), dim=-1).gather(1, routes[:, c].long())
                             for c, n in enumerate(numbers)], dim=1)
    out = {"query_probs_err": float((proximal.query_probs_TLK.double() - at_routes).abs().max())}
    _perturb_routers(model, scale=0.2)  # the update moves the router
    measured = shift_record(routes, numbers, proximal.query_probs_TLK, proximal.record.cu_seqlens_S1, MODEL.num_experts)
    rows = torch.cat([torch.arange(int(proximal.record.cu_seqlens_S1[i]) + p - 1,
                                   int(proximal.record.cu_seqlens_S1[i + 1]) - 1) for i, p in enumerate(PROMPTS)])
    for name, record in (("behaviour", measured), ("proximal", None)):
        batch = TrainBatch(sequences=SEQUENCES, prompt_lengths=PROMPTS, old_logprobs_T=proximal.logprobs_T,
                           advantages_T=torch.cat([_advantages(i) for i in range(len(SEQUENCES))]),
                           old_record=proximal.record, shift_record=record)
        logits, hooks = _hook_router_logits(model)
        result = forward_backward(ddp, groups, batch, get_preset("rspo"), RoutingPlan(mode="none"),
                                  micro_batch_sequences=2)
        for handle in hooks:
            handle.remove()
        reference = measured if record is not None else proximal.record
        shift = torch.zeros(reference.num_tokens, dtype=torch.float64)
        for c, n in enumerate(numbers):  # the probe's calls come first, then the training forward's
            log_p = torch.log_softmax(_real_rows(logits[n][: len(mb_tokens)], mb_tokens), dim=-1)
            current = log_p.gather(1, reference.expert_ids_TLK[:, c].long())
            shift += (current - reference.probs_TLK[:, c].double().log()).abs().mean(-1)
        out[f"gamma_{name}"] = result.probe_T["gamma"]
        out[f"gamma_{name}_err"] = float((result.probe_T["gamma"].double() - torch.exp(-shift / len(numbers))[rows])
                                         .abs().max())
    return out


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("train") / "ckpt")


@pytest.fixture(scope="module")
def reference(checkpoint_dir):
    return run_world(reference_worker, 1, checkpoint_dir, timeout_s=400)[0]


@pytest.fixture(scope="module")
def layout(checkpoint_dir, reference):
    @functools.cache
    def run(name):
        parallel, world = LAYOUTS[name]
        per_rank = run_world(layout_step_worker, world, parallel, checkpoint_dir, timeout_s=400)
        merged = {}
        for mode in PLANS:
            grads = {}
            for rank in per_rank:
                for key, value in rank[mode]["grads"].items():
                    grads.setdefault(key, value)
            merged[mode] = {"loss": [r[mode]["loss"] for r in per_rank], "grads": grads}
        weights = {}
        for rank in per_rank:
            for key, value in rank["update"]["weights"].items():
                weights.setdefault(key, value)
        merged["update"] = {"grad_norm": [r["update"]["grad_norm"] for r in per_rank], "weights": weights}
        merged["expert_spread_over_tp"] = [r["expert_spread_over_tp"] for r in per_rank]
        budget_grads = {}
        for rank in per_rank:
            for key, value in rank["budget:R2"]["grads"].items():
                budget_grads.setdefault(key, value)
        merged["budget:R2"] = {"loss": [r["budget:R2"]["loss"] for r in per_rank], "grads": budget_grads}
        temperature_grads = {}
        for rank in per_rank:
            for key, value in rank["temperature"]["grads"].items():
                temperature_grads.setdefault(key, value)
        merged["temperature"] = {"loss": [r["temperature"]["loss"] for r in per_rank], "grads": temperature_grads}
        for run_name in FILTER_RUNS:
            grads, kept = {}, {}
            for rank in per_rank:
                for key, value in rank[run_name]["grads"].items():
                    grads.setdefault(key, value)
                for sample, value in rank[run_name]["kept"].items():
                    kept.setdefault(sample, value)
            merged[run_name] = {
                "loss": [r[run_name]["loss"] for r in per_rank],
                "metrics": [r[run_name]["metrics"] for r in per_rank],
                "dp_size": [r[run_name]["dp_size"] for r in per_rank],
                "grads": grads,
                "kept": kept,
            }
        return merged

    return run


def test_r2_with_unchanged_weights_reproduces_the_recorded_pass(reference):
    assert reference["r2_unchanged_logprob_err"] == 0.0
    assert reference["agreement_unchanged"] == 1.0
    assert reference["r2_train_logits_err"] == 0.0
    assert reference["r2_train_ratio"] == (1.0, 1.0)


def test_rspo_gamma_is_one_with_unchanged_weights(reference):
    assert reference["gamma_unchanged_is_one"]


def test_r2_keeps_recorded_experts_after_router_change(reference):
    assert reference["natural_changed_frac"] > 0.05, "the perturbation must change natural routing"
    assert reference["r2_dispatch_equals_record"]
    assert reference["r2_agreement"] < 1.0


def test_rspo_gamma_matches_independent_computation(reference):
    assert reference["gamma_err"] <= 1e-6
    assert reference["gamma_below_one"] < 1.0
    assert reference["gamma_requires_grad"] is False


def test_rspo_gamma_uses_the_routes_each_token_was_produced_with(reference):
    """Asynchronous rollouts: with the producing routes as the measured record, each token's
    gamma is the router's shift at those experts (against the proximal policy's probabilities
    there, which the old-policy pass queries exactly); measured at the proximal top-K instead,
    the same step gives other weights."""
    assert reference["query_probs_err"] <= 1e-6
    assert reference["gamma_behaviour_err"] <= 1e-6 and reference["gamma_proximal_err"] <= 1e-6
    assert float((reference["gamma_behaviour"] - reference["gamma_proximal"]).abs().max()) > 1e-3


def test_r3_dispatches_given_experts_with_restricted_softmax_gates(reference):
    assert reference["r3_dispatch_equals_routes"]
    assert reference["r3_gate_err"] <= 1e-6


def test_r3w_replaces_the_gate_values_exactly(reference):
    assert reference["r3w_same_gates_equal"], "R3w with R3's own gates must reproduce R3 bit for bit"
    assert reference["r3w_other_gates_change"] > 1e-3


def test_grpo_gradient_at_temperature_equals_the_t_scaled_policy_by_hand(reference):
    step = reference["temperature"]
    assert step["ratio"] == (1.0, 1.0), "old log-probs at T make the first step on-policy"
    expected = by_hand_output_layer_grad(step)
    got = step["grads"]["output_layer"].double()
    assert expected.abs().max() > 1e-4
    assert relative_error(got, expected) <= 1e-5, relative_error(got, expected)
    # The same step scored at T = 1 is a different gradient: the temperature is not a no-op.
    at_one = dict(step, batch=dataclasses.replace(step["batch"], temperature_T=torch.ones_like(step["batch"].temperature_T)))
    assert relative_error(by_hand_output_layer_grad(at_one), expected) > 0.05


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_temperature_step_is_layout_invariant(name, layout, reference):
    ref, got = reference["temperature"], layout(name)["temperature"]
    for loss in got["loss"]:
        assert abs(loss - ref["loss"]) <= 1e-5 * max(1e-3, abs(ref["loss"])), (name, loss, ref["loss"])
    assert set(got["grads"]) == set(ref["grads"])
    for key, grad in ref["grads"].items():
        assert relative_error(got["grads"][key], grad) <= 1e-5, (name, key)


@pytest.mark.parametrize("mode", PLANS)
def test_router_receives_gradient(reference, mode):
    assert all(g.abs().sum() > 0 for g in reference["steps"][mode]["grads"].values()), mode


def test_optimizer_step_moves_the_weights(reference):
    assert reference["steps"]["update"]["grad_norm"] > 0
    assert reference["steps"]["update"]["moved"] > 0


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_optimizer_step_is_layout_invariant(name, layout, reference):
    ref, got = reference["steps"]["update"], layout(name)["update"]
    for norm in got["grad_norm"]:
        assert abs(norm - ref["grad_norm"]) <= 1e-5 * ref["grad_norm"], (name, norm, ref["grad_norm"])
    for key, weight in ref["weights"].items():
        assert relative_error(got["weights"][key], weight) <= 1e-6, (name, key)


def test_experts_replicated_over_tp_stay_equal_after_the_update(layout):
    # TP2+SP with EP 1 and expert-TP 1: each TP rank routes its own sequence shard through
    # whole experts; their gradients must be summed over TP (parallel.mcore_layers).
    assert layout("TP2+SP")["expert_spread_over_tp"] == [0.0, 0.0]


@pytest.mark.parametrize("mode", PLANS)
def test_activation_recomputation_gives_the_same_gradients(reference, mode):
    plain, recompute = reference["steps"][mode], reference["recompute_steps"][mode]
    assert abs(plain["loss"] - recompute["loss"]) <= 1e-6 * max(1.0, abs(plain["loss"]))
    for key, grad in plain["grads"].items():
        assert relative_error(recompute["grads"][key], grad) <= 1e-5, (mode, key)


@pytest.mark.parametrize("mode", PLANS)
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_training_step_is_layout_invariant(name, mode, layout, reference):
    ref = reference["steps"][mode]
    got = layout(name)[mode]
    for loss in got["loss"]:
        assert abs(loss - ref["loss"]) <= 1e-5 * max(1e-3, abs(ref["loss"])), (name, mode, loss, ref["loss"])
    assert set(got["grads"]) == set(ref["grads"])
    for key, grad in ref["grads"].items():
        assert relative_error(got["grads"][key], grad) <= 1e-5, (name, mode, key)


def test_token_filters_remove_part_of_the_batch(reference):
    """The comparison below is only meaningful if every filter keeps some tokens and drops some."""
    steps = reference["steps"]
    for run_name, metric in (("filter:entropy_8020", "mask/entropy_frac"), ("filter:stapo", "mask/stapo_frac"),
                             ("filter:stapo", "mask/overlong_frac")):
        kept = torch.cat(list(steps[run_name]["kept"].values()))
        assert 0 < int(kept.sum()) < kept.numel(), run_name
        assert 0 < steps[run_name]["metrics"][metric] < 1, (run_name, metric)
    assert set(steps["filter:stapo"]["grads"]) == {f"router.{n}" for n in range(1, 5)} | {"output_layer"}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_data_parallel_size_of_the_layouts(name, layout):
    expected = {"TP2+SP": 1, "EP2": 2, "PP2": 1, "TP2+SP x EP2": 2}[name]
    assert layout(name)[FILTER_RUNS[0]]["dp_size"] == [expected] * LAYOUTS[name][1]


@pytest.mark.parametrize("run_name", FILTER_RUNS)
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_token_filters_select_over_the_global_batch(name, run_name, layout, reference):
    """80/20 and STAPO keep the single-process tokens in every layout, DP = 2 included."""
    ref, got = reference["steps"][run_name], layout(name)[run_name]
    assert set(got["kept"]) == set(ref["kept"])
    for sample, kept in ref["kept"].items():
        assert torch.equal(got["kept"][sample], kept), (name, run_name, sample)
    for metrics in got["metrics"]:
        assert metrics == pytest.approx(ref["metrics"], rel=1e-12), (name, run_name)
    for loss in got["loss"]:
        assert abs(loss - ref["loss"]) <= 1e-5 * max(1e-3, abs(ref["loss"])), (name, run_name, loss, ref["loss"])
    assert set(got["grads"]) == set(ref["grads"])
    for key, grad in ref["grads"].items():
        assert relative_error(got["grads"][key], grad) <= 1e-5, (name, run_name, key)


@pytest.mark.parametrize("name", ["single process", *LAYOUTS])
def test_token_budget_step_equals_fixed_count_step(name, layout, reference):
    ref = reference["steps"]["R2"]
    if name == "single process":
        got = {"loss": [reference["steps"]["budget:R2"]["loss"]], "grads": reference["steps"]["budget:R2"]["grads"]}
    else:
        got = layout(name)["budget:R2"]
    for loss in got["loss"]:
        assert abs(loss - ref["loss"]) <= 1e-5 * max(1e-3, abs(ref["loss"])), (name, loss, ref["loss"])
    assert set(got["grads"]) == set(ref["grads"])
    for key, grad in ref["grads"].items():
        assert relative_error(got["grads"][key], grad) <= 1e-5, (name, key)
