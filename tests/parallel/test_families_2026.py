"""GPT-OSS, Qwen3-Next and Qwen3.5-MoE: conversion, parity with transformers in every layout the
family allows, the RL step under R2 / R3 with RSPO, and the hf engine, on the tiny checkpoints
``tools/make_tiny_family_checkpoint.py`` writes (held-out dims: 48 wide, 12- and 16-channel
heads, 8 experts of width 24; Qwen3-Next's and Qwen3.5's with MTP tensors, Qwen3.5's with a
vision tower, both kept aside).

Shown here (fp32): HF -> Megatron -> HF is byte for byte, the vision tower and MTP tensors
included; log-probs within 1e-4 of transformers, the same top-K experts per layer in order and
router probabilities within 1e-5 in TP1, TP2+SP, EP2, PP2 (also streamed from
the HF directory, the trainer's start), the product TP2+SP x EP2 (experts over the TP ranks)
and, for GPT-OSS, CP2 and CP2 x EP2 (Gated DeltaNet layers refuse CP before any process starts); one RSPO step under each replay plan gives the
single-process loss and router gradients within 1e-5 relative in every layout (R2 and R3 under
RSPO; the routers changed after the old-policy pass, so replay and natural routing differ); the hf engine
samples with log-probs within its stated tolerance of the trainer's pass (1e-4, as for every
family) and the same experts at 99% of the token-layer pairs at least (transformers' router may
break a near-tie the other way); a truncated checkpoint of each family is
refused naming the file, a family tensor one row short or missing naming the tensor; GPT-OSS's MXFP4 checkpoint converts to exactly the weights of its
dequantized bf16 twin.

Conversion runs in this process through the command lines; TP1 (parity, the hf engine, the
reference RL step) in ONE spawned world of 1, every other layout in ONE spawned world of 2.
"""

import hashlib
import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import torch

from megatron_rl.checkpoint.cli import hf_to_megatron_main, megatron_to_hf_main
from megatron_rl.checkpoint.hf_source import inspect_hf_checkpoint
from megatron_rl.checkpoint.parity import ParityTolerances, compare, hf_reference, random_prompts
from megatron_rl.parallel.smoke_worker import random_sequences, relative_error
from megatron_rl.parallel.world import run_world
from megatron_rl.sections import ParallelConfig

pytestmark = pytest.mark.parallel

MAKER_PATH = Path(__file__).resolve().parents[2] / "tools" / "make_tiny_family_checkpoint.py"
_spec = importlib.util.spec_from_file_location("make_tiny_family_checkpoint", MAKER_PATH)
maker = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(maker)

