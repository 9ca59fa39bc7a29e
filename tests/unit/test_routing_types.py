"""Routing record data, score math and log-prob pass input validation (single process)."""

import pytest
import torch

from megatron_rl.parallel.logprobs import validate_samples
from moe_routing.scores import dispatched_by_score, dispatched_topk, router_log_scores
from moe_routing.types import RouterRecord, compact_id_dtype


@pytest.mark.parametrize(
    "experts,dtype",
    [(1, torch.uint8), (8, torch.uint8), (256, torch.uint8), (257, torch.int16),
     (32768, torch.int16), (32769, torch.int32)],
)
def test_compact_id_dtype_is_the_narrowest_that_fits(experts, dtype):
    assert compact_id_dtype(experts) == dtype
    assert torch.tensor([experts - 1]).to(dtype).item() == experts - 1


def _record(t=5, l=2, k=2):
    return RouterRecord(
        expert_ids_TLK=torch.zeros(t, l, k, dtype=torch.uint8),
        probs_TLK=torch.zeros(t, l, k),
        gates_TLK=torch.zeros(t, l, k),
        layer_numbers=(1, 2),
        cu_seqlens_S1=torch.tensor([0, 2, t]),
        num_experts=8,
    )


def test_record_bytes_and_sample_view():
    rec = _record()
    assert rec.bytes_per_token() == 2 * 2 * (1 + 4)
    one = rec.sample(1)
    assert one.num_tokens == 3 and one.cu_seqlens_S1.tolist() == [0, 3]


def test_record_rejects_inconsistent_parts():
    with pytest.raises(ValueError, match="probs_TLK has shape"):
        RouterRecord(torch.zeros(5, 2, 2, dtype=torch.uint8), torch.zeros(5, 2, 1), torch.zeros(5, 2, 2),
                     (1, 2), torch.tensor([0, 5]), 8)
    with pytest.raises(ValueError, match="layer_numbers lists 1 layers"):
        RouterRecord(torch.zeros(5, 2, 2, dtype=torch.uint8), torch.zeros(5, 2, 2), torch.zeros(5, 2, 2),
                     (1,), torch.tensor([0, 5]), 8)
    with pytest.raises(ValueError, match="cu_seqlens_S1 ends at 4"):
        RouterRecord(torch.zeros(5, 2, 2, dtype=torch.uint8), torch.zeros(5, 2, 2), torch.zeros(5, 2, 2),
                     (1, 2), torch.tensor([0, 4]), 8)


def test_router_scores_and_dispatched_order():
    logits = torch.tensor([[2.0, 1.9, 0.5, -1.0]])
    log_scores = router_log_scores(logits, "softmax")
    assert torch.allclose(log_scores.exp().sum(), torch.tensor(1.0))
    routing_map = torch.tensor([[False, True, True, False]])
    assert dispatched_topk(log_scores, routing_map, 2).tolist() == [[1, 2]]
    sig = router_log_scores(logits, "sigmoid")
    assert torch.allclose(sig.exp(), torch.sigmoid(logits))
    with pytest.raises(ValueError, match="unknown router score function"):
        router_log_scores(logits, "sparsemax")


def test_dispatched_order_matches_masked_topk_and_ties_keep_expert_order():
    gen = torch.Generator().manual_seed(0)
    logits_NE = torch.randn(500, 32, generator=gen)
    # Dispatch a random K-set per token (as replay does), not the natural top-K.
    chosen_NK = torch.rand(500, 32, generator=gen).argsort(dim=-1)[:, :6]
    routing_map = torch.zeros(500, 32, dtype=torch.bool).scatter_(1, chosen_NK, True)
    log_scores = router_log_scores(logits_NE, "softmax")
    ids_NK, log_scores_NK = dispatched_by_score(log_scores, routing_map, 6)
    reference_NK = log_scores.masked_fill(~routing_map, float("-inf")).topk(6, dim=-1).indices
    assert torch.equal(ids_NK, reference_NK)
    assert torch.equal(log_scores_NK, log_scores.gather(1, reference_NK))
    tied = torch.tensor([[0.0, -1.0, -1.0, -1.0, 0.5]])
    assert dispatched_topk(tied, torch.tensor([[False, True, True, True, True]]), 4).tolist() == [[4, 1, 2, 3]]


def test_dispatch_with_dropped_token_is_named():
    log_scores = torch.zeros(3, 4)
    routing_map = torch.tensor([[1, 1, 0, 0], [1, 0, 0, 0], [0, 0, 1, 1]], dtype=torch.bool)
    with pytest.raises(ValueError, match="token 1 was dispatched to 1 experts, expected top-2"):
        dispatched_topk(log_scores, routing_map, 2)


def test_logprob_pass_rejects_bad_samples_naming_them():
    ok = torch.tensor([1, 2, 3, 4])
    with pytest.raises(ValueError, match="sample 1 position 2: token id 300 is outside the vocabulary"):
        validate_samples([ok, torch.tensor([1, 2, 300, 4])], [1, 1], vocab_size=256, max_length=16)
    with pytest.raises(ValueError, match="sample 0 position 0: token id -1"):
        validate_samples([torch.tensor([-1, 2])], [1], vocab_size=256, max_length=16)
    with pytest.raises(ValueError, match="sample 0 has 20 tokens, more than the model's maximum 16"):
        validate_samples([torch.arange(20)], [1], vocab_size=256, max_length=16)
    with pytest.raises(ValueError, match="sample 0: prompt length 4 must be in"):
        validate_samples([ok], [4], vocab_size=256, max_length=16)
    with pytest.raises(ValueError, match="2 sequences but 1 prompt lengths"):
        validate_samples([ok, ok], [1], vocab_size=256, max_length=16)
    with pytest.raises(ValueError, match="no samples"):
        validate_samples([], [], vocab_size=256, max_length=16)


def test_recording_a_model_without_moe_layers_is_an_error():
    from megatron_rl.parallel.routing_record import RouterRecorder

    with pytest.raises(ValueError, match="the model has no MoE layers"):
        RouterRecorder([torch.nn.Sequential(torch.nn.Linear(4, 4))])
