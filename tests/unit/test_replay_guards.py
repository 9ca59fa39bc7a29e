"""Routing replay refuses the Megatron-Core features under which it would be silently wrong.

The hazards (``mcore_compat.replay_hazards``): the fused router returns before the replay
hook, quantile balancing (0.19+) and Sinkhorn select experts without it, MTP routers share
the backbone's layer numbers, virtual pipeline stages run backwards out of the recompute
queue's order, token dropping discards replayed routes. The run config cannot turn any of
them on; a model built with replay and one of them (``build_model`` overrides) is refused
before the TransformerConfig exists, and ``RoutingReplay`` refuses a router configured so.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megatron_rl.config_loading import ConfigError
from megatron_rl.parallel import mcore_compat as mc
from megatron_rl.parallel.model import build_transformer_config, check_replay_fields
from megatron_rl.sections import ModelConfig, ParallelConfig
from megatron_rl.parallel.routing_replay import NATURAL, RoutingReplay, _route_natural_rows

HAZARDS = {
    "fused router": ({"moe_router_fusion": True}, "moe_router_fusion=True"),
    "quantile balancing": ({"moe_router_load_balancing_type": "quantile_balancing"},
                           "moe_router_load_balancing_type=quantile_balancing"),
    "quantile balancing in a list": ({"moe_router_load_balancing_type": ["seq_aux_loss", "quantile_balancing"]},
                                     "moe_router_load_balancing_type=quantile_balancing"),
    "sinkhorn": ({"moe_router_load_balancing_type": "sinkhorn"}, "moe_router_load_balancing_type=sinkhorn"),
    "MTP": ({"mtp_num_layers": 1}, "mtp_num_layers=1"),
    "virtual pipeline": ({"virtual_pipeline_model_parallel_size": 2}, "virtual_pipeline_model_parallel_size=2"),
    "token dropping": ({"moe_expert_capacity_factor": 1.0}, "moe_expert_capacity_factor"),
}


@pytest.mark.parametrize("name", list(HAZARDS))
def test_replay_model_with_hazard_is_refused(name):
    fields, key = HAZARDS[name]
    with pytest.raises(ConfigError) as err:
        build_transformer_config(ModelConfig(), ParallelConfig(), moe_enable_routing_replay=True, **fields)
    message = str(err.value)
    assert "moe_enable_routing_replay=True" in message and key in message and "\n" not in message


def test_hazards_are_named_together_and_only_with_replay():
    fields = {"moe_router_fusion": True, "mtp_num_layers": 2, "virtual_pipeline_model_parallel_size": 4}
    check_replay_fields(dict(fields, moe_enable_routing_replay=False))
    with pytest.raises(ConfigError, match="moe_router_fusion=True.*mtp_num_layers=2.*virtual_pipeline_model_parallel_size=4"):
        check_replay_fields(dict(fields, moe_enable_routing_replay=True))
    clean = {"moe_router_load_balancing_type": "aux_loss", "virtual_pipeline_model_parallel_size": 1,
             "mtp_num_layers": None, "moe_expert_capacity_factor": None, "moe_enable_routing_replay": True}
    check_replay_fields(clean)
    assert mc.replay_hazards(SimpleNamespace(moe_router_fusion=True)) == mc.replay_hazards({"moe_router_fusion": True})


def _router(config: SimpleNamespace, mtp: bool = False):
    """A ``TopKRouter`` object carrying only what ``RoutingReplay`` reads (no process group needed)."""
    router = mc.TopKRouter.__new__(mc.TopKRouter)
    torch.nn.Module.__init__(router)
    router.layer_number, router.config, router.is_mtp_layer = 1, config, mtp
    router.router_replay = mc.RouterReplay()
    mc.RouterReplay.global_router_replay_instances.remove(router.router_replay)
    return torch.nn.ModuleDict({"router": router})


@pytest.mark.parametrize("name", ["fused router", "quantile balancing", "MTP", "virtual pipeline"])
def test_routing_replay_refuses_a_hazardous_router(name):
    fields, key = HAZARDS[name]
    with pytest.raises(ValueError, match=f"layer 1: routing replay would be silently wrong: {key}"):
        RoutingReplay([_router(SimpleNamespace(**fields))], {1: [torch.zeros(1, 2, dtype=torch.int64)]})


def test_routing_replay_refuses_an_mtp_router():
    with pytest.raises(ValueError, match="layer 1: .*MTP layer"):
        RoutingReplay([_router(SimpleNamespace(), mtp=True)], {1: [torch.zeros(1, 2, dtype=torch.int64)]})
    RoutingReplay([_router(SimpleNamespace())], {1: [torch.zeros(1, 2, dtype=torch.int64)]})


@pytest.mark.parametrize("recompute", [False, True])
def test_padding_rows_alone_are_routed_by_the_routers_own_top_k(recompute):
    """Rows marked NATURAL (a micro-batch row's padding) get the router's own top-K; every other
    row keeps the experts it replays, in this call and in the recompute queue's next one."""
    replay = mc.RouterReplay()
    mc.RouterReplay.global_router_replay_instances.remove(replay)
    replayed_NK = torch.tensor([[3, 1], [NATURAL, NATURAL], [0, 2], [NATURAL, NATURAL]])
    replay.set_target_indices(replayed_NK)
    replay.set_target_indices(replayed_NK.clone())  # the next micro-batch, queued behind it
    scores_NE = torch.tensor([[0.1, 0.2, 0.3, 0.4], [0.4, 0.1, 0.3, 0.2], [0.3, 0.3, 0.2, 0.2],
                              [0.1, 0.5, 0.1, 0.3]])
    _route_natural_rows(replay, recompute, scores_NE, lambda: scores_NE.topk(2))
    want_NK = torch.tensor([[3, 1], [0, 2], [0, 2], [1, 3]])
    assert torch.equal(mc.queued_replay_ids(replay, recompute), want_NK)
    if recompute:
        assert torch.equal(replay.replay_backward_list[1], replayed_NK)  # the next call's, untouched
