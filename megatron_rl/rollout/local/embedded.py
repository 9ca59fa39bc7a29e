"""The embedded rollout engine: generation with the training model, in-process.

Shape legend: B prompts of this data-parallel rank, V vocabulary.

Every rank of the world calls ``generate`` together (it runs the same Megatron schedules
as training, so it works in every TP/EP/PP layout): each data-parallel rank generates for
its own prompts. A decode step runs one forward-only pass over the packed sequences and
takes the last position's vocab-sharded logits, gathering the vocabulary only for those B
rows to sample; the padding columns of Megatron's padded vocabulary are dropped there, so
a padded id is never sampled. All ranks of a model-parallel group hold identical logits and the same
counter-seeded generator, so they draw identical tokens with no extra communication; data
parallel ranks keep stepping together until all of them are done, because expert dispatch
is a collective across them.

Decoding recomputes the whole prefix each step (no KV cache). This is
``rollout.engine: megatron``, the exact "train = rollout" mode for debugging mismatch
(rollout log-probs and routes are the trainer's own, bit for bit); the default local
engine is the KV-cached ``hf_engine``, and GPU runs use SGLang. When generation ends, one more pass over
the full sequences (the log-prob pass, with routing recorded) yields the response
log-probs and the routed experts in SGLang's layout (from ``routes_from`` on), with the gate
weights and router probabilities of those experts (what R3w replays), so the trainer treats
this engine and SGLang alike. That pass scores ``log_softmax(logits / T)`` at the sampling
temperature, the trainer's own pass at the trainer's own T: the rollout log-probs equal the
trainer's old log-probs bit for bit (the same function on the same inputs) at any T.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from megatron_rl.parallel.comm import all_gather_cat, all_reduce, broadcast
from megatron_rl.parallel.context_parallel import values_at_rows
from megatron_rl.parallel.groups import ParallelGroups
from megatron_rl.parallel.logprobs import (
    compute_logprobs,
    needs_common_length,
    pack_for_rank,
    to_sample_order,
)
from megatron_rl.parallel.packing import PackedMicroBatch
from megatron_rl.parallel.schedule import run_schedule, unwrap
from megatron_rl.rollout.engine import RolloutSample, SamplingParams, check_routes_from
from megatron_rl.rollout.sampling import kept_log_mass, sample_next_tokens


class EmbeddedEngine:
    """Generate with the in-process Megatron policy.

    Args:
        model: this rank's model stage (the training model; its weights are served).
        groups: this rank's parallel groups.
        micro_batch_sequences: sequences per forward micro-batch (without a token budget).
        micro_batch_tokens: token budget per forward micro-batch (balanced token-budget packing).
        logprobs_after_temperature: report ``log_softmax(logits / T)``, the distribution each
            token is drawn from (SGLang's default); False: ``log_softmax(logits)`` (the T = 1
            objective, ``objective.policy_temperature=one``).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        groups: ParallelGroups,
        micro_batch_sequences: int = 32,
        micro_batch_tokens: int | None = None,
        logprobs_after_temperature: bool = True,
    ) -> None:
        self.model = model
        self.logprobs_after_temperature = logprobs_after_temperature
        self.groups = groups
        self.micro_batch_sequences = micro_batch_sequences
        self.micro_batch_tokens = micro_batch_tokens
        self.weight_version = 0

    def update_weights(self, version: int) -> None:
        """The engine shares the training model's parameters; only the version moves."""
        self.weight_version = version

    def close(self) -> None:
        """Nothing to release: the engine is the training model."""

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams, *,
                 return_routed_experts: bool = True, seed: int = 0,
                 routes_from: Sequence[int] | None = None) -> list[RolloutSample]:
        """``RolloutEngine.generate`` for this DP rank (collective over the world)."""
        starts = check_routes_from(prompts, routes_from)
        gpt = unwrap(self.model)
        longest = max(len(p) for p in prompts) + params.max_new_tokens
        if longest > gpt.max_sequence_length:
            raise ValueError(
                f"prompt + max_new_tokens = {longest} exceeds the model's maximum sequence length "
                f"{gpt.max_sequence_length} (rollout.max_new_tokens or model.max_position_embeddings)"
            )
        generator = torch.Generator().manual_seed(seed * 1_000_003 + self.groups.dp_rank)
        outputs: list[list[int]] = [[] for _ in prompts]
        truncation: list[list[float]] = [[] for _ in prompts]
        finished = [False] * len(prompts)
        stops = set(params.stop_token_ids)
        for _ in range(params.max_new_tokens):
            if not self._any_active(finished):
                break
            sequences = [torch.tensor(list(p) + o, dtype=torch.int64) for p, o in zip(prompts, outputs)]
            logits_BV = self._last_logits(sequences)
            tokens_B = sample_next_tokens(
                logits_BV, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
                generator=generator,
            )
            kept_B = kept_log_mass(logits_BV, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k)
            for i, token in enumerate(tokens_B.tolist()):
                if not finished[i]:
                    outputs[i].append(token)
                    truncation[i].append(-float(kept_B[i]))
                    finished[i] = token in stops
        scored_at = params.temperature if self.logprobs_after_temperature and params.temperature > 0 else None
        samples = self._finish(prompts, outputs, finished, return_routed_experts, starts, scored_at)
        truncates = params.temperature > 0 and (params.top_p < 1 or params.top_k > 0)
        for sample, values in zip(samples, truncation):
            sample.temperature = params.temperature
            if truncates:
                sample.truncation_logratio = torch.tensor(values, dtype=torch.float32)
        return samples

    def _any_active(self, finished: list[bool]) -> bool:
        active = torch.tensor([0 if all(finished) else 1], dtype=torch.int64)
        if self.groups.dp_size > 1:
            all_reduce(active, self.groups.dp, op=dist.ReduceOp.MAX)
        return bool(active.item())

    def _last_logits(self, sequences: list[torch.Tensor]) -> torch.Tensor:
        """Full-vocabulary logits ``[B, V]`` of each sequence's last position, on every rank."""
        groups = self.groups
        micro_batches = pack_for_rank(sequences, groups, self.micro_batch_sequences, max_tokens=self.micro_batch_tokens,
                                      common_length=needs_common_length(self.model, groups))
        vocab = unwrap(self.model).true_vocab_size

        def loss_fn(mb: PackedMicroBatch, logits_1TV: torch.Tensor):
            last_rows = mb.slot_starts[:-1] + mb.cu_seqlens.diff() - 1
            # Under context parallelism each last row comes from the CP rank that holds it.
            local_BV = values_at_rows(logits_1TV, mb, last_rows, groups.cp).float()
            if groups.tp_size > 1:
                # Only B rows: the vocabulary is gathered for sampling, never for the loss.
                local_BV = all_gather_cat(local_BV, groups.tp, dim=-1)
            full_BV = local_BV[:, :vocab]  # padding columns are no tokens: never sampled
            return logits_1TV.new_zeros(()), torch.tensor(0, dtype=torch.int), {"logits": full_BV}

        with torch.no_grad():
            outputs = run_schedule(self.model, micro_batches, loss_fn, forward_only=True)
        logits_BV = torch.empty(len(sequences), vocab, dtype=torch.float32)
        if groups.is_last_stage:
            one_row_each = torch.arange(len(sequences) + 1)
            logits_BV.copy_(to_sample_order([o["logits"].cpu() for o in outputs], micro_batches, one_row_each))
        if groups.pp_size > 1:
            broadcast(logits_BV, groups.pp_size - 1, groups.pp)
        return logits_BV

    def _finish(self, prompts, outputs, finished, return_routed_experts, starts,
                temperature: float | None) -> list[RolloutSample]:
        """Log-probs at ``temperature`` (None: 1), and routes, gates and router probabilities, of
        the generated tokens from one pass over full sequences."""
        # A response needs at least one token for the log-prob pass; max_new_tokens >= 1.
        sequences = [torch.tensor(list(p) + o, dtype=torch.int64) for p, o in zip(prompts, outputs)]
        temperature_T = None
        if temperature is not None:
            temperature_T = torch.full((sum(len(o) for o in outputs),), float(temperature))
        result = compute_logprobs(
            self.model, self.groups, sequences, [len(p) for p in prompts],
            micro_batch_sequences=self.micro_batch_sequences, micro_batch_tokens=self.micro_batch_tokens,
            record_routing=return_routed_experts, temperature_T=temperature_T,
        )
        samples = []
        for i, (prompt, output) in enumerate(zip(prompts, outputs)):
            lo, hi = int(result.cu_seqlens_S1[i]), int(result.cu_seqlens_S1[i + 1])
            record = result.record.sample(i) if result.record is not None else None
            samples.append(
                RolloutSample(
                    prompt_ids=list(prompt),
                    output_ids=list(output),
                    output_logprobs=result.logprobs_T[lo:hi].clone(),
                    finish_reason="stop" if finished[i] else "length",
                    weight_version=self.weight_version,
                    routed_experts=None if record is None else record.expert_ids_TLK[starts[i]:-1],
                    routed_gates=None if record is None else record.gates_TLK[starts[i]:-1].float(),
                    routed_probs=None if record is None else record.probs_TLK[starts[i]:-1].float(),
                )
            )
        return samples
