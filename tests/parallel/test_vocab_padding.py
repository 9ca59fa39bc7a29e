"""A vocabulary that TP does not divide: padded in Megatron, invisible everywhere else.

The model: a tiny random Qwen3-MoE built here with transformers, with V = 251 token ids
(odd: TP2 cannot split it), run with ``model.vocab_padding_multiple=8``, so Megatron holds
256 rows and tensor-parallel rank 1 holds the 5 padding rows. Shown here: HF -> Megatron
(written at TP2) -> HF gives the same bytes; the padded rows are zeros after import; the
log-probs equal transformers' forward within 1e-4 (fp32) with identical top-K experts at
TP1 (DP2) and TP2+SP, started from the HF checkpoint and from the TP2-written Megatron one;
the entropy is the entropy over the true 251 ids; the trainer's HF export gives back HF's
tensors; the embedded engine never samples a padded id even when the padding logits
dominate; and the masked vocab-parallel math, alone, equals the unpadded softmax.

One spawned 2-process gloo world runs every Megatron part; the export back to HF and the
transformers reference run in this process.
"""

import math
from pathlib import Path

import pytest
import torch

from megatron_rl.checkpoint.hf_io import HFCheckpoint
from megatron_rl.checkpoint.parity import (
    ParityTolerances,
    compare,
    hf_reference,
    random_prompts,
)
from megatron_rl.parallel.vocab_parallel import (
    VocabParallelLogProbMath,
    vocab_parallel_logprobs_entropy,
)
from megatron_rl.parallel.world import run_world

pytestmark = pytest.mark.parallel

VOCAB = 251
MULTIPLE = 8
PADDED = 256
VOCAB_SMALL = 11
"""True ids of the math tests: 3 shards of 6 columns hold 6, 5 and 0 of them."""
RUNS = {
    ("hf", "TP1 (DP2)"): [],
    ("hf", "TP2+SP"): ["parallel.tensor_model_parallel_size=2"],
    ("megatron", "TP1 (DP2)"): [],
}
TOLERANCES = ParityTolerances(logprob_max_abs=1e-4, topk_agreement_min=1.0, router_prob_max_abs=1e-5)
PROMPTS = [p[:n] for p, n in zip(random_prompts(4, 14, VOCAB, seed=7), (14, 9, 11, 6))]


def _tiny_random_checkpoint(directory: Path) -> None:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    config = Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
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
                # A trained router is decisive; near-ties would make top-K a coin toss.
                param.mul_(10)
    model.float().save_pretrained(directory)


def _padded_rows_max_abs(gpt, groups) -> float:
    """Largest |value| in this rank's padding rows of the embedding and the output layer."""
    largest = 0.0
    for weight in (gpt.embedding.word_embeddings.weight, gpt.output_layer.weight):
        rows = torch.arange(weight.shape[0]) + groups.tp_rank * weight.shape[0]
        padding = weight.detach()[rows >= VOCAB]
        largest = max(largest, float(padding.abs().max()) if padding.numel() else 0.0)
    return largest


def _generate_with_dominant_padding(gpt, groups) -> dict:
    """Every token's logit 0 and some padding logit far above it; then generate.

    Padding rows ``(-1)^k (k + 1) 100 d`` give, at every position, some padded logit of at
    least ``100 |h . d|``: a sampler that saw the padding would pick it almost surely (and
    greedy decoding always). Over the true vocabulary the distribution is uniform.
    """
    from megatron_rl.parallel.logprobs import compute_logprobs
    from megatron_rl.rollout.engine import SamplingParams
    from megatron_rl.rollout.local.embedded import EmbeddedEngine

    weight = gpt.output_layer.weight
    rows = torch.arange(weight.shape[0]) + groups.tp_rank * weight.shape[0]
    padding = rows >= VOCAB
    direction = torch.randn(weight.shape[1], generator=torch.Generator().manual_seed(0))
    k = torch.arange(int(padding.sum()), dtype=weight.dtype)
    with torch.no_grad():
        weight[~padding] = 0.0
        weight[padding] = ((-1.0) ** k * (k + 1) * 100)[:, None] * direction
    engine = EmbeddedEngine(gpt, groups)
    prompts = [p.tolist() for p in PROMPTS[:2]]
    samples = [
        engine.generate(prompts, SamplingParams(temperature=t, max_new_tokens=6), return_routed_experts=False, seed=3)
        for t in (1.0, 0.0)
    ]
    entropy_T = compute_logprobs(gpt, groups, list(PROMPTS), [1] * len(PROMPTS)).entropy_T
    return {
        "output_ids": [s.output_ids for batch in samples for s in batch],
        "output_logprobs": torch.cat([s.output_logprobs for batch in samples for s in batch]),
        "uniform_entropy_T": entropy_T,
    }


