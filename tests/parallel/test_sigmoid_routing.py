"""Sigmoid routing (DeepSeek-V3 style): records, replay, RSPO and layout invariance.

The model: multi-latent attention with query LoRA and YaRN, a dense first layer, three MoE
layers of 8 experts with a shared expert, sigmoid scores with a (non-zero) expert bias,
top-4 over 2 of 4 groups, routed scaling 2.5.

The single-process world checks the semantics against router logits hooked from the model:
a record's experts are the router's own selection (bias and group limit included), its
probabilities the experts' sigmoid scores, its gates the normalized scores times 2.5; R2
with unchanged weights reproduces the pass exactly (gamma 1); after a router change R2
dispatches the recorded experts and gamma equals exp(-mean |log sigma_cur - log sigma_old|)
computed from the hooked logits; R3 routes in SGLang's layout (a column per decoder layer,
the dense layer's column garbage) dispatch exactly the MoE columns. Each of the seven
layouts then reproduces the log-probs, the records and one RSPO training step under R2
replay; PP4 leaves the first stage with the dense layer alone (no router). To keep the
suite short, ONE world of 4 processes runs the seven layouts one after another (the
2-process layouts with data parallelism 2 on top).
"""

import functools

import pytest
import torch

from megatron_rl.parallel.smoke_worker import random_sequences, relative_error
from megatron_rl.parallel.world import run_world
from megatron_rl.sections import ModelConfig, ParallelConfig

pytestmark = pytest.mark.parallel