FAMILIES = ["gpt_oss", "qwen3_next", "qwen3_5_moe"]
VOCAB = 256
LAYOUTS = {
    "TP2+SP": ParallelConfig(tensor_model_parallel_size=2),
    "EP2": ParallelConfig(expert_model_parallel_size=2),
    "PP2": ParallelConfig(pipeline_model_parallel_size=2),
    "CP2": ParallelConfig(context_parallel_size=2),
    # Products in the same 2 processes: the experts split over the TP (or CP) ranks (ETP 1).
    "TP2+SP x EP2": ParallelConfig(tensor_model_parallel_size=2, expert_model_parallel_size=2),
    "CP2 x EP2": ParallelConfig(context_parallel_size=2, expert_model_parallel_size=2),
}
LAYOUTS_4 = {
    # Products with pipeline stages: a 4-process world.
    "TP2+SP x PP2": ParallelConfig(tensor_model_parallel_size=2, pipeline_model_parallel_size=2),
    "EP2 x PP2": ParallelConfig(expert_model_parallel_size=2, pipeline_model_parallel_size=2),
}
NO_CP = ["TP2+SP", "EP2", "PP2", "TP2+SP x EP2", *LAYOUTS_4]
ALLOWED = {"gpt_oss": [*LAYOUTS, *LAYOUTS_4], "qwen3_next": NO_CP, "qwen3_5_moe": NO_CP}
PROMPTS = [p[:n] for p, n in zip(random_prompts(4, 12, VOCAB, seed=5), (12, 7, 10, 5))]
TOLERANCES = ParityTolerances(logprob_max_abs=1e-4, topk_agreement_min=1.0, router_prob_max_abs=1e-5)
SEQUENCES = random_sequences(4, VOCAB, min_len=6, max_len=14, seed=3)
PROMPT_LENGTHS = [max(1, len(s) // 3) for s in SEQUENCES]
PLANS = ("R2", "R3")


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    dirs = {}
    for family in FAMILIES:
        dirs[family] = root / family
        maker.save(maker.build(family, vocab_size=VOCAB), family, dirs[family], max_shard_size="150KB")
    return dirs


@pytest.fixture(scope="module")
def references(hf_dirs):
    out = {}
    for family in FAMILIES:
        model = inspect_hf_checkpoint(hf_dirs[family]).model
        out[family] = hf_reference(hf_dirs[family], PROMPTS, model.moe_router_topk, model.moe_router_score_function)
    return out


@pytest.fixture(scope="module")
def tp1(hf_dirs, tmp_path_factory):
    """In this process, through the command lines: convert at TP1 and export back."""
    root = tmp_path_factory.mktemp("megatron")
    out = {}
    for family in FAMILIES:
        megatron, back = root / family, root / f"{family}-back"
        assert hf_to_megatron_main([str(hf_dirs[family]), str(megatron), "--no-progress"]) == 0
        assert megatron_to_hf_main([str(megatron), str(back), "--no-progress"]) == 0
        out[family] = {"megatron": str(megatron), "back": back}
    return out


def _advantages(sample: int) -> torch.Tensor:
    """Positive advantages: the loss is then about -1, not a near-cancelling sum whose relative error means nothing."""
    n = SEQUENCES[sample].numel() - PROMPT_LENGTHS[sample]
    return 0.5 + torch.rand(n, generator=torch.Generator().manual_seed(50 + sample))


def _rollout_routes(sample: int, layers: int, experts: int, topk: int) -> torch.Tensor:
    """Arbitrary valid experts per position in SGLang's layout ``[len - 1, L, K]``."""
    scores = torch.rand(SEQUENCES[sample].numel() - 1, layers, experts, generator=torch.Generator().manual_seed(9 + sample))
    return scores.topk(topk, dim=-1).indices.to(torch.int32)


def _rl_steps(model, groups) -> dict:
    """This rank's RSPO forward-backward under every routing plan, from the same weights after a
    router change: loss and router gradients by global layer number (tp rank 0)."""
    from megatron_rl.algos.presets import get_preset
    from megatron_rl.parallel.logprobs import compute_logprobs
    from megatron_rl.parallel.schedule import wrap_for_training
    from megatron_rl.parallel.train_step import RoutingPlan, TrainBatch, forward_backward

    ddp = wrap_for_training(model)
    mine = list(range(groups.dp_rank, len(SEQUENCES), groups.dp_size))
    sequences, prompts = [SEQUENCES[i] for i in mine], [PROMPT_LENGTHS[i] for i in mine]
    old = compute_logprobs(ddp, groups, sequences, prompts, micro_batch_sequences=2, record_routing=True)
    config = model.config
    for layer in model.decoder.layers:
        weight = layer.mlp.router.weight
        weight.data += 0.05 * torch.randn(weight.shape, generator=torch.Generator().manual_seed(layer.layer_number))
    out = {}
    for mode in PLANS:
        batch = TrainBatch(
            sequences=sequences, prompt_lengths=prompts, old_logprobs_T=old.logprobs_T,
            advantages_T=torch.cat([_advantages(i) for i in mine]), old_record=old.record,
            rollout_routes=[_rollout_routes(i, config.num_layers, config.num_moe_experts, config.moe_router_topk)
                            for i in mine],
        )
        result = forward_backward(ddp, groups, batch, get_preset("rspo"), RoutingPlan(mode=mode), micro_batch_sequences=2)
        grads = {f"router.{layer.layer_number}": layer.mlp.router.weight.main_grad.clone()
                 for layer in model.decoder.layers}
        out[mode] = {"loss": float(result.loss), "grads": grads if groups.tp_rank == 0 else {}}
    return out


def _engine_check(model, groups, source) -> dict:
    """The hf engine's samples against the trainer's log-prob pass over them."""
    from megatron_rl.parallel.logprobs import compute_logprobs
    from megatron_rl.rollout.engine import SamplingParams
    from megatron_rl.rollout.local.hf_engine import HFEngine

    engine = HFEngine(model, groups, architecture=source.architecture, model_config=source.model)
    prompts = [p.tolist() for p in PROMPTS]
    samples = engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=8), seed=3)
    sequences = [s.tokens for s in samples]
    mega = compute_logprobs(model, groups, sequences, [len(p) for p in prompts], record_routing=True)
    hf_lp = torch.cat([s.output_logprobs for s in samples])
    same = torch.cat([(s.routed_experts.long().sort(-1).values
                       == mega.record.sample(i).expert_ids_TLK[:-1].long().sort(-1).values).all(-1).flatten()
                      for i, s in enumerate(samples)])
    return {"logprob_diff": float((hf_lp - mega.logprobs_T).abs().max()), "route_agreement": float(same.double().mean()),
            "tokens": int(hf_lp.numel())}


