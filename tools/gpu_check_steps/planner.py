"""Step ``planner``: the memory planner's update-step peak against ``torch.cuda.max_memory_allocated``.

Each case is a run config (``common.MADE_MODELS["mid"]``, ~0.5B parameters in bf16, on one GPU:
DP1) with a token budget or a sequence count per micro-batch, a recompute choice and the plain or
distributed optimizer. Built as the trainer builds it (``build_model`` with ``recompute_fields``,
Megatron DDP and the optimizer for ``optim``), it runs two Dr. GRPO updates over 8 samples of
512 + 1536 tokens; measured is the peak of allocated bytes during the second (Adam's state exists
from the first), less what was allocated before the case was built (nothing of a previous case:
a case whose model is not freed after it fails the step).
Predicted is the ``train`` phase of ``megatron_rl.plan.make_plan`` for that config on this GPU,
less the runtime reserve term (the CUDA context, NCCL and the allocator's slack: nothing
``max_memory_allocated`` counts). Pass: every case within 10%. The table also gives what the
caching allocator reserved at the peak, beside the planner's reserve.
"""

from __future__ import annotations

import dataclasses
import gc
import weakref

import torch

from gpu_check_steps.common import MADE_MODELS, Context, Outcome, device_world, gib, verdict

SAMPLE = (512, 1536)
"""Prompt and response tokens of every sample (8 samples: 16384 tokens a step)."""
DRY_SCALE = 128
"""The dry run divides every token count by this (samples of 4 + 12 tokens)."""
TOLERANCE = 0.10


@dataclasses.dataclass(frozen=True)
class Case:
    """One measured configuration (token counts at the GPU's scale)."""

    name: str
    overrides: tuple[str, ...]
    """``key=value`` overrides of the run config; ``{tokens:N}`` is a token count (scaled in the dry run)."""


CASES = (
    Case("4k", ("train.micro_batch_tokens={tokens:4096}",)),
    Case("16k", ("train.micro_batch_tokens={tokens:16384}",)),
    Case("16k-selective", ("train.micro_batch_tokens={tokens:16384}", "train.recompute=selective")),
    Case("16k-full", ("train.micro_batch_tokens={tokens:16384}", "train.recompute=full")),
    Case("2-sequences", ("train.micro_batch_sequences=2",)),
    Case("8k-distributed", ("train.micro_batch_tokens={tokens:8192}", "optim.distributed=true")),
    Case("16k-full-distributed", ("train.micro_batch_tokens={tokens:16384}", "train.recompute=full",
                                  "optim.distributed=true")),
    Case("8k-dense-shared", ("train.micro_batch_tokens={tokens:8192}", "model.num_dense_layers=1",
                             "model.ffn_hidden_size={width:2048}",
                             "model.moe_shared_expert_intermediate_size={width:512}",
                             "model.moe_shared_expert_gate=true")),
)


