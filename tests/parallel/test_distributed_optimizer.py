"""Megatron's distributed optimizer (``optim.distributed``) against the plain one, its
checkpoints, resumed at the same and at other layouts, and its memory per parameter.

Two gloo worlds, each running many checks. The world of 2 (DP2) trains bf16 models from
the same initial weights with the plain optimizer, the distributed one, and the distributed
one overlapping its reduce-scatter and all-gather with small buckets, over two steps whose
number of micro-batches differs (what token-budget packing does, and what trips an overlap
without the schedule's sync functions). It then trains fp32 with the distributed optimizer,
saves trainer checkpoints after two steps in both formats, takes two more steps, and resumes
the fully-reshardable checkpoint into a freshly built model and optimizer; and it offers a
plain optimizer's checkpoint to the distributed one. The world of 4 repeats the
plain-vs-distributed comparison in EP2 (dense DP4, expert-DP2) and TP2+SP x DP2, and resumes
the world of 2's checkpoints at DP4 (both formats) and at TP2+SP x DP2. Every world also
counts the bytes the training state's storages hold, against ``optimizer_bytes_per_param``.

Tolerances: a distributed step must equal the plain step (loss, grad norm, updated
weights) within 1e-6 relative. Loss and weights come out bit-identical (the reduce-scatter
sums the same per-rank gradients in the same order as the all-reduce); the grad norm, summed
over each rank's slices first, can differ in its last bit. A same-size resume must be
bit-identical. A resume at another DP size sums the per-rank gradients in another grouping
and order, so its steps equal the same-size resume's within float rounding (1e-6 relative
asserted, in fp32; in bf16 the rounding of the updated weights turns such a difference
into a whole bf16 ulp, 2^-8 relative, in a few elements). The optimizer state it loads is
bitwise the saved one: that is asserted exactly.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from megatron_rl.parallel.optimizer_memory import optimizer_bytes_per_param
from megatron_rl.parallel.smoke_worker import random_sequences
from megatron_rl.parallel.world import run_world
from megatron_rl.sections import ModelConfig, OptimConfig, ParallelConfig

pytestmark = pytest.mark.parallel

MODEL = ModelConfig(vocab_size=64, num_layers=2, num_experts=4, moe_router_topk=2)
SEQUENCES = random_sequences(12, MODEL.vocab_size, min_len=6, max_len=16, seed=3)
STEP_SAMPLES = (8, 12)
"""Samples of steps 1 and 2: DP2 ranks pack 2 then 3 micro-batches, DP4 ranks 1 then 2."""
MICRO_BATCH_SEQUENCES = 2
PLAIN = OptimConfig(lr=1e-2, clip_grad=0.0)
DISTRIBUTED = OptimConfig(lr=1e-2, clip_grad=0.0, distributed=True)
OVERLAP = OptimConfig(lr=1e-2, clip_grad=0.0, distributed=True, overlap_grad_reduce=True,
                      overlap_param_gather=True, bucket_size=2000)
SAVE_STEP = 2
SHARDINGS = ("fully_reshardable", "dp_reshardable")


def _loss_fn(groups):
    """Next-token cross-entropy (vocabulary-parallel) summed over the real tokens, with their count."""
    from megatron_rl.parallel.packing import next_token_targets
    from megatron_rl.parallel.vocab_parallel import vocab_parallel_logprobs_entropy

    def loss_fn(mb, logits_1TV):
        targets_T, mask_T = next_token_targets(mb)
        logprobs_T, _ = vocab_parallel_logprobs_entropy(logits_1TV[0].float(), targets_T, groups.tp,
                                                        compute_entropy=False, vocab_size=MODEL.vocab_size)
        loss = -(logprobs_T * mask_T).sum()
        return loss, mask_T.sum().to(torch.int), {"loss_sum": loss.detach(), "tokens": mask_T.sum().float()}

    return loss_fn


def _micro_batches(groups, step: int):
    from megatron_rl.parallel.logprobs import pack_for_rank

    chosen = SEQUENCES[: STEP_SAMPLES[(step - 1) % len(STEP_SAMPLES)]]
    return pack_for_rank(chosen[groups.dp_rank :: groups.dp_size], groups, MICRO_BATCH_SEQUENCES)


class _Run:
    """A model (from ``init`` weights), its DDP wrapper and optimizer for one ``OptimConfig``."""

    def __init__(self, parallel, optim, init, params_dtype="float32"):
        import dataclasses

        from megatron_rl.parallel.model import build_model
        from megatron_rl.parallel.optim import build_optimizer
        from megatron_rl.parallel.schedule import wrap_for_training

        self.model = build_model(dataclasses.replace(MODEL, params_dtype=params_dtype), parallel)
        if init is not None:
            self.model.load_state_dict(init, strict=False)
        self.ddp = wrap_for_training(self.model, optim)
        self.optimizer = build_optimizer(self.ddp, optim)

    def step(self, groups, step: int) -> dict:
        """One step: the global loss before it, the grad norm, the weights after it."""
        import torch.distributed as dist

        from megatron_rl.parallel.optim import gather_updated_weights, optimizer_step
        from megatron_rl.parallel.schedule import run_schedule

        outputs = run_schedule(self.ddp, _micro_batches(groups, step), _loss_fn(groups), forward_only=False)
        totals = torch.stack([sum(o["loss_sum"] for o in outputs), sum(o["tokens"] for o in outputs)]).double()
        dist.all_reduce(totals, group=groups.dp)
        norm = optimizer_step(self.optimizer)["optim/grad_norm"]
        gather_updated_weights(self.ddp)
        return {"loss": float(totals[0] / totals[1]), "grad_norm": float(norm),
                "weights": {k: p.detach().float().clone() for k, p in self.model.named_parameters()}}

    def model_space_state(self) -> dict[str, torch.Tensor]:
        """Every parameter's fp32 main weight and Adam moments, assembled from all DP slices
        (exact: the slices are disjoint and summed with zeros), identical on every rank."""
        import torch.distributed as dist

        from megatron_rl.parallel.mcore_optimizer import optimizer_members

        names = {p: n for n, p in self.model.named_parameters()}
        out = {}
        for member in optimizer_members(self.optimizer):
            for buffer in member.buffers:
                for param in buffer.param_index_map:
                    full = {key: torch.zeros(param.numel()) for key in ("param", "exp_avg", "exp_avg_sq")}
                    if param in member.model_param_gbuf_map:
                        piece = member._get_model_param_range_map(param)["param"]
                        tensors = member._get_main_param_and_optimizer_states(param)
                        for key, t in full.items():
                            t[piece.start : piece.end] = tensors[key].detach().float()
                    for key, t in full.items():
                        dist.all_reduce(t, group=member.data_parallel_group)
                        out[f"{names[param]}.{key}"] = t
        return out


def _initial_weights(parallel, params_dtype):
    import dataclasses

    from megatron_rl.parallel.model import build_model

    model = build_model(dataclasses.replace(MODEL, params_dtype=params_dtype), parallel)
    return {k: t.clone() for k, t in model.state_dict().items() if torch.is_tensor(t)}


def _compare_optimizers(parallel, groups, params_dtype, variants) -> dict:
    """Two steps of each variant from the same weights; results keyed by variant."""
    init = _initial_weights(parallel, params_dtype)
    results = {}
    for name, optim in variants.items():
        run = _Run(parallel, optim, init, params_dtype)
        results[name] = [run.step(groups, step) for step in (1, 2)]
        results[name + ":bytes"] = _measured_bytes(run)
    return results


def _measured_bytes(run) -> dict:
    """Storage bytes of weights, gradient buffers, main weights and optimizer state (each
    storage once), and what ``optimizer_bytes_per_param`` predicts for this rank's parameters."""
    from megatron_rl.parallel.mcore_optimizer import optimizer_members

    storages: dict[int, int] = {}

    def count(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()

    for p in run.model.parameters():
        count(p)
    for buffer in run.ddp.buffers + run.ddp.expert_parallel_buffers:
        count(buffer.grad_data)
    predicted = 0.0
    for member in optimizer_members(run.optimizer):
        for group in member.optimizer.param_groups:
            for p in group["params"]:
                count(p)
                for value in member.optimizer.state[p].values():
                    if torch.is_tensor(value) and value.dim() > 0:
                        count(value)
        distributed = type(member).__name__ == "DistributedOptimizer"
        size = member.data_parallel_group.size() if distributed else 1
        dtype = str(run.model.config.params_dtype).removeprefix("torch.")
        per_param = optimizer_bytes_per_param(dtype, distributed=distributed, data_parallel_size=size).total
        members_params = {p for buffer in getattr(member, "buffers", []) for p in buffer.param_index_map} or {
            p for g in member.param_groups for p in g["params"]}
        predicted += per_param * sum(p.numel() for p in members_params)
    return {"measured": sum(storages.values()), "predicted": predicted}


def world2_worker(run_dir: str) -> dict:
    from megatron_rl.parallel.cpu_platform import cpu_platform
    from megatron_rl.parallel.groups import model_parallel
    from megatron_rl.train.checkpoint import (
        TrainerState,
        load_checkpoint,
        parallel_layout,
        save_checkpoint,
    )

    parallel = ParallelConfig()
    out = {}
    with cpu_platform(), model_parallel(parallel, seed=1234) as groups:
        out["DP2"] = _compare_optimizers(parallel, groups, "bfloat16",
                                         {"plain": PLAIN, "distributed": DISTRIBUTED, "overlap": OVERLAP})
        # fp32 distributed: checkpoints after SAVE_STEP steps in both formats, then one more step.
        run = _Run(parallel, DISTRIBUTED, _initial_weights(parallel, "float32"))
        for step in range(1, SAVE_STEP + 1):
            run.step(groups, step)
        for sharding in SHARDINGS:
            save_checkpoint(f"{run_dir}/{sharding}", run.ddp, run.optimizer, TrainerState(SAVE_STEP, 0, SAVE_STEP),
                            {}, groups.world, layout=parallel_layout(groups), sharding=sharding)
        out["saved_state"] = run.model_space_state()
        out["uninterrupted"] = [run.step(groups, step) for step in RESUMED_STEPS]
        resumed = _Run(parallel, DISTRIBUTED, None)
        load_checkpoint(_checkpoint(run_dir, "fully_reshardable"), resumed.ddp, resumed.optimizer, groups.world)
        out["resumed"] = [resumed.step(groups, step) for step in RESUMED_STEPS]
        out["plain into distributed"] = _load_plain_checkpoint_into_distributed(parallel, groups, run_dir)
    return out


def _load_plain_checkpoint_into_distributed(parallel, groups, run_dir) -> str:
    """What loading a plain optimizer's checkpoint into the distributed optimizer says."""
    from megatron_rl.train.checkpoint import (
        TrainerState,
        load_checkpoint,
        save_checkpoint,
    )

    plain = _Run(parallel, PLAIN, None)
    plain.step(groups, 1)
    save_checkpoint(f"{run_dir}/plain", plain.ddp, plain.optimizer, TrainerState(1, 0, 1), {}, groups.world)
    distributed = _Run(parallel, DISTRIBUTED, None)
    try:
        load_checkpoint(Path(run_dir) / "plain" / "checkpoints" / "step_000001", distributed.ddp,
                        distributed.optimizer, groups.world)
    except RuntimeError as refused:
        return str(refused)
    return "loaded"


def _checkpoint(run_dir, sharding):
    return Path(run_dir) / sharding / "checkpoints" / f"step_{SAVE_STEP:06d}"


TP2_DP2 = ParallelConfig(tensor_model_parallel_size=2, expert_tensor_parallel_size=2)
"""Experts sharded over TP too: with EP1 and ETP1 under TP2 the experts are replicated over
TP but reduced over DP only (Megatron counts EP1 experts as dense), so the TP copies drift."""
RESHARDED = {"DP4": ParallelConfig(), "TP2+SP x DP2": TP2_DP2}
RESUMED_STEPS = (SAVE_STEP + 1, SAVE_STEP + 2)


LAYOUTS4 = {"EP2": ParallelConfig(expert_model_parallel_size=2), "TP2+SP x DP2": TP2_DP2, "DP4": ParallelConfig()}
"""The world of 4's layouts: plain vs distributed in the first two, resumes in the last two."""


def world4_worker(run_dir: str) -> dict:
    from megatron_rl.parallel.cpu_platform import cpu_platform
    from megatron_rl.parallel.groups import model_parallel
    from megatron_rl.train.checkpoint import load_checkpoint

    out = {}
    with cpu_platform():
        for name, parallel in LAYOUTS4.items():
            with model_parallel(parallel, seed=1234) as groups:
                if name != "DP4":
                    out[name] = _compare_optimizers(parallel, groups, "bfloat16",
                                                    {"plain": PLAIN, "distributed": DISTRIBUTED})
                if name not in RESHARDED:
                    continue
                for sharding in SHARDINGS if name == "DP4" else SHARDINGS[:1]:
                    run = _Run(parallel, DISTRIBUTED, None)
                    load_checkpoint(_checkpoint(run_dir, sharding), run.ddp, run.optimizer, groups.world)
                    state = run.model_space_state() if parallel.tensor_model_parallel_size == 1 else None
                    out[f"resumed {name} {sharding}"] = {"state": state,
                                                         "steps": [run.step(groups, step) for step in RESUMED_STEPS]}
    return out


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("distopt"))