def reference_worker(megatron_dirs: dict) -> dict:
    """One process: each family's parity outputs, hf engine check and RL step at TP1."""
    from megatron_rl.checkpoint.convert import read_export_source
    from megatron_rl.checkpoint.megatron_io import load_megatron_model_into
    from megatron_rl.checkpoint.parity import megatron_outputs
    from megatron_rl.parallel.cpu_platform import cpu_platform
    from megatron_rl.parallel.groups import model_parallel
    from megatron_rl.parallel.model import build_model

    out = {}
    with cpu_platform(), model_parallel(ParallelConfig(), seed=0) as groups:
        for family, directory in megatron_dirs.items():
            source = read_export_source(directory)
            model = build_model(source.model, ParallelConfig(), moe_enable_routing_replay=True)
            load_megatron_model_into(model, directory)
            out[("parity", "TP1", family)] = megatron_outputs(model, groups, PROMPTS)
            out[("engine", family)] = _engine_check(model, groups, source)
            out[("steps", family)] = _rl_steps(model, groups)
    return out


def layouts_worker(megatron_dirs: dict, hf_dirs: dict, layouts: dict) -> dict:
    """Every rank of a world: each of ``layouts`` in turn, each family it allows loaded resharded
    (parity outputs, then the RL steps); in PP2 also the trainer's start from the HF directory."""
    import torch.distributed as dist

    from megatron_rl.checkpoint.convert import read_export_source
    from megatron_rl.checkpoint.init_source import inspect_init_checkpoint
    from megatron_rl.checkpoint.megatron_io import load_megatron_model_into
    from megatron_rl.checkpoint.parity import megatron_outputs
    from megatron_rl.parallel.cpu_platform import cpu_platform
    from megatron_rl.parallel.groups import model_parallel
    from megatron_rl.parallel.model import build_model
    from megatron_rl.train.init_weights import load_initial_weights

    results = {}
    with cpu_platform():
        for layout, parallel in layouts.items():
            with model_parallel(parallel, seed=0) as groups:
                for family, directory in megatron_dirs.items():
                    if layout not in ALLOWED[family]:
                        continue
                    source = read_export_source(directory)
                    model = build_model(source.model, parallel, moe_enable_routing_replay=True)
                    load_megatron_model_into(model, directory)
                    results[("parity", layout, family)] = megatron_outputs(model, groups, PROMPTS)
                    results[("steps", layout, family)] = _rl_steps(model, groups)
                    if layout == "PP2":
                        init = inspect_init_checkpoint(hf_dirs[family])
                        gpt = build_model(init.hf.model, parallel)
                        load_initial_weights(gpt, init, init.hf.model, groups)
                        results[("parity", "trainer init", family)] = megatron_outputs(gpt, groups, PROMPTS)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, {k: v for k, v in results.items() if k[0] == "steps"})
    if dist.get_rank() != 0:
        return None
    for rank_steps in gathered[1:]:
        for key, steps in rank_steps.items():
            for mode, got in steps.items():
                results[key][mode]["grads"] = {**got["grads"], **results[key][mode]["grads"]}
                results[key][mode].setdefault("losses", [results[key][mode]["loss"]]).append(got["loss"])
    return results


