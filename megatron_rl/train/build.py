"""Everything one RL run is made of, built in order before its first step.

Owns :func:`build_run`: the objective, the tokenizer and the prompts, the starting checkpoint
(validated again on every rank), the rollout servers (probed before the model exists, so a
run whose servers are missing fails in seconds), the policy in this run's layout with its
starting weights (an HF checkpoint streamed in, or a Megatron one resharded; skipped when the
run resumes), DDP and the optimizer, the rollout engine and its turns on the devices, the
reward pool, the rollout source and the batch generated ahead; and the services the loop
calls: the checkpoint lifecycle with the warm start, evaluation, the frozen models (the KL
reference, the distillation teachers), the HF exports, the run's log and the gap's breakdown.
The order is the one that matters: the starting weights are
loaded before the optimizer copies them into its fp32 main weights, and every random draw
happens in the same order on every start.

Does not own any of those parts (each lives in its module) nor the loop (``train.trainer``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from megatron_rl.checkpoint.init_source import InitSource, inspect_init_checkpoint
from megatron_rl.config import resolve_objective, validate_batch_split
from megatron_rl.data.prompts import PromptSet
from megatron_rl.fp8 import transformer_config_fields
from megatron_rl.parallel.comm import rank
from megatron_rl.parallel.model import build_model, recompute_fields
from megatron_rl.parallel.optim import build_optimizer
from megatron_rl.parallel.schedule import wrap_for_training
from megatron_rl.parallel.train_step import RoutingPlan
from megatron_rl.rewards.pool import RewardScorer
from megatron_rl.telemetry import GpuTelemetry
from megatron_rl.train.async_rollouts import AsyncRollouts
from megatron_rl.train.checkpoint import latest_checkpoint
from megatron_rl.train.colocate import EngineTurns
from megatron_rl.train.engines import build_engine, hf_architecture, rollout_urls
from megatron_rl.train.evaluation import Evaluator
from megatron_rl.train.frozen import FrozenModels
from megatron_rl.train.hf_export import RunExports
from megatron_rl.train.init_weights import load_initial_weights
from megatron_rl.train.lifecycle import CheckpointLifecycle
from megatron_rl.train.mismatch import StepMismatch
from megatron_rl.train.prepare import RunPrompts, load_run_prompts
from megatron_rl.train.rollouts import RolloutSource
from megatron_rl.train.run_log import RunLog
from megatron_rl.train.sft import WarmStart

if TYPE_CHECKING:
    from megatron_rl.algos import ObjectiveConfig
    from megatron_rl.config import RunConfig
    from megatron_rl.data.tokenizer import PromptTokenizer
    from megatron_rl.parallel.groups import ParallelGroups


@dataclass(kw_only=True)
class RunParts:
    """One run's parts on this rank."""

    objective: ObjectiveConfig
    """The resolved objective (preset + overrides)."""
    tokenizer: PromptTokenizer
    """The run's tokenizer (chat template applied)."""
    train_set: PromptSet
    """The training prompts."""
    eval_set: PromptSet
    """The held-out prompts (may be empty)."""
    init: InitSource | None
    """The starting checkpoint, or None for random weights."""
    model: torch.nn.Module
    """This rank's bare policy stage."""
    ddp: torch.nn.Module
    """The policy stage wrapped for training (Megatron's DDP)."""
    optimizer: object
    """The policy's optimizer (plain or distributed)."""
    engine: object
    """The rollout engine (hf, megatron or sglang)."""
    turns: EngineTurns
    """When the engine gets the weights and the devices."""
    plan: RoutingPlan
    """The updates' routing replay mode and diagnostics."""
    scorer: RewardScorer
    """The reward worker pool."""
    rollouts: RolloutSource
    """Draw, generate, score and choose this rank's groups."""
    ahead: AsyncRollouts | None
    """The batches generated ahead (``rollout.max_staleness`` > 0), else None."""
    checkpoints: CheckpointLifecycle
    """Start or resume, and every checkpoint."""
    evaluate: Evaluator
    """The held-out evaluation."""
    frozen: FrozenModels
    """The frozen models scored beside the policy (the KL reference, the distillation teachers)."""
    exports: RunExports
    """The HF checkpoints out."""
    log: RunLog
    """Where the rows go."""
    mismatch: StepMismatch
    """The sampled policy's temperatures, the saved rollouts and the gap's breakdown."""


