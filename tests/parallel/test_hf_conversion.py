"""HF <-> Megatron conversion of tiny Qwen3-MoE and Mixtral models built with transformers.

Shown here: HF -> Megatron -> HF is byte-for-byte identical (every shard, the index, the
config) whether the Megatron checkpoint was written under TP1 or TP2+SP x EP2; the
Megatron model's log-probs match transformers' forward within 1e-4 (fp32) with identical
top-K experts and router probabilities within 1e-5 in both layouts; a parity check
catches experts in the wrong layout; malformed checkpoints are rejected by name with
nothing written; the FP8 export meets the e4m3 block-wise bound and its config loads in
transformers.

One spawned gloo world of 4 processes runs TP2+SP x EP2 (convert, load, log-prob pass);
everything at TP1 goes through the command lines in this process (a world of one).
"""

import hashlib
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_rl.checkpoint.cli import (
    export_fp8_main,
    hf_to_megatron_main,
    megatron_to_hf_main,
    parity_main,
)
from megatron_rl.checkpoint.convert import (
    convert_hf_to_megatron,
    convert_megatron_to_hf,
)
from megatron_rl.checkpoint.errors import CheckpointMismatchError
from megatron_rl.checkpoint.fp8 import SCALE_SUFFIX, dequantize_blockwise, error_bound
from megatron_rl.checkpoint.hf_io import INDEX_NAME, HFCheckpoint, staging_dir
from megatron_rl.checkpoint.parity import (
    ParityTolerances,
    compare,
    hf_reference,
    random_prompts,
)
from megatron_rl.parallel.world import run_world
from megatron_rl.sections import ParallelConfig

pytestmark = pytest.mark.parallel

ARCHS = ["qwen3_moe", "mixtral"]
LAYOUTS = ["TP1", "TP2+SP x EP2"]
# The TP2+SP x EP2 checkpoint is also exported with the HF directory as the config source.
EXPORTS = [*LAYOUTS, "TP2+SP x EP2 --hf-config"]
TP2_EP2 = ParallelConfig(tensor_model_parallel_size=2, expert_model_parallel_size=2)
PROMPTS = [p[:n] for p, n in zip(random_prompts(4, 12, 256, seed=3), (12, 7, 10, 5))]
TOLERANCES = ParityTolerances(logprob_max_abs=1e-4, topk_agreement_min=1.0, router_prob_max_abs=1e-5)


def _tiny_hf_model(arch: str):
    from transformers import (
        MixtralConfig,
        MixtralForCausalLM,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )

    common = dict(
        vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, num_experts_per_tok=2, tie_word_embeddings=False, rope_theta=1e6, rms_norm_eps=1e-6,
        max_position_embeddings=512, initializer_range=0.1,
    )
    if arch == "qwen3_moe":
        config = Qwen3MoeConfig(
            **common, intermediate_size=128, moe_intermediate_size=32, num_experts=8,
            decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True,
        )
        model = Qwen3MoeForCausalLM(config)
    else:
        config = MixtralConfig(**common, intermediate_size=32, num_local_experts=8, sliding_window=None)
        model = MixtralForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 1:
                # Norm weights other than ones: swapping two norms must change the output.
                param.copy_(1 + 0.2 * torch.randn_like(param))
            elif name.endswith("gate.weight"):
                # A trained router is decisive; near-ties would make top-K a coin toss.
                param.mul_(10)
    return model.float()


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    torch.manual_seed(0)
    dirs = {}
    for arch in ARCHS:
        dirs[arch] = root / arch
        _tiny_hf_model(arch).save_pretrained(dirs[arch], max_shard_size="50KB")
    return dirs


@pytest.fixture(scope="module")
def references(hf_dirs):
    return {arch: hf_reference(hf_dirs[arch], PROMPTS, topk=2) for arch in ARCHS}


@dataclass
class Job:
    """One architecture's paths (picklable)."""

    arch: str
    hf_dir: str
    tp1_dir: str
    tp2ep2_dir: str
    back_dir: str


