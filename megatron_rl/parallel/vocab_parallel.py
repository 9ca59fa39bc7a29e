"""Vocab-parallel per-token log-probability and entropy, with autograd.

Owns: from logits whose vocabulary is split over a tensor-parallel group (Megatron's
contiguous split: rank ``r`` holds global ids ``[r * V_local, (r + 1) * V_local)``), the
log-probability of each token's target id and the entropy of each token's full next-token
distribution, forward and backward. It never gathers the vocabulary and never holds an fp32
copy of all logits: tokens go through in chunks of ``chunk_tokens``, and the only
temporaries that scale with the vocabulary are fp32 ``[C, V_local]`` buffers, at most two at
a time (one when the entropy is neither computed in forward nor differentiated in backward),
allocated once per call and reused by every chunk.
The entropy needs ``exp(x)`` and ``x`` side by side; the one-buffer alternative,
``xlogy(e, e)`` in place, runs ~20x slower on CPU (no vectorized kernel), so it is not used.

Does not own: the process groups (passed in; ``None`` or a group of size 1 means no
collectives), label shifting, token masks, packing and the loss (``megatron_rl.algos``).

Layout follows Megatron's ``VocabParallelCrossEntropy``: :class:`VocabParallelLogProbMath`
holds the local math in static methods and never communicates; the autograd Function
``_VocabParallelLogProbEntropy`` interleaves it with two all-reduces per chunk: a MAX of the
local maxima, then one SUM of the packed ``[3, C]`` partial statistics.

Temperature: with ``temperature_T`` each token's distribution is ``softmax(z / T)`` for its own
``T > 0`` (the policy a rollout engine sampled from; per token, so samples of different
temperatures share one call). Every shard divides its own logits by ``T`` (as SGLang's sampler
does, ``logits.div_(temperatures)``), which commutes with the MAX all-reduce (division by a
positive number keeps the order, in floating point too), so nothing is gathered; the math below
then holds for ``z / T``, and backward divides the gradient by ``T`` once more (chain rule).

Math per token, with ``z`` the (temperature-divided) logits, ``m`` their max over the whole
vocabulary, ``s = sum_v exp(z_v - m)`` and ``p = softmax(z)``::

    logprob = z_target - m - log s
    entropy = log s - sum_v exp(z_v - m) (z_v - m) / s
    d logprob / dz = onehot(target) - p
    d entropy / dz = -p (log p + entropy)

Padded vocabulary: Megatron may hold more columns than there are tokens (``V_pad =
V_local * tp_size >= V``, see ``ModelConfig.padded_vocab_size``). Given the true ``V``, each
shard treats its columns at global ids ``>= V`` as ``-inf`` logits inside its local math:
they add nothing to ``m``, ``s`` or the entropy, and their gradient is exactly zero, so the
results are those of the unpadded ``V``-way softmax.

Saved for backward: a reference to the input logits (no copy), the targets, the temperatures
when given, and two ``[T]`` vectors in the compute dtype: the log-normalizer ``lse = m + log s`` and the entropy (the
latter only when the entropy needs a gradient). The softmax is not kept; backward
recomputes it chunk by chunk as ``p = exp(z - lse)``, which is local to the shard, so the
backward pass needs no collectives. Both upstream gradients are applied in one pass.

Precision: the math runs in fp32 for fp32/bf16/fp16 logits (fp64 for fp64 logits, so that
gradients can be checked in double); each chunk is cast on its own, never the whole input.
Outputs are in that compute dtype; the logits gradient comes back in the logits' dtype.

Shape legend: T tokens, V vocabulary (global, ``V <= V_local * tp_size``: the rest is padding),
V_local this rank's vocabulary shard, C tokens in one chunk.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_rl.parallel.comm import group_rank_and_size
from megatron_rl.parallel.vocab_parallel_checks import check_inputs, check_temperatures

__all__ = ["VocabParallelLogProbMath", "vocab_parallel_logprobs_entropy"]


# exp() of anything below this is exactly 0 in fp32 (below ~-104) and fp64 (below ~-745), so
# clamping z - m here changes no probability; it turns z = -inf into a finite number, which
# keeps products of the form 0 * (z - m) at 0 instead of nan.
_EXP_UNDERFLOW = -1e4


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp64 stays fp64 (exact gradient checks); every narrower float is computed in fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


class VocabParallelLogProbMath:
    """Local math on one chunk of one vocabulary shard; no collectives.

    ``z`` denotes logits, ``m`` the per-token max over the whole vocabulary (after the MAX
    all-reduce) and ``lse = m + log sum_v exp(z_v - m)`` the per-token log-normalizer.
    ``num_valid`` is how many leading columns of the shard are real ids (see
    :meth:`valid_columns`); the columns after them are padding, taken as ``-inf`` logits.
    ``None`` means every column is real.
    """

    @staticmethod
    def valid_columns(vocab_start: int, v_local: int, vocab_size: int) -> int:
        """How many leading columns of the shard at ``vocab_start`` hold ids below ``vocab_size``.

        Padding sits at the end of the global vocabulary, so only the last shard(s) hold
        any; with little vocabulary and much padding a shard may hold nothing but padding (0).
        """
        return max(0, min(v_local, vocab_size - vocab_start))

    @staticmethod
    def mask_padding_(values_CV: torch.Tensor, num_valid: int | None) -> torch.Tensor:
        """Sets the padding columns of a scratch buffer to ``-inf`` in place; returns it."""
        if num_valid is not None and num_valid < values_CV.shape[1]:
            values_CV[:, num_valid:] = float("-inf")
        return values_CV

    @staticmethod
    def local_targets(
        targets_C: torch.Tensor, vocab_start: int, v_local: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Maps global target ids to ids inside this shard.

        Args:
            targets_C: global target ids, shape [C], int64.
            vocab_start: first global id this shard holds.
            v_local: number of ids this shard holds.

        Returns:
            ``(local_ids_C, in_shard_C)``: local ids, shape [C] int64, set to 0 where the
            target lives on another shard (so indexing stays in bounds); and the bool mask
            of targets this shard holds, shape [C].
        """
        local_ids_C = targets_C - vocab_start
        in_shard_C = (local_ids_C >= 0) & (local_ids_C < v_local)
        return local_ids_C.masked_fill(~in_shard_C, 0), in_shard_C

    @staticmethod
    def chunk_max(
        logits_CV: torch.Tensor,
        compute_dtype: torch.dtype,
        num_valid: int | None = None,
        temperature_C: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Per-token max over this shard's real ids of ``z / T``, shape [C], in ``compute_dtype``.

        The max is exact in any dtype, so only the [C] result is cast, not the chunk; dividing
        it by ``T`` gives the max of the divided chunk bit for bit (rounding is monotone). A
        shard of padding only gives ``-inf``, which the MAX all-reduce over shards ignores.
        """
        if num_valid == 0:
            return logits_CV.new_full((logits_CV.shape[0],), float("-inf"), dtype=compute_dtype)
        max_C = logits_CV[:, :num_valid].amax(dim=-1).to(compute_dtype)
        return max_C if temperature_C is None else max_C.div_(temperature_C)

    @staticmethod
    def scaled_copy_(scratch_CV: torch.Tensor, logits_CV: torch.Tensor, temperature_C: torch.Tensor | None):
        """``z / T`` of the chunk in the scratch buffer (compute dtype); returns it."""
        scratch_CV.copy_(logits_CV)
        return scratch_CV if temperature_C is None else scratch_CV.div_(temperature_C[:, None])

    @staticmethod
    def chunk_partial_stats(
        logits_CV: torch.Tensor,
        max_C: torch.Tensor,
        local_ids_C: torch.Tensor,
        in_shard_C: torch.Tensor,
        scratch_CV: torch.Tensor,
        entropy_scratch_CV: torch.Tensor | None = None,
        num_valid: int | None = None,
        temperature_C: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """This shard's share of the per-token statistics, packed for one SUM all-reduce.

        Args:
            logits_CV: this shard's logits for the chunk, shape [C, V_local], any float dtype.
            max_C: global per-token max, shape [C], in the compute dtype.
            local_ids_C: targets as shard-local ids, shape [C] (see :meth:`local_targets`).
            in_shard_C: which targets this shard holds, shape [C] bool.
            scratch_CV: buffer [C, V_local] in the compute dtype; overwritten.
            entropy_scratch_CV: a second such buffer, or ``None`` to skip the entropy term
                (row 1 is then zero).
            num_valid: leading columns that are real ids; padding adds nothing to any row.
            temperature_C: per-token temperature ``T > 0`` (``z`` is then ``logits / T``), or
                ``None`` for ``T = 1``.

        Returns:
            Shape [3, C] in ``max_C``'s dtype: row 0 ``sum_v exp(z_v - m)``, row 1
            ``sum_v exp(z_v - m) (z_v - m)``, row 2 the target's ``z`` (0 where another
            shard holds the target). Summed over shards, each row is the full-vocabulary value.
        """
        math = VocabParallelLogProbMath
        shifted_CV = math.scaled_copy_(scratch_CV, logits_CV, temperature_C).sub_(max_C[:, None])
        VocabParallelLogProbMath.mask_padding_(shifted_CV, num_valid)
        if entropy_scratch_CV is None:
            sum_exp_C = shifted_CV.exp_().sum(dim=-1)
            weighted_C = torch.zeros_like(sum_exp_C)
        else:
            # Keeps 0 * (z - m) at 0, not nan, for logits at -inf (masked or padding entries).
            shifted_CV.clamp_min_(_EXP_UNDERFLOW)
            exp_CV = torch.exp(shifted_CV, out=entropy_scratch_CV)
            sum_exp_C = exp_CV.sum(dim=-1)
            weighted_C = exp_CV.mul_(shifted_CV).sum(dim=-1)
        target_logit_C = logits_CV.gather(1, local_ids_C[:, None]).squeeze(1).to(max_C.dtype)
        if temperature_C is not None:
            target_logit_C = target_logit_C / temperature_C  # rounded as the scratch's copy is
        target_logit_C = target_logit_C.masked_fill(~in_shard_C, 0.0)
        return torch.stack([sum_exp_C, weighted_C, target_logit_C])

    @staticmethod
    def finalize(
        max_C: torch.Tensor, stats_3C: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per-token results from the global max and the summed statistics.

        Args:
            max_C: global per-token max, shape [C].
            stats_3C: statistics summed over all shards (see :meth:`chunk_partial_stats`).

        Returns:
            ``(logprobs_C, entropy_C, lse_C)``, each shape [C]; ``entropy_C`` is meaningless
            if row 1 was not computed.
        """
        sum_exp_C, weighted_C, target_logit_C = stats_3C
        log_sum_exp_C = sum_exp_C.log()
        logprobs_C = (target_logit_C - max_C) - log_sum_exp_C
        entropy_C = log_sum_exp_C - weighted_C / sum_exp_C
        return logprobs_C, entropy_C, max_C + log_sum_exp_C

    @staticmethod
    def chunk_grad(
        logits_CV: torch.Tensor,
        lse_C: torch.Tensor,
        local_ids_C: torch.Tensor,
        in_shard_C: torch.Tensor,
        grad_logprobs_C: torch.Tensor,
        scratch_CV: torch.Tensor,
        entropy_C: torch.Tensor | None = None,
        grad_entropy_C: torch.Tensor | None = None,
        entropy_scratch_CV: torch.Tensor | None = None,
        num_valid: int | None = None,
        temperature_C: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Gradient of the chunk's logits: ``(g_lp (onehot - p) - g_H p (log p + H)) / T``.

        Args:
            logits_CV: this shard's logits for the chunk, shape [C, V_local].
            lse_C: global per-token log-normalizer, shape [C], in the compute dtype.
            local_ids_C: targets as shard-local ids, shape [C].
            in_shard_C: which targets this shard holds, shape [C] bool.
            grad_logprobs_C: upstream gradient of the log-probs, shape [C].
            scratch_CV: buffer [C, V_local] in the compute dtype; overwritten (it may be the
                gradient's own storage when the logits are in the compute dtype).
            entropy_C: per-token entropy, shape [C]; only with ``grad_entropy_C``.
            grad_entropy_C: upstream gradient of the entropy, shape [C], or ``None`` to skip
                the entropy term.
            entropy_scratch_CV: a second buffer like ``scratch_CV``; only with
                ``grad_entropy_C``.
            num_valid: leading columns that are real ids; padding columns get exactly 0.
            temperature_C: per-token temperature of the forward, or ``None`` for T = 1.

        Returns:
            The gradient, shape [C, V_local] in the compute dtype, in one of the scratch buffers.
        """
        math = VocabParallelLogProbMath
        log_probs_CV = math.scaled_copy_(scratch_CV, logits_CV, temperature_C).sub_(lse_C[:, None])
        VocabParallelLogProbMath.mask_padding_(log_probs_CV, num_valid)
        if grad_entropy_C is None:
            grad_CV = log_probs_CV.exp_().mul_(-grad_logprobs_C[:, None])
        else:
            # -p (g_lp + g_H (log p + H)); the clamp keeps p * log p at 0, not nan, where p = 0.
            log_probs_CV.clamp_min_(_EXP_UNDERFLOW)
            probs_CV = torch.exp(log_probs_CV, out=entropy_scratch_CV)
            scale_C = grad_logprobs_C + grad_entropy_C * entropy_C
            factor_CV = log_probs_CV.mul_(-grad_entropy_C[:, None]).sub_(scale_C[:, None])
            grad_CV = probs_CV.mul_(factor_CV)
        rows = in_shard_C.nonzero().squeeze(1)
        grad_CV.index_put_(
            (rows, local_ids_C[rows]), grad_logprobs_C[rows].to(grad_CV.dtype), accumulate=True
        )
        return grad_CV if temperature_C is None else grad_CV.div_(temperature_C[:, None])


def _scratch(
    num_buffers: int, num_tokens: int, chunk_tokens: int, like_TV: torch.Tensor, dtype
) -> list[torch.Tensor]:
    """Scratch buffers [min(chunk, T), V_local] in ``dtype``, allocated once per call.

    Every chunk reuses them (sliced to its rows): on CPU, a fresh allocation per chunk would
    pay page faults and zeroing each time.
    """
    rows = min(chunk_tokens, num_tokens)
    return [like_TV.new_empty((rows, like_TV.shape[1]), dtype=dtype) for _ in range(num_buffers)]


class _VocabParallelLogProbEntropy(torch.autograd.Function):
    """Chunked forward with the all-reduces; collective-free backward from recomputed p."""

    @staticmethod
    def forward(
        ctx,
        logits_TV: torch.Tensor,
        targets_T: torch.Tensor,
        tp_group: dist.ProcessGroup | None,
        chunk_tokens: int,
        compute_entropy: bool,
        entropy_requires_grad: bool,
        vocab_size: int,
        temperature_T: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        math = VocabParallelLogProbMath
        tp_rank, tp_size = group_rank_and_size(tp_group)
        num_tokens, v_local = logits_TV.shape
        vocab_start = tp_rank * v_local
        num_valid = math.valid_columns(vocab_start, v_local, vocab_size)
        dtype = _compute_dtype(logits_TV.dtype)
        if temperature_T is not None:
            temperature_T = temperature_T.to(device=logits_TV.device, dtype=dtype)
        logprobs_T = logits_TV.new_empty(num_tokens, dtype=dtype)
        lse_T = logits_TV.new_empty(num_tokens, dtype=dtype)
        entropy_T = logits_TV.new_empty(num_tokens if compute_entropy else 0, dtype=dtype)
        num_buffers = 2 if compute_entropy else 1
        scratch = _scratch(num_buffers, num_tokens, chunk_tokens, logits_TV, dtype)
        for start in range(0, num_tokens, chunk_tokens):
            chunk = slice(start, min(start + chunk_tokens, num_tokens))
            logits_CV = logits_TV[chunk]
            local_ids_C, in_shard_C = math.local_targets(targets_T[chunk], vocab_start, v_local)
            temperature_C = None if temperature_T is None else temperature_T[chunk]
            max_C = math.chunk_max(logits_CV, dtype, num_valid, temperature_C)
            if tp_size > 1:
                dist.all_reduce(max_C, op=dist.ReduceOp.MAX, group=tp_group)
            buffers = [buf[: chunk.stop - start] for buf in scratch]
            stats_3C = math.chunk_partial_stats(
                logits_CV, max_C, local_ids_C, in_shard_C, *buffers, num_valid=num_valid,
                temperature_C=temperature_C,
            )
            if tp_size > 1:
                dist.all_reduce(stats_3C, op=dist.ReduceOp.SUM, group=tp_group)
            logprobs_C, entropy_C, lse_C = math.finalize(max_C, stats_3C)
            logprobs_T[chunk] = logprobs_C
            lse_T[chunk] = lse_C
            if compute_entropy:
                entropy_T[chunk] = entropy_C
        del scratch

        ctx.chunk_tokens = chunk_tokens
        ctx.vocab_start = vocab_start
        ctx.num_valid = num_valid
        ctx.entropy_grad = compute_entropy and entropy_requires_grad
        ctx.save_for_backward(
            logits_TV, targets_T, lse_T, entropy_T if ctx.entropy_grad else None, temperature_T
        )
        if not ctx.entropy_grad:
            ctx.mark_non_differentiable(entropy_T)
        return logprobs_T, entropy_T

    @staticmethod
    def backward(ctx, grad_logprobs_T: torch.Tensor, grad_entropy_T: torch.Tensor | None):
        math = VocabParallelLogProbMath
        logits_TV, targets_T, lse_T, entropy_T, temperature_T = ctx.saved_tensors
        num_tokens, v_local = logits_TV.shape
        grad_TV = torch.empty_like(logits_TV, memory_format=torch.contiguous_format)
        dtype = lse_T.dtype
        # Logits in the compute dtype (fp32, fp64): each chunk's own gradient rows serve as
        # its first scratch buffer, which saves a buffer and a copy.
        reuse_grad = grad_TV.dtype == dtype
        num_buffers = int(not reuse_grad) + int(ctx.entropy_grad)
        scratch = _scratch(num_buffers, num_tokens, ctx.chunk_tokens, logits_TV, dtype)
        for start in range(0, num_tokens, ctx.chunk_tokens):
            chunk = slice(start, min(start + ctx.chunk_tokens, num_tokens))
            grad_CV = grad_TV[chunk]
            buffers = [grad_CV] if reuse_grad else []
            buffers += [buf[: chunk.stop - start] for buf in scratch]
            entropy_terms = {}
            if ctx.entropy_grad:
                entropy_terms = {
                    "entropy_C": entropy_T[chunk],
                    "grad_entropy_C": grad_entropy_T[chunk],
                    "entropy_scratch_CV": buffers[1],
                }
            local_ids_C, in_shard_C = math.local_targets(
                targets_T[chunk], ctx.vocab_start, v_local
            )
            result_CV = math.chunk_grad(
                logits_TV[chunk],
                lse_T[chunk],
                local_ids_C,
                in_shard_C,
                grad_logprobs_T[chunk],
                buffers[0],
                **entropy_terms,
                num_valid=ctx.num_valid,
                temperature_C=None if temperature_T is None else temperature_T[chunk],
            )
            if result_CV.data_ptr() != grad_CV.data_ptr():
                grad_CV.copy_(result_CV)  # also casts back to the logits' dtype
        return grad_TV, None, None, None, None, None, None, None


def vocab_parallel_logprobs_entropy(
    logits_TV: torch.Tensor,
    targets_T: torch.Tensor,
    tp_group: dist.ProcessGroup | None = None,
    *,
    chunk_tokens: int = 1024,
    compute_entropy: bool = True,
    entropy_requires_grad: bool = False,
    vocab_size: int | None = None,
    temperature_T: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log-probability of the target and full-vocabulary entropy, vocab-parallel.

    Every rank of ``tp_group`` must call this with the same ``T``, targets and
    ``chunk_tokens`` (each chunk runs two all-reduces in forward; backward runs none).

    Args:
        logits_TV: this rank's vocabulary shard of the logits, shape [T, V_local], any float
            dtype; rank ``r`` holds global ids ``[r * V_local, (r + 1) * V_local)``.
        targets_T: global target ids, shape [T], integer dtype, each in ``[0, V)``.
        tp_group: the tensor-parallel group the vocabulary is split over; ``None`` or a
            group of size 1 means the whole vocabulary is local and nothing is communicated.
        chunk_tokens: tokens per chunk; bounds the temporaries to at most two
            ``[chunk_tokens, V_local]`` buffers in the compute dtype.
        compute_entropy: also compute the entropy (costs one more pass over each chunk).
        entropy_requires_grad: make the entropy differentiable; otherwise it is returned
            detached and backward skips the entropy term.
        vocab_size: the true vocabulary V when Megatron's is padded (``V_local * tp_size >
            V``): ids ``>= V`` take no part in the softmax, the entropy or the gradient.
            ``None``: every column is a real id.
        temperature_T: per-token temperature ``T > 0``, shape [T]: the log-prob, the entropy
            and their gradients are those of ``softmax(logits / T)``, the distribution a rollout
            engine samples at temperature ``T``. ``None``: ``T = 1`` (the same numbers as all ones).

    Returns:
        ``(logprobs_T, entropy_T)``: shape [T] each, fp32 (fp64 for fp64 logits);
        ``logprobs_T`` is differentiable w.r.t. ``logits_TV``; ``entropy_T`` is ``None``
        when ``compute_entropy`` is False.

    Raises:
        ValueError: a tensor of the wrong shape, a target outside ``[0, V)`` (the message
            names the first such token and its id), a non-positive ``chunk_tokens``, a
            ``vocab_size`` outside ``[1, V_local * tp_size]``, or a temperature that is not
            finite and positive (naming the token).
        TypeError: non-float logits or non-integer targets.
    """
    _, tp_size = group_rank_and_size(tp_group)
    vocab = check_inputs(logits_TV, targets_T, tp_size, chunk_tokens, vocab_size)
    check_temperatures(temperature_T, logits_TV.shape[0])
    logprobs_T, entropy_T = _VocabParallelLogProbEntropy.apply(
        logits_TV,
        targets_T.long(),
        tp_group,
        chunk_tokens,
        compute_entropy,
        entropy_requires_grad,
        vocab,
        temperature_T,
    )
    return logprobs_T, (entropy_T if compute_entropy else None)
