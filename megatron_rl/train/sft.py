"""Supervised warm start: teach a fresh model the task's answer format before RL.

Cross-entropy on the answer tokens (prompt tokens carry no loss), token-mean over the
whole global batch, through the same Megatron schedules, vocab-parallel log-probs and
optimizer as the RL updates, so it runs in every layout. :class:`WarmStart` is the run's
(``train.sft_steps`` steps on the training prompts' reference answers, before the first RL
step of a fresh run); when it runs is the checkpoint lifecycle's (``train.lifecycle``).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Callable, Sequence

import torch

from megatron_rl.parallel.comm import all_reduce, broadcast, rank
from megatron_rl.parallel.context_parallel import response_logprobs_entropy
from megatron_rl.parallel.groups import ParallelGroups
from megatron_rl.parallel.logprobs import needs_common_length, pack_for_rank
from megatron_rl.parallel.optim import build_optimizer, gather_updated_weights
from megatron_rl.parallel.packing import PackedMicroBatch
from megatron_rl.parallel.schedule import run_schedule, unwrap
from megatron_rl.train.engines import probe_rollout_servers
from megatron_rl.train.metrics import progress

if TYPE_CHECKING:
    from megatron_rl.config import RunConfig
    from megatron_rl.data.prompts import PromptSet
    from megatron_rl.data.tokenizer import PromptTokenizer


def sft_step(
    model,
    optimizer,
    groups: ParallelGroups,
    examples: Sequence[tuple[list[int], list[int]]],
    micro_batch_sequences: int,
) -> dict[str, torch.Tensor]:
    """One supervised step on this DP rank's ``(prompt_ids, answer_ids)`` examples.

    Returns:
        ``sft/loss`` (global token-mean negative log-likelihood) and ``optim/grad_norm``.
    """
    sequences = [torch.tensor(p + a, dtype=torch.int64) for p, a in examples]
    prompt_lengths = [len(p) for p, _ in examples]
    count = torch.tensor([float(sum(len(a) for _, a in examples))], dtype=torch.float64)
    if groups.dp_size > 1:
        all_reduce(count, groups.dp)
    micro_batches = pack_for_rank(sequences, groups, micro_batch_sequences,
                                  common_length=needs_common_length(model, groups))
    vocab = unwrap(model).true_vocab_size

    def loss_fn(mb: PackedMicroBatch, logits_1TV: torch.Tensor):
        logprobs_T, _ = response_logprobs_entropy(
            mb, logits_1TV, prompt_lengths, groups, compute_entropy=False, vocab_size=vocab
        )
        loss = -logprobs_T.sum() / float(count[0])
        return loss, torch.tensor(0, dtype=torch.int), {"loss": loss.detach()}

    outputs = run_schedule(model, micro_batches, loss_fn, forward_only=False)
    total = torch.tensor([float(sum(o["loss"] for o in outputs)) if groups.is_last_stage else 0.0])
    if groups.pp_size > 1:
        broadcast(total, groups.pp_size - 1, groups.pp)
    if groups.dp_size > 1:
        all_reduce(total, groups.dp)
    ok, grad_norm, _ = optimizer.step()
    return {"sft/loss": total[0], "optim/grad_norm": torch.tensor(float(grad_norm or 0.0))}


def run_warm_start(
    model,
    optimizer,
    groups: ParallelGroups,
    make_examples: Callable[[int], Sequence[tuple[list[int], list[int]]]],
    steps: int,
    micro_batch_sequences: int,
    log: Callable[[int, dict], None],
    progress,
) -> None:
    """``steps`` supervised steps; ``make_examples(step)`` gives this rank's examples."""
    for step in progress(range(1, steps + 1), desc="warm start (SFT)"):
        metrics = sft_step(model, optimizer, groups, make_examples(step), micro_batch_sequences)
        if step % 10 == 0 or step == steps:
            log(step, metrics)


class WarmStart:
    """The run's warm start: ``train.sft_steps`` supervised steps on the training prompts'
    reference answers, with an optimizer of its own at ``train.sft_lr``.

    Args:
        cfg: the run config (``train.sft_*``, ``optim``, ``seed``).
        groups: this rank's parallel groups.
        ddp: the DDP-wrapped policy stage.
        optimizer: the RL optimizer, whose fp32 main weights are refreshed afterwards.
        train_set: the training prompts (their reference answers are the targets).
        tokenizer: the run's tokenizer (the answer and the stop token).
        mine: this DP rank's share of a list (``RolloutSource.mine``).
        rollout_urls: the SGLang servers, probed first (they may have died meanwhile).
    """

    def __init__(self, cfg: RunConfig, groups: ParallelGroups, ddp, optimizer, train_set: PromptSet,
                 tokenizer: PromptTokenizer, mine: Callable[[list], list], rollout_urls: list[str]) -> None:
        self.cfg, self.groups, self.ddp, self.optimizer = cfg, groups, ddp, optimizer
        self.train_set, self.tokenizer, self.mine, self.rollout_urls = train_set, tokenizer, mine, rollout_urls
        self.rank0 = rank(groups.world) == 0

    def __call__(self) -> None:
        """Collective: the supervised steps; the RL optimizer then sees the new weights."""
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
            mine = [records[i] for i in self.mine(picks)[:per_rank]]
            # The reference answer and the stop token: the model learns to answer and to stop.
            return [(list(r.prompt_ids), self.tokenizer.encode_text(r.ground_truth) + [stop]) for r in mine]

        run_warm_start(self.ddp, sft_optimizer, self.groups, examples, t.sft_steps,
                       t.micro_batch_sequences, self._print, lambda it, desc: progress(it, desc, self.rank0 and t.progress))
        gather_updated_weights(self.ddp)
        # The RL optimizer's fp32 main weights were copied before the warm start changed
        # the weights (a no-op for fp32 weights, which it updates in place).
        self.optimizer.reload_model_params()

    def _print(self, step: int, metrics: dict) -> None:
        if self.rank0:
            values = ", ".join(f"{k}={float(v):.4f}" for k, v in metrics.items())
            print(f"  warm start step {step}: {values}", flush=True)