@pytest.fixture(scope="module")
def jobs(hf_dirs, tmp_path_factory):
    root = tmp_path_factory.mktemp("megatron")
    paths = {arch: [str(root / f"{arch}-{kind}") for kind in ("tp1", "tp2ep2", "back")] for arch in ARCHS}
    return [Job(arch, str(hf_dirs[arch]), *paths[arch]) for arch in ARCHS]


def tp2ep2_worker(jobs: list[Job]) -> dict:
    """Every rank: convert at TP2+SP x EP2, load the result into that layout, run the log-prob pass."""
    import torch.distributed as dist

    from megatron_rl.checkpoint.convert import (
        hf_to_megatron_world_entry,
        read_export_source,
    )
    from megatron_rl.checkpoint.megatron_io import load_megatron_model
    from megatron_rl.checkpoint.parity import megatron_outputs
    from megatron_rl.parallel.cpu_platform import cpu_platform
    from megatron_rl.parallel.groups import model_parallel

    for job in jobs:
        hf_to_megatron_world_entry(job.hf_dir, job.tp2ep2_dir, TP2_EP2, False)
    result = {"rank": dist.get_rank(), "outputs": {}}
    with cpu_platform(), model_parallel(TP2_EP2, seed=0) as groups:
        for job in jobs:
            source = read_export_source(job.tp2ep2_dir)
            model = load_megatron_model(source.arch, source.model, TP2_EP2, job.tp2ep2_dir)
            result["outputs"][job.arch] = megatron_outputs(model, groups, PROMPTS)
            layer = model.decoder.layers[0]
            result["layout"] = {
                "tp": (groups.tp_rank, groups.tp_size), "ep": (groups.ep_rank, groups.ep_size),
                "experts": list(layer.mlp.local_expert_indices),
                "qkv_rows": layer.self_attention.linear_qkv.weight.shape[0],
                "sequence_parallel": model.config.sequence_parallel,
            }
    return result


@pytest.fixture(scope="module")
def tp2ep2(jobs):
    return run_world(tp2ep2_worker, 4, jobs, timeout_s=300)


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "prompts.json"
    path.write_text(json.dumps([p.tolist() for p in PROMPTS]))
    return path


@pytest.fixture(scope="module")
def tp1(jobs, tp2ep2, prompts_file):
    """In this process, through the command lines: convert at TP1, export both layouts back, check parity."""
    reports = {}
    for job in jobs:
        assert hf_to_megatron_main([job.hf_dir, job.tp1_dir, "--no-progress"]) == 0
        for layout, directory in (("TP1", job.tp1_dir), ("TP2+SP x EP2", job.tp2ep2_dir)):
            assert megatron_to_hf_main([directory, f"{job.back_dir}-{layout}", "--no-progress"]) == 0
        out = f"{job.back_dir}-{EXPORTS[2]}"
        assert megatron_to_hf_main([job.tp2ep2_dir, out, "--hf-config", job.hf_dir, "--no-progress"]) == 0
        out = f"{job.back_dir}-resharded"
        assert megatron_to_hf_main([job.tp1_dir, out, "--max-shard-size", "200KB", "--no-progress"]) == 0
        report_path = Path(job.back_dir + "-parity.json")
        args = ["--hf", job.hf_dir, "--megatron", job.tp1_dir, "--prompts", str(prompts_file)]
        code = parity_main([*args, "--json", str(report_path)])
        reports[job.arch] = (code, json.loads(report_path.read_text()))
    return reports


# ------------------------------------------------------------------ round trip


@pytest.mark.parametrize("layout", EXPORTS)
@pytest.mark.parametrize("arch", ARCHS)
def test_round_trip_is_bit_exact(arch, layout, hf_dirs, jobs, tp1):
    original = hf_dirs[arch]
    back = Path(f"{jobs[ARCHS.index(arch)].back_dir}-{layout}")
    files = sorted(p.name for p in original.iterdir())
    assert sorted(p.name for p in back.iterdir()) == files
    assert json.loads((back / INDEX_NAME).read_text()) == json.loads((original / INDEX_NAME).read_text())
    source, exported = HFCheckpoint(original), HFCheckpoint(back)
    assert exported.names() == source.names() and len(source.names()) > 50
    for name in source.names():
        assert torch.equal(exported.get(name), source.get(name)), name
    for name in files:
        digest = [hashlib.sha256((d / name).read_bytes()).hexdigest() for d in (original, back)]
        assert digest[0] == digest[1], name


