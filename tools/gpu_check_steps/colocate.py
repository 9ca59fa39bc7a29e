"""Step ``colocate``: one colocated turn on one GPU, as ``rollout.placement: colocated`` runs it.

The trainer (``common.MADE_MODELS["mid"]``, ~0.5B bf16, Megatron DDP + Adam after one update, so
its optimizer state exists) and an hf engine over it share the GPU; ``train.colocate.EngineTurns``
runs the turn: the trainer's state goes to host memory, the engine's replica comes back and takes
the weights, the trainer's weights go out, the engine generates (16 prompts x 64 new tokens),
then the engine releases its memory and the trainer's state comes back.

Measured: the trainer's bytes moved out (``TrainerOffload``'s parts), the bytes torch holds and
the device memory the driver reports used (NVML) before the turn, inside it (before generating)
and after it. Pass: (1) what torch freed went back to the driver: NVML's drop >= 90% of torch's
allocated drop; (2) torch's drop >= 90% of the bytes moved out less the replica it resumed;
(3) every weight and optimizer-state tensor is bit for bit what it was before the turn.
"""

from __future__ import annotations

import torch

from gpu_check_steps.common import Context, Outcome, device_world, gib, made_model, nvml_used_bytes, verdict
from megatron_rl.sections import OptimConfig, ParallelConfig

PROMPTS, PROMPT_TOKENS, NEW_TOKENS = 16, 64, 64
SHARE = 0.9


def trainer_tensors(ddp, optimizer) -> list[torch.Tensor]:
    """Every weight, fp32 main weight and optimizer-state tensor of the trainer, in a fixed order."""
    from megatron_rl.parallel.mcore_optimizer import optimizer_members

    members = [m.optimizer for m in optimizer_members(optimizer)]
    mains = [p for m in members for group in m.param_groups for p in group["params"]]
    states = [v for m in members for s in m.state.values() for v in s.values() if torch.is_tensor(v)]
    return [*ddp.parameters(), *mains, *states]


def memory(ctx: Context) -> dict[str, int | None]:
    """Torch's allocated bytes and NVML's used bytes now (None in the dry run)."""
    if ctx.dry:
        nvml_used_bytes(ctx)
        return {"allocated": None, "nvml_used": None}
    torch.cuda.synchronize()
    return {"allocated": torch.cuda.memory_allocated(), "nvml_used": nvml_used_bytes(ctx)}


def run(ctx: Context) -> Outcome:
    from megatron_rl.algos.presets import get_preset
    from megatron_rl.config import RunConfig
    from megatron_rl.config_loading import from_dict
    from megatron_rl.parallel.model import build_model
    from megatron_rl.parallel.optim import build_optimizer, optimizer_step
    from megatron_rl.parallel.schedule import wrap_for_training
    from megatron_rl.parallel.train_step import RoutingPlan, TrainBatch, forward_backward
    from megatron_rl.rollout.engine import SamplingParams
    from megatron_rl.rollout.local.hf_engine import HFEngine
    from megatron_rl.train.colocate import EngineTurns

    m = made_model(ctx, "mid")
    cfg = from_dict(RunConfig, {"rollout": {"placement": "colocated", "engine": "hf"}})
    optim = OptimConfig(lr=1e-5)
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, m.vocab_size, (PROMPT_TOKENS,), generator=gen).tolist() for _ in range(PROMPTS)]
    with device_world(ctx) as groups:
        model = build_model(m, ParallelConfig())
        ddp = wrap_for_training(model, optim)
        optimizer = build_optimizer(ddp, optim)
        sequences = [torch.tensor(p + p[:NEW_TOKENS]) for p in prompts]
        batch = TrainBatch(sequences=sequences, prompt_lengths=[PROMPT_TOKENS] * PROMPTS,
                           old_logprobs_T=torch.full((PROMPTS * NEW_TOKENS,), -6.0),
                           advantages_T=torch.randn(PROMPTS * NEW_TOKENS, generator=gen))
        forward_backward(ddp, groups, batch, get_preset("dr_grpo"), RoutingPlan(mode="none", diagnostics=False))
        optimizer_step(optimizer)
        engine = HFEngine(ddp, groups, architecture="qwen3_moe", model_config=m)
        turns = EngineTurns(cfg, ddp, optimizer, engine)  # the engine starts released
        snapshot = [t.detach().to("cpu", copy=True) for t in trainer_tensors(ddp, optimizer)]
        metrics: dict = {}
        before = memory(ctx)
        with turns.generating(metrics):
            inside = memory(ctx)
            moved = sum(part.nbytes for part in turns.offload.parts.values())
            replica = sum(p.numel() * p.element_size() for p in engine.hf_model.parameters())
            samples = engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=NEW_TOKENS), seed=1)
        after = memory(ctx)
        restored = [torch.equal(a, b.detach().cpu()) for a, b in zip(snapshot, trainer_tensors(ddp, optimizer))]
    exact = len(restored) == len(snapshot) and all(restored)
    figures = {"moved_gib": gib(moved), "replica_gib": gib(replica), "tensors_compared": len(snapshot),
               "bitwise_restored": exact, "generated_tokens": sum(len(s.output_ids) for s in samples),
               **{k: float(v) for k, v in metrics.items() if k.startswith("time/")}}
    if ctx.dry:
        return Outcome("dry", f"{gib(moved)} GiB moved, replica {gib(replica)} GiB, restored bit for bit: {exact}",
                       figures)
    torch_freed = before["allocated"] - inside["allocated"]
    driver_got = before["nvml_used"] - inside["nvml_used"]
    figures.update({f"{when}_{k}_gib": gib(v) for when, d in (("before", before), ("inside", inside),
                                                                ("after", after)) for k, v in d.items()},
                   torch_freed_gib=gib(torch_freed), driver_got_back_gib=gib(driver_got))
    ok = exact and driver_got >= SHARE * torch_freed and torch_freed >= SHARE * (moved - replica)
    headline = (f"{gib(moved)} GiB moved out, replica {gib(replica)} GiB back in: torch freed {gib(torch_freed)} GiB, "
                f"the driver got back {gib(driver_got)} GiB (NVML); restored bit for bit: {exact}; "
                f"offload {figures.get('time/offload', 0):.2f} s, restore {figures.get('time/restore', 0):.2f} s")
    return Outcome(verdict(ctx, ok), headline, figures)