def case_config(ctx: Context, case: Case):
    """The validated run config of ``case`` (world of one)."""
    from megatron_rl.config import RunConfig, validate
    from megatron_rl.config_loading import from_dict, merge, parse_overrides

    scale = DRY_SCALE if ctx.dry else 1
    prompt, response = (n // scale for n in SAMPLE)
    model = {**MADE_MODELS["tiny" if ctx.dry else "mid"], "params_dtype": "bfloat16"}
    base = {
        "model": model,
        "data": {"max_prompt_tokens": prompt},
        "rollout": {"max_new_tokens": response, "group_size": 4, "prompts_per_step": 2},
        "train": {"routing_replay": "none", "routing_diagnostics": False, "mini_batches": 1},
        "objective": {"preset": "dr_grpo"},
        "optim": {"optimizer": "adam", "lr": 1e-6},
    }
    width = model["hidden_size"] * 2 if ctx.dry else None
    overrides = [_fill(o, scale, width) for o in case.overrides]
    return validate(from_dict(RunConfig, merge(base, parse_overrides(overrides))), 1)


def _fill(override: str, scale: int, width: int | None) -> str:
    """``{tokens:N}`` -> N / scale; ``{width:N}`` -> N (or the dry run's width)."""
    key, _, value = override.partition("=")
    if value.startswith("{tokens:"):
        value = str(int(value[len("{tokens:"):-1]) // scale)
    elif value.startswith("{width:"):
        value = str(width or int(value[len("{width:"):-1]))
    return f"{key}={value}"


def predicted_bytes(cfg, gpu_memory: int) -> tuple[int, int]:
    """(the planner's train-phase peak less its runtime reserve, that reserve) on one GPU."""
    from megatron_rl.plan import Machine, make_plan

    machine = Machine(gpus=1, gpu_memory=gpu_memory)
    plan = make_plan(cfg, machine)
    return max(p.peak for p in plan.phases if p.name == "train") - machine.runtime_reserve, machine.runtime_reserve


def measure(ctx: Context, cfg, groups) -> dict:
    """Build as the trainer does and run two updates; the second's peak of allocated bytes."""
    from megatron_rl.algos.presets import get_preset
    from megatron_rl.parallel.model import build_model, recompute_fields
    from megatron_rl.parallel.optim import build_optimizer, optimizer_step
    from megatron_rl.parallel.schedule import wrap_for_training
    from megatron_rl.parallel.train_step import RoutingPlan, TrainBatch, forward_backward

    prompt, response = cfg.data.max_prompt_tokens, cfg.rollout.max_new_tokens
    samples = cfg.rollout.prompts_per_step * cfg.rollout.group_size
    gen = torch.Generator().manual_seed(3)
    batch = TrainBatch(
        sequences=[torch.randint(0, cfg.model.vocab_size, (prompt + response,), generator=gen) for _ in range(samples)],
        prompt_lengths=[prompt] * samples, old_logprobs_T=torch.full((samples * response,), -6.0),
        advantages_T=torch.randn(samples * response, generator=gen))
    before = 0 if ctx.dry else torch.cuda.memory_allocated()
    model = build_model(cfg.model, cfg.parallel, moe_enable_routing_replay=True,
                        **recompute_fields(cfg.train.recompute))
    ddp = wrap_for_training(model, cfg.optim)
    optimizer = build_optimizer(ddp, cfg.optim)
    packing = {"micro_batch_tokens": cfg.train.micro_batch_tokens,
               "micro_batch_sequences": cfg.train.micro_batch_sequences}
    figures = {}
    for step in range(1 if ctx.dry else 2):
        if step == 1 and not ctx.dry:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        forward_backward(ddp, groups, batch, get_preset("dr_grpo"), RoutingPlan(mode="none", diagnostics=False),
                         **packing)
        figures = optimizer_step(optimizer)
    if not ctx.dry:
        torch.cuda.synchronize()
        figures = {"measured": torch.cuda.max_memory_allocated() - before, "before": before,
                   "reserved": torch.cuda.max_memory_reserved()}
    _drop_forward_tensors(model)
    freed = weakref.ref(model)
    del model, ddp, optimizer
    gc.collect()
    if freed() is not None:
        raise RuntimeError("the case's model is still referenced after it: the next case would not start clean")
    if not ctx.dry:
        torch.cuda.empty_cache()
    return figures


def _drop_forward_tensors(model: torch.nn.Module) -> None:
    """Drop the tensors modules keep from their last forward (Megatron's token dispatcher keeps
    its routing probabilities). Their autograd graph reaches the parameters' gradient hooks, whose
    closures hold the DDP wrapper and so the model: a cycle through autograd's C++ nodes, which
    ``gc`` cannot see. Without this each case left its weights, gradient buffer and main weights
    allocated (4.6 GiB a case on the H200: the "before GiB" column grew by that much)."""
    for module in model.modules():
        # The module and the helper objects it owns (the dispatcher is not a module).
        owners = [module] + [v for v in vars(module).values()
                             if hasattr(v, "__dict__") and not isinstance(v, (torch.nn.Module, type))]
        for owner in owners:
            for name, value in list(vars(owner).items()):
                if isinstance(value, torch.Tensor) and value.grad_fn is not None:
                    setattr(owner, name, None)


def run(ctx: Context) -> Outcome:
    gpu_memory = 1 << 40 if ctx.dry else torch.cuda.get_device_properties(0).total_memory
    rows, worst, failed, built = [], 0.0, [], set()
    with device_world(ctx) as groups:
        for case in CASES:
            cfg = case_config(ctx, case)
            predicted, reserve = predicted_bytes(cfg, gpu_memory)
            # The dry run builds and steps each model, recompute and optimizer once (packing alone
            # changes no call made).
            kind = (repr(cfg.model), cfg.train.recompute, cfg.optim.distributed)
            try:
                measured = measure(ctx, cfg, groups) if not (ctx.dry and kind in built) else {}
                built.add(kind)
            except Exception as err:  # noqa: BLE001 - one case's failure (an OOM) is its row
                if ctx.dry:
                    raise
                measured = {"failure": f"failed: {type(err).__name__}: {str(err).splitlines()[0][:80]}"}
            if "failure" in measured:  # out of the handler: its traceback no longer holds the case's tensors
                failed.append(case.name)
                rows.append({"case": case.name, "predicted GiB": gib(predicted), "error": measured["failure"]})
                gc.collect()
                torch.cuda.empty_cache()
                continue
            budget = cfg.train.micro_batch_tokens or f"{cfg.train.micro_batch_sequences} seq"
            row = {"case": case.name, "tokens": budget,
                   "recompute": cfg.train.recompute, "distributed": cfg.optim.distributed,
                   "predicted GiB": gib(predicted)}
            if not ctx.dry:
                error = (predicted - measured["measured"]) / measured["measured"]
                worst = max(worst, abs(error))
                row.update({"measured GiB": gib(measured["measured"]), "error": f"{100 * error:+.1f}%",
                            "reserved GiB": gib(measured["reserved"]), "planner reserve GiB": gib(reserve),
                            "before GiB": gib(measured["before"])})
            rows.append(row)
            ctx.log(str(row))
    ok = not failed and worst <= TOLERANCE
    headline = (f"{len(CASES)} cases (~0.5B bf16, DP1): worst error {100 * worst:.1f}% (limit {100 * TOLERANCE:.0f}%)"
                + (f"; failed: {', '.join(failed)}" if failed else ""))
    return Outcome(verdict(ctx, ok), headline, {"worst_error": worst, "failed": failed}, rows)