@pytest.mark.parametrize("arch", ARCHS)
def test_export_can_reshard_by_size(arch, hf_dirs, jobs, tp1):
    original = HFCheckpoint(hf_dirs[arch])
    resharded = HFCheckpoint(f"{jobs[ARCHS.index(arch)].back_dir}-resharded")
    sizes = {}
    for name, file in resharded.weight_map.items():
        sizes[file] = sizes.get(file, 0) + resharded.get(name).numel() * 4
    assert len(sizes) == 4 and max(sizes.values()) <= 200_000  # 630 KB in 200 KB shards
    assert sorted(resharded.names()) == sorted(original.names())
    assert all(torch.equal(resharded.get(n), original.get(n)) for n in original.names())


# ------------------------------------------------------------------ parity with transformers


def _check_report(report: dict, label: str) -> None:
    print(f"\n{label}: {json.dumps(report)}")
    assert report["num_scored_tokens"] == sum(len(p) - 1 for p in PROMPTS)
    assert report["num_positions"] == sum(len(p) for p in PROMPTS)
    assert report["logprob_max_abs_diff"] <= 1e-4
    assert report["topk_ids_identical"] and report["topk_agreement_per_layer"] == [1.0, 1.0]
    assert report["router_prob_max_abs_diff"] <= 1e-5


@pytest.mark.parametrize("arch", ARCHS)
def test_parity_tool_passes_at_tp1(arch, tp1):
    code, report = tp1[arch]
    _check_report(report, f"{arch} TP1")
    assert code == 0 and report["violations"] == []


@pytest.mark.parametrize("arch", ARCHS)
def test_megatron_matches_transformers_at_tp2_sp_ep2(arch, references, tp2ep2):
    report = compare(references[arch], tp2ep2[0]["outputs"][arch])
    _check_report(report.to_dict(), f"{arch} TP2+SP x EP2")
    assert report.violations(TOLERANCES) == []


def test_every_rank_of_the_layout_returns_the_same_outputs(tp2ep2):
    for arch in ARCHS:
        first = tp2ep2[0]["outputs"][arch]
        for other in tp2ep2[1:]:
            for a, b in zip(first, other["outputs"][arch]):
                assert torch.equal(a.logprobs_N1, b.logprobs_N1)
                assert torch.equal(a.expert_ids_NLK, b.expert_ids_NLK)


def test_the_layout_was_really_tp2_sp_ep2(tp2ep2):
    layouts = [r["layout"] for r in sorted(tp2ep2, key=lambda r: r["rank"])]
    assert {lay["tp"][1] for lay in layouts} == {2} and {lay["ep"][1] for lay in layouts} == {2}
    assert all(lay["sequence_parallel"] for lay in layouts)
    assert all(lay["qkv_rows"] == 64 for lay in layouts)  # half of (4 + 2 + 2) heads x 16
    assert {tuple(lay["experts"]) for lay in layouts} == {(0, 1, 2, 3), (4, 5, 6, 7)}


def test_routing_is_decisive(references):
    """Top-K equality is meaningful only if no token sits on a near-tie."""
    for outputs in references.values():
        for out in outputs:
            top = out.router_probs_NLE.double().topk(3, dim=-1).values.log()
            assert (top[..., 1] - top[..., 2]).min() > 1e-2


def _swap_gate_and_up(tensors):
    """The silent-converter bug: layer 1's experts with their SwiGLU halves exchanged."""
    for expert in range(8):
        gate, up = (f"model.layers.1.mlp.experts.{expert}.{p}_proj.weight" for p in ("gate", "up"))
        if gate in tensors and up in tensors:
            tensors[gate], tensors[up] = tensors[up], tensors[gate]


