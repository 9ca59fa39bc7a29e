"""Supervised warm start: teach a fresh model the task's answer format before RL.

Cross-entropy on the answer tokens (prompt tokens carry no loss), token-mean over the
whole global batch, through the same Megatron schedules, vocab-parallel log-probs and
optimizer as the RL updates, so it runs in every layout.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from megatron_rl.parallel.comm import all_reduce, broadcast
from megatron_rl.parallel.context_parallel import response_logprobs_entropy
from megatron_rl.parallel.groups import ParallelGroups
from megatron_rl.parallel.logprobs import needs_common_length, pack_for_rank
from megatron_rl.parallel.packing import PackedMicroBatch
from megatron_rl.parallel.schedule import run_schedule, unwrap


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
