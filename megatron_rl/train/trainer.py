"""The RL loop: rollouts -> DP balance -> old-policy pass -> advantages -> updates under the
routing plan -> engine refresh -> evaluation -> checkpoint (+ HF out).

Owns :class:`Trainer`: building the run (policy, optimizer, rollout engine, reward pool),
starting or resuming it, one RL step after the rollouts, evaluation, checkpoints and the
HF export. The rollouts themselves (data draw, sampling rounds, rewards, dynamic sampling)
are :mod:`megatron_rl.train.rollouts`; with ``rollout.max_staleness: 1`` the next step's
first round is generated while a step trains (:mod:`megatron_rl.train.async_rollouts`);
0 keeps the synchronous loop. With ``rollout.placement: colocated`` the engine and the trainer
take turns on the devices around every generation (:mod:`megatron_rl.train.colocate`). With
``rollout.env`` each sample is a multi-turn trajectory
(:mod:`megatron_rl.rollout.multiturn`): the loss mask of every pass is the tokens the policy
generated, and the environment's tokens stay in the context only.

The policy starts from ``init_checkpoint`` (an HF directory streamed into this run's
layout, or a Megatron checkpoint) unless the run directory holds a checkpoint of its own,
which always wins (resume). Prompts come from ``megatron_rl.data`` (files with the chat
template applied, or a built-in task), rewards from ``megatron_rl.rewards`` (a process
pool per rank).

Runs on every rank of the world inside ``model_parallel`` (and the CPU platform when there
is no GPU). Each data-parallel rank owns whole groups (all G responses of a prompt), so
group advantages need no communication; losses are normalized over the global batch.
Everything random is drawn from generators seeded by (seed, step, round), and the data
order by (seed, epoch), so a resumed run continues exactly as an uninterrupted one.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from pathlib import Path

import torch
from megatron.core import dist_checkpointing

from megatron_rl.algos import compute_advantages, kl_estimate_T
from megatron_rl.algos.segments import seq_ids_from_cu_seqlens
from megatron_rl.checkpoint.init_source import inspect_init_checkpoint
from megatron_rl.config import RunConfig, resolve_objective, validate_batch_split
from megatron_rl.config_loading import to_dict
from megatron_rl.data.prompts import load_prompts
from megatron_rl.fp8 import transformer_config_fields
from megatron_rl.parallel.checkpoint import load_model, save_model
from megatron_rl.parallel.comm import all_reduce, broadcast_object, mean_over, rank
from megatron_rl.parallel.groups import ParallelGroups
from megatron_rl.parallel.logprobs import compute_logprobs
from megatron_rl.parallel.model import build_model, recompute_fields
from megatron_rl.parallel.optim import (
    build_optimizer,
    gather_updated_weights,
    optimizer_step,
)
from megatron_rl.parallel.schedule import wrap_for_training
from megatron_rl.parallel.train_step import RoutingPlan, TrainBatch, forward_backward
from megatron_rl.rewards.pool import RewardScorer
from megatron_rl.rollout.multiturn import trajectory_stats
from megatron_rl.rollout.trajectory import turn_layout, turn_of_positions
from megatron_rl.telemetry import GpuTelemetry
from megatron_rl.train.async_rollouts import AsyncRollouts, resume_batch
from megatron_rl.train.checkpoint import (
    TrainerState,
    WrittenCheckpoint,
    latest_checkpoint,
    load_checkpoint,
    parallel_layout,
    publish_checkpoint,
    write_checkpoint,
)
from megatron_rl.train.colocate import EngineTurns
from megatron_rl.train.dp_balance import rebalance_over_dp
from megatron_rl.train.engines import (
    build_engine,
    hf_architecture,
    probe_rollout_servers,
    rollout_urls,
)
from megatron_rl.train.evaluation import pass_at_k
from megatron_rl.train.hf_export import HFExportSpec, export_hf
from megatron_rl.train.init_weights import load_initial_weights
from megatron_rl.train.metrics import MetricsLogger, progress
from megatron_rl.train.phases import StepWatch, phase_timer
from megatron_rl.train.prepare import max_prompt_tokens, run_tokenizer
from megatron_rl.train.rollouts import Groups, RolloutSource, check_versions
from megatron_rl.train.sft import run_warm_start
from megatron_rl.train.sinks import Trackers


class Trainer:
    """One RL run on this rank (construct and ``run()`` on every rank together)."""

    def __init__(self, cfg: RunConfig, groups: ParallelGroups) -> None:
        self.cfg, self.groups = cfg, groups
        self.objective = resolve_objective(cfg)
        self.tokenizer = run_tokenizer(cfg)
        limit = max_prompt_tokens(cfg)
        self.train_set = load_prompts(cfg.data, "train", self.tokenizer, limit)
        self.eval_set = load_prompts(cfg.data, "eval", self.tokenizer, limit)
        self.init = inspect_init_checkpoint(cfg.init_checkpoint) if cfg.init_checkpoint else None
        validate_batch_split(cfg, groups.dp_size)  # the entry points checked it from the config already
        # Before the model exists: a run whose rollout servers are missing fails in seconds.
        self.rollout_urls = rollout_urls(cfg, groups.world)
        self.model = build_model(cfg.model, cfg.parallel, moe_enable_routing_replay=True,
                                 **transformer_config_fields(cfg.fp8), **recompute_fields(cfg.train.recompute))
        self.resume_path = latest_checkpoint(cfg.train.run_dir) if cfg.train.resume else None
        if self.resume_path is None and self.init is not None:
            # Before the optimizer exists: a mixed-precision optimizer copies the weights
            # into its fp32 main parameters when it is built.
            load_initial_weights(self.model, self.init, cfg.model, groups)
        self.ddp = wrap_for_training(self.model, cfg.optim)
        self.optimizer = build_optimizer(self.ddp, cfg.optim)
        self.engine = build_engine(cfg, self.ddp, groups, self.rollout_urls, self.hf_architecture())
        self.turns = EngineTurns(cfg, self.ddp, self.optimizer, self.engine)
        self.reference = None
        self.rank0 = rank(groups.world) == 0
        # Node 0's GPUs; on a machine without NVML this prints one line and reports nothing.
        self.telemetry = GpuTelemetry() if self.rank0 else None
        self.plan = RoutingPlan(mode=cfg.train.routing_replay, diagnostics=cfg.train.routing_diagnostics)
        self.scorer = RewardScorer(cfg.reward)
        self.rollouts = RolloutSource(cfg, self.objective, groups, self.engine, self.tokenizer, self.train_set,
                                      self.scorer)
        # rollout.max_staleness > 0: the next step's first round is generated while a step trains.
        self.ahead = AsyncRollouts(self.rollouts) if cfg.rollout.max_staleness > 0 else None

    def hf_architecture(self) -> str:
        """The policy's HF ``model_type``: the starting checkpoint's, else ``rollout.sglang.hf_architecture``."""
        return hf_architecture(self.cfg, self.init)

    # ------------------------------------------------------------------ the run

    def run(self, trackers: Trackers | None = None) -> list[dict]:
        """The whole run; returns the per-step metrics (as floats) logged by this run, which
        ``trackers`` (W&B, MLflow) also get, with each HF checkpoint."""
        t = self.cfg.train
        history: list[dict] = []
        resume_step = int(self.resume_path.name.split("_")[-1]) if self.resume_path is not None else None
        with MetricsLogger(t.run_dir, enabled=self.rank0, resume_from_step=resume_step) as logger:
            def log(step, metrics):
                row = {k: float(v) for k, v in metrics.items()}
                history.append({"step": step, **row})
                logger.log(step, row)
                if trackers is not None:
                    trackers.log(step, row)

            state, written = self._start(self._print_warm_start)
            self._setup_reference(state)
            self._finish_owed_export(state)
            if written is not None:  # as every step: its row, then its checkpoint published
                log(0, {**self.evaluate(), **self._engine_metrics(),
                        "data/train_prompts": torch.tensor(float(len(self.train_set.records))),
                        "data/eval_prompts": torch.tensor(float(len(self.eval_set.records))),
                        "data/prompts_over_length": torch.tensor(
                            float(self.train_set.num_filtered + self.eval_set.num_filtered))})
                publish_checkpoint(written, self.groups.world)
            watch = StepWatch(self.cfg.profile, t.run_dir, rank(self.groups.world))
            bar = progress(range(state.step + 1, t.steps + 1), "RL steps", self.rank0 and t.progress)
            for step in bar:
                watch.begin(step)
                metrics = self.rl_step(step, state)
                state.step = step
                evaluating = step % t.eval_every == 0 or step == t.steps
                saving = step % t.save_every == 0 or step == t.steps
                if self.ahead is not None and (evaluating or saving):
                    # Evaluation sees this step's weights; a checkpoint holds the next batch, whole.
                    with phase_timer(metrics, "rollout_join"):
                        self.ahead.settle(state)
                if evaluating:
                    with phase_timer(metrics, "evaluation"):
                        metrics.update(self.evaluate())
                # Checkpoint and export are written before the step's row is logged (the row
                # holds their times), and the checkpoint is published after it: a run stopped
                # in between resumes at the step before, whose metrics end before this row.
                written = None
                if saving:
                    with phase_timer(metrics, "checkpoint"):
                        written = self._save(state, publish=False)
                exported = None
                if self._exports_hf_at(step):
                    with phase_timer(metrics, "hf_export"):
                        exported = self.export_hf(step)
                watch.end(step, metrics)
                if self.telemetry is not None:
                    metrics.update({k: torch.tensor(v) for k, v in self.telemetry.sample().items()})
                metrics.update(self._engine_metrics())
                log(step, metrics)
                if written is not None:
                    publish_checkpoint(written, self.groups.world)
                if exported is not None and trackers is not None:
                    trackers.log_checkpoint(step, exported)
            # Collective for SGLang (the weight-sync group spans every rank), so not in a
            # finally: a rank that failed must not wait here for peers that never come.
            self.engine.close()
        if self.telemetry is not None:
            self.telemetry.close()
        self.scorer.close()
        return history

    def rl_step(self, step: int, state: TrainerState) -> dict[str, torch.Tensor]:
        """One RL step; returns its metrics (identical on every rank)."""
        metrics: dict[str, torch.Tensor] = {}
        start = time.perf_counter()
        with phase_timer(metrics, "rollout"):
            chosen = self._rollouts(step, state, metrics)
        chosen = self._balanced(chosen, metrics)
        batch = self._batch(chosen, metrics)
        with phase_timer(metrics, "update"):
            self._update(batch, metrics)
        state.weight_version += 1
        if self.ahead is None:
            with phase_timer(metrics, "weight_sync"):
                self.turns.weights_changed(state.weight_version)  # asynchronous: pushed by ahead.take/settle
        tokens = torch.tensor([float(sum(int(s.numel()) for s in batch.sequences))])
        if self.groups.dp_size > 1:
            all_reduce(tokens, self.groups.dp)
        metrics["perf/tokens_per_s"] = tokens[0] / (time.perf_counter() - start)
        return metrics

    def _rollouts(self, step: int, state: TrainerState, metrics: dict) -> Groups:
        """This rank's groups of step ``step``; asynchronous, the first round is the one
        generated ahead, and step ``step + 1``'s is launched meanwhile."""
        if self.ahead is None:
            with self.turns.generating(metrics):
                return self.rollouts.collect(step, state, metrics)
        first = self.ahead.take(step, state, metrics)
        # Without dynamic sampling a step has one round: once it is here the servers owe
        # this step nothing, so the next batch starts before this one is even scored.
        # Further rounds are drawn before the next batch and generated with nothing in
        # flight, so with dynamic sampling the next batch waits for them. The last step
        # launches one too: the final checkpoint then holds it, and a run extended later
        # (train.steps raised) trains what an uninterrupted longer run would have.
        early = first is not None and not self.objective.dynamic_sampling
        if early:
            self.ahead.launch(step + 1, state)
        chosen = self.rollouts.collect(step, state, metrics, first)
        metrics.update(self.ahead.metrics([s for g in chosen.samples for s in g], state))
        if not early:
            self.ahead.launch(step + 1, state)
        return chosen

    def _balanced(self, chosen: Groups, metrics: dict) -> Groups:
        """With a token budget, re-deal whole groups over DP ranks so that tokens per rank balance."""
        if self.cfg.train.micro_batch_tokens is None or self.groups.dp_size == 1:
            return chosen
        items = list(zip(chosen.problems, chosen.samples, chosen.rewards))
        tokens = [sum(len(s.prompt_ids) + len(s.output_ids) for s in group) for group in chosen.samples]
        mine, balance = rebalance_over_dp(items, tokens, self.groups, self.cfg.train.mini_batches)
        metrics.update(balance)
        return Groups(*(list(column) for column in zip(*mine)))

    def _packing(self) -> dict:
        """Micro-batching keywords of the log-prob passes and the updates."""
        t = self.cfg.train
        return {"micro_batch_sequences": t.micro_batch_sequences, "micro_batch_tokens": t.micro_batch_tokens}

    def _batch(self, chosen: Groups, metrics: dict) -> TrainBatch:
        """Old-policy pass, optional reference pass and advantages for the chosen groups."""
        G = self.cfg.rollout.group_size
        samples = [s for group in chosen.samples for s in group]
        sequences = [s.tokens for s in samples]
        prompt_lengths = [len(s.prompt_ids) for s in samples]
        packing = self._packing()
        with phase_timer(metrics, "old_logprobs"):
            old = compute_logprobs(self.ddp, self.groups, sequences, prompt_lengths, record_routing=True, **packing)
        # The loss sees only what the policy generated: a multi-turn trajectory's environment
        # tokens stay in the context, masked. They have no rollout log-prob; they take the old
        # policy's, so that every train/rollout correction is neutral there.
        mask_T = torch.cat([s.loss_mask() for s in samples])
        rollout_lp = torch.where(mask_T, torch.cat([s.output_logprobs for s in samples]), old.logprobs_T)
        diff = (old.logprobs_T - rollout_lp)
        metrics.update(mean_over({
            "mismatch/train_rollout_abs_diff": diff.abs()[mask_T].mean(),
            "mismatch/train_rollout_kl": kl_estimate_T("k3", rollout_lp, old.logprobs_T)[mask_T].mean(),
        }, self.groups.dp))
        ref_lp = None
        if self.reference is not None:
            with phase_timer(metrics, "ref_logprobs"):
                ref_lp = compute_logprobs(self.reference, self.groups, sequences, prompt_lengths,
                                          **packing).logprobs_T
        seq_ids_T = seq_ids_from_cu_seqlens(old.cu_seqlens_S1)
        advantages = compute_advantages(
            self.objective, rewards_S=torch.cat(chosen.rewards).float(),
            group_ids_S=torch.arange(len(chosen.rewards)).repeat_interleave(G),
            seq_ids_T=seq_ids_T, loss_mask_T=mask_T, num_groups=len(chosen.rewards),
            old_logprobs_T=old.logprobs_T, ref_logprobs_T=ref_lp,
            turns=turn_layout(samples) if self.objective.turn_credit == "turn" else None,
        )
        routes = [s.routed_experts for s in samples] if self.cfg.rollout.return_routed_experts else None
        if routes is not None and self.rollouts.multiturn is not None:
            metrics.update(self._route_agreement_per_turn(samples, old.record))
        return TrainBatch(
            sequences=sequences, prompt_lengths=prompt_lengths, old_logprobs_T=old.logprobs_T,
            advantages_T=advantages.float(), loss_mask_T=mask_T, rollout_logprobs_T=rollout_lp,
            ref_logprobs_T=ref_lp, truncated_S=torch.tensor([s.finish_reason == "length" for s in samples]),
            old_record=old.record, rollout_routes=routes,
        )

    def _route_agreement_per_turn(self, samples, old_record) -> dict[str, torch.Tensor]:
        """``routing/rollout_agreement/turn<k>``: share of (position, layer) pairs whose rollout
        routes (what R3 replays) are the experts the old-policy pass chose, among the positions
        turn k's engine pass computed (``turn_of_positions``), averaged over the DP group."""
        same, count = {}, {}
        for i, s in enumerate(samples):
            rollout_NLK = s.routed_experts.long()
            old_NLK = old_record.sample(i).expert_ids_TLK[:-1].long()
            if rollout_NLK.shape[1] != old_NLK.shape[1]:
                rollout_NLK = rollout_NLK[:, [n - 1 for n in old_record.layer_numbers]]
            agree_N = (rollout_NLK.sort(-1).values == old_NLK.sort(-1).values).all(-1).double().mean(-1)
            turn_N = turn_of_positions(len(s.prompt_ids), s.turns or [(0, len(s.output_ids))], agree_N.numel())
            for k in range(1, int(turn_N.max()) + 1):
                same[k] = same.get(k, 0.0) + float(agree_N[turn_N == k].sum())
                count[k] = count.get(k, 0.0) + float((turn_N == k).sum())
        values = {f"routing/rollout_agreement/turn{k}": [same[k] / max(count[k], 1.0)] for k in same}
        return self.rollouts.agreed_means(values)

    def _update(self, batch: TrainBatch, metrics: dict) -> None:
        """Mini-batch / multi-epoch policy updates."""
        G, t = self.cfg.rollout.group_size, self.cfg.train
        groups_per_mb = self.rollouts.groups_per_rank // t.mini_batches
        collected: list[dict] = []
        for _ in range(t.epochs):
            for m in range(t.mini_batches):
                indices = list(range(m * groups_per_mb * G, (m + 1) * groups_per_mb * G))
                result = forward_backward(self.ddp, self.groups, batch.select(indices), self.objective,
                                          self.plan, **self._packing())
                collected.append({**result.metrics, **optimizer_step(self.optimizer)})
        # The weights are read next outside a forward (weight push, checkpoint, HF export).
        gather_updated_weights(self.ddp)
        for name in collected[0]:
            metrics[name] = torch.stack([c[name].float() for c in collected if name in c]).mean()

    def evaluate(self) -> dict[str, torch.Tensor]:
        """Held-out accuracy and pass@k over ``eval.num_samples`` responses per eval prompt.

        A response counts as correct when its reward is positive. Greedy accuracy is added
        when ``eval.greedy`` is set and the sampled evaluation is not greedy already.
        """
        e = self.cfg.eval
        if not self.eval_set.records:
            return {}  # no eval files: evaluation is optional
        records = self.eval_set.records[: e.max_prompts]
        records = records[: len(records) - len(records) % self.groups.dp_size]
        mine = self.rollouts.mine(records)
        n = e.num_samples
        asked = [r for r in mine for _ in range(n)]
        greedy = None
        with self.turns.generating():
            samples = self.rollouts.respond(asked, e.temperature, self.cfg.seed, return_routes=False)
            if e.greedy and e.temperature > 0:
                greedy = self.rollouts.respond(mine, 0.0, self.cfg.seed, return_routes=False)
        check_versions(samples, self.engine.weight_version)
        results = self.rollouts.score(asked, samples)
        rewards = [self.rollouts.total_reward(res, s) for res, s in zip(results, samples)]
        correct = [sum(reward > 0 for reward in rewards[i * n : (i + 1) * n]) for i in range(len(mine))]
        # A response whose reward failed counts as wrong: the fractions say how many did, and why.
        names = ["eval/accuracy", *(f"eval/pass@{k}" for k in e.pass_k), "eval/reward_error_frac",
                 "eval/reward_timeout_frac"]
        sums = [sum(correct) / n, *(pass_at_k(correct, n, k) for k in e.pass_k),
                sum(r.error is not None for r in results) / n, sum(r.timed_out for r in results) / n]
        if greedy is not None:
            names.append("eval/accuracy_greedy")
            sums.append(float(sum(self.rollouts.total_reward(res, s) > 0
                                  for res, s in zip(self.rollouts.score(mine, greedy), greedy))))
        totals = torch.tensor([*sums, float(len(mine))], dtype=torch.float64)
        if self.groups.dp_size > 1:
            all_reduce(totals, self.groups.dp)
        out = {name: (totals[i] / totals[-1]).float() for i, name in enumerate(names)}
        if self.rollouts.multiturn is not None:
            stats = trajectory_stats(samples)
            out.update({"eval/" + name.removeprefix("env/"): value
                        for name, value in self.rollouts.agreed_means(stats).items()})
        return out

    # ------------------------------------------------------------------ start and checkpoints

    def _start(self, log) -> tuple[TrainerState, WrittenCheckpoint | None]:
        """Resume from the run's latest checkpoint, or start (from ``init_checkpoint`` when set,
        already loaded by the constructor), optionally warm-start, and write step 0's checkpoint
        (returned, for the caller to publish after step 0's row)."""
        path = self.resume_path
        if path is not None:
            state = load_checkpoint(path, self.ddp, self.optimizer, self.groups.world)
            ahead = resume_batch(self.rollouts, path, state, asynchronous=self.ahead is not None)
            if self.ahead is not None:
                self.ahead.next = ahead
            self.turns.weights_changed(state.weight_version)
            if self.rank0:
                print(f"resumed from {path} (step {state.step})", flush=True)
            return state, None
        state = TrainerState(step=0, data_position=0, weight_version=0)
        if self.rank0 and self.init is not None:
            print(f"policy initialized from {self.init.path} ({self.init.hf.architecture})", flush=True)
        if self.cfg.train.sft_steps > 0:
            self._warm_start(log)
            gather_updated_weights(self.ddp)
            # The RL optimizer's fp32 main weights were copied before the warm start changed
            # the weights (a no-op for fp32 weights, which it updates in place).
            self.optimizer.reload_model_params()
            # The warm start changed the weights the engine was built with (same version 0).
            self.turns.weights_changed(state.weight_version)
        return state, self._save(state, publish=False)

    def _warm_start(self, log) -> None:
        """Supervised steps on the training prompts' reference answers (``train.sft_steps``)."""
        t = self.cfg.train
        if self.rollout_urls:
            # Servers may have died while the model was built; find out before the warm start.
            probe_rollout_servers(self.cfg, self.rollout_urls, self.groups.world)
        sft_optimizer = build_optimizer(self.ddp, dataclasses.replace(self.cfg.optim, lr=t.sft_lr))
        per_rank = t.sft_batch_size // self.groups.dp_size

        records = self.train_set.records
        stop = self.tokenizer.stop_token_ids[0]

        def examples(step):
            gen = torch.Generator().manual_seed(self.cfg.seed * 31 + step)
            picks = torch.randint(len(records), (t.sft_batch_size,), generator=gen).tolist()
            mine = [records[i] for i in self.rollouts.mine(picks)[:per_rank]]
            # The reference answer and the stop token: the model learns to answer and to stop.
            return [(list(r.prompt_ids), self.tokenizer.encode_text(r.ground_truth) + [stop]) for r in mine]

        run_warm_start(self.ddp, sft_optimizer, self.groups, examples, t.sft_steps,
                       t.micro_batch_sequences, log, lambda it, desc: progress(it, desc, self.rank0 and t.progress))

    def _save(self, state: TrainerState, publish: bool = True) -> WrittenCheckpoint:
        """Checkpoint, with the batch generated ahead when rollouts are asynchronous; published
        (named by ``latest``) unless the caller publishes it later (:func:`publish_checkpoint`)."""
        write_more = None
        if self.ahead is not None:
            self.ahead.settle(state)
            write_more = functools.partial(self.ahead.save, state=state)
        written = write_checkpoint(self.cfg.train.run_dir, self.ddp, self.optimizer, state, to_dict(self.cfg), self.groups.world,
                                   write_more, layout=parallel_layout(self.groups),
                                   sharding=self.cfg.optim.checkpoint_sharding)
        if publish:
            publish_checkpoint(written, self.groups.world)
        return written

    def _setup_reference(self, state: TrainerState) -> None:
        """A frozen copy of the starting policy, when the objective uses KL to a reference.

        Saved next to the checkpoints when the run starts, so a resumed run keeps the same
        reference.
        """
        if self.objective.kl_coef <= 0 and self.objective.kl_in_reward_coef <= 0:
            return
        ref_dir = Path(self.cfg.train.run_dir) / "checkpoints" / "reference"
        if state.step == 0 and not dist_checkpointing.check_is_distributed_checkpoint(str(ref_dir)):
            save_model(self.model, ref_dir)
        self.reference = build_model(self.cfg.model, self.cfg.parallel, **transformer_config_fields(self.cfg.fp8))
        load_model(self.reference, ref_dir)
        self.turns.add_frozen(self.reference)

    def _engine_metrics(self) -> dict[str, torch.Tensor]:
        """The SGLang client's counters since the last call (``sglang/attempts``, ``retries``,
        ``duplicates``, ``resyncs``, ``timeouts``), the same on every rank: a collective the
        engine reduces over the world itself. Nothing for the local engines."""
        step_metrics = getattr(self.engine, "step_metrics", None)
        return step_metrics() if step_metrics is not None else {}

    def _print_warm_start(self, step: int, metrics: dict) -> None:
        if self.rank0:
            values = ", ".join(f"{k}={float(v):.4f}" for k, v in metrics.items())
            print(f"  warm start step {step}: {values}", flush=True)

    def _exports_hf_at(self, step: int) -> bool:
        t = self.cfg.train
        return bool(t.save_hf and (step == t.steps or (t.save_hf_every and step % t.save_hf_every == 0)))

    def _finish_owed_export(self, state: TrainerState) -> None:
        """Collective: the HF checkpoint the resumed step owes, when it is missing. A step
        publishes its training checkpoint after its export, so a run stopped during the export
        resumes at the step before; this covers the rest (a run directory written before that
        order, ``train.save_hf`` turned on for the resume): the weights loaded are that step's,
        so the export is made now. Staging left by a stopped export is removed either way."""
        if self.resume_path is None or state.step == 0 or not self._exports_hf_at(state.step):
            return
        out = Path(self.cfg.train.run_dir) / "hf" / f"step_{state.step:06d}"
        # Rank 0 alone writes the export: on nodes without a shared file system only it can tell.
        if broadcast_object(self.rank0 and not out.is_dir(), 0, self.groups.world):
            if self.rank0:
                print(f"the HF export of step {state.step} did not finish before the run stopped: writing it now",
                      flush=True)
            self.export_hf(state.step)

    def export_hf(self, step: int) -> Path:
        """Collective: the current policy as an HF checkpoint in ``<run_dir>/hf/step_NNNNNN``."""
        cfg = self.cfg
        side_files = [Path(f) for f in self.init.hf.files] if self.init is not None else []
        own_tokenizer = cfg.data.source == "files" and cfg.tokenizer.path is not None
        spec = HFExportSpec(
            architecture=self.hf_architecture(),
            model=cfg.model, side_files=side_files,
            save_tokenizer=self.tokenizer.hf_tokenizer.save_pretrained if own_tokenizer else None,
        )
        out = export_hf(self.ddp, self.groups, Path(cfg.train.run_dir) / "hf" / f"step_{step:06d}", spec)
        if self.rank0:
            print(f"HF checkpoint: {out}", flush=True)
        return out