@pytest.fixture(scope="module")
def reference(tp1):
    return run_world(reference_worker, 1, {f: tp1[f]["megatron"] for f in FAMILIES}, timeout_s=900)[0]


@pytest.fixture(scope="module")
def layouts(tp1, hf_dirs):
    megatron_dirs = {f: tp1[f]["megatron"] for f in FAMILIES}
    hf = {f: str(d) for f, d in hf_dirs.items()}
    two = run_world(layouts_worker, 2, megatron_dirs, hf, LAYOUTS, timeout_s=900)[0]
    four = run_world(layouts_worker, 4, megatron_dirs, hf, LAYOUTS_4, timeout_s=900)[0]
    return {**two, **four}


@pytest.mark.parametrize("family", FAMILIES)
def test_round_trip_is_bit_exact_kept_tensors_included(family, hf_dirs, tp1):
    original, back = hf_dirs[family], tp1[family]["back"]
    files = sorted(p.name for p in original.iterdir())
    assert sorted(p.name for p in back.iterdir()) == files
    for name in files:
        digest = [hashlib.sha256((d / name).read_bytes()).hexdigest() for d in (original, back)]
        assert digest[0] == digest[1], name
    kept = json.loads((Path(tp1[family]["megatron"]) / "conversion.json").read_text())["hf_passthrough"]
    names = json.loads((original / "model.safetensors.index.json").read_text())["weight_map"]
    assert kept == sorted(n for n in names if n.startswith(("mtp.", "model.visual.")))
    assert (family == "gpt_oss") == (not kept)


@pytest.mark.parametrize("layout", ["TP1", *LAYOUTS, *LAYOUTS_4, "trainer init"])
@pytest.mark.parametrize("family", FAMILIES)
def test_layout_matches_transformers(family, layout, layouts, reference, references):
    if layout in {**LAYOUTS, **LAYOUTS_4} and layout not in ALLOWED[family]:
        pytest.skip(f"{family} refuses {layout} before any process starts (tests/unit/test_family_rules_2026.py)")
    outputs = reference if layout == "TP1" else layouts
    report = compare(references[family], outputs[("parity", layout, family)])
    print(f"{family} {layout}: log-prob {report.logprob_max_abs_diff:.2e}, router {report.router_prob_max_abs_diff:.2e}")
    assert report.violations(TOLERANCES) == [], report
    assert report.topk_ids_identical


@pytest.mark.parametrize("family", FAMILIES)
def test_rl_step_is_layout_invariant(family, layouts, reference):
    ref = reference[("steps", family)]
    for mode in PLANS:
        assert all(g.abs().sum() > 0 for g in ref[mode]["grads"].values()), (family, mode)
        for layout in ALLOWED[family]:
            got = layouts[("steps", layout, family)][mode]
            for loss in got["losses"]:
                assert abs(loss - ref[mode]["loss"]) <= 1e-5 * max(1e-3, abs(ref[mode]["loss"])), (family, layout, mode)
            assert set(got["grads"]) == set(ref[mode]["grads"]), (family, layout, mode)
            worst = max(relative_error(got["grads"][k], g) for k, g in ref[mode]["grads"].items())
            print(f"{family} {layout} {mode}: router gradients within {worst:.1e} relative")
            assert worst <= 1e-5, (family, layout, mode, worst)
    assert ref["R2"]["loss"] != ref["R3"]["loss"]  # the plans dispatch different experts