def test_parity_tool_fails_on_experts_in_the_wrong_layout(hf_dirs, prompts_file, tmp_path):
    buggy = tmp_path / "buggy-hf"
    shutil.copytree(hf_dirs["qwen3_moe"], buggy)
    _tamper_all_shards(buggy, _swap_gate_and_up)
    assert hf_to_megatron_main([str(buggy), str(tmp_path / "buggy-mc"), "--no-progress"]) == 0
    report_path = tmp_path / "report.json"
    code = parity_main(
        ["--hf", str(hf_dirs["qwen3_moe"]), "--megatron", str(tmp_path / "buggy-mc"),
         "--prompts", str(prompts_file), "--json", str(report_path)]
    )
    report = json.loads(report_path.read_text())
    assert code == 1 and report["logprob_max_abs_diff"] > 1e-2
    assert any(v.startswith("log-prob max abs diff") for v in report["violations"])


# ------------------------------------------------------------------ rejection, nothing written


def _tamper_all_shards(directory: Path, edit) -> None:
    """Apply ``edit(tensors)`` to all tensors at once and rewrite every shard (same layout)."""
    index = json.loads((directory / INDEX_NAME).read_text())
    files = sorted(set(index["weight_map"].values()))
    tensors = {name: t for f in files for name, t in load_file(directory / f).items()}
    edit(tensors)
    for f in files:
        shard = {n: tensors[n] for n, g in index["weight_map"].items() if g == f}
        save_file(shard, str(directory / f), metadata={"format": "pt"})


def _tamper_shard(directory: Path, edit, key: str = "mlp.experts.5.up_proj") -> None:
    """Apply ``edit(tensors)`` to the shard holding layer 1's ``key`` tensor and refresh the index."""
    index_path = directory / INDEX_NAME
    index = json.loads(index_path.read_text())
    shard = index["weight_map"][f"model.layers.1.{key}.weight"]
    tensors = load_file(directory / shard)
    edit(tensors)
    save_file(tensors, str(directory / shard), metadata={"format": "pt"})
    kept = {n: f for n, f in index["weight_map"].items() if f != shard}
    index["weight_map"] = kept | {n: shard for n in tensors}
    index_path.write_text(json.dumps(index))


def _drop_expert(tensors):
    del tensors["model.layers.1.mlp.experts.5.up_proj.weight"]


def _add_unknown(tensors):
    tensors["model.layers.1.mlp.shared_expert_gate.weight"] = torch.zeros(1, 64)


def _reshape(tensors):
    tensors["model.layers.1.mlp.experts.5.up_proj.weight"] = torch.zeros(31, 64)


