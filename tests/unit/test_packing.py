"""Packing variable-length sequences into one THD row."""

import pytest
import torch

from megatron_rl.parallel.packing import (
    cp_partition_indices,
    next_token_targets,
    pack_sequences,
    padded_row_length,
    response_rows,
)


def test_pack_pads_to_multiple_and_common_length():
    seqs = [torch.tensor([5, 6, 7]), torch.tensor([8, 9])]
    mb = pack_sequences(seqs, sample_ids=[4, 1], pad_multiple=4, pad_to=6)
    assert mb.padded_length == 8 and mb.num_tokens == 5 and mb.num_sequences == 2
    assert mb.tokens[0, :5].tolist() == [5, 6, 7, 8, 9]
    assert mb.position_ids[0].tolist() == [0, 1, 2, 0, 1, 0, 1, 2]  # padding restarts too
    assert mb.cu_seqlens.tolist() == [0, 3, 5]
    assert mb.sample_ids.tolist() == [4, 1]
    targets, mask = next_token_targets(mb)
    assert mask.tolist() == [True, True, False, True, False, False, False, False]
    assert targets[mask].tolist() == [6, 7, 9]


def test_packed_seq_params_cover_the_row_with_padding_as_its_own_segment():
    mb = pack_sequences([torch.tensor([5, 6, 7]), torch.tensor([8, 9])], pad_multiple=4)
    params = mb.packed_seq_params()
    assert params.qkv_format == "thd"
    assert params.cu_seqlens_q.dtype == torch.int32
    assert params.cu_seqlens_q.tolist() == [0, 3, 5, 8]  # the padding tail is segment 3
    assert params.cu_seqlens_kv is params.cu_seqlens_q
    assert params.max_seqlen_q == params.max_seqlen_kv == 3
    exact = pack_sequences([torch.tensor([1, 2]), torch.tensor([3, 4])], pad_multiple=2)
    assert exact.packed_seq_params().cu_seqlens_q.tolist() == [0, 2, 4]  # no empty segment


def test_padding_only_row():
    mb = pack_sequences([], pad_multiple=2)
    assert mb.num_sequences == 0 and mb.num_tokens == 0 and mb.padded_length == 2
    assert mb.packed_seq_params().cu_seqlens_q.tolist() == [0, 2]
    assert not next_token_targets(mb)[1].any()
    assert padded_row_length(0) == 1 and padded_row_length(5, 4) == 8 and padded_row_length(5, 4, 9) == 12


def test_pack_rejects_empty_sequences():
    with pytest.raises(ValueError, match="sequence 1 must be a non-empty 1-D tensor"):
        pack_sequences([torch.tensor([1]), torch.tensor([], dtype=torch.long)])


# ------------------------------------------------------------------ context parallelism


def test_cp_slots_pad_every_sequence_to_twice_cp():
    mb = pack_sequences([torch.tensor([5, 6, 7]), torch.tensor([1, 2, 3, 4, 8])], sample_ids=[1, 0], cp_size=2)
    assert mb.padded_length == 12 and mb.num_tokens == 8
    assert mb.tokens[0].tolist() == [5, 6, 7, 0, 1, 2, 3, 4, 8, 0, 0, 0]
    assert mb.position_ids[0].tolist() == [0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6, 7]
    assert mb.cu_seqlens.tolist() == [0, 3, 8] and mb.slot_starts.tolist() == [0, 4, 12]
    assert mb.real_rows.tolist() == [0, 1, 2, 4, 5, 6, 7, 8]
    targets, mask = next_token_targets(mb)
    assert torch.nonzero(mask)[:, 0].tolist() == [0, 1, 4, 5, 6, 7]
    assert targets[mask].tolist() == [6, 7, 2, 3, 4, 8]
    # Packing order: sample 1 (prompt 1) in slot [0, 4), then sample 0 (prompt 2) in slot [4, 12).
    assert response_rows(mb, prompt_lengths=[2, 1]).tolist() == [0, 1, 5, 6, 7]
    params = mb.packed_seq_params()
    # TE attends over the real lengths; RoPE and the CP split read the slots (Megatron's THD CP contract).
    assert params.cu_seqlens_q.tolist() == [0, 3, 8] and params.cu_seqlens_q_padded.tolist() == [0, 4, 12]
    assert params.cu_seqlens_kv is params.cu_seqlens_q and params.max_seqlen_q == 8


