"""Packing variable-length sequences into one masked row."""

import torch

from megatron_rl.parallel.packing import block_causal_mask, next_token_targets, pack_sequences


def test_block_causal_mask_admits_only_earlier_tokens_of_the_same_sequence():
    cu = torch.tensor([0, 2, 5])
    blocked = block_causal_mask(cu, 7)  # 5 real tokens + 2 padding
    seq_of = [0, 0, 1, 1, 1, 2, 2]
    for q in range(7):
        for k in range(7):
            allowed = seq_of[q] == seq_of[k] and k <= q
            assert bool(blocked[q, k]) == (not allowed), (q, k)


def test_pack_pads_to_multiple_and_common_length():
    seqs = [torch.tensor([5, 6, 7]), torch.tensor([8, 9])]
    mb = pack_sequences(seqs, sample_ids=[4, 1], pad_multiple=4, pad_to=6)
    assert mb.padded_length == 8 and mb.num_tokens == 5
    assert mb.tokens[0, :5].tolist() == [5, 6, 7, 8, 9]
    assert mb.position_ids[0, :5].tolist() == [0, 1, 2, 0, 1]
    assert mb.cu_seqlens.tolist() == [0, 3, 5]
    assert mb.sample_ids.tolist() == [4, 1]
    targets, mask = next_token_targets(mb)
    assert mask.tolist() == [True, True, False, True, False, False, False, False]
    assert targets[mask].tolist() == [6, 7, 9]


def test_pack_rejects_empty_input():
    import pytest

    with pytest.raises(ValueError, match="no sequences"):
        pack_sequences([])
    with pytest.raises(ValueError, match="sequence 1 must be a non-empty 1-D tensor"):
        pack_sequences([torch.tensor([1]), torch.tensor([], dtype=torch.long)])