def build_run(cfg: RunConfig, groups: ParallelGroups, prompts: RunPrompts | None = None) -> RunParts:
    """Collective: every part of the run, on every rank of the world together. ``prompts``:
    the tokenizer and prompts the input check loaded (``train.prepare.check_inputs``); None
    loads them here."""
    objective = resolve_objective(cfg)
    if prompts is None:
        prompts = load_run_prompts(cfg)
    tokenizer, train_set, eval_set = prompts.tokenizer, prompts.train, prompts.eval
    init = inspect_init_checkpoint(cfg.init_checkpoint) if cfg.init_checkpoint else None
    validate_batch_split(cfg, groups.dp_size)  # the entry points checked it from the config already
    # Before the model exists: a run whose rollout servers are missing fails in seconds.
    urls = rollout_urls(cfg, groups.world)
    model = build_model(cfg.model, cfg.parallel, moe_enable_routing_replay=True,
                        **transformer_config_fields(cfg.fp8), **recompute_fields(cfg.train.recompute))
    resume_path = latest_checkpoint(cfg.train.run_dir) if cfg.train.resume else None
    if resume_path is None and init is not None:
        # Before the optimizer exists: a mixed-precision optimizer copies the weights
        # into its fp32 main parameters when it is built.
        load_initial_weights(model, init, cfg.model, groups)
    ddp = wrap_for_training(model, cfg.optim)
    optimizer = build_optimizer(ddp, cfg.optim)
    engine = build_engine(cfg, ddp, groups, urls, hf_architecture(cfg, init))
    turns = EngineTurns(cfg, ddp, optimizer, engine)
    rank0 = rank(groups.world) == 0
    # Node 0's GPUs; on a machine without NVML this prints one line and reports nothing.
    telemetry = GpuTelemetry() if rank0 else None
    plan = RoutingPlan(mode=cfg.train.routing_replay, diagnostics=cfg.train.routing_diagnostics)
    scorer = RewardScorer(cfg.reward)
    rollouts = RolloutSource(cfg, objective, groups, engine, tokenizer, train_set, scorer)
    # rollout.max_staleness k > 0: the next k steps' first rounds are generated while a step trains.
    ahead = (AsyncRollouts(rollouts, cfg.rollout.max_staleness, cfg.rollout.partial)
             if cfg.rollout.max_staleness > 0 else None)
    warm_start = (WarmStart(cfg, groups, ddp, optimizer, train_set, tokenizer, rollouts.mine, urls)
                  if cfg.train.sft_steps > 0 else None)
    return RunParts(
        objective=objective, tokenizer=tokenizer, train_set=train_set, eval_set=eval_set, init=init,
        model=model, ddp=ddp, optimizer=optimizer, engine=engine, turns=turns, plan=plan, scorer=scorer,
        rollouts=rollouts, ahead=ahead,
        checkpoints=CheckpointLifecycle(cfg, groups, ddp, optimizer, turns, rollouts, ahead, resume_path, init,
                                        warm_start),
        evaluate=Evaluator(cfg.eval, cfg.seed, groups, eval_set, rollouts, turns, engine),
        frozen=FrozenModels(cfg, objective, model, groups, turns),
        exports=RunExports(cfg, groups, ddp, init, tokenizer),
        log=RunLog(cfg.train.run_dir, rank0, cfg.train.progress, engine, telemetry),
        mismatch=StepMismatch(cfg.train, ddp, groups),
    )
