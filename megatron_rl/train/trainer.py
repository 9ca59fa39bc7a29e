"""The RL loop: rollouts -> DP balance -> old-policy pass (+ frozen models' and teachers' passes) ->
advantages -> updates under the routing plan -> weight push -> log, evaluation, checkpoint
(+ HF out).

Owns :class:`Trainer`: the run's steps in order, and one RL step top to bottom
(:meth:`Trainer.rl_step`). Everything a step uses is built before the first one
(:mod:`megatron_rl.train.build`), each part behind a small interface in its own module: the
rollouts (data draw, sampling rounds, rewards, dynamic sampling, DP balance:
:mod:`~megatron_rl.train.rollouts`), the batch generated ahead with ``rollout.max_staleness: 1``
(:mod:`~megatron_rl.train.async_rollouts`; 0 keeps the synchronous loop), the engine's turns
on the devices (:mod:`~megatron_rl.train.colocate`), the checkpoint lifecycle with the warm
start (:mod:`~megatron_rl.train.lifecycle`, :mod:`~megatron_rl.train.sft`), evaluation
(:mod:`~megatron_rl.train.evaluation`), the frozen models such as the KL reference
and the distillation teachers (:mod:`~megatron_rl.train.frozen`, :mod:`~megatron_rl.train.teachers`),
the HF exports (:mod:`~megatron_rl.train.hf_export`), the sampled policy's temperatures and the
gap's breakdown (:mod:`~megatron_rl.train.mismatch`) and the
rows (:mod:`~megatron_rl.train.run_log`). With ``rollout.env`` each sample is a multi-turn
trajectory (:mod:`megatron_rl.rollout.multiturn`): the loss mask of every pass is the tokens
the policy generated, and the environment's tokens stay in the context only.

Runs on every rank of the world inside ``model_parallel`` (and the CPU platform when there
is no GPU). Each data-parallel rank owns whole groups (all G responses of a prompt), so
group advantages need no communication; losses are normalized over the global batch.
Everything random is drawn from generators seeded by (seed, step, round), and the data
order by (seed, epoch), so a resumed run continues exactly as an uninterrupted one.
"""

from __future__ import annotations

import time

import torch

from megatron_rl.algos import compute_advantages, kl_estimate_T, seq_ids_from_cu_seqlens
from megatron_rl.config import RunConfig
from megatron_rl.parallel.comm import all_reduce, mean_over, rank
from megatron_rl.parallel.groups import ParallelGroups
from megatron_rl.parallel.logprobs import compute_logprobs
from megatron_rl.parallel.optim import gather_updated_weights, optimizer_step
from megatron_rl.parallel.train_step import TrainBatch, forward_backward
from megatron_rl.rollout.trajectory import turn_layout
from megatron_rl.train.build import RunPrompts, build_run
from megatron_rl.train.checkpoint import TrainerState
from megatron_rl.train.drift import LagMeans, behaviour_route_ids, shift_record
from megatron_rl.train.phases import StepWatch, phase_timer
from megatron_rl.train.rollouts import Groups


