"""Context parallelism under the Transformer Engine spec (skipped without CUDA, TE or GPUs).

1. One GPU: Transformer Engine's own THD partition (``tex.thd_get_partitioned_indices``, what
   Megatron-Core's ``get_thd_batch_on_this_cp_rank`` slices with) equals
   ``packing.cp_partition_indices`` for CP 2, 4 and 8, slots of many lengths.
2. Two GPUs (an NCCL world, rank r on GPU r): the shipped pretrained tiny Qwen3-MoE in
   bfloat16, CP2 (TE's p2p ring attention on THD rows with per-sequence slots,
   ``cp_comm_type='p2p'``) against CP1 (each rank alone with the whole batch): the log-prob
   pass with routing records and one R2 RSPO step (loss, router gradients). CP changes only the
   order of the attention's partial sums (the ring merges per-chunk softmax statistics), as
   packing does, so the bounds are the bfloat16 bounds of ``tests/packed_checks.py``.

``pytest -s`` prints the measured figures.
"""

import json

import pytest
import torch
from packed_checks import (
    BOUNDS,
    MIN_SAME_EXPERTS,
    PROMPT_TOKENS,
    build_pretrained,
    chat_samples,
)

from megatron_rl.parallel.packing import cp_partition_indices
from megatron_rl.parallel.world import run_world
from megatron_rl.sections import ParallelConfig

pytestmark = pytest.mark.gpu


def _te_or_skip():
    from megatron_rl.parallel.model import transformer_engine_available

    if not transformer_engine_available():
        pytest.skip("Transformer Engine does not import here")


@pytest.mark.parametrize("cp_size", [2, 4, 8])
def test_transformer_engine_partitions_thd_rows_as_we_do(cp_size):
    _te_or_skip()
    import transformer_engine_torch as tex

    slots = torch.tensor([1, 7, 2, 30, 5, 1]) * 2 * cp_size
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), slots.cumsum(0)]).to(torch.int32)
    total = int(cu[-1])
    for rank in range(cp_size):
        theirs = tex.thd_get_partitioned_indices(cu.cuda(), total, cp_size, rank)
        assert torch.equal(theirs.cpu().long(), cp_partition_indices(cu, total, cp_size, rank)), (cp_size, rank)


def _cp_worker() -> dict:
    """CP1 then CP2 in one NCCL world of two ranks: log-prob pass with records, one R2 step."""
    from megatron_rl.algos.presets import get_preset
    from megatron_rl.parallel.groups import model_parallel
    from megatron_rl.parallel.logprobs import compute_logprobs
    from megatron_rl.parallel.train_step import (
        RoutingPlan,
        TrainBatch,
        forward_backward,
    )

    samples = chat_samples(8)
    prompts = [PROMPT_TOKENS] * len(samples)
    advantages = None
    out = {}
    for name, parallel in (("cp1", ParallelConfig()), ("cp2", ParallelConfig(context_parallel_size=2))):
        with model_parallel(parallel, seed=1234) as groups:
            model, ddp = build_pretrained(True, "bfloat16", groups, parallel)
            old = compute_logprobs(ddp, groups, samples, prompts, micro_batch_sequences=4, record_routing=True)
            with torch.no_grad():  # the policy moved since the rollout: routers differ, replay matters
                for layer in model.decoder.layers:
                    weight = layer.mlp.router.weight
                    noise = torch.randn(weight.shape, generator=torch.Generator().manual_seed(100 + layer.layer_number))
                    weight += (0.05 * noise).to(weight) * weight.float().std()
            if advantages is None:
                advantages = torch.randn(old.logprobs_T.numel(), generator=torch.Generator().manual_seed(7))
            batch = TrainBatch(sequences=samples, prompt_lengths=prompts, old_logprobs_T=old.logprobs_T,
                               advantages_T=advantages, old_record=old.record)
            step = forward_backward(ddp, groups, batch, get_preset("rspo"), RoutingPlan(mode="R2"),
                                    micro_batch_sequences=4)
            out[name] = {
                "logprobs": old.logprobs_T.cpu(), "ids": old.record.expert_ids_TLK.cpu(),
                "probs": old.record.probs_TLK.float().cpu(), "loss": float(step.loss),
                "router_grads": {l.layer_number: l.mlp.router.weight.main_grad.detach().float().cpu()
                                 for l in model.decoder.layers},
            }
    return out


def test_cp2_matches_cp1_on_two_gpus():
    _te_or_skip()
    if torch.cuda.device_count() < 2:
        pytest.skip("context parallelism needs two GPUs (NCCL does not put two ranks on one GPU)")
    bounds = BOUNDS["bfloat16"]
    for rank, out in enumerate(run_world(_cp_worker, 2, backend="nccl", timeout_s=600)):
        cp1, cp2 = out["cp1"], out["cp2"]
        diff = (cp2["logprobs"] - cp1["logprobs"]).abs()
        same = (cp2["ids"].sort(-1).values == cp1["ids"].sort(-1).values).all(-1)
        grad_rel = max(float((cp2["router_grads"][n] - g).norm() / g.norm()) for n, g in cp1["router_grads"].items())
        measured = {"rank": rank, "logprob_mean": float(diff.mean()), "logprob_max": float(diff.max()),
                    "experts_equal_fraction": float(same.float().mean()),
                    "router_prob_max_where_equal": float((cp2["probs"] - cp1["probs"]).abs().amax(-1)[same].max()),
                    "loss_rel": abs(cp2["loss"] - cp1["loss"]) / abs(cp1["loss"]), "router_grad_rel_max": grad_rel}
        print(json.dumps(measured))
        assert measured["logprob_mean"] <= bounds.logprob_mean and measured["logprob_max"] <= bounds.logprob_max
        assert measured["experts_equal_fraction"] >= MIN_SAME_EXPERTS
        assert measured["router_prob_max_where_equal"] <= bounds.router_prob
        assert measured["loss_rel"] <= bounds.loss_rel
        assert measured["router_grad_rel_max"] <= bounds.grad_rel
