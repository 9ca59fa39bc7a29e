"""Router drift per version lag (:class:`megatron_rl.train.drift.LagMeans`): means over the
tokens of each lag, and nothing logged for a lag no token has (a group of one rank)."""

from types import SimpleNamespace

import torch

from megatron_rl.train.drift import LagMeans


def test_a_lag_without_tokens_logs_nothing_rather_than_zero():
    """Training version 5 with k = 3: tokens of versions 5 and 3 (lags 0 and 2), one of version
    4 masked out of the loss; lags 1 and 3 have no token, so they have no mean to log."""
    means = LagMeans(max_lag=3, version=5)
    versions_T = torch.tensor([5, 5, 3, 4, 3])
    mask_T = torch.tensor([1, 1, 1, 0, 1])
    means.add("flip_rate", torch.tensor([0.0, 0.5, 0.25, 9.0, 0.75]), versions_T, mask_T)
    means.add("gamma", torch.tensor([1.0, 0.5, 0.5, 9.0, 0.25]), versions_T, mask_T)
    out = means.reduce(SimpleNamespace(dp_size=1, dp=None))
    assert set(out) == {f"drift/{m}/lag{d}" for m in ("flip_rate", "gamma") for d in (0, 2)}
    assert out["drift/flip_rate/lag0"].item() == 0.25 and out["drift/flip_rate/lag2"].item() == 0.5
    assert out["drift/gamma/lag0"].item() == 0.75 and out["drift/gamma/lag2"].item() == 0.375