def _worker(hf_dir: str, megatron_dir: str, export_dir: str) -> dict:
    import torch.distributed as dist

    from megatron_rl.checkpoint.convert import hf_to_megatron_world_entry
    from megatron_rl.checkpoint.init_source import inspect_init_checkpoint
    from megatron_rl.checkpoint.parity import megatron_outputs
    from megatron_rl.parallel.cpu_platform import cpu_platform
    from megatron_rl.parallel.groups import model_parallel
    from megatron_rl.parallel.logprobs import compute_logprobs
    from megatron_rl.parallel.model import build_model
    from megatron_rl.sections import ParallelConfig
    from megatron_rl.train.hf_export import HFExportSpec, export_hf
    from megatron_rl.train.init_weights import load_initial_weights
    from megatron_rl.config import load_config as load_run_config

    tp2 = ParallelConfig(tensor_model_parallel_size=2)
    hf_to_megatron_world_entry(hf_dir, megatron_dir, tp2, False, MULTIPLE)
    results: dict = {}
    with cpu_platform():
        for (source, layout), overrides in RUNS.items():
            path = hf_dir if source == "hf" else megatron_dir
            # A Megatron checkpoint records its padding; over HF it is the run's choice.
            padding = [f"model.vocab_padding_multiple={MULTIPLE}"] if source == "hf" else []
            cfg = load_run_config(
                None, [f"init_checkpoint={path}", "parallel.world_size=2", *padding, *overrides], world_size=2
            )
            with model_parallel(cfg.parallel, cfg.seed) as groups:
                init = inspect_init_checkpoint(path)
                gpt = build_model(cfg.model, cfg.parallel)
                load_initial_weights(gpt, init, cfg.model, groups)
                run = {
                    "padded_vocab_size": cfg.model.padded_vocab_size,
                    "padded_rows_max_abs": _padded_rows_max_abs(gpt, groups),
                    "outputs": megatron_outputs(gpt, groups, PROMPTS),
                    "entropy_T": compute_logprobs(gpt, groups, list(PROMPTS), [1] * len(PROMPTS)).entropy_T,
                }
                if (source, layout) == ("hf", "TP2+SP"):
                    spec = HFExportSpec(architecture=init.hf.architecture, model=cfg.model,
                                        side_files=[Path(f) for f in init.hf.files])
                    export_hf(gpt, groups, export_dir, spec)
                    run.update(_generate_with_dominant_padding(gpt, groups))
                results[(source, layout)] = run
    # Rank 1 is tensor-parallel rank 1 at TP2: the rank that holds the padding rows.
    return results if dist.get_rank() == 1 else {}


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("vocab_padding")
    _tiny_random_checkpoint(root / "hf")
    results = run_world(_worker, 2, str(root / "hf"), str(root / "megatron"), str(root / "export"), timeout_s=600)
    return root, results[1]


