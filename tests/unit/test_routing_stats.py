"""Routing diagnostics worked out by hand: the values of the flip rate, the router shift and the
replay agreement (not only their names), per layer and averaged, over valid tokens only."""

import pytest
import torch

from moe_routing.stats import routing_metrics


def test_flip_rate_abs_dlogr_and_agreement_values():
    # 4 tokens, the last not valid (its values would change every mean); layers 2 and 4.
    valid_T = torch.tensor([True, True, True, False])
    same_as_old_TL = torch.tensor([[1, 1], [0, 1], [0, 1], [1, 0]], dtype=torch.bool)
    dispatched_TL = torch.tensor([[1, 0], [1, 1], [1, 1], [0, 0]], dtype=torch.bool)
    shift_TL = torch.tensor([[0.1, 0.2], [0.3, 0.4], [0.5, 0.9], [9.0, 9.0]], dtype=torch.float64)
    m = routing_metrics([2, 4], natural_equals_dispatched_TL=dispatched_TL, valid_T=valid_T,
                        natural_equals_old_TL=same_as_old_TL, shift_TL=shift_TL)
    # Layer 2: tokens 1 and 2 chose other experts than the old policy (2 of 3 flip); layer 4: none.
    assert float(m["routing/flip_rate/layer2"]) == pytest.approx(2 / 3)
    assert float(m["routing/flip_rate/layer4"]) == 0.0
    assert float(m["routing/flip_rate"]) == pytest.approx(1 / 3)
    assert float(m["routing/abs_dlogr/layer2"]) == pytest.approx(0.9 / 3)
    assert float(m["routing/abs_dlogr/layer4"]) == pytest.approx(1.5 / 3)
    assert float(m["routing/abs_dlogr"]) == pytest.approx(0.4)
    assert float(m["routing/replay_agreement"]) == pytest.approx((1.0 + 2 / 3) / 2)
    assert sorted(m) == sorted(["routing/replay_agreement", "routing/flip_rate", "routing/abs_dlogr",
                                *(f"routing/{n}/layer{k}" for n in ("flip_rate", "abs_dlogr") for k in (2, 4))])

