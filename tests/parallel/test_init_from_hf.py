"""Step-0 parity of a run that starts from an HF checkpoint, and the HF checkpoint it writes back.

The trainer's own path is exercised: ``load_run_config`` reads the model section from the
checkpoint's config.json, ``load_initial_weights`` streams the safetensors into the run's
layout (TP1 (DP2), TP2+SP, EP2, PP2), and the forward-only log-prob pass with routing
records is compared with transformers' forward of the same checkpoint on the same tokens:
log-probs within 1e-4 (fp32) and the same top-K experts at every position and layer. The
checkpoints: a tiny random Qwen3-MoE built here with transformers (decisive routers, so
top-K has no near-ties), the same converted to a Megatron checkpoint by the converter
(loaded in EP2 and PP2), and the shipped pretrained one. Then, in EP2, the policy is changed
(as training would) and exported with ``export_hf``; transformers loads the export as is
and reproduces the Megatron log-probs within 1e-4.

Distillation teachers (``train.teachers``) in the same world: beside a policy in EP2 (each rank
its own data-parallel replica with its own samples), a teacher streamed from the random
checkpoint into TP1 (DP2), TP2+SP (DP1) and EP2 scores every rank's samples in its own layout
and brings the results back: the log-probs of the response tokens equal transformers' within
the same 1e-4, the top-3 ids are transformers' and their log-probs within 1e-4, whatever the
layout; and two teachers (two checkpoints, in TP2 and EP2) each score exactly the samples whose
``source`` column routes to them.

One spawned 2-process gloo world runs every layout.
"""

import functools
from pathlib import Path

import pytest
import torch

from megatron_rl.checkpoint.parity import (
    ParityTolerances,
    compare,
    hf_reference,
    random_prompts,
)
from megatron_rl.parallel.world import run_world

pytestmark = pytest.mark.parallel

SHIPPED = Path(__file__).resolve().parents[2] / "megatron_rl" / "assets" / "tiny_qwen3_moe"
LAYOUTS = {
    "TP1 (DP2)": [],
    "TP2+SP": ["parallel.tensor_model_parallel_size=2"],
    "EP2": ["parallel.expert_model_parallel_size=2"],
    "PP2": ["parallel.pipeline_model_parallel_size=2"],
}
TOLERANCES = ParityTolerances(logprob_max_abs=1e-4, topk_agreement_min=1.0, router_prob_max_abs=1e-5)
TRAINED_NOISE = 0.05


def _tiny_random_checkpoint(directory: Path, seed: int = 0) -> None:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    config = Qwen3MoeConfig(
        vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, num_experts_per_tok=2, tie_word_embeddings=False, rope_theta=1e6, rms_norm_eps=1e-6,
        max_position_embeddings=128, initializer_range=0.1, intermediate_size=128, moe_intermediate_size=32,
        num_experts=8, decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True,
    )
    model = Qwen3MoeForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 1:
                param.copy_(1 + 0.2 * torch.randn_like(param))
            elif name.endswith("gate.weight"):
                param.mul_(10)
    model.float().save_pretrained(directory, max_shard_size="60KB")


def _worker(checkpoints: dict[str, str], prompts: dict[str, list], export_dir: str, megatron_dir: str) -> dict:
    import torch.distributed as dist

    from megatron_rl.checkpoint.convert import hf_to_megatron_world_entry
    from megatron_rl.checkpoint.init_source import inspect_init_checkpoint
    from megatron_rl.checkpoint.parity import megatron_outputs
    from megatron_rl.parallel.cpu_platform import cpu_platform
    from megatron_rl.parallel.groups import model_parallel
    from megatron_rl.parallel.model import build_model
    from megatron_rl.sections import ParallelConfig
    from megatron_rl.train.hf_export import HFExportSpec, export_hf
    from megatron_rl.train.init_weights import load_initial_weights
    from megatron_rl.config import load_config as load_run_config

    results: dict = {"layouts": {}, "exported": None}
    hf_to_megatron_world_entry(checkpoints["random"], megatron_dir, ParallelConfig(), False)
    checkpoints = {**checkpoints, "megatron": megatron_dir}
    teachers_only = {"random2"}
    prompts = {**prompts, "megatron": prompts["random"]}
    with cpu_platform():
        for name, path in checkpoints.items():
            if name in teachers_only:
                continue
            for layout, overrides in LAYOUTS.items():
                if name == "megatron" and layout not in ("EP2", "PP2"):
                    continue
                cfg = load_run_config(None, [f"init_checkpoint={path}", "parallel.world_size=2", *overrides],
                                      world_size=2)
                with model_parallel(cfg.parallel, cfg.seed) as groups:
                    source = inspect_init_checkpoint(path)
                    gpt = build_model(cfg.model, cfg.parallel)
                    load_initial_weights(gpt, source, cfg.model, groups)
                    outputs = megatron_outputs(gpt, groups, prompts[name])
                    results["layouts"][(name, layout)] = outputs
                    if name == "random" and layout == "EP2":
                        with torch.no_grad():
                            for param in gpt.parameters():
                                param.add_(TRAINED_NOISE * torch.randn_like(param))
                        results["exported"] = megatron_outputs(gpt, groups, prompts[name])
                        spec = HFExportSpec(architecture=source.hf.architecture, model=cfg.model,
                                            side_files=[Path(f) for f in source.hf.files])
                        export_hf(gpt, groups, export_dir, spec)
        results["teachers"] = _teacher_passes(checkpoints["random"], checkpoints["random2"], prompts["random"])
    return results if dist.get_rank() == dist.get_world_size() - 1 else {}