@pytest.fixture(scope="module")
def worlds(run_dir):
    two = run_world(world2_worker, 2, run_dir, timeout_s=900)
    four = run_world(world4_worker, 4, run_dir, timeout_s=1200)
    return two, four


def _relative(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-30)


def _weights_relative(got: dict, want: dict) -> float:
    diff = math.sqrt(sum(float((got[k] - want[k]).double().pow(2).sum()) for k in want))
    norm = math.sqrt(sum(float(want[k].double().pow(2).sum()) for k in want))
    return diff / norm


def _assert_step_equal(got: dict, want: dict, tolerance: float, where: str):
    assert _relative(got["loss"], want["loss"]) <= tolerance, (where, got["loss"], want["loss"])
    assert _relative(got["grad_norm"], want["grad_norm"]) <= tolerance, (where, got["grad_norm"], want["grad_norm"])
    assert _weights_relative(got["weights"], want["weights"]) <= tolerance, (where, _weights_relative(got["weights"], want["weights"]))


@pytest.mark.parametrize("layout, variant", [("DP2", "distributed"), ("DP2", "overlap"),
                                             ("EP2", "distributed"), ("TP2+SP x DP2", "distributed")])
def test_distributed_step_equals_plain_step(worlds, layout, variant):
    ranks = worlds[0] if layout == "DP2" else worlds[1]
    for rank, result in enumerate(ranks):
        for step in (0, 1):
            _assert_step_equal(result[layout][variant][step], result[layout]["plain"][step], 1e-6,
                               f"{layout} {variant} rank {rank} step {step + 1}")


