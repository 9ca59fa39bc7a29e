"""``moe_routing.scores.selection_topk`` against the two routers it stands for.

Megatron-Core's ``topk_routing_with_score_function`` (what the model runs) for any group
setting, and transformers' ``DeepseekV3TopkRouter`` (what checkpoints were trained with)
where the two agree (K = 2 x topk_group); a setting where they disagree shows why the
converter refuses it.
"""

import pytest
import torch

from moe_routing.scores import selection_topk


def _sets(ids_NK):
    return ids_NK.sort(-1).values


def _megatron_ids(logits_NE, topk, bias_E, groups, group_topk):
    from megatron_rl.parallel.mcore_compat import topk_routing_with_score_function

    _, routing_map_NE = topk_routing_with_score_function(
        logits_NE, topk, num_groups=groups or None, group_topk=group_topk or None,
        score_function="sigmoid", expert_bias=bias_E,
    )
    return torch.nonzero(routing_map_NE)[:, 1].view(-1, topk)


@pytest.mark.parametrize("topk, groups, group_topk", [(4, 0, 0), (4, 4, 2), (6, 4, 2), (8, 8, 4), (3, 8, 3)])
def test_matches_megatron(topk, groups, group_topk):
    gen = torch.Generator().manual_seed(topk * 100 + groups)
    logits_NE = 3 * torch.randn(500, 16, generator=gen)
    bias_E = 0.5 * torch.randn(16, generator=gen)
    ours = selection_topk(logits_NE, "sigmoid", topk, bias_E, groups, group_topk)
    assert torch.equal(_sets(ours), _sets(_megatron_ids(logits_NE, topk, bias_E, groups, group_topk)))
    # The bias matters here: plain top-K of the scores picks other experts for some tokens.
    plain = torch.sigmoid(logits_NE).topk(topk, -1).indices
    assert (_sets(plain) != _sets(ours)).any()


def _transformers_ids(hidden_NH, weight_EH, bias_E, topk, groups, group_topk):
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
        DeepseekV3TopkRouter,
    )

    config = DeepseekV3Config(hidden_size=hidden_NH.shape[1], n_routed_experts=weight_EH.shape[0],
                              num_experts_per_tok=topk, n_group=groups, topk_group=group_topk)
    router = DeepseekV3TopkRouter(config)
    with torch.no_grad():
        router.weight.copy_(weight_EH)
        router.e_score_correction_bias.copy_(bias_E)
    return router(hidden_NH)[2]


@pytest.mark.parametrize("topk, groups, group_topk, agree", [(4, 4, 2, True), (8, 8, 4, True), (6, 4, 2, False)])
def test_transformers_agrees_exactly_when_k_is_twice_topk_group(topk, groups, group_topk, agree):
    gen = torch.Generator().manual_seed(7 + topk)
    hidden_NH = torch.randn(2000, 32, generator=gen)
    weight_EH = torch.randn(16, 32, generator=gen)
    bias_E = 0.5 * torch.randn(16, generator=gen)
    logits_NE = hidden_NH @ weight_EH.t()
    ours = selection_topk(logits_NE, "sigmoid", topk, bias_E, groups, group_topk)
    theirs = _transformers_ids(hidden_NH, weight_EH, bias_E, topk, groups, group_topk)
    same = (_sets(ours) == _sets(theirs)).all(-1)
    assert bool(same.all()) == agree, f"{int((~same).sum())} tokens differ"