TEACHER_LAYOUTS = {"TP1 (DP2)": {}, "TP2+SP": {"tensor_model_parallel_size": 2}, "EP2": {"expert_model_parallel_size": 2}}
OFFLOADED = "TP2+SP"
"""The layout whose teacher is offloaded between its passes (its weights come back for the pass)."""
PROMPT_TOKENS = 4
"""Each scored sample's prompt: its first tokens; the rest is the response the teacher scores."""


class _NoTurns:
    """A disaggregated run's turns: nothing moves between passes."""

    def add_frozen(self, module) -> None:
        pass


def _teacher_passes(random: str, random2: str, sequences: list) -> dict:
    """Collective: every rank's samples (rank r holds sequences r::2, the policy in EP2) scored by a
    teacher in each layout, and by two teachers routed by a ``source`` column; gathered."""
    import dataclasses

    from megatron_rl.data.prompts import PromptRecord
    from megatron_rl.parallel.comm import all_gather_objects
    from megatron_rl.parallel.groups import model_parallel
    from megatron_rl.sections import ParallelConfig
    from megatron_rl.sections.distill import DistillConfig, TeacherConfig
    from megatron_rl.config import load_config as load_run_config
    from megatron_rl.train.teachers import Teachers, TrainerTeacher

    cfg = load_run_config(None, [f"init_checkpoint={random}", "parallel.world_size=2",
                                 "parallel.expert_model_parallel_size=2"], world_size=2)
    out: dict = {"layouts": {}}
    with model_parallel(cfg.parallel, cfg.seed) as groups:
        mine = list(range(groups.dp_rank, len(sequences), groups.dp_size))
        items = [(sequences[j], PROMPT_TOKENS) for j in mine]
        for layout, sizes in TEACHER_LAYOUTS.items():
            teacher = TrainerTeacher(TeacherConfig(path=random, model=cfg.model, parallel=ParallelConfig(**sizes),
                                                   offload=layout == OFFLOADED), cfg, groups, _NoTurns())
            resident = [sum(p.untyped_storage().nbytes() for p in teacher.model.parameters())]
            scored = teacher.score(items, 3, {})
            resident.append(sum(p.untyped_storage().nbytes() for p in teacher.model.parameters()))
            teacher.close()
            out.setdefault("resident", {})[layout] = resident
            out["layouts"][layout] = dict(pair for got in all_gather_objects(list(zip(mine, scored)), groups.world)
                                          for pair in got)
        two = dataclasses.replace(cfg, distill=DistillConfig(teacher_key="source", topk=3, teachers=[
            TeacherConfig(path=random, model=cfg.model, sources=["a"], parallel=ParallelConfig(tensor_model_parallel_size=2)),
            TeacherConfig(path=random2, model=cfg.model, sources=["b"], parallel=ParallelConfig(expert_model_parallel_size=2)),
        ]))
        records = [PromptRecord(sample_id=str(j), prompt="", prompt_ids=(), ground_truth="",
                                metadata={"source": "ab"[j % 3 == 0]}) for j in mine]
        teachers = Teachers(two, groups, _NoTurns())
        scores = teachers.score(records, [s for s, _ in items], [p for _, p in items], {})
        teachers.close()
        lengths = [int(s.numel()) - PROMPT_TOKENS for s, _ in items]
        per_sample = zip(mine, scores.logprobs_T.split(lengths), scores.teacher_S.tolist())
        out["routed"] = dict(pair for got in all_gather_objects([(j, (lp, t)) for j, lp, t in per_sample], groups.world)
                             for pair in got)
    return out


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("init")
    _tiny_random_checkpoint(root / "random")
    _tiny_random_checkpoint(root / "random2", seed=1)
    checkpoints = {"random": str(root / "random"), "shipped": str(SHIPPED), "random2": str(root / "random2")}
    prompts = {
        "random": [p[:n] for p, n in zip(random_prompts(4, 14, 256, seed=5), (14, 9, 11, 6))],
        "shipped": [p[:n] for p, n in zip(random_prompts(4, 14, 300, seed=6), (14, 9, 11, 6))],
    }
    results = run_world(_worker, 2, checkpoints, prompts, str(root / "export"), str(root / "megatron"),
                        timeout_s=600)
    return checkpoints, prompts, results[-1], root / "export"


