"""Layout invariance: a checkpoint saved at TP1/EP1/PP1 and resharded into each layout gives
the single-process logits (1e-5, fp32) and router / output-layer gradients (1e-4 relative),
the same response log-probs and entropies (1e-5) and the same routing records (ids exactly,
router probabilities 1e-5) from the forward-only log-prob pass.

The single process in a world of its own, then every layout of 2 processes in turn in ONE world
of 2 and every layout of 4 in ONE world of 4 (groups torn down between layouts); everything a
layout checks comes out of its turn in that world.
"""

from dataclasses import dataclass, field
from typing import Callable

import pytest
import torch

from megatron_rl.parallel.smoke_worker import (
    LayoutRun,
    compare,
    forward_backward,
    layout_groups,
    load_layout_model,
    merge_rank_results,
    random_sequences,
)
from megatron_rl.parallel.world import run_world
from megatron_rl.sections import ModelConfig, ParallelConfig

pytestmark = pytest.mark.parallel

MODEL = ModelConfig(vocab_size=256, num_layers=4, num_experts=8, moe_router_topk=2)
# 8 variable-length sequences: 4 micro-batches of 2 on one process, 2 per rank under DP=2.
SEQUENCES = random_sequences(8, MODEL.vocab_size, min_len=5, max_len=40, seed=0)
PROMPT_LENGTHS = [max(1, len(s) // 3) for s in SEQUENCES]

LAYOUTS = {
    "TP2+SP": (ParallelConfig(tensor_model_parallel_size=2), 2),
    "EP2 alltoall": (ParallelConfig(expert_model_parallel_size=2), 2),
    "EP2 allgather": (
        ParallelConfig(expert_model_parallel_size=2, moe_token_dispatcher_type="allgather"),
        2,
    ),
    "PP2": (ParallelConfig(pipeline_model_parallel_size=2), 2),
    "TP2+SP x EP2": (ParallelConfig(tensor_model_parallel_size=2, expert_model_parallel_size=2), 4),
    "TP2+SP x PP2": (ParallelConfig(tensor_model_parallel_size=2, pipeline_model_parallel_size=2), 4),
}


@dataclass
class CheckedRun(LayoutRun):
    """The smoke worker's run plus what these tests check in the same world."""

    prompt_lengths: list[int] = field(default_factory=list)
    """Prompt length of each sample, for the log-prob pass with routing records."""
    extra_check: Callable | None = None
    """Module-level ``fn(model, groups, run) -> dict`` run after loading, returned as ``extra``."""


def checked_layout_worker(run: CheckedRun) -> dict:
    """The smoke worker's forward + backward, after the log-prob pass and ``extra_check`` on
    the loaded model."""
    with layout_groups(run) as groups:
        model = load_layout_model(run)
        extra = run.extra_check(model, groups, run) if run.extra_check else {}
        logprob_pass = _logprob_pass(model, groups, run)
        return {**forward_backward(model, groups, run), "logprob_pass": logprob_pass, "extra": extra}


def layouts_worker(runs: dict[str, CheckedRun]) -> dict:
    """Every rank of one world: each layout of ``runs`` in turn, as :func:`checked_layout_worker`."""
    return {name: checked_layout_worker(run) for name, run in runs.items()}


def _logprob_pass(model, groups, run: CheckedRun) -> dict:
    """Per-sample response log-probs, entropies and routing records of this DP rank."""
    from megatron_rl.parallel.logprobs import compute_logprobs

    mine = list(range(groups.dp_rank, len(run.sequences), groups.dp_size))
    result = compute_logprobs(model, groups, [run.sequences[i] for i in mine], [run.prompt_lengths[i] for i in mine],
                              micro_batch_sequences=run.micro_batch_sequences, record_routing=True)
    out = {}
    for j, sample in enumerate(mine):
        lo, hi = int(result.cu_seqlens_S1[j]), int(result.cu_seqlens_S1[j + 1])
        rec = result.record.sample(j)
        out[sample] = {"logprobs": result.logprobs_T[lo:hi], "entropy": result.entropy_T[lo:hi],
                       "expert_ids": rec.expert_ids_TLK, "probs": rec.probs_TLK, "gates": rec.gates_TLK,
                       "layer_numbers": rec.layer_numbers}
    return out


def _merged(results: list[dict]) -> dict:
    """:func:`merge_rank_results` plus each sample's log-prob pass once, every rank's copy of
    it (``per_rank_logprob_pass``: the model-parallel ranks must agree) and each rank's ``extra``."""
    logprob_pass: dict[int, dict] = {}
    for res in results:
        for sample, value in res["logprob_pass"].items():
            logprob_pass.setdefault(sample, value)
    return {**merge_rank_results(results), "logprob_pass": logprob_pass,
            "per_rank_logprob_pass": [res["logprob_pass"] for res in results],
            "extra": [res["extra"] for res in results]}


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("layout") / "ckpt")


@pytest.fixture(scope="module")
def reference(checkpoint_dir):
    run = CheckedRun(
        model=MODEL,
        parallel=ParallelConfig(),
        checkpoint_dir=checkpoint_dir,
        sequences=SEQUENCES,
        prompt_lengths=PROMPT_LENGTHS,
        save_checkpoint=True,
        extra_check=reference_checks,
    )
    return _merged(run_world(checked_layout_worker, 1, run, timeout_s=300))


@pytest.fixture(scope="module")
def layout_results(checkpoint_dir, reference):
    results = {}
    for world in sorted({size for _, size in LAYOUTS.values()}):
        runs = {
            name: CheckedRun(
                model=MODEL,
                parallel=parallel,
                checkpoint_dir=checkpoint_dir,
                sequences=SEQUENCES,
                prompt_lengths=PROMPT_LENGTHS,
                extra_check=token_budget_pass,
            )
            for name, (parallel, size) in LAYOUTS.items() if size == world
        }
        per_rank = run_world(layouts_worker, world, runs, timeout_s=600)
        results.update({name: _merged([rank[name] for rank in per_rank]) for name in runs})
    return results


def test_reference_is_not_degenerate(reference):
    assert sorted(reference["samples"]) == list(range(len(SEQUENCES)))
    for i, seq in enumerate(SEQUENCES):
        logits = reference["samples"][i]
        assert logits.shape == (seq.numel(), MODEL.vocab_size)
        assert torch.isfinite(logits).all() and logits.std() > 0
    assert set(reference["grads"]) == {f"router.{n}" for n in range(1, 5)} | {"output_layer"}
    for name, grad in reference["grads"].items():
        assert torch.isfinite(grad).all() and grad.abs().sum() > 0, name


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_single_process(name, layout_results, reference):
    report = compare(layout_results[name], reference)
    assert report["logits_max_abs_diff"] <= 1e-5, report
    grads = {k: v for k, v in report.items() if k.startswith("grad_rel_err")}
    assert len(grads) == 5
    assert max(grads.values()) <= 1e-4, report


def test_comparison_detects_a_wrong_weight(reference):
    """The tolerance check is not vacuous: a perturbed result fails it."""
    tampered = {
        "samples": {i: t + 1e-3 for i, t in reference["samples"].items()},
        "grads": {k: v * 1.01 for k, v in reference["grads"].items()},
    }
    report = compare(tampered, reference)
    assert report["logits_max_abs_diff"] > 1e-5
    assert min(v for k, v in report.items() if k.startswith("grad_rel_err")) > 1e-4


# ------------------------------------------------------------------ log-prob pass and records


def independent_reference_check(model, groups, run):
    """Runs in the single-process world: the log-prob pass against plain computations.

    Log-probs and entropies come from each sample run alone (no packing) with a full
    log-softmax; expert ids and probabilities from router logits captured by a forward
    hook on each router (hidden states times the router weight), softmax, top-K.
    """
    from megatron_rl.parallel.logprobs import compute_logprobs

    router_logits = {}
    hooks = []
    for layer in model.decoder.layers:
        def hook(module, inputs, output, number=layer.layer_number):
            hidden = inputs[0].reshape(-1, inputs[0].shape[-1]).float()
            router_logits.setdefault(number, []).append(hidden @ module.weight.float().t())

        hooks.append(layer.mlp.router.register_forward_hook(hook))
    result = compute_logprobs(
        model, groups, run.sequences, run.prompt_lengths,
        micro_batch_sequences=run.micro_batch_sequences, record_routing=True,
    )
    for handle in hooks:
        handle.remove()
    record = result.record
    routers_restored = all("routing" not in vars(layer.mlp.router) for layer in model.decoder.layers)

    lp_err, ent_err = 0.0, 0.0
    with torch.no_grad():
        for i, (seq, prompt) in enumerate(zip(run.sequences, run.prompt_lengths)):
            n = seq.numel()
            logits = model(
                input_ids=seq[None],
                position_ids=torch.arange(n)[None],
                attention_mask=torch.ones(n, n, dtype=torch.bool).triu(1)[None, None],
            )[0].double()
            logp = torch.log_softmax(logits, dim=-1)[prompt - 1 : n - 1]
            expected_lp = logp.gather(1, seq[prompt:, None])[:, 0]
            expected_ent = -(logp.exp() * logp).sum(-1)
            lo, hi = int(result.cu_seqlens_S1[i]), int(result.cu_seqlens_S1[i + 1])
            lp_err = max(lp_err, float((result.logprobs_T[lo:hi] - expected_lp).abs().max()))
            ent_err = max(ent_err, float((result.entropy_T[lo:hi] - expected_ent).abs().max()))

    # Router calls are padded micro-batch rows; keep the real tokens of each row.
    mb_tokens = []
    for start in range(0, len(run.sequences), run.micro_batch_sequences):
        chunk = run.sequences[start : start + run.micro_batch_sequences]
        mb_tokens.append(sum(s.numel() for s in chunk))
    ids_equal, prob_err, gate_err = True, 0.0, 0.0
    k = record.topk
    for column, number in enumerate(record.layer_numbers):
        logits_TE = torch.cat([call[:n] for call, n in zip(router_logits[number], mb_tokens)])
        probs_TE = torch.softmax(logits_TE.double(), dim=-1)
        top = probs_TE.topk(k, dim=-1)
        ids_equal &= bool((record.expert_ids_TLK[:, column].long() == top.indices).all())
        prob_err = max(prob_err, float((record.probs_TLK[:, column].double() - top.values).abs().max()))
        gates = top.values / top.values.sum(-1, keepdim=True)
        gate_err = max(gate_err, float((record.gates_TLK[:, column].double() - gates).abs().max()))
    return {
        "logprob_max_err": lp_err,
        "entropy_max_err": ent_err,
        "record_ids_equal_hooked_topk": ids_equal,
        "record_prob_max_err": prob_err,
        "record_gate_max_err": gate_err,
        "record_dtype": str(record.expert_ids_TLK.dtype),
        "record_shape": tuple(record.expert_ids_TLK.shape),
        "total_tokens": sum(s.numel() for s in run.sequences),
        "routers_restored": routers_restored,
    }


def test_logprob_pass_matches_independent_computation(reference):
    check = reference["extra"][0]
    assert check["logprob_max_err"] <= 1e-5, check
    assert check["entropy_max_err"] <= 1e-5, check


def test_record_matches_hooked_router_logits(reference):
    check = reference["extra"][0]
    assert check["record_ids_equal_hooked_topk"], check
    assert check["record_prob_max_err"] <= 1e-6, check
    assert check["record_gate_max_err"] <= 1e-6, check
    assert check["record_dtype"] == "torch.uint8"  # E = 8 fits the narrowest type
    assert check["record_shape"] == (check["total_tokens"], MODEL.num_layers, MODEL.moe_router_topk)
    assert check["routers_restored"], "the recorder left a wrapper on a router"


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_logprob_pass_and_record_match_single_process(name, layout_results, reference):
    actual, expected = layout_results[name]["logprob_pass"], reference["logprob_pass"]
    assert sorted(actual) == sorted(expected) == list(range(len(SEQUENCES)))
    for sample, ref in expected.items():
        got = actual[sample]
        assert got["layer_numbers"] == ref["layer_numbers"] == (1, 2, 3, 4)
        assert (got["logprobs"] - ref["logprobs"]).abs().max() <= 1e-5, (name, sample)
        assert (got["entropy"] - ref["entropy"]).abs().max() <= 1e-5, (name, sample)
        assert torch.equal(got["expert_ids"], ref["expert_ids"]), (name, sample)
        assert (got["probs"] - ref["probs"]).abs().max() <= 1e-5, (name, sample)
        assert (got["gates"] - ref["gates"]).abs().max() <= 1e-5, (name, sample)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_every_model_parallel_rank_returns_the_same_outputs(name, layout_results):
    per_rank = layout_results[name]["per_rank_logprob_pass"]
    by_sample = {}
    for rank_result in per_rank:
        for sample, value in rank_result.items():
            by_sample.setdefault(sample, []).append(value)
    parallel, _ = LAYOUTS[name]
    copies = parallel.model_parallel_size  # TP x PP ranks share one data-parallel shard
    for sample, values in by_sample.items():
        assert len(values) == copies, (sample, len(values))
        for other in values[1:]:
            for key in ("logprobs", "entropy", "expert_ids", "probs", "gates"):
                assert torch.equal(other[key], values[0][key]), (name, sample, key)


# ------------------------------------------------------------------ THD packing


BUDGET = 64  # tokens per micro-batch: the 8 samples (5-40 tokens) are re-packed, in another order
PERTURBED = 3  # the sample whose tokens the isolation check replaces


def reference_checks(model, groups, run):
    """Everything the single-process world checks beyond the layouts' common work."""
    return {**independent_reference_check(model, groups, run), **packing_isolation_check(model, groups, run),
            **token_budget_pass(model, groups, run)}


def token_budget_pass(model, groups, run):
    """Per-sample log-prob pass outputs with token-budget micro-batches, on every DP rank."""
    from megatron_rl.parallel.logprobs import compute_logprobs, pack_for_rank

    mine = list(range(groups.dp_rank, len(run.sequences), groups.dp_size))
    sequences = [run.sequences[i] for i in mine]
    result = compute_logprobs(model, groups, sequences, [run.prompt_lengths[i] for i in mine],
                              micro_batch_tokens=BUDGET, record_routing=True)
    plan = [mb.sample_ids.tolist() for mb in pack_for_rank(sequences, groups, 0, max_tokens=BUDGET)]
    # Uneven ranks: DP rank 1 keeps one sample, so it runs padding-only rows while rank 0
    # works through its micro-batches (expert dispatch still pairs every forward).
    few = mine[:1] if groups.dp_rank == 1 else mine
    uneven = compute_logprobs(model, groups, [run.sequences[i] for i in few], [run.prompt_lengths[i] for i in few],
                              micro_batch_tokens=BUDGET, record_routing=True)
    uneven_plan = [mb.sample_ids.tolist() for mb in pack_for_rank([run.sequences[i] for i in few], groups, 0,
                                                                  max_tokens=BUDGET)]
    return {"budget_pass": _per_sample(result, mine), "budget_plan": plan,
            "uneven_pass": _per_sample(uneven, few), "uneven_plan": uneven_plan}


def _per_sample(result, samples):
    out = {}
    for j, sample in enumerate(samples):
        lo, hi = int(result.cu_seqlens_S1[j]), int(result.cu_seqlens_S1[j + 1])
        rec = result.record.sample(j)
        out[sample] = {"logprobs": result.logprobs_T[lo:hi], "expert_ids": rec.expert_ids_TLK,
                       "probs": rec.probs_TLK}
    return out


def packing_isolation_check(model, groups, run):
    """Replace one sample's tokens inside a packed micro-batch of all samples; what moves?

    Attention is the only operation that mixes tokens, and it runs per segment. Under
    routing replay of the unperturbed routes every tensor shape (expert GEMM row counts
    included) is the same in both passes, so every other sample must come out bit for bit
    equal. Without replay the perturbed sample may send a different number of tokens to an
    expert; CPU GEMMs choose their blocking by row count, so other samples' expert outputs
    may move by float rounding, while their routes stay those of the unperturbed pass.
    """
    from pathlib import Path

    from megatron_rl.parallel.checkpoint import load_model
    from megatron_rl.parallel.logprobs import compute_logprobs
    from megatron_rl.parallel.model import build_model

    replaying = build_model(run.model, run.parallel, moe_enable_routing_replay=True)
    load_model(replaying, Path(run.checkpoint_dir))
    gen = torch.Generator().manual_seed(7)
    perturbed = list(run.sequences)
    perturbed[PERTURBED] = torch.randint(0, run.model.vocab_size, run.sequences[PERTURBED].shape, generator=gen)
    one_micro_batch = {"micro_batch_sequences": len(run.sequences), "record_routing": True}

    def run_pass(m, sequences, **kwargs):
        return compute_logprobs(m, groups, sequences, run.prompt_lengths, **one_micro_batch, **kwargs)

    base = run_pass(model, run.sequences)
    moved = run_pass(model, perturbed)
    ids, columns = base.record.expert_ids_TLK, base.record.layer_numbers
    base_replayed = run_pass(replaying, run.sequences, replay_ids_TLK=ids, replay_layer_numbers=columns)
    moved_replayed = run_pass(replaying, perturbed, replay_ids_TLK=ids, replay_layer_numbers=columns)

    def per_sample(result):
        out = []
        for i in range(len(run.sequences)):
            lo, hi = int(result.cu_seqlens_S1[i]), int(result.cu_seqlens_S1[i + 1])
            rec = result.record.sample(i)
            out.append((result.logprobs_T[lo:hi], result.entropy_T[lo:hi], rec.expert_ids_TLK, rec.probs_TLK))
        return out

    def compare(a, b):
        others = [i for i in range(len(run.sequences)) if i != PERTURBED]
        pa, pb = per_sample(a), per_sample(b)
        return {
            "others_bitwise_equal": all(all(torch.equal(x, y) for x, y in zip(pa[i], pb[i])) for i in others),
            "others_ids_equal": all(torch.equal(pa[i][2], pb[i][2]) for i in others),
            "others_logprob_max_diff": max(float((pa[i][0] - pb[i][0]).abs().max()) for i in others),
            "perturbed_changed": not torch.equal(pa[PERTURBED][0], pb[PERTURBED][0]),
        }

    return {"isolation_natural": compare(base, moved), "isolation_replayed": compare(base_replayed, moved_replayed)}


def test_perturbing_one_packed_sample_changes_no_other_sample(reference):
    replayed = reference["extra"][0]["isolation_replayed"]
    assert replayed["perturbed_changed"], replayed
    assert replayed["others_bitwise_equal"], replayed  # exact by construction
    natural = reference["extra"][0]["isolation_natural"]
    assert natural["perturbed_changed"] and natural["others_ids_equal"], natural
    assert natural["others_logprob_max_diff"] <= 1e-6, natural


@pytest.mark.parametrize("name", ["single process", *LAYOUTS])
def test_token_budget_packing_gives_the_same_per_sample_outputs(name, layout_results, reference):
    result = reference if name == "single process" else layout_results[name]
    actual = {}
    for extra in result["extra"]:
        actual.update(extra["budget_pass"])
    expected = reference["logprob_pass"]
    assert sorted(actual) == list(range(len(SEQUENCES)))
    for sample, ref in expected.items():
        got = actual[sample]
        assert (got["logprobs"] - ref["logprobs"]).abs().max() <= 1e-5, (name, sample)
        assert torch.equal(got["expert_ids"], ref["expert_ids"]), (name, sample)
        assert (got["probs"] - ref["probs"]).abs().max() <= 1e-5, (name, sample)
    uneven = {}
    for extra in result["extra"]:
        uneven.update(extra["uneven_pass"])
    for sample, got in uneven.items():
        ref = expected[sample]
        assert (got["logprobs"] - ref["logprobs"]).abs().max() <= 1e-5, (name, "uneven", sample)
        assert torch.equal(got["expert_ids"], ref["expert_ids"]), (name, "uneven", sample)
    if name in ("EP2 alltoall", "EP2 allgather", "TP2+SP x EP2"):  # data-parallel layouts
        assert any(plan.count([]) > 0 for plan in (e["uneven_plan"] for e in result["extra"]))
    plans = [extra["budget_plan"] for extra in result["extra"]]
    assert all(len(plan) >= 2 for plan in plans)
    if name == "single process":  # the planner re-orders: results still come back per sample
        assert any(mb != list(range(mb[0], mb[0] + len(mb))) for plan in plans for mb in plan if mb)
