"""Packing variable-length sequences into one THD row."""

import pytest
import torch

from megatron_rl.parallel.packing import (
    next_token_targets,
    pack_sequences,
    padded_row_length,
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
