"""Layout invariance: a checkpoint saved at TP1/EP1/PP1 and resharded into each layout gives
the single-process logits (1e-5, fp32) and router / output-layer gradients (1e-4 relative).

One gloo world per layout; everything a layout checks comes out of that one world.
"""

import functools

import pytest
import torch

from megatron_rl.config import ModelConfig, ParallelConfig
from megatron_rl.parallel.layout_check import (
    LayoutRun,
    compare,
    layout_worker,
    merge_rank_results,
    random_sequences,
)
from megatron_rl.parallel.world import run_world

pytestmark = pytest.mark.parallel

MODEL = ModelConfig(vocab_size=256, num_layers=4, num_experts=8, moe_router_topk=2)
# 8 variable-length sequences: 4 micro-batches of 2 on one process, 2 per rank under DP=2.
SEQUENCES = random_sequences(8, MODEL.vocab_size, min_len=5, max_len=40, seed=0)

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


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("layout") / "ckpt")


@pytest.fixture(scope="module")
def reference(checkpoint_dir):
    run = LayoutRun(
        model=MODEL,
        parallel=ParallelConfig(),
        checkpoint_dir=checkpoint_dir,
        sequences=SEQUENCES,
        save_checkpoint=True,
    )
    return merge_rank_results(run_world(layout_worker, 1, run, timeout_s=300))


@pytest.fixture(scope="module")
def layout_results(checkpoint_dir, reference):
    @functools.cache
    def run(name):
        parallel, world = LAYOUTS[name]
        job = LayoutRun(
            model=MODEL, parallel=parallel, checkpoint_dir=checkpoint_dir, sequences=SEQUENCES
        )
        return merge_rank_results(run_world(layout_worker, world, job, timeout_s=300))

    return run


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
    report = compare(layout_results(name), reference)
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
