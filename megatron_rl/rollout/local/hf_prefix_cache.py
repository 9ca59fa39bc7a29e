"""The HF engine's prefix cache: a finished response's KV, reused when a later prompt extends it.

Shape legend: B batch rows, H key/value heads, C cached positions, D head channels,
L MoE layers, K top-K.

A multi-turn trajectory's next prompt is its previous prompt and response followed by the
environment's tokens. When a row finishes, :func:`take_rows` keeps its KV (every forwarded
position: the prompt and the response but its last token) and the routes of those
positions; the next request whose prompt starts with those ids is served from them
(:meth:`PrefixCache.lookup`), so its prefill computes only the new positions, as SGLang's
radix cache does. Routes of cached positions come from the cache, recorded by the pass
that computed them (SGLang captures routes per KV slot in the same way), so a request may
ask for routes from any position. An entry is used once (the continuation stores a
longer one), the oldest go first past ``max_entries``, and :meth:`PrefixCache.clear`
forgets everything when the weights change.

:func:`batch_cache` lays out the rows of one prefill: row i's ``C_i`` cached positions
right-aligned in ``C = max C_i`` cache slots (the rest masked), its new tokens after them,
left-padded; attention masks and explicit positions make every row compute what it would
alone. Does not own decoding (``hf_generate``).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence

import torch


@dataclass
class CachedPrefix:
    """The KV and routes of a finished row's forwarded positions."""

    ids: tuple[int, ...]
    """Token ids of the cached positions."""
    keys: list[torch.Tensor]
    """Per decoder layer, ``[H, C, D]``."""
    values: list[torch.Tensor]
    """Per decoder layer, ``[H, C, D]``."""
    routes_CLK: torch.Tensor | None
    """Routes of those positions (None: not recorded)."""


class PrefixCache:
    """Finished rows' KV by the ids they cover (see the module docstring)."""

    def __init__(self, max_entries: int = 4096) -> None:
        self.max_entries = max_entries
        self._entries: OrderedDict[tuple[int, ...], CachedPrefix] = OrderedDict()
        self.hits = 0
        """Requests served from the cache since the last :meth:`clear` (positions not recomputed)."""

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        """Forget every entry (the weights changed)."""
        self._entries.clear()
        self.hits = 0

    def store(self, entry: CachedPrefix) -> None:
        """Keep ``entry`` (the oldest entry goes past ``max_entries``)."""
        self._entries[entry.ids] = entry
        self._entries.move_to_end(entry.ids)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def take(self, ids: Sequence[int]) -> CachedPrefix | None:
        """The entry of exactly ``ids`` (removed from the cache), or None."""
        return self._entries.pop(tuple(ids), None)

    def lookup(self, prompt: Sequence[int], need_routes: bool) -> CachedPrefix | None:
        """The longest entry whose ids are a proper prefix of ``prompt`` (removed from the cache), or None."""
        prompt = tuple(prompt)
        best = None
        for key, entry in self._entries.items():
            if len(key) < len(prompt) and prompt[: len(key)] == key and (not need_routes or entry.routes_CLK is not None):
                if best is None or len(key) > len(best.ids):
                    best = entry
        if best is not None:
            del self._entries[best.ids]
            self.hits += 1
        return best


def batch_cache(cache, cached: Sequence[CachedPrefix | None], dtype: torch.dtype, device) -> tuple[int, torch.Tensor]:
    """Fill the empty transformers ``cache`` with the cached positions of each row, right-aligned.

    Returns ``(C, mask_BC)``: the number of cache slots and which of them hold a real position.
    """
    lengths = [0 if c is None else len(c.ids) for c in cached]
    C = max(lengths)
    mask_BC = torch.zeros(len(cached), C, dtype=torch.long, device=device)
    template = next(c for c in cached if c is not None)
    for layer in range(len(template.keys)):
        H, _, D = template.keys[layer].shape
        keys = torch.zeros(len(cached), H, C, D, dtype=dtype, device=device)
        values = torch.zeros_like(keys)
        for row, entry in enumerate(cached):
            if entry is not None:
                n = lengths[row]
                keys[row, :, C - n:] = entry.keys[layer]
                values[row, :, C - n:] = entry.values[layer]
                mask_BC[row, C - n:] = 1
        cache.update(keys, values, layer)
    return C, mask_BC


def take_rows(cache, rows: Sequence[int], mask_BS: torch.Tensor) -> list[tuple[list[torch.Tensor], list[torch.Tensor]]]:
    """Each batch row's ``(keys, values)`` at its real positions (``mask_BS`` over the cache slots)."""
    out = []
    for row in rows:
        real = mask_BS[row].bool()
        out.append(([layer.keys[row][:, real].clone() for layer in cache.layers],
                    [layer.values[row][:, real].clone() for layer in cache.layers]))
    return out