class Trainer:
    """One RL run on this rank (construct and ``run()`` on every rank together)."""

    def __init__(self, cfg: RunConfig, groups: ParallelGroups, prompts: RunPrompts | None = None) -> None:
        self.cfg, self.groups = cfg, groups
        parts = build_run(cfg, groups, prompts)
        self.objective, self.tokenizer = parts.objective, parts.tokenizer
        self.train_set, self.eval_set = parts.train_set, parts.eval_set
        self.ddp, self.optimizer, self.plan = parts.ddp, parts.optimizer, parts.plan
        self.engine, self.turns, self.scorer = parts.engine, parts.turns, parts.scorer
        self.rollouts, self.ahead = parts.rollouts, parts.ahead
        self.checkpoints, self.evaluate, self.exports = parts.checkpoints, parts.evaluate, parts.exports
        self.frozen, self.log, self.mismatch = parts.frozen, parts.log, parts.mismatch
        self.reference = None
        """The KL reference, once the run has started (None: the objective has no KL)."""
        self.teachers = None
        """The distillation teachers, once the run has started (None: no ``distill.teachers``)."""

    # ------------------------------------------------------------------ the run

    def run(self, trackers=None) -> list[dict]:
        """The whole run; returns the per-step metrics (as floats) logged by this run, which
        ``trackers`` (``train.sinks.Trackers``: W&B, MLflow) also get, with each HF checkpoint."""
        t = self.cfg.train
        with self.log.open(trackers, self.checkpoints.resumed_step) as log:
            state, written = self.checkpoints.start()
            self.reference = self.frozen.reference(state.step)
            self.teachers = self.frozen.teachers()
            self.exports.finish_owed(state.step, resumed=self.checkpoints.resumed_step is not None)
            if written is not None:  # as every step: its row, then its checkpoint published
                log.log(0, {**self.evaluate(), **log.engine_metrics(),
                            "data/train_prompts": torch.tensor(float(len(self.train_set.records))),
                            "data/eval_prompts": torch.tensor(float(len(self.eval_set.records))),
                            "data/prompts_over_length": torch.tensor(
                                float(self.train_set.num_filtered + self.eval_set.num_filtered))})
                self.checkpoints.publish(written)
            watch = StepWatch(self.cfg.profile, t.run_dir, rank(self.groups.world))
            for step in log.progress(range(state.step + 1, t.steps + 1), "RL steps"):
                watch.begin(step)
                metrics = self.rl_step(step, state)
                state.step = step
                evaluating = step % t.eval_every == 0 or step == t.steps
                saving = step % t.save_every == 0 or step == t.steps
                if self.ahead is not None and (evaluating or saving):
                    # Evaluation sees this step's weights; a checkpoint holds the batches ahead, whole.
                    with phase_timer(metrics, "rollout_join"):
                        self.ahead.settle(state, everything=saving)
                if evaluating:
                    with phase_timer(metrics, "evaluation"):
                        metrics.update(self.evaluate())
                # Checkpoint and export are written before the step's row is logged (the row
                # holds their times), and the checkpoint is published after it: a run stopped
                # in between resumes at the step before, whose metrics end before this row.
                written = None
                if saving:
                    with phase_timer(metrics, "checkpoint"):
                        written = self.checkpoints.save(state, publish=False)
                exported = None
                if self.exports.due(step):
                    with phase_timer(metrics, "hf_export"):
                        exported = self.exports(step)
                watch.end(step, metrics)
                metrics.update(log.step_extras())
                log.log(step, metrics)
                if written is not None:
                    self.checkpoints.publish(written)
                if exported is not None:
                    log.log_checkpoint(step, exported)
            # Collective for SGLang (the weight-sync group spans every rank), so not in a
            # finally: a rank that failed must not wait here for peers that never come.
            self.engine.close()
            if self.teachers is not None:
                self.teachers.close()
        self.log.close()
        self.scorer.close()
        return self.log.history

    # ------------------------------------------------------------------ one RL step

    def rl_step(self, step: int, state: TrainerState) -> dict[str, torch.Tensor]:
        """One RL step; returns its metrics (identical on every rank)."""
        metrics: dict[str, torch.Tensor] = {}
        start = time.perf_counter()
        with phase_timer(metrics, "rollout"):
            chosen = self._rollouts(step, state, metrics)
        chosen = self.rollouts.balanced(chosen, metrics)
        self.mismatch.save(step, [s for g in chosen.samples for s in g])
        # Asynchronous: drift against staleness, per version lag (megatron_rl.train.drift).
        drift = LagMeans(self.cfg.rollout.max_staleness, state.weight_version) if self.ahead is not None else None
        batch = self._batch(chosen, metrics, drift)
        self.mismatch.breakdown(step, chosen.samples, batch, metrics)
        with phase_timer(metrics, "update"):
            self._update(batch, metrics, drift)
        if drift is not None:
            metrics.update(drift.reduce(self.groups))
        state.weight_version += 1
        with phase_timer(metrics, "weight_sync"):
            if self.ahead is None:
                self.turns.weights_changed(state.weight_version)
            else:  # partial rollouts: pushed now, the batches in flight paused; else at the next take
                self.ahead.weights_changed(state)
        tokens = torch.tensor([float(sum(int(s.numel()) for s in batch.sequences))])
        if self.groups.dp_size > 1:
            all_reduce(tokens, self.groups.dp)
        metrics["perf/tokens_per_s"] = tokens[0] / (time.perf_counter() - start)
        return metrics

    def _rollouts(self, step: int, state: TrainerState, metrics: dict) -> Groups:
        """This rank's groups of step ``step``; asynchronous, the first round is the one
        generated ahead, and the batches of steps up to ``step + k`` are launched meanwhile."""
        if self.ahead is None:
            with self.turns.generating(metrics):
                return self.rollouts.collect(step, state, metrics)
        first = self.ahead.take(step, state, metrics)
        # Without dynamic sampling a step has one round: once it is here the servers owe
        # this step nothing, so the next batch starts before this one is even scored.
        # Further rounds are drawn before the next batch, so with dynamic sampling it waits
        # for them (and a step without a batch ahead draws its own first). The last step
        # launches too: the final checkpoint then holds the batches, and a run extended later
        # (train.steps raised) trains what an uninterrupted longer run would have.
        early = first is not None and not self.objective.dynamic_sampling
        if early:
            self.ahead.fill(step, state)
        chosen = self.rollouts.collect(step, state, metrics, first)
        metrics.update(self.ahead.metrics([s for g in chosen.samples for s in g], state))
        if not early:
            self.ahead.fill(step, state)
        return chosen

    def _packing(self) -> dict:
        """Micro-batching keywords of the log-prob passes and the updates."""
        t = self.cfg.train
        return {"micro_batch_sequences": t.micro_batch_sequences, "micro_batch_tokens": t.micro_batch_tokens}

    def _batch(self, chosen: Groups, metrics: dict, drift: LagMeans | None = None) -> TrainBatch:
        """Old-policy pass, optional reference pass and advantages for the chosen groups, at their
        temperatures; with ``drift`` (asynchronous rollouts) RSPO measures at the experts each
        token was produced with, and the drift per version lag is measured."""
        G = self.cfg.rollout.group_size
        samples = [s for group in chosen.samples for s in group]
        sequences = [s.tokens for s in samples]
        prompt_lengths = [len(s.prompt_ids) for s in samples]
        packing = {**self._packing(), "temperature_T": self.mismatch.temperatures(samples)}
        routes = [s.routed_experts for s in samples] if self.cfg.rollout.return_routed_experts else None
        query, layers = (None, None)
        if drift is not None and routes is not None:
            query, layers = behaviour_route_ids(self.ddp, sequences, routes)
        with phase_timer(metrics, "old_logprobs"):
            old = compute_logprobs(self.ddp, self.groups, sequences, prompt_lengths, record_routing=True,
                                   query_ids_TLK=query, query_layer_numbers=layers, **packing)
        # The loss sees only what the policy generated: a multi-turn trajectory's environment
        # tokens stay in the context, masked. They have no rollout log-prob; they take the old
        # policy's, so that every train/rollout correction is neutral there.
        mask_T = torch.cat([s.loss_mask() for s in samples])
        rollout_lp = torch.where(mask_T, torch.cat([s.output_logprobs for s in samples]), old.logprobs_T)
        diff = (old.logprobs_T - rollout_lp)
        metrics.update(mean_over({
            "mismatch/train_rollout_abs_diff": diff.abs()[mask_T].mean(),
            "mismatch/train_rollout_kl": kl_estimate_T("k3", rollout_lp, old.logprobs_T)[mask_T].mean(),
            **self.mismatch.truncation(samples, mask_T),
        }, self.groups.dp))
        ref_lp = None
        if self.reference is not None:
            with phase_timer(metrics, "ref_logprobs"):
                ref_lp = self.reference.logprobs_T(sequences, prompt_lengths, **packing)
        taught = None
        if self.teachers is not None:
            with phase_timer(metrics, "teacher_logprobs"):
                # The teachers are scored at T = 1, the distribution distilled into the sampled policy.
                taught = self.teachers.score([p for p in chosen.problems for _ in range(G)], sequences,
                                             prompt_lengths, self._packing())
            metrics.update(mean_over(taught.metrics(old.logprobs_T, mask_T), self.groups.dp))
        seq_ids_T = seq_ids_from_cu_seqlens(old.cu_seqlens_S1)
        advantages = compute_advantages(
            self.objective, rewards_S=torch.cat(chosen.rewards).float(),
            group_ids_S=torch.arange(len(chosen.rewards)).repeat_interleave(G),
            seq_ids_T=seq_ids_T, loss_mask_T=mask_T, num_groups=len(chosen.rewards),
            old_logprobs_T=old.logprobs_T, ref_logprobs_T=ref_lp,
            turns=turn_layout(samples) if self.objective.turn_credit == "turn" else None,
            teacher_logprobs_T=None if taught is None else taught.logprobs_T,
        )
        if routes is not None and self.rollouts.multiturn is not None:
            metrics.update(self.rollouts.route_agreement_per_turn(samples, old.record))
        versions_T = torch.cat([s.versions() for s in samples])
        shift = None
        if drift is not None:
            drift.add("train_rollout_abs_diff", diff.abs(), versions_T, mask_T)
            if query is not None:
                drift.add("flip_rate", old.flip_T, versions_T, mask_T)
                shift = shift_record(query, layers, old.query_probs_TLK, old.record.cu_seqlens_S1,
                                     old.record.num_experts)
        return TrainBatch(
            sequences=sequences, prompt_lengths=prompt_lengths, old_logprobs_T=old.logprobs_T,
            advantages_T=advantages.float(), loss_mask_T=mask_T, rollout_logprobs_T=rollout_lp,
            ref_logprobs_T=ref_lp, truncated_S=torch.tensor([s.finish_reason == "length" for s in samples]),
            old_record=old.record, rollout_routes=routes, versions_T=versions_T, shift_record=shift,
            temperature_T=packing["temperature_T"],
            rollout_gates=[s.routed_gates for s in samples] if self.plan.mode == "R3w" else None,
            teacher_logprobs_T=None if taught is None else taught.logprobs_T,
            teacher_topk_ids_TK=None if taught is None else taught.topk_ids_TK,
            teacher_topk_logprobs_TK=None if taught is None else taught.topk_logprobs_TK,
        )

    def _update(self, batch: TrainBatch, metrics: dict, drift: LagMeans | None = None) -> None:
        """Mini-batch / multi-epoch policy updates (``drift``: adds what RSPO measured, per lag)."""
        G, t = self.cfg.rollout.group_size, self.cfg.train
        groups_per_mb = self.rollouts.groups_per_rank // t.mini_batches
        collected: list[dict] = []
        for _ in range(t.epochs):
            for m in range(t.mini_batches):
                indices = list(range(m * groups_per_mb * G, (m + 1) * groups_per_mb * G))
                mini = batch.select(indices)
                result = forward_backward(self.ddp, self.groups, mini, self.objective, self.plan, **self._packing())
                collected.append({**result.metrics, **optimizer_step(self.optimizer)})
                for name in ("router_shift", "gamma") if drift is not None else ():
                    if name in result.probe_T:
                        drift.add(name, result.probe_T[name], mini.versions_T, mini.loss_mask_T)
        # The weights are read next outside a forward (weight push, checkpoint, HF export).
        gather_updated_weights(self.ddp)
        for name in collected[0]:
            metrics[name] = torch.stack([c[name].float() for c in collected if name in c]).mean()
