"""vocab_parallel_logprobs_entropy at TP2 (gloo, CPU) against the full-vocabulary reference.

One world of 2 ranks runs every check in ``_tp_checks`` and returns what it measured; each
test below asserts one acceptance point on those results. Each rank builds the same full
logits from a shared seed and passes its contiguous vocabulary shard, with the default
group as the TP group. The reference (torch.log_softmax over the whole vocabulary, float64)
is computed here, in the pytest process. A world of 1 runs the same checks for the
world-of-1 vs world-of-2 comparison.
"""

import pytest
import torch
import torch.distributed as dist

from megatron_rl.parallel.vocab_parallel import vocab_parallel_logprobs_entropy
from megatron_rl.parallel.world import run_world

pytestmark = pytest.mark.parallel

NUM_TOKENS = 37
VOCAB = 600
CHUNK = 8  # 5 chunks, the last one partial
OUT_OF_RANGE = {5: VOCAB, 2: -1}  # token index -> bad target id


def full_problem():
    """The same logits, targets and loss weights on every rank and in the test process."""
    gen = torch.Generator().manual_seed(1234)
    logits_TV = torch.randn(NUM_TOKENS, VOCAB, generator=gen, dtype=torch.float64) * 4
    targets_T = torch.randint(0, VOCAB, (NUM_TOKENS,), generator=gen)
    # Both ends of both shards of the TP2 split.
    targets_T[:4] = torch.tensor([0, VOCAB // 2 - 1, VOCAB // 2, VOCAB - 1])
    lp_weights_T = torch.randn(NUM_TOKENS, generator=gen, dtype=torch.float64)
    entropy_weights_T = torch.randn(NUM_TOKENS, generator=gen, dtype=torch.float64)
    return logits_TV, targets_T, lp_weights_T, entropy_weights_T


def _run_on_shard(shard_TV, targets_T, lp_weights_T, entropy_weights_T=None):
    """Forward, then backward of sum(w * logprobs) (+ sum(u * entropy)); returns all three."""
    shard = shard_TV.detach().clone().requires_grad_(True)
    logprobs_T, entropy_T = vocab_parallel_logprobs_entropy(
        shard,
        targets_T,
        dist.group.WORLD,
        chunk_tokens=CHUNK,
        entropy_requires_grad=entropy_weights_T is not None,
    )
    loss = (lp_weights_T * logprobs_T.double()).sum()
    if entropy_weights_T is not None:
        loss = loss + (entropy_weights_T * entropy_T.double()).sum()
    loss.backward()
    return {"logprobs": logprobs_T.detach(), "entropy": entropy_T.detach(), "grad": shard.grad}


def _count_all_reduces(calls):
    original = dist.all_reduce

    def counting(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        calls.append((str(op), tuple(tensor.shape)))
        return original(tensor, op=op, group=group, async_op=async_op)

    return original, counting


def _tp_checks():
    """Every check of this file on one rank; returns the raw measurements."""
    rank, world = dist.get_rank(), dist.get_world_size()
    logits_TV, targets_T, lp_weights_T, entropy_weights_T = full_problem()
    v_local = VOCAB // world
    shard_TV = logits_TV[:, rank * v_local : (rank + 1) * v_local]
    out = {"rank": rank, "world": world}

    out["fp32"] = _run_on_shard(shard_TV.float(), targets_T, lp_weights_T)
    out["fp64_logprob_grad"] = _run_on_shard(shard_TV, targets_T, lp_weights_T)
    out["fp64_entropy_grad"] = _run_on_shard(
        shard_TV, targets_T, lp_weights_T, entropy_weights_T
    )
    out["bf16"] = _run_on_shard(shard_TV.bfloat16(), targets_T, lp_weights_T, entropy_weights_T)
    out["entropy_requires_grad_default"] = vocab_parallel_logprobs_entropy(
        shard_TV.clone().requires_grad_(True), targets_T, dist.group.WORLD
    )[1].requires_grad

    calls = []
    original, dist.all_reduce = _count_all_reduces(calls)
    try:
        shard = shard_TV.clone().requires_grad_(True)
        logprobs_T, entropy_T = vocab_parallel_logprobs_entropy(
            shard, targets_T, dist.group.WORLD, chunk_tokens=CHUNK, entropy_requires_grad=True
        )
        out["forward_all_reduces"] = list(calls)
        calls.clear()
        (logprobs_T.sum() + entropy_T.sum()).backward()
        out["backward_all_reduces"] = list(calls)
    finally:
        dist.all_reduce = original

    out["errors"] = {}
    for token, bad_id in OUT_OF_RANGE.items():
        bad_T = targets_T.clone()
        bad_T[token] = bad_id
        try:
            vocab_parallel_logprobs_entropy(shard_TV, bad_T, dist.group.WORLD)
            out["errors"][token] = None
        except ValueError as err:
            out["errors"][token] = str(err)
    # The group still works after the rejected calls: nobody is left inside a collective.
    out["after_errors"] = _run_on_shard(shard_TV, targets_T, lp_weights_T)["logprobs"]
    return out


def reference(logits_TV, targets_T):
    logp_TV = torch.log_softmax(logits_TV.double(), dim=-1)
    logprobs_T = logp_TV.gather(1, targets_T[:, None]).squeeze(1)
    entropy_T = -(logp_TV.exp() * logp_TV).sum(dim=-1)
    return logprobs_T, entropy_T


def reference_grad(logits_TV, targets_T, lp_weights_T, entropy_weights_T=None):
    logits = logits_TV.detach().double().requires_grad_(True)
    logprobs_T, entropy_T = reference(logits, targets_T)
    loss = (lp_weights_T * logprobs_T).sum()
    if entropy_weights_T is not None:
        loss = loss + (entropy_weights_T * entropy_T).sum()
    loss.backward()
    return logits.grad


@pytest.fixture(scope="module")
def tp2():
    return run_world(_tp_checks, 2, timeout_s=120)


@pytest.fixture(scope="module")
def tp1():
    return run_world(_tp_checks, 1, timeout_s=120)


def max_err(a, b):
    return float((a.double() - b.double()).abs().max())


def test_ranks_ran_as_a_tp2_world(tp2):
    assert [(r["rank"], r["world"]) for r in tp2] == [(0, 2), (1, 2)]


def test_logprobs_and_entropy_match_full_log_softmax_fp32(tp2):
    logits_TV, targets_T, _, _ = full_problem()
    ref_logprobs_T, ref_entropy_T = reference(logits_TV.float(), targets_T)
    assert ref_entropy_T.std() > 0.1, "degenerate problem"
    for result in tp2:
        assert result["fp32"]["logprobs"].dtype == torch.float32
        assert max_err(result["fp32"]["logprobs"], ref_logprobs_T) <= 1e-5
        assert max_err(result["fp32"]["entropy"], ref_entropy_T) <= 1e-5


def test_targets_on_both_shards_are_exact(tp2):
    """Each token's log-prob is right whichever shard holds its target."""
    logits_TV, targets_T, _, _ = full_problem()
    ref_logprobs_T, _ = reference(logits_TV, targets_T)
    on_shard_1 = targets_T >= VOCAB // 2
    assert 5 <= int(on_shard_1.sum()) <= NUM_TOKENS - 5
    for result in tp2:
        logprobs_T = result["fp64_logprob_grad"]["logprobs"]
        assert max_err(logprobs_T[~on_shard_1], ref_logprobs_T[~on_shard_1]) <= 1e-12
        assert max_err(logprobs_T[on_shard_1], ref_logprobs_T[on_shard_1]) <= 1e-12


def test_logprob_gradient_matches_full_vocabulary_gradient(tp2):
    logits_TV, targets_T, lp_weights_T, _ = full_problem()
    expected_TV = reference_grad(logits_TV, targets_T, lp_weights_T)
    for rank, result in enumerate(tp2):
        shard_slice = slice(rank * VOCAB // 2, (rank + 1) * VOCAB // 2)
        grad = result["fp64_logprob_grad"]["grad"]
        assert grad.shape == (NUM_TOKENS, VOCAB // 2)
        assert max_err(grad, expected_TV[:, shard_slice]) <= 1e-6
        # The one-hot term lands on the shard that holds the target, and only there.
        assert expected_TV[:, shard_slice].max() > 0.1


def test_entropy_gradient_matches_full_vocabulary_gradient(tp2):
    logits_TV, targets_T, lp_weights_T, entropy_weights_T = full_problem()
    expected_TV = reference_grad(logits_TV, targets_T, lp_weights_T, entropy_weights_T)
    without_entropy_TV = reference_grad(logits_TV, targets_T, lp_weights_T)
    assert max_err(expected_TV, without_entropy_TV) > 1e-2
    for rank, result in enumerate(tp2):
        shard_slice = slice(rank * VOCAB // 2, (rank + 1) * VOCAB // 2)
        assert max_err(result["fp64_entropy_grad"]["grad"], expected_TV[:, shard_slice]) <= 1e-6


def test_entropy_is_detached_by_default(tp2):
    assert not any(result["entropy_requires_grad_default"] for result in tp2)


def test_bf16_shards_match_reference_on_the_bf16_values(tp2):
    logits_TV, targets_T, _, _ = full_problem()
    ref_logprobs_T, ref_entropy_T = reference(logits_TV.bfloat16(), targets_T)
    for result in tp2:
        assert result["bf16"]["grad"].dtype == torch.bfloat16
        assert max_err(result["bf16"]["logprobs"], ref_logprobs_T) <= 1e-5
        assert max_err(result["bf16"]["entropy"], ref_entropy_T) <= 1e-5


def test_two_all_reduces_per_chunk_in_forward_none_in_backward(tp2):
    num_chunks = -(-NUM_TOKENS // CHUNK)
    for result in tp2:
        calls = result["forward_all_reduces"]
        assert len(calls) == 2 * num_chunks
        assert [op for op, _ in calls[:2]] == [str(dist.ReduceOp.MAX), str(dist.ReduceOp.SUM)]
        assert calls[1][1] == (3, CHUNK) and calls[-1][1] == (3, NUM_TOKENS % CHUNK)
        assert result["backward_all_reduces"] == []


def test_out_of_range_target_raises_on_every_rank_naming_the_token(tp2):
    for result in tp2:
        for token, bad_id in OUT_OF_RANGE.items():
            message = result["errors"][token]
            assert message is not None, f"rank {result['rank']} accepted target {bad_id}"
            assert f"targets_T[{token}] = {bad_id} is outside the vocabulary [0, {VOCAB})" in (
                message
            )
        assert torch.equal(result["after_errors"], result["fp64_logprob_grad"]["logprobs"])


def test_world_of_one_equals_world_of_two(tp1, tp2):
    (single,) = tp1
    assert single["world"] == 1 and single["forward_all_reduces"] == []
    for key, tol in (("fp64_logprob_grad", 1e-12), ("fp64_entropy_grad", 1e-12), ("fp32", 1e-6)):
        full_grad = torch.cat([r[key]["grad"] for r in tp2], dim=1)
        assert max_err(full_grad, single[key]["grad"]) <= tol, key
        for rank_result in tp2:
            assert max_err(rank_result[key]["logprobs"], single[key]["logprobs"]) <= tol, key
            assert max_err(rank_result[key]["entropy"], single[key]["entropy"]) <= tol, key