def test_same_size_resume_is_bit_identical(worlds):
    for rank, result in enumerate(worlds[0]):
        for got, want in zip(result["resumed"], result["uninterrupted"], strict=True):
            assert (got["loss"], got["grad_norm"]) == (want["loss"], want["grad_norm"]), rank
            assert all(torch.equal(got["weights"][k], want["weights"][k]) for k in want["weights"]), rank


@pytest.mark.parametrize("sharding", SHARDINGS)
def test_resume_at_dp4_loads_the_saved_state_bitwise_and_runs_on(worlds, sharding):
    two, four = worlds
    saved, same_size = two[0]["saved_state"], two[0]["resumed"]
    for rank, result in enumerate(four):
        resumed = result[f"resumed DP4 {sharding}"]
        assert resumed["state"].keys() == saved.keys()
        assert [k for k in saved if not torch.equal(resumed["state"][k], saved[k])] == [], rank
        for step, (got, want) in enumerate(zip(resumed["steps"], same_size, strict=True)):
            _assert_step_equal(got, want, 1e-6, f"DP4 {sharding} rank {rank} step {RESUMED_STEPS[step]}")


def test_resume_at_tp2_reshards_model_and_optimizer(worlds):
    """TP2+SP x DP2 from a DP2 checkpoint: the loss of the first step says the weights loaded,
    the second step's loss says the first update (Adam's loaded moments) was the same."""
    same_size = worlds[0][0]["resumed"]
    for rank, result in enumerate(worlds[1]):
        for step, (got, want) in enumerate(zip(result["resumed TP2+SP x DP2 fully_reshardable"]["steps"], same_size)):
            where = f"rank {rank} step {RESUMED_STEPS[step]}"
            assert _relative(got["loss"], want["loss"]) <= 1e-6, (where, got["loss"], want["loss"])
            assert _relative(got["grad_norm"], want["grad_norm"]) <= 1e-6, (where, got["grad_norm"], want["grad_norm"])