MODEL = ModelConfig(
    vocab_size=256, hidden_size=64, num_layers=4, num_attention_heads=4, num_query_groups=4, head_dim=24,
    num_experts=8, moe_router_topk=4, moe_ffn_hidden_size=16, max_position_embeddings=256,
    multi_latent_attention=True, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
    v_head_dim=16, rope_scaling="yarn", yarn_factor=4.0, yarn_original_max_position_embeddings=64,
    yarn_mscale=1.0, yarn_mscale_all_dim=1.0, rotary_base=10000.0,
    num_dense_layers=1, ffn_hidden_size=64, moe_shared_expert_intermediate_size=32,
    moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
    moe_router_num_groups=4, moe_router_group_topk=2, moe_router_topk_scaling_factor=2.5,
)
MOE_LAYERS = (2, 3, 4)
SEQUENCES = random_sequences(4, MODEL.vocab_size, min_len=6, max_len=30, seed=7)
PROMPTS = [max(1, len(s) // 3) for s in SEQUENCES]
LAYOUT_PLANS = ("R2",)
LAYOUTS = {
    "TP2+SP": ParallelConfig(tensor_model_parallel_size=2),
    "EP2 alltoall": ParallelConfig(expert_model_parallel_size=2),
    "EP2 allgather": ParallelConfig(expert_model_parallel_size=2, moe_token_dispatcher_type="allgather"),
    "PP2": ParallelConfig(pipeline_model_parallel_size=2),
    "TP2+SP x EP2": ParallelConfig(tensor_model_parallel_size=2, expert_model_parallel_size=2),
    "TP2+SP x PP2": ParallelConfig(tensor_model_parallel_size=2, pipeline_model_parallel_size=2),
    # Stage 0 holds the dense first layer alone: no router, no record columns of its own.
    "PP4": ParallelConfig(pipeline_model_parallel_size=4),
}


def _advantages(sample: int) -> torch.Tensor:
    n = SEQUENCES[sample].numel() - PROMPTS[sample]
    return torch.randn(n, generator=torch.Generator().manual_seed(50 + sample))


def _rollout_routes(sample: int) -> torch.Tensor:
    """Valid experts for the MoE layers in SGLang's layout ``[len - 1, num_layers, K]``; the
    dense layer's column holds duplicates (it routes nothing and must be ignored)."""
    gen = torch.Generator().manual_seed(1000 + sample)
    n = SEQUENCES[sample].numel() - 1
    ids = torch.rand(n, MODEL.num_layers, MODEL.num_experts, generator=gen).topk(MODEL.moe_router_topk, -1).indices
    ids[:, 0] = 0
    return ids.to(torch.int32)


def _routers(model):
    return {l.layer_number: l.mlp.router for l in model.decoder.layers if hasattr(l.mlp, "router")}


def _perturb_routers(model, scale=0.05):
    """Deterministic router change, identical in every layout (routers are replicated)."""
    for number, router in _routers(model).items():
        gen = torch.Generator().manual_seed(100 + number)
        router.weight.data += scale * torch.randn(router.weight.shape, generator=gen) * router.weight.data.std()


def _build(parallel, checkpoint, save):
    from megatron_rl.parallel.checkpoint import load_model, save_model
    from megatron_rl.parallel.model import build_model
    from megatron_rl.parallel.schedule import wrap_for_training

    model = build_model(MODEL, parallel, moe_enable_routing_replay=True)
    if save:
        for number, router in _routers(model).items():
            # A bias large enough to change selections; saved with the weights.
            gen = torch.Generator().manual_seed(200 + number)
            router.expert_bias.copy_(0.2 * torch.randn(MODEL.num_experts, generator=gen))
    (save_model if save else load_model)(model, checkpoint)
    return model, wrap_for_training(model)


def _steps(model, ddp, groups, mine, old, plans=LAYOUT_PLANS):
    """One RSPO forward-backward per routing plan from the same weights: loss, router grads."""
    from megatron_rl.algos.presets import get_preset
    from megatron_rl.parallel.train_step import (
        RoutingPlan,
        TrainBatch,
        forward_backward,
    )

    out = {}
    for mode in plans:
        batch = TrainBatch(
            sequences=[SEQUENCES[i] for i in mine], prompt_lengths=[PROMPTS[i] for i in mine],
            old_logprobs_T=old.logprobs_T, advantages_T=torch.cat([_advantages(i) for i in mine]),
            old_record=old.record, rollout_routes=[_rollout_routes(i) for i in mine],
        )
        for param in ddp.parameters():
            param.main_grad.zero_()
        result = forward_backward(ddp, groups, batch, get_preset("rspo"), RoutingPlan(mode=mode),
                                  micro_batch_sequences=2)
        grads = {f"router.{n}": r.weight.main_grad.clone() for n, r in _routers(model).items()}
        out[mode] = {"loss": float(result.loss), "grads": grads if groups.tp_rank == 0 else {}}
    return out


def _pass(ddp, groups, mine):
    from megatron_rl.parallel.logprobs import compute_logprobs

    return compute_logprobs(ddp, groups, [SEQUENCES[i] for i in mine], [PROMPTS[i] for i in mine],
                            micro_batch_sequences=2, record_routing=True)


def layouts_worker(checkpoint):
    """Every rank of the 4-process world: each layout in turn, loaded from the reference checkpoint."""
    from megatron_rl.parallel.cpu_platform import cpu_platform
    from megatron_rl.parallel.groups import model_parallel

    results = {}
    with cpu_platform():
        for name, parallel in LAYOUTS.items():
            with model_parallel(parallel, seed=1234) as groups:
                model, ddp = _build(parallel, checkpoint, save=False)
                mine = list(range(groups.dp_rank, len(SEQUENCES), groups.dp_size))
                old = _pass(ddp, groups, mine)
                per_sample = {}
                for j, i in enumerate(mine):
                    record = old.record.sample(j)
                    lo, hi = int(old.cu_seqlens_S1[j]), int(old.cu_seqlens_S1[j + 1])
                    per_sample[i] = {"logprobs": old.logprobs_T[lo:hi], "ids": record.expert_ids_TLK,
                                     "probs": record.probs_TLK, "gates": record.gates_TLK}
                _perturb_routers(model)
                steps = _steps(model, ddp, groups, mine, old, LAYOUT_PLANS)
                results[name] = {"samples": per_sample, "steps": steps}
    return results


def _hook_router_logits(model):
    logits, hooks = {}, []
    for number, router in _routers(model).items():
        def hook(module, inputs, output, number=number):
            hidden = inputs[0].reshape(-1, inputs[0].shape[-1]).double()
            logits.setdefault(number, []).append(hidden @ module.weight.double().t())

        hooks.append(router.register_forward_hook(hook))
    return logits, hooks


def _real_rows(calls, micro_batch_tokens):
    return torch.cat([c[:n] for c, n in zip(calls, micro_batch_tokens)])


def reference_worker(checkpoint):
    """Single process: semantics against hooked router logits, then the reference outputs."""
    from megatron_rl.parallel.cpu_platform import cpu_platform
    from megatron_rl.parallel.groups import model_parallel
    from megatron_rl.parallel.logprobs import compute_logprobs
    from moe_routing.scores import selection_topk

    parallel = ParallelConfig()
    everything = list(range(len(SEQUENCES)))
    mb_tokens = [sum(s.numel() for s in SEQUENCES[i : i + 2]) for i in range(0, len(SEQUENCES), 2)]
    out = {}
    with cpu_platform(), model_parallel(parallel, seed=1234) as groups:
        model, ddp = _build(parallel, checkpoint, save=True)
        run = functools.partial(compute_logprobs, ddp, groups, SEQUENCES, PROMPTS, micro_batch_sequences=2)
        logits, hooks = _hook_router_logits(model)
        old = run(record_routing=True)
        for handle in hooks:
            handle.remove()
        rec = old.record
        out["layer_numbers"] = rec.layer_numbers
        ids_err = probs_err = gates_err = 0.0
        by_score_only = 0
        for col, number in enumerate(rec.layer_numbers):
            z = _real_rows(logits[number], mb_tokens)
            router = _routers(model)[number]
            chosen = selection_topk(z, "sigmoid", 4, router.expert_bias, num_groups=4, group_topk=2)
            ids = rec.expert_ids_TLK[:, col].long()
            ids_err += float((chosen.sort(-1).values != ids.sort(-1).values).any(-1).sum())
            by_score_only += int((torch.sigmoid(z).topk(4, -1).indices.sort(-1).values != ids.sort(-1).values)
                                 .any(-1).sum())
            sigma = torch.sigmoid(z).gather(1, ids)
            probs_err = max(probs_err, float((rec.probs_TLK[:, col].double() - sigma).abs().max()))
            gates = 2.5 * sigma / sigma.sum(-1, keepdim=True)
            gates_err = max(gates_err, float((rec.gates_TLK[:, col].double() - gates).abs().max()))
        out.update(ids_mismatch=ids_err, probs_err=probs_err, gates_err=gates_err, differs_from_score_topk=by_score_only)

        same = run(replay_ids_TLK=rec.expert_ids_TLK, replay_layer_numbers=rec.layer_numbers, old_record=rec)
        out["r2_unchanged_logprob_err"] = float((same.logprobs_T - old.logprobs_T).abs().max())
        out["gamma_unchanged_is_one"] = bool((same.rspo_gamma_T == 1).all())

        per_sample = {}
        for i in everything:
            record = rec.sample(i)
            lo, hi = int(old.cu_seqlens_S1[i]), int(old.cu_seqlens_S1[i + 1])
            per_sample[i] = {"logprobs": old.logprobs_T[lo:hi], "ids": record.expert_ids_TLK,
                             "probs": record.probs_TLK, "gates": record.gates_TLK}
        out["samples"] = per_sample

        _perturb_routers(model)
        logits, hooks = _hook_router_logits(model)
        r2 = run(record_routing=True, replay_ids_TLK=rec.expert_ids_TLK, replay_layer_numbers=rec.layer_numbers,
                 old_record=rec)
        for handle in hooks:
            handle.remove()
        out["r2_dispatch_equals_record"] = torch.equal(
            r2.record.expert_ids_TLK.sort(-1).values, rec.expert_ids_TLK.sort(-1).values)
        shift = torch.zeros(rec.expert_ids_TLK.shape[0], dtype=torch.float64)
        for col, number in enumerate(rec.layer_numbers):
            current = torch.nn.functional.logsigmoid(_real_rows(logits[number], mb_tokens))
            current = current.gather(1, rec.expert_ids_TLK[:, col].long())
            shift += (current - rec.probs_TLK[:, col].double().log()).abs().mean(-1)
        gamma = torch.exp(-shift / len(rec.layer_numbers))
        rows = torch.cat([torch.arange(int(rec.cu_seqlens_S1[i]) + p - 1, int(rec.cu_seqlens_S1[i + 1]) - 1)
                          for i, p in enumerate(PROMPTS)])
        out["gamma_err"] = float((r2.rspo_gamma_T.double() - gamma[rows]).abs().max())
        out["gamma_min"] = float(r2.rspo_gamma_T.min())
        out["steps"] = _steps(model, ddp, groups, everything, old)

        # Weight sync and HF export gather the expert bias with the parameters.
        from megatron_rl.rollout.sglang.weight_sync import gather_full_params

        gathered = dict(gather_full_params(model, groups))
        out["bias_gathered"] = all(
            torch.equal(gathered[f"decoder.layers.{n - 1}.mlp.router.expert_bias"], r.expert_bias)
            for n, r in _routers(model).items()
        )

        # R3 through the training step's own route handling (dense column dropped).
        from megatron_rl.parallel.train_step import (
            RoutingPlan,
            TrainBatch,
            replay_ids_for,
        )

        batch = TrainBatch(sequences=SEQUENCES, prompt_lengths=PROMPTS, old_logprobs_T=old.logprobs_T,
                           advantages_T=torch.zeros(1), rollout_routes=[_rollout_routes(i) for i in everything])
        routes = replay_ids_for(batch, RoutingPlan(mode="R3"), num_experts=8, topk=4, layer_numbers=MOE_LAYERS,
                                local_layers=MOE_LAYERS, num_model_layers=MODEL.num_layers)
        r3 = run(record_routing=True, replay_ids_TLK=routes, replay_layer_numbers=MOE_LAYERS)
        out["r3_dispatch_equals_routes"] = torch.equal(
            r3.record.expert_ids_TLK.long().sort(-1).values, routes.long().sort(-1).values)
    return out


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("sigmoid") / "ckpt")


@pytest.fixture(scope="module")
def reference(checkpoint_dir):
    return run_world(reference_worker, 1, checkpoint_dir, timeout_s=400)[0]


@pytest.fixture(scope="module")
def layouts(checkpoint_dir, reference):
    per_rank = run_world(layouts_worker, 4, checkpoint_dir, timeout_s=600)
    merged = {}
    for name in LAYOUTS:
        samples, steps = {}, {mode: {"loss": [], "grads": {}} for mode in LAYOUT_PLANS}
        for rank in per_rank:
            for i, value in rank[name]["samples"].items():
                samples.setdefault(i, value)
            for mode in LAYOUT_PLANS:
                steps[mode]["loss"].append(rank[name]["steps"][mode]["loss"])
                for key, grad in rank[name]["steps"][mode]["grads"].items():
                    steps[mode]["grads"].setdefault(key, grad)
        merged[name] = {"samples": samples, "steps": steps}
    return merged


def test_record_is_the_routers_own_selection_with_sigmoid_probs_and_scaled_gates(reference):
    assert reference["layer_numbers"] == MOE_LAYERS
    assert reference["ids_mismatch"] == 0
    assert reference["differs_from_score_topk"] > 0, "bias and groups never mattered: the check is vacuous"
    assert reference["probs_err"] <= 1e-6 and reference["gates_err"] <= 1e-5


def test_r2_with_unchanged_weights_is_exact(reference):
    assert reference["r2_unchanged_logprob_err"] == 0.0 and reference["gamma_unchanged_is_one"]


def test_r2_and_rspo_after_a_router_change(reference):
    assert reference["r2_dispatch_equals_record"]
    assert reference["gamma_err"] <= 1e-6 and reference["gamma_min"] < 1.0


def test_r3_dispatches_the_moe_columns_of_sglang_routes(reference):
    assert reference["r3_dispatch_equals_routes"]


def test_weight_gather_includes_the_expert_bias(reference):
    assert reference["bias_gathered"]


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_logprobs_and_records_are_layout_invariant(name, layouts, reference):
    got = layouts[name]["samples"]
    assert sorted(got) == sorted(reference["samples"])
    for i, ref in reference["samples"].items():
        assert (got[i]["logprobs"] - ref["logprobs"]).abs().max() <= 1e-5, (name, i)
        assert torch.equal(got[i]["ids"], ref["ids"]), (name, i)
        for key in ("probs", "gates"):
            assert (got[i][key] - ref[key]).abs().max() <= 1e-5, (name, i, key)


@pytest.mark.parametrize("mode", LAYOUT_PLANS)
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_training_step_is_layout_invariant(name, mode, layouts, reference):
    ref, got = reference["steps"][mode], layouts[name]["steps"][mode]
    for loss in got["loss"]:
        assert abs(loss - ref["loss"]) <= 1e-5 * max(1e-3, abs(ref["loss"])), (name, mode, loss, ref["loss"])
    assert set(got["grads"]) == set(ref["grads"]) == {f"router.{n}" for n in MOE_LAYERS}
    for key, grad in ref["grads"].items():
        assert grad.abs().sum() > 0, key
        assert relative_error(got["grads"][key], grad) <= 1e-5, (name, mode, key)