def _fewer_experts_in_config(directory: Path) -> None:
    config = json.loads((directory / "config.json").read_text())
    config["num_local_experts"] = 6
    (directory / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize(
    "tamper, message",
    [
        (lambda d: _tamper_shard(d, _drop_expert), "missing tensors: model.layers.1.mlp.experts.5.up_proj"),
        (lambda d: _tamper_shard(d, _add_unknown), "unknown tensors .*model.layers.1.mlp.shared_expert_gate"),
        (
            lambda d: _tamper_shard(d, _reshape),
            r"model.layers.1.mlp.experts.5.up_proj.weight has shape \(31, 64\), the config implies \(32, 64\)",
        ),
        (_fewer_experts_in_config, "num_local_experts=6 disagrees with the checkpoint, whose layers all hold 8"),
    ],
    ids=["missing expert", "unknown tensor", "wrong shape", "config expert count"],
)
def test_malformed_checkpoints_are_rejected_and_nothing_is_written(tamper, message, hf_dirs, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(hf_dirs["qwen3_moe"], bad)
    tamper(bad)
    out = tmp_path / "out"
    with pytest.raises(CheckpointMismatchError, match=message):
        convert_hf_to_megatron(bad, out, progress=False)
    assert not out.exists() and not staging_dir(out).exists()


def test_a_conversion_failing_mid_write_leaves_nothing(hf_dirs, tmp_path, monkeypatch):
    from megatron_rl.checkpoint import megatron_io

    real_save = megatron_io.save_model

    def save_then_fail(model, directory):
        real_save(model, directory)
        assert any(Path(directory).glob("*.distcp"))  # real shards are on disk at this point
        raise OSError("disk full")

    monkeypatch.setattr(megatron_io, "save_model", save_then_fail)
    out = tmp_path / "out"
    with pytest.raises(OSError, match="disk full"):
        convert_hf_to_megatron(hf_dirs["mixtral"], out, progress=False)
    assert not out.exists() and not staging_dir(out).exists()


@pytest.mark.parametrize("arch", ARCHS)
def test_export_refuses_another_architectures_table(arch, hf_dirs, jobs, tp1, tmp_path):
    other = hf_dirs[ARCHS[1 - ARCHS.index(arch)]]
    out = tmp_path / "out"
    verdict = "unknown" if arch == "qwen3_moe" else "missing"
    qk_norm = "decoder.layers.self_attention.q_layernorm.weight"
    with pytest.raises(CheckpointMismatchError, match=f"{verdict} tensor {qk_norm}"):
        convert_megatron_to_hf(jobs[ARCHS.index(arch)].tp1_dir, out, hf_config=other, progress=False)
    assert not out.exists() and not staging_dir(out).exists()


def test_command_line_reports_a_mismatch_by_name(hf_dirs, tmp_path, capsys):
    bad = tmp_path / "bad"
    shutil.copytree(hf_dirs["mixtral"], bad)
    expert = "block_sparse_moe.experts.5.w3"
    _tamper_shard(bad, lambda t: t.pop(f"model.layers.1.{expert}.weight"), key=expert)
    assert hf_to_megatron_main([str(bad), str(tmp_path / "out"), "--no-progress"]) == 2
    assert "missing tensors: model.layers.1.block_sparse_moe.experts.5.w3.weight" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------ FP8 export


@pytest.mark.parametrize("arch", ARCHS)
def test_fp8_export(arch, hf_dirs, tmp_path):
    from transformers import AutoConfig, FineGrainedFP8Config

    out = tmp_path / "fp8"
    assert export_fp8_main([str(hf_dirs[arch]), str(out), "--no-progress"]) == 0
    config = AutoConfig.from_pretrained(out)
    assert config.model_type == arch
    assert type(config) is type(AutoConfig.from_pretrained(hf_dirs[arch]))
    quant = FineGrainedFP8Config.from_dict(config.quantization_config)
    assert quant.quant_method == "fp8" and list(quant.weight_block_size) == [128, 128]
    assert quant.activation_scheme == "dynamic" and config.quantization_config["fmt"] == "e4m3"
    assert "lm_head" in quant.modules_to_not_convert and "model.embed_tokens" in quant.modules_to_not_convert
    source, exported = HFCheckpoint(hf_dirs[arch]), HFCheckpoint(out)
    scales = {n for n in exported.names() if n.endswith(SCALE_SUFFIX)}
    assert set(exported.names()) - scales == set(source.names())
    worst = 0.0
    for name in source.names():
        original = source.get(name)
        if name + SCALE_SUFFIX in scales:
            weight, scale_inv = exported.get(name), exported.get(name + SCALE_SUFFIX)
            assert weight.dtype == torch.float8_e4m3fn and scale_inv.dtype == torch.float32
            assert scale_inv.shape == (-(-original.shape[0] // 128), -(-original.shape[1] // 128))
            err = (dequantize_blockwise(weight, scale_inv).double() - original.double()).abs()
            worst = max(worst, float((err / error_bound(original, scale_inv)).max()))
        else:
            assert torch.equal(exported.get(name), original), name
            assert name.endswith(("norm.weight", "gate.weight", "embed_tokens.weight", "lm_head.weight")), name
    print(f"\n{arch} FP8: {len(scales)} quantized weights, max error / bound = {worst:.4f}")
    assert len(scales) == 2 * (4 + 3 * 8) and 0.5 < worst <= 1.0