def test_checkpoints_record_their_format_and_layout(worlds, run_dir):
    from megatron.core import dist_checkpointing

    from megatron_rl.parallel.mcore_optimizer import distributed_optimizer_metadata

    for sharding in SHARDINGS:
        path = _checkpoint(run_dir, sharding)
        assert dist_checkpointing.load_content_metadata(str(path)) == distributed_optimizer_metadata(sharding)
        body = json.loads((path / "trainer_state.json").read_text())
        assert body["optimizer"] == {"distributed": True, "sharding": sharding}
        assert body["optimizer_state"] is True
        assert body["layout"] == {"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1,
                                  "expert_model_parallel_size": 1, "expert_tensor_parallel_size": 1,
                                  "data_parallel_size": 2, "world_size": 2}


def test_plain_checkpoint_is_refused_by_the_distributed_optimizer(worlds):
    message = worlds[0][0]["plain into distributed"]
    assert "holds the plain optimizer's state, but this run uses the distributed optimizer" in message, message


def test_memory_per_parameter_matches_the_storages(worlds):
    """Plain: exactly the predicted bytes. Distributed: the predicted bytes plus the buffers'
    padding (each parameter at a multiple of 64 elements, buckets at lcm(D, 128)), < 1% here."""
    checked = 0
    for ranks in worlds:
        for result in ranks:
            for layout, variants in result.items():
                if not (isinstance(variants, dict) and "plain:bytes" in variants):
                    continue
                assert variants["plain:bytes"]["measured"] == variants["plain:bytes"]["predicted"], layout
                for name in ("distributed:bytes", "overlap:bytes"):
                    if name in variants:
                        measured, predicted = variants[name]["measured"], variants[name]["predicted"]
                        assert predicted <= measured <= 1.01 * predicted, (layout, name, measured, predicted)
                        checked += 1
    assert checked == 2 * 2 + 4 * 2  # DP2 (distributed, overlap); EP2 and TP2 x DP2 on 4 ranks