def test_cp_row_is_padded_for_tp_shards_and_common_length():
    # CP2 x TP2 under SP: rows a multiple of lcm(2 x CP, CP x TP) = 4; pad_to 18 -> 20; the tail counts whole.
    mb = pack_sequences([torch.tensor([5, 6, 7])], pad_multiple=2, pad_to=18, cp_size=2)
    assert mb.padded_length == 20
    params = mb.packed_seq_params()
    assert params.cu_seqlens_q_padded.tolist() == [0, 4, 20] and params.cu_seqlens_q.tolist() == [0, 3, 19]
    assert mb.local_rows.numel() == 10 and mb.local_rows.numel() % 2 == 0
    assert pack_sequences([], cp_size=4).packed_seq_params().cu_seqlens_q_padded.tolist() == [0, 8]


def test_cp_partition_is_transformer_engines_example():
    """TE's ``attn_forward_func_with_cp`` docstring (transformer_engine/pytorch/attention/
    dot_product_attention/context_parallel.py): seq_lens [8, 4], CP 2 -> GPU0 holds positions
    0 1 6 7 of sequence 0 and 0 3 of sequence 1; GPU1 2 3 4 5 and 1 2."""
    cu = torch.tensor([0, 8, 12], dtype=torch.int32)
    assert cp_partition_indices(cu, 12, 2, 0).tolist() == [0, 1, 6, 7, 8, 11]
    assert cp_partition_indices(cu, 12, 2, 1).tolist() == [2, 3, 4, 5, 9, 10]


@pytest.mark.parametrize("cp_size", [2, 3, 4])
def test_cp_partition_deals_two_chunks_per_slot_to_every_rank(cp_size):
    slots = [2 * cp_size * k for k in (1, 5, 2, 3)]
    cu = torch.tensor([0] + torch.tensor(slots).cumsum(0).tolist())
    total = int(cu[-1])
    every = [cp_partition_indices(cu, total, cp_size, r) for r in range(cp_size)]
    assert torch.equal(torch.cat(every).sort().values, torch.arange(total))  # a partition of the row
    for rank, rows in enumerate(every):
        expected = []
        for start, slot in zip(cu[:-1].tolist(), slots):
            chunk = slot // (2 * cp_size)
            for index in (rank, 2 * cp_size - 1 - rank):
                expected += range(start + index * chunk, start + (index + 1) * chunk)
        assert rows.tolist() == expected
    with pytest.raises(ValueError, match=f"every segment must be a multiple of {2 * cp_size}"):
        cp_partition_indices(torch.tensor([0, 2 * cp_size + 1]), 2 * cp_size + 1, cp_size, 0)


def test_cp_rank_feeds_its_share_and_the_row_comes_back_in_order():
    sequences = [torch.arange(1, 8), torch.arange(10, 13), torch.arange(20, 31)]
    shares = [pack_sequences(sequences, cp_size=2, cp_rank=r) for r in range(2)]
    row = shares[0].tokens[0]
    for mb in shares:
        inputs = mb.model_inputs()
        assert torch.equal(inputs["input_ids"][0], row[mb.local_rows])
        assert torch.equal(inputs["position_ids"][0], mb.position_ids[0, mb.local_rows])
        owned = mb.local_position_of_row >= 0
        assert torch.equal(mb.local_position_of_row[mb.local_rows], torch.arange(mb.local_rows.numel()))
        assert int(owned.sum()) == row.numel() // 2
    gathered = torch.cat([row[mb.local_rows] for mb in shares])
    assert torch.equal(gathered[shares[0].cp_row_order], row)


def test_token_budget_is_per_cp_rank():
    from types import SimpleNamespace

    from megatron_rl.parallel.logprobs import pack_for_rank

    groups = SimpleNamespace(tp_size=1, sequence_parallel=False, cp_size=2, cp_rank=1, dp_size=1)
    sequences = [torch.ones(n, dtype=torch.int64) for n in (30, 7, 19, 12)]  # slots 32, 8, 20, 12
    rows = pack_for_rank(sequences, groups, 0, max_tokens=20)  # rows of at most 40 tokens
    assert sorted(j for mb in rows for j in mb.sample_ids.tolist()) == [0, 1, 2, 3]
    assert all(mb.padded_length <= 40 and mb.cp_rank == 1 and mb.local_rows.numel() * 2 == mb.padded_length
               for mb in rows)
    with pytest.raises(ValueError, match="sample 0 takes 32 tokens of a row .* 14 tokens per CP rank x CP 2"):
        pack_for_rank(sequences, groups, 0, max_tokens=14)
    with pytest.raises(ValueError, match="budget 21 per CP rank .* not a multiple of 4"):
        pack_for_rank(sequences, groups, 0, max_tokens=21)