def _hf_entropy_T(hf_dir: Path) -> torch.Tensor:
    """Entropy of transformers' next-token distribution at every scored position, float64."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype="auto").eval()
    rows = []
    with torch.no_grad():
        for seq in PROMPTS:
            logp_NV = torch.log_softmax(model(input_ids=seq[None]).logits[0, :-1].double(), dim=-1)
            rows.append(-(logp_NV.exp() * logp_NV).sum(-1))
    return torch.cat(rows)


def test_hf_to_megatron_at_tp2_to_hf_is_byte_identical(world):
    from megatron_rl.checkpoint.convert import convert_megatron_to_hf

    root, results = world
    hf = root / "hf"
    # From the conversion record, and with the HF directory as the config source (it knows
    # no padding: the checkpoint's own record still says how the stored rows are padded).
    for name, hf_config in (("back", None), ("back_hf_config", hf)):
        back = convert_megatron_to_hf(root / "megatron", root / name, hf_config=hf_config, progress=False)
        assert sorted(p.name for p in back.iterdir()) == sorted(p.name for p in hf.iterdir())
        for path in sorted(hf.iterdir()):
            assert (back / path.name).read_bytes() == path.read_bytes(), (name, path.name)
    assert all(run["padded_vocab_size"] == PADDED for run in results.values())


@pytest.mark.parametrize("run", list(RUNS), ids=[f"{s}-{layout}" for s, layout in RUNS])
def test_logprobs_routes_and_entropy_match_transformers(world, run):
    root, results = world
    got = results[run]
    assert got["padded_rows_max_abs"] == 0.0  # imported as zeros
    report = compare(hf_reference(root / "hf", PROMPTS, topk=2), got["outputs"])
    assert not report.violations(TOLERANCES), report.to_dict()
    assert report.topk_ids_identical
    assert (got["entropy_T"].double() - _hf_entropy_T(root / "hf")).abs().max() <= 1e-4


def test_trainer_export_strips_the_padding(world):
    root, _ = world
    original, exported = HFCheckpoint(root / "hf"), HFCheckpoint(root / "export")
    assert sorted(exported.names()) == sorted(original.names())
    assert exported.shape("lm_head.weight")[0] == exported.shape("model.embed_tokens.weight")[0] == VOCAB
    for name in original.names():
        assert torch.equal(exported.get(name), original.get(name)), name


def test_embedded_engine_never_samples_padding(world):
    _, results = world
    got = results[("hf", "TP2+SP")]
    ids = [i for output in got["output_ids"] for i in output]
    assert len(ids) == 4 * 6 and max(ids) < VOCAB
    # Every true token has logit 0: uniform over the 251 ids, as if the padding were absent.
    assert (got["output_logprobs"] + math.log(VOCAB)).abs().max() <= 1e-5
    assert (got["uniform_entropy_T"] - math.log(VOCAB)).abs().max() <= 1e-5


# ------------------------------------------------------------------ the masked math alone


def _reference(logits_TV, targets_T, lp_weights_T, entropy_weights_T):
    """Log-probs, entropy and gradient of the softmax over the true ids only, float64."""
    logits = logits_TV.detach().double().requires_grad_(True)
    logp_TV = torch.log_softmax(logits[:, :VOCAB_SMALL], dim=-1)
    logprobs_T = logp_TV.gather(1, targets_T[:, None]).squeeze(1)
    entropy_T = -(logp_TV.exp() * logp_TV).sum(-1)
    ((lp_weights_T * logprobs_T).sum() + (entropy_weights_T * entropy_T).sum()).backward()
    return logprobs_T.detach(), entropy_T.detach(), logits.grad


def _problem(seed=0):
    """Logits [9, 18] (11 true ids, 7 padding columns), targets and two loss weights [9]."""
    gen = torch.Generator().manual_seed(seed)
    logits_TV = torch.randn(9, 18, generator=gen, dtype=torch.float64) * 3
    # Huge padding logits: any leak into the max, the sums or the gradient shows at once.
    logits_TV[:, VOCAB_SMALL:] = 1e3
    targets_T = torch.randint(0, VOCAB_SMALL, (9,), generator=gen)
    lp_weights_T, entropy_weights_T = torch.randn(2, 9, generator=gen, dtype=torch.float64)
    return logits_TV, targets_T, lp_weights_T, entropy_weights_T


def test_masked_static_math_over_three_shards_equals_the_true_softmax():
    vp = VocabParallelLogProbMath
    logits_TV, targets_T, lp_w_T, ent_w_T = _problem()
    shards = logits_TV.split(6, dim=1)
    valid = [vp.valid_columns(r * 6, 6, VOCAB_SMALL) for r in range(3)]
    assert valid == [6, 5, 0]
    ids = [vp.local_targets(targets_T, r * 6, 6) for r in range(3)]
    max_C = torch.stack([vp.chunk_max(s, torch.float64, n) for s, n in zip(shards, valid)]).amax(0)
    stats_3C = sum(
        vp.chunk_partial_stats(s, max_C, *i, torch.empty_like(s), torch.empty_like(s), num_valid=n)
        for s, i, n in zip(shards, ids, valid)
    )
    logprobs_C, entropy_C, lse_C = vp.finalize(max_C, stats_3C)
    ref_logprobs, ref_entropy, ref_grad = _reference(logits_TV, targets_T, lp_w_T, ent_w_T)
    assert (logprobs_C - ref_logprobs).abs().max() <= 1e-12
    assert (entropy_C - ref_entropy).abs().max() <= 1e-12
    grads = [
        vp.chunk_grad(s, lse_C, *i, lp_w_T, torch.empty_like(s), entropy_C, ent_w_T, torch.empty_like(s),
                         num_valid=n)
        for s, i, n in zip(shards, ids, valid)
    ]
    grad_TV = torch.cat(grads, dim=1)
    assert (grad_TV[:, :VOCAB_SMALL] - ref_grad[:, :VOCAB_SMALL]).abs().max() <= 1e-12
    assert torch.equal(grad_TV[:, VOCAB_SMALL:], torch.zeros(9, 18 - VOCAB_SMALL, dtype=torch.float64))


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_masked_autograd_function_equals_the_true_softmax(dtype):
    logits_TV, targets_T, lp_w_T, ent_w_T = _problem(seed=1)
    logits = logits_TV.to(dtype).requires_grad_(True)
    logprobs_T, entropy_T = vocab_parallel_logprobs_entropy(
        logits, targets_T, chunk_tokens=4, entropy_requires_grad=True, vocab_size=VOCAB_SMALL
    )
    ((lp_w_T * logprobs_T).sum() + (ent_w_T * entropy_T).sum()).backward()
    ref_logprobs, ref_entropy, ref_grad = _reference(logits.detach(), targets_T, lp_w_T, ent_w_T)
    # bf16: the math runs in fp32, and the gradient comes back rounded to bf16.
    tol, grad_tol = (1e-12, 1e-12) if dtype == torch.float64 else (1e-5, 1e-2)
    assert (logprobs_T.double() - ref_logprobs).abs().max() <= tol
    assert (entropy_T.double() - ref_entropy).abs().max() <= tol
    assert (logits.grad.double()[:, :VOCAB_SMALL] - ref_grad[:, :VOCAB_SMALL]).abs().max() <= grad_tol
    assert not logits.grad[:, VOCAB_SMALL:].any()


def test_a_padding_target_or_an_impossible_vocab_size_is_named():
    logits_TV, targets_T, _, _ = _problem()
    with pytest.raises(ValueError, match=r"targets_T\[0\] = 12 is outside the vocabulary \[0, 11\) .*7 padding"):
        vocab_parallel_logprobs_entropy(logits_TV, torch.full_like(targets_T, 12), vocab_size=VOCAB_SMALL)
    with pytest.raises(ValueError, match=r"vocab_size must be an int in \[1, 18\]"):
        vocab_parallel_logprobs_entropy(logits_TV, targets_T, vocab_size=19)


def test_config_pads_independently_of_tp_and_names_the_multiple_that_fits():
    from megatron_rl.checkpoint.local_world import check_layout
    from megatron_rl.config_loading import ConfigError
    from megatron_rl.sections import ModelConfig, ParallelConfig, validate_layout

    tp2 = ParallelConfig(tensor_model_parallel_size=2)
    padded = ModelConfig(vocab_size=VOCAB, vocab_padding_multiple=MULTIPLE)
    assert padded.padded_vocab_size == PADDED and ModelConfig(vocab_size=VOCAB).padded_vocab_size == VOCAB
    validate_layout(padded, tp2, 2)
    with pytest.raises(ConfigError, match=r"must divide the padded vocabulary 251 .*vocab_padding_multiple=128 "
                                          r"\(pads to 256\)"):
        validate_layout(ModelConfig(vocab_size=VOCAB), tp2, 2)
    with pytest.raises(ConfigError, match=r"--tp 2 .*model.vocab_size=251 .*--vocab-padding-multiple"):
        check_layout(ModelConfig(vocab_size=VOCAB), tp2, 2)