@pytest.mark.parametrize("family", FAMILIES)
def test_hf_engine_samples_match_the_trainer(family, reference):
    check = reference[("engine", family)]
    print(f"{family} hf engine: log-prob max |diff| {check['logprob_diff']:.2e} over {check['tokens']} tokens, "
          f"routes agree {check['route_agreement']:.4f}")
    # transformers' own router decides near-ties (K-th vs (K+1)-th probability) differently at times.
    assert check["tokens"] == 4 * 8 and check["route_agreement"] >= 0.99
    assert check["logprob_diff"] <= 1e-4, check


@pytest.mark.parametrize("family", FAMILIES)
def test_truncated_checkpoint_is_refused_naming_the_file(family, hf_dirs, tmp_path, capsys):
    damaged = shutil.copytree(hf_dirs[family], tmp_path / "damaged")
    shard = sorted(damaged.glob("*.safetensors"))[-1]
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    assert hf_to_megatron_main([str(damaged), str(tmp_path / "out"), "--no-progress"]) == 2
    assert shard.name in capsys.readouterr().err and not (tmp_path / "out").exists()


FAMILY_TENSOR = {"gpt_oss": "model.layers.0.self_attn.sinks", "qwen3_next": "model.layers.0.linear_attn.conv1d.weight",
                 "qwen3_5_moe": "model.language_model.layers.0.linear_attn.in_proj_z.weight"}
"""A tensor only the family has (a sink, a Gated DeltaNet convolution or gate projection)."""


@pytest.mark.parametrize("damage", ["one row short", "missing"])
@pytest.mark.parametrize("family", FAMILIES)
def test_a_damaged_family_tensor_is_refused_naming_it(family, damage, hf_dirs, tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    damaged, name = shutil.copytree(hf_dirs[family], tmp_path / "damaged"), FAMILY_TENSOR[family]
    index_path = damaged / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    shard = damaged / index["weight_map"][name]
    tensors = load_file(shard)
    if damage == "missing":
        del tensors[name], index["weight_map"][name]
        index_path.write_text(json.dumps(index))
    else:
        tensors[name] = tensors[name][:-1].contiguous()
    save_file(tensors, shard, metadata={"format": "pt"})
    assert hf_to_megatron_main([str(damaged), str(tmp_path / "out"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert name in err and ("missing tensors" if damage == "missing" else "the config implies") in err, err
    assert not (tmp_path / "out").exists()


def test_mxfp4_checkpoint_converts_to_its_dequantized_twin(tmp_path):
    """GPT-OSS's released format: the experts as MXFP4 blocks and scales, dequantized on load and
    exported in bf16: the export is, tensor for tensor, what transformers' own
    ``convert_moe_packed_tensors`` makes of them, and its config the same without
    ``quantization_config``."""
    from safetensors.torch import load_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    mx = tmp_path / "mxfp4"
    maker.save(maker.build("gpt_oss", vocab_size=VOCAB, mxfp4=True), "gpt_oss", mx, mxfp4=True)
    tensors = load_file(mx / "model.safetensors")
    for name in [n for n in tensors if n.endswith("_blocks")]:
        base = name.removesuffix("_blocks")
        tensors[base] = convert_moe_packed_tensors(tensors.pop(name), tensors.pop(base + "_scales"))
    config = json.loads((mx / "config.json").read_text())
    del config["quantization_config"]
    assert hf_to_megatron_main([str(mx), str(tmp_path / "megatron"), "--no-progress"]) == 0
    assert megatron_to_hf_main([str(tmp_path / "megatron"), str(tmp_path / "back"), "--no-progress"]) == 0
    exported = load_file(tmp_path / "back" / "model.safetensors")
    assert sorted(exported) == sorted(tensors) and all(torch.equal(exported[n], tensors[n]) for n in tensors)
    assert json.loads((tmp_path / "back" / "config.json").read_text()) == config
