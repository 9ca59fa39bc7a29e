"""Every objective preset config (configs/objectives/*.yaml) runs the demo's update step.

One EP2 world: the old-policy pass records routing, then each preset's objective drives
one R2-replayed forward/backward/optimizer step of the same batch. Losses and gradients
must be finite and the router must receive a gradient.
"""

import math
from pathlib import Path

import pytest
import torch

from megatron_rl.parallel.smoke_worker import random_sequences
from megatron_rl.parallel.world import run_world
from megatron_rl.config import load_config

pytestmark = pytest.mark.parallel

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "configs" / "objectives").glob("*.yaml"))


def presets_worker(config_paths):
    from megatron_rl.config import resolve_objective
    from megatron_rl.parallel.cpu_platform import cpu_platform
    from megatron_rl.parallel.groups import model_parallel
    from megatron_rl.parallel.logprobs import compute_logprobs
    from megatron_rl.parallel.model import build_model
    from megatron_rl.parallel.optim import build_optimizer, optimizer_step
    from megatron_rl.parallel.schedule import wrap_for_training
    from megatron_rl.parallel.train_step import (
        RoutingPlan,
        TrainBatch,
        forward_backward,
    )

    first = load_config(config_paths[0], world_size=2)
    parallel = first.parallel
    with cpu_platform(), model_parallel(parallel, seed=0) as groups:
        model = build_model(first.model, parallel, moe_enable_routing_replay=True)
        ddp = wrap_for_training(model)
        optimizer = build_optimizer(ddp, first.optim)
        sequences = random_sequences(8, first.model.vocab_size, 6, 14, seed=3)
        mine = list(range(groups.dp_rank, 8, groups.dp_size))
        seqs = [sequences[i] for i in mine]
        prompts = [3] * len(seqs)
        old = compute_logprobs(ddp, groups, seqs, prompts, micro_batch_sequences=4, record_routing=True)
        gen = torch.Generator().manual_seed(10 + groups.dp_rank)
        advantages = torch.randn(old.logprobs_T.shape, generator=gen)
        out = {}
        for path in config_paths:
            cfg = load_config(path, world_size=2)
            batch = TrainBatch(
                sequences=seqs, prompt_lengths=prompts, old_logprobs_T=old.logprobs_T,
                advantages_T=advantages, rollout_logprobs_T=old.logprobs_T - 0.01,
                ref_logprobs_T=old.logprobs_T + 0.02, truncated_S=torch.zeros(len(seqs), dtype=torch.bool),
                old_record=old.record,
            )
            result = forward_backward(ddp, groups, batch, resolve_objective(cfg),
                                      RoutingPlan(mode=cfg.train.routing_replay), micro_batch_sequences=4)
            router_grad = sum(float(l.mlp.router.weight.main_grad.abs().sum()) for l in model.decoder.layers)
            step = optimizer_step(optimizer)
            out[Path(path).stem] = {"loss": float(result.loss), "router_grad": router_grad,
                                   "grad_norm": float(step["optim/grad_norm"])}
        return out


@pytest.fixture(scope="module")
def results():
    return run_world(presets_worker, 2, [str(p) for p in CONFIGS], timeout_s=300)[0]


def test_there_is_a_config_per_preset():
    from megatron_rl.algos.presets import OBJECTIVE_PRESETS

    assert sorted(p.stem for p in CONFIGS) == sorted(OBJECTIVE_PRESETS.names())


@pytest.mark.parametrize("name", [p.stem for p in CONFIGS])
def test_preset_config_runs_the_update_step(results, name):
    res = results[name]
    assert math.isfinite(res["loss"]), res
    assert math.isfinite(res["grad_norm"]) and res["grad_norm"] > 0, res
    assert res["router_grad"] > 0, res
