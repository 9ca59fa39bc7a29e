"""Exact order statistics over a masked token axis without a host synchronisation.

The Beyond-80/20 filter needs the top ``k`` tokens and STAPO an entropy quantile, where
``k`` and the population size are tensors. ``torch.topk`` / ``kthvalue`` need a Python
``int`` (one ``.item()`` per call) and a full ``torch.sort`` of ~1M values costs more than
the whole loss on a CPU. This module selects by radix instead: floats are mapped to
integer keys with the same order, and the k-th largest key is found one digit at a time
with one weighted ``bincount`` per digit. Digits are 16 bits wide on large batches (2
passes for 32-bit floats, 4 for 64-bit) and 8 bits on small ones, where a 65536-bin
histogram would cost more than the tokens themselves.

Ties are broken by position (the earlier token wins), so :func:`top_k_mask` keeps exactly
``k`` tokens. ``-0.0`` and ``+0.0`` are the same value.

Shape legend: T tokens.
"""

from __future__ import annotations

import torch
from torch import Tensor

# Token count from which 16-bit digits (fewer passes) beat 8-bit ones (tiny histograms).
_WIDE_DIGITS_MIN_TOKENS = 1 << 18
_INT_VIEW = {
    torch.float16: torch.int16,
    torch.bfloat16: torch.int16,
    torch.float32: torch.int32,
    torch.float64: torch.int64,
}


def order_keys(values_T: Tensor) -> Tensor:
    """int64 keys ordered like the float values (IEEE-754: flip the magnitude bits of negatives)."""
    canonical_T = values_T.detach() + 0.0  # turns -0.0 into +0.0
    bits_T = canonical_T.view(_INT_VIEW[values_T.dtype]).long()
    magnitude_mask = (1 << (torch.finfo(values_T.dtype).bits - 1)) - 1
    return torch.where(bits_T < 0, bits_T ^ magnitude_mask, bits_T)


def _radix_select(
    keys_T: Tensor, valid_T: Tensor, k: Tensor, key_bits: int
) -> tuple[Tensor, Tensor, Tensor]:
    """Finds the k-th largest valid key.

    Returns:
        (greater_T, tied_T, take): valid keys strictly above it, valid keys equal to it,
        and how many of the tied keys belong to the top k.
    """
    digit_bits = 16 if keys_T.numel() >= _WIDE_DIGITS_MIN_TOKENS else 8
    num_digits = 1 << digit_bits
    in_prefix_T = valid_T
    greater_T = torch.zeros_like(valid_T)
    remaining = k.to(torch.float64)
    for shift in range(key_bits - digit_bits, -1, -digit_bits):
        if shift == key_bits - digit_bits:
            # Top digit of a signed key: the arithmetic shift is signed; move it to [0, num_digits).
            digit_T = (keys_T >> shift) + (num_digits // 2)
        else:
            digit_T = (keys_T >> shift) & (num_digits - 1)
        hist = torch.bincount(digit_T, weights=in_prefix_T.double(), minlength=num_digits)
        at_or_above = hist.flip(0).cumsum(0).flip(0)
        # The largest digit with at least `remaining` keys at or above it.
        chosen = (at_or_above >= remaining).sum() - 1
        # index_select, not hist[chosen]: indexing with a 0-dim tensor would fetch it to the host.
        index = chosen.reshape(1)
        remaining = (
            remaining - (at_or_above.index_select(0, index) - hist.index_select(0, index))[0]
        )
        greater_T = greater_T | (in_prefix_T & (digit_T > chosen))
        in_prefix_T = in_prefix_T & (digit_T == chosen)
    return greater_T, in_prefix_T, remaining


def _key_bits(dtype: torch.dtype) -> int:
    return 64 if torch.finfo(dtype).bits == 64 else 32


def top_k_mask(values_T: Tensor, valid_T: Tensor, k: Tensor) -> Tensor:
    """[T] bool: the ``k`` largest valid values (ties: earlier tokens first).

    Args:
        values_T: [T] floats.
        valid_T: [T] bool population.
        k: 0-dim integer tensor, clamped to [0, number of valid tokens].
    """
    k = torch.minimum(k.long().clamp(min=0), valid_T.sum())
    greater_T, tied_T, take = _radix_select(
        order_keys(values_T), valid_T, k, _key_bits(values_T.dtype)
    )
    return greater_T | (tied_T & (torch.cumsum(tied_T, 0) <= take) & (k > 0))


def kth_smallest(values_T: Tensor, valid_T: Tensor, index: Tensor) -> Tensor:
    """0-dim value of the valid entry at 0-based ascending position ``index`` (a tensor).

    ``index`` must lie in [0, number of valid tokens); the result is undefined otherwise.
    """
    k = valid_T.sum() - index.long()  # ascending position i is the (n - i)-th largest
    _, tied_T, _ = _radix_select(order_keys(values_T), valid_T, k, _key_bits(values_T.dtype))
    return torch.where(tied_T, values_T.detach(), values_T.new_tensor(float("-inf"))).amax()