@pytest.fixture(scope="module")
def references(world):
    """transformers' outputs for each starting checkpoint, computed once for every layout's test."""
    checkpoints, prompts, _, _ = world
    return functools.cache(lambda name: hf_reference(checkpoints[name], prompts[name], topk=2))


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("name", ["random", "shipped"])
def test_step0_logprobs_and_routes_match_transformers(world, references, name, layout):
    results = world[2]
    report = compare(references(name), results["layouts"][(name, layout)])
    assert not report.violations(TOLERANCES), (name, layout, report.to_dict())


@pytest.mark.parametrize("layout", ["EP2", "PP2"])
def test_megatron_checkpoint_of_the_converter_starts_the_same_policy(world, references, layout):
    results = world[2]
    report = compare(references("random"), results["layouts"][("megatron", layout)])
    assert not report.violations(TOLERANCES), (layout, report.to_dict())


def test_exported_checkpoint_loads_in_transformers_and_reproduces_the_trainer(world):
    _, prompts, results, export_dir = world
    from transformers import AutoModelForCausalLM

    assert (export_dir / "config.json").is_file() and not list(export_dir.parent.glob(".export*"))
    AutoModelForCausalLM.from_pretrained(str(export_dir))  # loads as is, no warnings about missing keys
    reference = hf_reference(export_dir, prompts["random"], topk=2)
    report = compare(reference, results["exported"])
    assert report.logprob_max_abs_diff <= 1e-4, report.to_dict()


@functools.lru_cache(maxsize=None)
def _hf_model(hf_dir: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(hf_dir, dtype="auto").eval()


def _hf_logprobs(hf_dir: str, sequence: torch.Tensor) -> torch.Tensor:
    """``[N - 1, V]`` transformers' log-softmax at every position of one sequence."""
    with torch.no_grad():
        return torch.log_softmax(_hf_model(hf_dir)(sequence[None]).logits[0, :-1].double(), -1)


@pytest.mark.parametrize("layout", list(TEACHER_LAYOUTS))
def test_teacher_pass_in_its_own_layout_matches_transformers(world, layout):
    checkpoints, prompts, results, _ = world
    scored = results["teachers"]["layouts"][layout]
    assert sorted(scored) == list(range(len(prompts["random"])))
    for j, sequence in enumerate(prompts["random"]):
        ref = _hf_logprobs(checkpoints["random"], sequence)[PROMPT_TOKENS - 1:]
        lp, ids, top = scored[j]
        want = ref.gather(1, sequence[PROMPT_TOKENS:, None])[:, 0]
        assert (lp.double() - want).abs().max() <= TOLERANCES.logprob_max_abs, (layout, j)
        ref_top, ref_ids = ref.topk(3, dim=-1)
        assert torch.equal(ids, ref_ids), (layout, j)
        assert (top.double() - ref_top).abs().max() <= TOLERANCES.logprob_max_abs, (layout, j)


def test_an_offloaded_teacher_holds_no_device_weights_between_its_passes(world):
    resident = world[2]["teachers"]["resident"]
    assert resident[OFFLOADED] == [0, 0]  # before and after its pass; the pass itself matched transformers
    assert all(before > 0 and after == before for layout, (before, after) in resident.items() if layout != OFFLOADED)


def test_samples_go_to_the_teacher_of_their_source(world):
    checkpoints, prompts, results, _ = world
    routed = results["teachers"]["routed"]
    assert sorted(routed) == list(range(len(prompts["random"])))
    for j, sequence in enumerate(prompts["random"]):
        lp, teacher = routed[j]
        expected = 1 if j % 3 == 0 else 0  # source "b" for every third sample
        assert teacher == expected
        for index, name in enumerate(("random", "random2")):
            want = _hf_logprobs(checkpoints[name], sequence)[PROMPT_TOKENS - 1:].gather(1, sequence[PROMPT_TOKENS:, None])[:, 0]
            close = bool((lp.double() - want).abs().max() <= TOLERANCES.logprob_max_abs)
            assert close == (index == expected), (j, name)
