"""Token masks and the sync-free order statistics behind them, against sorting in Python."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch

from megatron_rl.algos import TokenBatch, build_loss_mask, get_preset
from megatron_rl.algos.masks import entropy_top_keep_T, stapo_keep_T
from megatron_rl.algos.order_stats import kth_smallest, order_keys, top_k_mask


def _values(gen: torch.Generator, n: int, dtype: torch.dtype, ties: bool) -> torch.Tensor:
    v = torch.randn(n, generator=gen, dtype=torch.float64) * 3
    if ties:
        v = v.round()
    v[torch.rand(n, generator=gen) < 0.1] = -0.0
    return v.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("ties", [False, True])
def test_top_k_and_kth_smallest_match_sorting(dtype, ties):
    gen = torch.Generator().manual_seed(0)
    for _ in range(60):
        n = int(torch.randint(1, 50, (1,), generator=gen))
        values = _values(gen, n, dtype, ties)
        valid = torch.rand(n, generator=gen) < 0.7
        population = [i for i in range(n) if valid[i]]
        k = int(torch.randint(0, len(population) + 2, (1,), generator=gen))
        got = torch.nonzero(top_k_mask(values, valid, torch.tensor(k))).flatten().tolist()
        want = sorted(sorted(population, key=lambda i: (-float(values[i]), i))[:k])
        assert got == want
        if population:
            j = int(torch.randint(0, len(population), (1,), generator=gen))
            assert (
                float(kth_smallest(values, valid, torch.tensor(j)))
                == sorted(float(values[i]) for i in population)[j]
            )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_large_batches_use_wide_digits_and_stay_exact(dtype):
    n = (1 << 18) + 1234  # above the 16-bit digit threshold
    gen = torch.Generator().manual_seed(1)
    values = _values(gen, n, dtype, ties=True) + torch.randint(0, 3, (n,), generator=gen) * 1e-3
    valid = torch.rand(n, generator=gen) < 0.6
    masked = torch.where(valid, values.double(), torch.tensor(-math.inf, dtype=torch.float64))
    order = torch.argsort(masked, descending=True, stable=True)  # ties: earlier index first
    for k in (1, 777, int(valid.sum()) // 3, int(valid.sum())):
        want = torch.zeros(n, dtype=torch.bool)
        want[order[:k]] = True
        assert torch.equal(top_k_mask(values, valid, torch.tensor(k)), want)
    ascending = torch.sort(values[valid].double()).values
    for j in (0, 5000, ascending.numel() - 1):
        assert float(kth_smallest(values, valid, torch.tensor(j))) == float(ascending[j])


def test_order_keys_are_monotone_and_merge_signed_zeros():
    values = torch.tensor(
        [-math.inf, -3.5, -1e-30, -0.0, 0.0, 1e-30, 2.0, math.inf], dtype=torch.float32
    )
    keys = order_keys(values).tolist()
    assert keys == sorted(keys) and keys[3] == keys[4] and len(set(keys)) == 7


@pytest.mark.parametrize(
    "rho,n,k", [(0.2, 10, 2), (0.7, 10, 7), (0.3, 10, 3), (0.2, 11, 3), (0.01, 5, 1), (1.0, 7, 7),
                # rho * n is an integer, but in binary a hair above it (7.000000000000001, 14.000000000000002):
                # a bare ceil keeps one token too many
                (0.28, 25, 7), (0.07, 100, 7), (0.56, 25, 14)]
)
def test_entropy_top_rho_keeps_ceil_rho_n(rho, n, k):
    assert k == math.ceil(Fraction(str(rho)) * n)  # the exact value, not the float product
    entropy = torch.linspace(0.0, 1.0, n, dtype=torch.float64)
    keep = entropy_top_keep_T(entropy, torch.ones(n, dtype=torch.bool), rho)
    assert int(keep.sum()) == k and keep[-k:].all()


def test_entropy_top_rho_ignores_masked_tokens_and_ties_keep_earlier():
    entropy = torch.tensor([1.0, 1.0, 5.0, 1.0, 1.0], dtype=torch.float64)
    base = torch.tensor([True, True, False, True, True])
    keep = entropy_top_keep_T(entropy, base, 0.5)
    assert keep.tolist() == [True, True, False, False, False]


def test_stapo_edge_cases():
    adv = torch.ones(4, dtype=torch.float64)
    base = torch.ones(4, dtype=torch.bool)
    entropy = torch.tensor([0.3, 0.1, 0.2, 0.4], dtype=torch.float64)
    # No candidate (all probable): nothing silenced.
    assert stapo_keep_T(
        torch.full((4,), -0.1, dtype=torch.float64), adv, entropy, base, 0.002, 0.75
    ).all()
    # One candidate: the quantile is its own entropy and "strictly below" keeps it.
    lp = torch.tensor([-9.0, -0.1, -0.1, -0.1], dtype=torch.float64)
    assert stapo_keep_T(lp, adv, entropy, base, 0.002, 0.75).all()
    # Ties at the quantile are kept; negative-advantage tokens are never candidates.
    lp = torch.full((4,), -9.0, dtype=torch.float64)
    tied = torch.tensor([0.5, 0.5, 0.5, 0.1], dtype=torch.float64)
    assert stapo_keep_T(lp, adv, tied, base, 0.002, 0.75).tolist() == [True, True, True, False]
    assert stapo_keep_T(lp, -adv, tied, base, 0.002, 0.75).all()


def test_masks_compose_on_the_overlong_survivors():
    cfg = get_preset("dapo", overlong_filter=True, entropy_top_rho=0.5)
    seq_ids = torch.tensor([0, 0, 0, 1, 1, 1])
    entropy = torch.tensor([9.0, 8.0, 7.0, 1.0, 2.0, 3.0], dtype=torch.float64)
    mask, metrics = build_loss_mask(
        cfg,
        TokenBatch(
            loss_mask_T=torch.ones(6, dtype=torch.bool),
            seq_ids_T=seq_ids,
            num_seqs=2,
            entropy_T=entropy,
            truncated_S=torch.tensor([True, False]),
        ),
    )
    # Sequence 0 is dropped, so the top half is taken among sequence 1's three tokens.
    assert mask.tolist() == [False, False, False, False, True, True]
    assert float(metrics["mask/overlong_frac"]) == 0.5
    assert float(metrics["mask/entropy_frac"]) == pytest.approx(1 / 6)
