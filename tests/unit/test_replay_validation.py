"""Replay data validation, RSPO math and the replay gate (objectives.md §19.13-19.14)."""

import pytest
import torch

from megatron_rl.parallel.train_step import RoutingPlan, TrainBatch, replay_ids_for
from moe_routing.shift import router_shift_TL, rspo_gamma_T
from moe_routing.validate import RoutingDataError, validate_expert_ids

E, K, LAYERS = 8, 2, (1, 2, 3)


def _ids(t=4):
    ids = torch.stack([torch.tensor([[0, 1], [2, 3], [4, 5]])] * t)
    return ids.to(torch.uint8)


def _check(ids, **kw):
    args = dict(num_experts=E, topk=K, layer_numbers=LAYERS, required_layers=LAYERS, num_tokens=4, source="R2 record")
    args.update(kw)
    validate_expert_ids(ids, **args)


def test_valid_ids_pass():
    _check(_ids())


@pytest.mark.parametrize(
    "mutate,kw,message",
    [
        (lambda x: x.float(), {}, "expert ids must be integers"),
        (lambda x: x[:, :, :1], {}, "has top-1 ids but the routers use top-2"),
        (lambda x: x[:3], {}, "covers 3 tokens but the batch has 4"),
        (lambda x: x[:, :2], {"layer_numbers": (1, 2)}, r"no routing for MoE layer\(s\) \[3\]"),
        (lambda x: x[:, :, :, None], {}, "expected \\[tokens, layers, top-K\\]"),
    ],
)
def test_malformed_ids_are_rejected(mutate, kw, message):
    with pytest.raises(RoutingDataError, match=message):
        _check(mutate(_ids()), **kw)


def test_out_of_range_id_names_layer_and_token():
    ids = _ids().to(torch.int64)
    ids[2, 1, 0] = 8
    with pytest.raises(RoutingDataError, match=r"R2 record: layer 2 token 2: expert id 8 is outside \[0, 8\)"):
        _check(ids)
    ids[2, 1, 0] = -1
    with pytest.raises(RoutingDataError, match="layer 2 token 2: expert id -1"):
        _check(ids)


def test_duplicate_expert_names_layer_and_token():
    ids = _ids()
    ids[3, 2] = torch.tensor([5, 5])
    with pytest.raises(RoutingDataError, match=r"layer 3 token 3: expert repeated in \[5, 5\]"):
        _check(ids)


def _batch(routes):
    seqs = [torch.arange(5), torch.arange(4)]
    return TrainBatch(sequences=seqs, prompt_lengths=[2, 2], old_logprobs_T=torch.zeros(5),
                      advantages_T=torch.zeros(5), rollout_routes=routes)


def _r3_ids(routes):
    return replay_ids_for(_batch(routes), RoutingPlan(mode="R3"), num_experts=E, topk=K,
                          layer_numbers=LAYERS, local_layers=LAYERS)


def test_r3_routes_in_sglang_layout_are_accepted_and_extended():
    routes = [torch.tensor([[0, 1]]).repeat(4, 3, 1), torch.tensor([[2, 3]]).repeat(3, 3, 1)]
    ids = _r3_ids(routes)
    assert ids.shape == (9, 3, 2)
    assert ids[4].tolist() == ids[3].tolist()  # the un-forwarded last position copies its predecessor


@pytest.mark.parametrize("moe_layers", [(1, 2), (2, 4), (1, 3)])
def test_r3_routes_with_a_column_per_decoder_layer_keep_the_moe_layers_columns(moe_layers):
    """SGLang's routes have a column per decoder layer (4 here); replay takes the MoE layers'
    own, also when dense layers come after the MoE layers (1, 2): an index off by one there
    takes a dense layer's column without failing."""
    columns_TL = torch.arange(4)[None, :].expand(4, 4)  # column c routes to experts 2c, 2c + 1
    routes = [torch.stack([2 * columns_TL, 2 * columns_TL + 1], dim=-1)[:n - 1] for n in (5, 4)]
    ids = replay_ids_for(_batch(routes), RoutingPlan(mode="R3"), num_experts=E, topk=K, layer_numbers=moe_layers,
                         local_layers=moe_layers, num_model_layers=4)
    assert ids.shape == (9, 2, 2)
    assert ids[:, :, 0].tolist() == [[2 * (n - 1) for n in moe_layers]] * 9


def test_r3_routes_of_wrong_length_name_the_sample():
    routes = [torch.tensor([[0, 1]]).repeat(4, 3, 1), torch.tensor([[2, 3]]).repeat(4, 3, 1)]
    with pytest.raises(RoutingDataError, match=r"R3 routes of sample 1: expected \[3, L, K\]"):
        _r3_ids(routes)


def test_r3_routes_with_bad_ids_name_sample_layer_and_token():
    bad = torch.tensor([[0, 1]]).repeat(3, 3, 1)
    bad[1, 0] = torch.tensor([7, 7])
    routes = [torch.tensor([[0, 1]]).repeat(4, 3, 1), bad]
    with pytest.raises(RoutingDataError, match="R3 routes of sample 1: layer 1 token 1: expert repeated"):
        _r3_ids(routes)


def test_missing_replay_data_is_named():
    with pytest.raises(RoutingDataError, match="R3 needs one rollout route tensor per sample"):
        _r3_ids(None)
    with pytest.raises(RoutingDataError, match="R2 needs the old-policy RouterRecord"):
        replay_ids_for(_batch(None), RoutingPlan(mode="R2"), num_experts=E, topk=K,
                       layer_numbers=LAYERS, local_layers=LAYERS)


def test_rspo_gamma_worked_example():
    """objectives.md §19.13: |dlogr| [[0.1, 0.3], [0.05, 0.15]] -> gamma = exp(-0.15)."""
    old = torch.full((1, 2, 2), 0.25)
    current = old * torch.exp(torch.tensor([[[0.1, -0.3], [0.05, -0.15]]]))
    shift = router_shift_TL(current, old)
    assert torch.allclose(shift, torch.tensor([[0.2, 0.1]], dtype=torch.float64))
    gamma = rspo_gamma_T(shift.sum(1), 2)
    assert abs(float(gamma) - 0.860708) < 1e-6
    assert not gamma.requires_grad


def test_replay_gate_worked_example():
    """objectives.md §19.14: logits [2.0, 1.9, 0.5, -1.0], replayed experts {0, 2}."""
    from megatron_rl.parallel import mcore_compat as mc
    from megatron_rl.parallel.routing_replay import RoutingReplay

    replay = mc.RouterReplay()
    mc.RouterReplay.global_router_replay_instances.remove(replay)
    mc.override_replay_topk(replay, lambda original: RoutingReplay._choose_action(replay, original))
    replay.set_target_indices(torch.tensor([[0, 2]]))
    logits = torch.tensor([[2.0, 1.9, 0.5, -1.0]], requires_grad=True)
    probs, routing_map = mc.topk_routing_with_score_function(logits, 2, router_replay=replay)
    assert routing_map.tolist() == [[True, False, True, False]]
    assert torch.allclose(probs, torch.tensor([[0.817574, 0.0, 0.182426, 0.0]]), atol=1e-6)
    probs[0, 0].backward()
    assert logits.grad.abs().sum() > 0  # gates stay differentiable in the router logits
    assert replay.replay_backward_list == []  # consumed: no recompute will pop it
