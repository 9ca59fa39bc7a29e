"""Block-causal core attention over THD segments, against an explicit masked softmax."""

import math
from types import SimpleNamespace

import pytest
import torch

from megatron_rl.parallel.mcore_compat import AttnMaskType, PackedSeqParams
from megatron_rl.parallel.packed_attention import PackedCoreAttention

HEADS, GROUPS, DIM = 4, 2, 8
CU = [0, 5, 6, 13, 18, 20]  # lengths 5, 1, 7, 5, 2 (the last one: a padding tail)


def _config():
    return SimpleNamespace(context_parallel_size=1, attention_dropout=0.0, kv_channels=DIM, window_size=None,
                           softmax_type="vanilla")


def _attention():
    return PackedCoreAttention(_config(), 1, AttnMaskType.causal, "self")


def _params(cu):
    cu = torch.tensor(cu, dtype=torch.int32)
    longest = int(cu.diff().max())
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest,
                           max_seqlen_kv=longest)


def _reference(q, k, v, cu):
    """Dense float64 attention with an explicit block-causal mask."""
    total = q.shape[0]
    block = torch.bucketize(torch.arange(total), torch.tensor(cu[1:]), right=True)
    allowed = (block[:, None] == block[None, :]) & torch.ones(total, total, dtype=torch.bool).tril()
    k = k.double().repeat_interleave(HEADS // GROUPS, dim=1)
    v = v.double().repeat_interleave(HEADS // GROUPS, dim=1)
    scores = torch.einsum("thd,uhd->htu", q.double(), k) / math.sqrt(DIM)
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    return torch.einsum("htu,uhd->thd", probs, v).reshape(total, -1)


def _qkv(total, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(total, HEADS, DIM, generator=gen), torch.randn(total, GROUPS, DIM, generator=gen),
            torch.randn(total, GROUPS, DIM, generator=gen))


def test_matches_dense_block_causal_attention_with_gqa():
    q, k, v = _qkv(CU[-1])
    out = _attention()(q, k, v, None, packed_seq_params=_params(CU))
    assert out.shape == (CU[-1], HEADS * DIM)
    torch.testing.assert_close(out.double(), _reference(q, k, v, CU), rtol=0, atol=1e-5)


def test_gradients_match_dense_reference():
    q, k, v = (t.double().requires_grad_() for t in _qkv(CU[-1], seed=1))
    out = _attention()(q, k, v, None, packed_seq_params=_params(CU))
    weights = torch.randn_like(out)
    grads = torch.autograd.grad((out * weights).sum(), (q, k, v))
    qr, kr, vr = (t.detach().clone().requires_grad_() for t in (q, k, v))
    expected = torch.autograd.grad((_reference(qr, kr, vr, CU) * weights).sum(), (qr, kr, vr))
    for got, want in zip(grads, expected):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-10)


def test_a_segment_never_sees_another_segment_exactly():
    q, k, v = _qkv(CU[-1])
    attention = _attention()
    before = attention(q, k, v, None, packed_seq_params=_params(CU))
    q2, k2, v2 = q.clone(), k.clone(), v.clone()
    for t in (q2, k2, v2):
        t[6:13] = torch.randn_like(t[6:13]) * 5  # segment 2 only
    after = attention(q2, k2, v2, None, packed_seq_params=_params(CU))
    changed = (before != after).any(dim=1)
    assert changed[6:13].all()
    assert not changed[:6].any() and not changed[13:].any()  # bit for bit


def test_one_sequence_per_batch_row_without_packed_params():
    q, k, v = _qkv(7, seed=2)
    out_sb = _attention()(q[:, None], k[:, None], v[:, None], None)  # [s, b=1, H, D]
    assert out_sb.shape == (7, 1, HEADS * DIM)
    torch.testing.assert_close(out_sb[:, 0].double(), _reference(q, k, v, [0, 7]), rtol=0, atol=1e-5)


def test_rejects_what_it_cannot_compute():
    q, k, v = _qkv(CU[-1])
    attention = _attention()
    with pytest.raises(ValueError, match="segments cover 19 tokens, the row has 20"):
        attention(q, k, v, None, packed_seq_params=_params(CU[:-1] + [19]))
    with pytest.raises(ValueError, match="qkv_format 'sbhd'"):
        attention(q, k, v, None, packed_seq_params=PackedSeqParams(qkv_format="sbhd"))
    with pytest.raises(ValueError, match="computes causal attention"):
        PackedCoreAttention(_config(), 1, AttnMaskType.no_mask, "self")


def test_sliding_window_and_sinks_match_transformers_gpt_oss():
    """GPT-OSS attention: each segment alone through transformers' own eager GPT-OSS attention
    (its sink logits and a sliding-window mask as transformers builds it: key j is seen from
    query i when i - window < j <= i), against the packed row; gradients of the sinks too."""
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    window = 3
    tp = SimpleNamespace(size=lambda: 1)
    config = SimpleNamespace(**vars(_config()), num_attention_heads=HEADS, params_dtype=torch.float64,
                             perform_initialization=False, window_attn_skip_freq=None)
    config.window_size, config.softmax_type = (window - 1, 0), "learnable"
    attention = PackedCoreAttention(config, 1, AttnMaskType.causal, "self", pg_collection=SimpleNamespace(tp=tp))
    with torch.no_grad():
        attention.softmax_offset.copy_(torch.tensor([0.5, -1.0, 2.0, 0.0], dtype=torch.float64))
    q, k, v = (t.double() for t in _qkv(CU[-1], seed=2))
    out = attention(q, k, v, None, packed_seq_params=_params(CU))
    sinks = attention.softmax_offset.detach().clone().requires_grad_()
    module = SimpleNamespace(sinks=sinks, num_key_value_groups=HEADS // GROUPS, training=False)
    expected = []
    for start, end in zip(CU[:-1], CU[1:]):
        n = end - start
        i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
        mask = torch.zeros(n, n, dtype=torch.float64).masked_fill(~((j <= i) & (j > i - window)), float("-inf"))
        seg = [t[start:end].transpose(0, 1)[None] for t in (q, k, v)]
        hf, _ = eager_attention_forward(module, *seg, mask[None, None], scaling=1 / math.sqrt(DIM))
        expected.append(hf[0].reshape(n, -1))
    expected = torch.cat(expected)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)
    weights = torch.randn_like(out)
    (out * weights).sum().backward()
    (expected * weights).sum().backward()
    torch.testing.assert_close(attention.softmax_offset.grad, sinks.grad, rtol=0, atol=1e-12)
    assert float(attention.softmax_offset.grad.abs().min()) > 0
