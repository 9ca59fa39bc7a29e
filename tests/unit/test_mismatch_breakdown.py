"""The mismatch breakdown's arithmetic (``moe_routing.breakdown``) on passes written by hand.

A gap injected into the tokens of one layer's pass must be attributed to that layer and
stage; the parts telescope to the total whatever the passes are; the router KL over the
engine's K experts plus one bin is zero for equal routers and never above the E-way KL; the
worst tokens name their sample, position, cause and flipped layers.
"""

import pytest
import torch

from moe_routing.breakdown import (
    StagePasses,
    breakdown_metrics,
    coarse_router_kl_TL,
    gap_sums,
    routing_sums,
    token_causes,
    worst_tokens,
)

LAYERS = (1, 2, 3)
T = 40


def _passes(gen, ids_fix_layer=None, gate_fix_layer=None, other=1e-4):
    """Rollout log-probs and passes where replaying layer ``ids_fix_layer``'s ids (and then
    ``gate_fix_layer``'s gates) removes a gap of ~0.1 on half the tokens; ``other`` remains."""
    rollout = -torch.rand(T, generator=gen) * 3
    residual = other * torch.randn(T, generator=gen, dtype=torch.float64).float()
    ids_gap = torch.where(torch.arange(T) % 2 == 0, 0.1, 0.0) if ids_fix_layer else torch.zeros(T)
    gate_gap = torch.where(torch.arange(T) % 2 == 1, 0.05, 0.0) if gate_fix_layer else torch.zeros(T)
    trainer = rollout + ids_gap + gate_gap + residual
    ids_passes = [rollout + torch.where(torch.tensor(n >= (ids_fix_layer or 99)), 0.0, 1.0) * ids_gap + gate_gap
                  + residual for n in LAYERS]
    gate_passes = [rollout + torch.where(torch.tensor(n >= (gate_fix_layer or 99)), 0.0, 1.0) * gate_gap + residual
                   for n in LAYERS]
    return StagePasses(rollout_T=rollout, trainer_T=trainer, ids_passes=ids_passes, gate_passes=gate_passes,
                       mask_T=torch.ones(T, dtype=torch.bool))


def _metrics(passes, routing=None):
    routing = routing if routing is not None else torch.zeros(3, len(LAYERS)) + torch.tensor([[0.0], [0.0], [1.0]])
    return breakdown_metrics(gap_sums(passes), routing, LAYERS, len(passes.ids_passes), len(passes.gate_passes),
                             with_kl=True)


def test_an_injected_cause_goes_to_its_layer_and_stage_and_the_parts_sum_to_the_gap():
    m = _metrics(_passes(torch.Generator().manual_seed(0), ids_fix_layer=2, gate_fix_layer=3))
    total = float(m["mismatch/breakdown/gap"])
    parts = [float(m[f"mismatch/breakdown/gap/{s}"]) for s in ("expert_choice", "gate_weights", "other")]
    assert sum(parts) == pytest.approx(total, rel=1e-6)
    assert float(m["mismatch/breakdown/layer2/expert_choice"]) > 0.6  # 0.05 of 0.075 mean gap
    assert float(m["mismatch/breakdown/layer3/gate_weights"]) > 0.3
    for n in (1, 3):
        assert abs(float(m[f"mismatch/breakdown/layer{n}/expert_choice"])) < 0.01
    for n in (1, 2):
        assert abs(float(m[f"mismatch/breakdown/layer{n}/gate_weights"])) < 0.01
    assert float(m["mismatch/breakdown/share/other"]) < 0.01


def test_parts_telescope_whatever_the_passes():
    gen = torch.Generator().manual_seed(1)
    passes = StagePasses(rollout_T=torch.randn(T, generator=gen), trainer_T=torch.randn(T, generator=gen),
                         ids_passes=[torch.randn(T, generator=gen) for _ in LAYERS], gate_passes=[],
                         mask_T=torch.rand(T, generator=gen) > 0.3)
    m = _metrics(passes)
    assert "mismatch/breakdown/gap/gate_weights" not in m  # no gates: not measured, inside "other"
    shares = sum(float(m[f"mismatch/breakdown/share/{s}"]) for s in ("expert_choice", "other"))
    assert shares == pytest.approx(1.0, abs=1e-6)
    layer_shares = sum(float(m[f"mismatch/breakdown/layer{n}/expert_choice"]) for n in LAYERS)
    assert layer_shares == pytest.approx(float(m["mismatch/breakdown/share/expert_choice"]), abs=1e-6)


def test_router_kl_over_k_plus_one_bins_is_zero_when_equal_and_below_the_full_kl():
    gen = torch.Generator().manual_seed(2)
    engine_TLE = torch.softmax(torch.randn(50, 3, 8, generator=gen) * 2, -1)
    trainer_TLE = torch.softmax(torch.randn(50, 3, 8, generator=gen) * 2, -1)
    ids_TLK = engine_TLE.topk(2, -1).indices
    kl_TL = coarse_router_kl_TL(engine_TLE.gather(-1, ids_TLK), trainer_TLE.gather(-1, ids_TLK))
    full_TL = (engine_TLE * (engine_TLE.log() - trainer_TLE.log())).sum(-1).double()
    assert bool((kl_TL <= full_TL + 1e-9).all()) and float(kl_TL.mean()) > 0.05
    same = coarse_router_kl_TL(engine_TLE.gather(-1, ids_TLK), engine_TLE.gather(-1, ids_TLK))
    assert float(same.abs().max()) < 1e-9


def test_flip_rates_and_worst_tokens_name_sample_position_cause_and_flips():
    passes = _passes(torch.Generator().manual_seed(3), ids_fix_layer=2)
    engine_TLK = torch.tensor([[0, 1], [2, 3], [4, 5]]).expand(T, 3, 2).clone()
    trainer_TLK = engine_TLK.clone()
    trainer_TLK[::2, 1] = torch.tensor([3, 2])  # same set: no flip
    trainer_TLK[::2, 1, 0] = 7  # a flip at layer 2 on even tokens
    routing = routing_sums(engine_TLK, trainer_TLK, passes.mask_T)
    m = _metrics(passes, routing)
    assert float(m["mismatch/breakdown/layer2/flip_rate"]) == 0.5
    assert float(m["mismatch/breakdown/layer1/flip_rate"]) == 0.0
    causes = token_causes(passes, LAYERS)
    assert causes[0] == "expert_choice at layer2" and causes[1] == "other"
    flips_TL = (engine_TLK.sort(-1).values != trainer_TLK.sort(-1).values).any(-1)
    cu = torch.tensor([0, 15, 40])
    worst = worst_tokens(passes, LAYERS, cu, flips_TL, 3)
    assert len(worst) == 3 and all(row["cause"] == "expert_choice at layer2" for row in worst)
    assert all(row["flipped_layers"] == [2] for row in worst)
    for row in worst:
        assert 0 <= row["position"] < (15 if row["sample"] == 0 else 25)
