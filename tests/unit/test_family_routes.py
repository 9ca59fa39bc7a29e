"""SGLang routes of a model with dense first layers (DeepSeek-V3, GLM-4.5).

SGLang's capturer holds a column per decoder layer (``num_hidden_layers``) and writes only
the MoE layers' (``sglang/srt/layers/moe/routed_experts_capturer.py``: a zero-initialized
buffer, ``buffer[:, layer_id] = topk_ids`` from each MoE layer); the dense layers' columns
reach the client as zeros. Decoding keeps the MoE columns only.
"""

import pytest
import torch

from megatron_rl.rollout.sglang.wire import decode_routed_experts, encode_routed_experts
from moe_routing.validate import RoutingDataError

N, LAYERS, K, E = 6, 4, 2, 8
MOE = (1, 2, 3)


def _sglang_payload() -> tuple[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    moe_NLK = torch.rand(N, len(MOE), E, generator=gen).topk(K, -1).indices
    sent_NLK = torch.zeros(N, LAYERS, K, dtype=torch.int64)
    sent_NLK[:, list(MOE)] = moe_NLK
    return encode_routed_experts(sent_NLK), moe_NLK


def test_dense_columns_are_dropped():
    payload, moe_NLK = _sglang_payload()
    got = decode_routed_experts(payload, prompt_len=4, output_len=3, num_layers=LAYERS, topk=K, num_experts=E,
                                source="sample 0", moe_layers=MOE)
    assert got.shape == (N, len(MOE), K) and torch.equal(got.long(), moe_NLK)


def test_without_the_moe_layers_the_zero_column_is_an_error_naming_layer_1():
    payload, _ = _sglang_payload()
    with pytest.raises(RoutingDataError, match="layer 1 token 0: expert repeated"):
        decode_routed_experts(payload, prompt_len=4, output_len=3, num_layers=LAYERS, topk=K, num_experts=E,
                              source="sample 0")


def test_errors_name_the_decoder_layer():
    gen = torch.Generator().manual_seed(1)
    sent_NLK = torch.zeros(N, LAYERS, K, dtype=torch.int64)
    sent_NLK[:, list(MOE)] = torch.rand(N, len(MOE), E, generator=gen).topk(K, -1).indices
    sent_NLK[2, 3] = torch.tensor([5, 5])
    with pytest.raises(RoutingDataError, match="layer 4 token 2: expert repeated"):
        decode_routed_experts(encode_routed_experts(sent_NLK), prompt_len=4, output_len=3, num_layers=LAYERS,
                              topk=K, num_experts=E, source="sample 0", moe_layers=MOE)
