"""HF <-> Megatron weight names, shapes and layouts: one table per architecture.

Shape legend: V vocabulary, H hidden size, Q query width (heads x head_dim), G key/value
width (query groups x head_dim), D head_dim, E experts per layer, F one expert's FFN width.

Owns: applying the per-architecture tables (:mod:`megatron_rl.checkpoint.families`), which say
which HF tensors make each Megatron parameter and how (copied; Q, K, V interleaved per query group; SwiGLU gate and
up stacked; GPT-OSS's stacked and interleaved experts; Qwen3-Next's gated queries and grouped
DeltaNet projections; sections split over TP one by one), which HF config keys describe the model, the shapes both sides must have for
a :class:`~megatron_rl.config.ModelConfig`, and the pure tensor functions that fuse, split
and tensor-parallel-shard those layouts. Megatron names are those of a TP1/EP1/PP1 model
(global 0-based layer and expert indices), so any rank can map its local parameters after
offsetting its layer and expert indices. Used by the converters, the FP8 export and
weight sync. Does not own files, process groups or Megatron modules.

The vocabulary: HF tensors have V rows, Megatron's embedding and output layer
``ModelConfig.padded_vocab_size`` rows. :func:`fuse` appends zero rows (no softmax, sample
or loss ever reads them: they are masked) and :func:`split` drops the rows past V, so HF
-> Megatron -> HF gives the same bytes and weight sync sends HF shapes.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Callable

import torch

from megatron_rl.checkpoint.errors import CheckpointMismatchError
from megatron_rl.checkpoint.families import ARCHITECTURES, MIXTRAL, QWEN3_MOE
from megatron_rl.checkpoint.weight_rules import Architecture, WeightRule, applies
from megatron_rl.sections import ModelConfig

__all__ = ["ARCHITECTURES", "MIXTRAL", "QWEN3_MOE", "Architecture", "WeightRule"]  # the tables, re-exported for callers

@dataclass(frozen=True)
class BoundWeight:
    """A rule instantiated for one layer and expert of a concrete model."""

    rule: WeightRule
    """The table row."""
    layer: int | None
    """Global 0-based layer index (None outside the layers)."""
    expert: int | None
    """Global expert index (None for non-expert weights)."""
    megatron: str
    """Megatron parameter name in a TP1/EP1/PP1 model."""
    hf: tuple[str, ...]
    """HF tensor names, in fuse order."""
    hf_shapes: tuple[tuple[int, ...], ...]
    """Shape each HF tensor must have."""
    megatron_shape: tuple[int, ...]
    """Shape of the full (unsharded) Megatron parameter."""


def dimensions(cfg: ModelConfig) -> dict[str, int]:
    """Sizes of the symbolic dimensions used in the tables."""
    return {
        "vocab": cfg.vocab_size,
        "hidden": cfg.hidden_size,
        "q": cfg.num_attention_heads * cfg.head_dim,
        "kv": cfg.num_query_groups * cfg.head_dim,
        "head_dim": cfg.head_dim,
        "experts": cfg.num_experts,
        "expert_ffn": cfg.moe_ffn_hidden_size,
        "ffn": cfg.ffn_hidden_size,
        "shared_ffn": cfg.moe_shared_expert_intermediate_size,
        "one": 1,
        # Multi-latent attention (DeepSeek-V3).
        "q_lora": cfg.q_lora_rank or 0,
        "kv_lora": cfg.kv_lora_rank,
        "mla_q": cfg.num_attention_heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim),
        "mla_kv_down": cfg.kv_lora_rank + cfg.qk_rope_head_dim,
        "mla_kv_up": cfg.num_attention_heads * (cfg.qk_nope_head_dim + cfg.v_head_dim),
        "mla_o": cfg.num_attention_heads * cfg.v_head_dim,
        # GPT-OSS: fused gate/up columns, sink logits.
        "expert_ffn2": 2 * cfg.moe_ffn_hidden_size,
        "heads": cfg.num_attention_heads,
        # Qwen3-Next: queries with their output gates; Gated DeltaNet widths.
        "q_gate": 2 * cfg.num_attention_heads * cfg.head_dim,
        "gdn_qk": cfg.linear_num_key_heads * cfg.linear_key_head_dim,
        "gdn_v": cfg.linear_num_value_heads * cfg.linear_value_head_dim,
        "gdn_qkv": 2 * cfg.linear_num_key_heads * cfg.linear_key_head_dim
        + cfg.linear_num_value_heads * cfg.linear_value_head_dim,
        "gdn_qkvz": 2 * cfg.linear_num_key_heads * cfg.linear_key_head_dim
        + 2 * cfg.linear_num_value_heads * cfg.linear_value_head_dim,
        "gdn_heads": cfg.linear_num_value_heads,
        "gdn_ba": 2 * cfg.linear_num_value_heads,
        "gdn_dv": cfg.linear_value_head_dim,
        "conv_k": cfg.linear_conv_kernel_dim,
    }


def piece_shapes(weight: BoundWeight) -> tuple[tuple[int, ...], ...]:
    """Shape of each HF tensor's part this weight is made of (one expert's slice when stacked)."""
    return tuple(s[1:] for s in weight.hf_shapes) if weight.rule.stacked else weight.hf_shapes


def bind(
    rule: WeightRule, cfg: ModelConfig, layer: int | None = None, expert: int | None = None
) -> BoundWeight:
    """Instantiate ``rule`` at one layer (and expert) with the shapes ``cfg`` implies."""
    dims = dimensions(cfg)
    hf_shapes = tuple(tuple(dims[d] for d in shape) for shape in rule.hf_dims)
    pieces = tuple(s[1:] for s in hf_shapes) if rule.stacked else hf_shapes
    if rule.transpose:
        pieces = tuple(tuple(reversed(s)) for s in pieces)
    if rule.pads_vocab:
        megatron_shape = (cfg.padded_vocab_size, *pieces[0][1:])
    elif rule.fuse in ("copy", "glu_interleaved"):
        megatron_shape = pieces[0]
    else:  # the others stack their parts along the output dimension
        megatron_shape = (sum(s[0] for s in pieces), *pieces[0][1:])
    names = {"layer": layer, "expert": expert}
    return BoundWeight(
        rule=rule,
        layer=layer,
        expert=expert,
        megatron=rule.megatron.format(**names),
        hf=tuple(t.format(**names) for t in rule.hf),
        hf_shapes=hf_shapes,
        megatron_shape=megatron_shape,
    )


def weight_groups(arch: Architecture, cfg: ModelConfig) -> dict[int | None, list[BoundWeight]]:
    """Every weight of the model, grouped by layer (key None: outside the layers).

    Each group is what converters hold in memory at once, so a layer's experts travel
    together and nothing larger does.
    """
    groups: dict[int | None, list[BoundWeight]] = {None: []}
    for layer in range(cfg.num_layers):
        groups[layer] = []
        for rule in arch.rules:
            if rule.scope == "layer" and applies(rule, cfg, layer):
                groups[layer].append(bind(rule, cfg, layer))
        for expert in range(cfg.num_experts):
            for rule in arch.rules:
                if rule.scope == "expert" and applies(rule, cfg, layer):
                    groups[layer].append(bind(rule, cfg, layer, expert))
    groups[None] = [bind(rule, cfg) for rule in arch.rules if rule.scope == "model" and applies(rule, cfg)]
    return groups


def all_weights(arch: Architecture, cfg: ModelConfig) -> list[BoundWeight]:
    """Every weight of the model, in group order."""
    return [w for group in weight_groups(arch, cfg).values() for w in group]


def hf_tensor_shapes(arch: Architecture, cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every HF tensor name the model must have, with its shape."""
    return {name: shape for w in all_weights(arch, cfg) for name, shape in zip(w.hf, w.hf_shapes)}


def template_regex(template: str) -> re.Pattern:
    """Regex matching a name template, capturing ``layer`` and ``expert`` indices."""
    pattern = re.escape(template)
    pattern = pattern.replace(re.escape("{layer}"), r"(?P<layer>\d+)")
    pattern = pattern.replace(re.escape("{expert}"), r"(?P<expert>\d+)")
    return re.compile(f"^{pattern}$")


def bound_for_megatron_name(arch: Architecture, cfg: ModelConfig, name: str) -> BoundWeight:
    """The bound weight of a TP1/EP1/PP1 Megatron parameter name.

    Raises:
        CheckpointMismatchError: no rule makes ``name``, or its indices are out of range.
    """
    for rule in arch.rules:
        match = template_regex(rule.megatron).match(name)
        if match is None:
            continue
        layer = int(match.groupdict()["layer"]) if "layer" in match.groupdict() else None
        if not applies(rule, cfg, layer):
            # A weight this model does not have (a dense MLP at an MoE layer, a shared
            # expert of a model without one): another rule may still make the name.
            continue
        found = match.groupdict()
        layer = int(found["layer"]) if "layer" in found else None
        expert = int(found["expert"]) if "expert" in found else None
        if layer is not None and not layer < cfg.num_layers:
            raise CheckpointMismatchError(
                f"Megatron parameter {name}: layer {layer} >= num_layers {cfg.num_layers}"
            )
        if expert is not None and not expert < cfg.num_experts:
            raise CheckpointMismatchError(
                f"Megatron parameter {name}: expert {expert} >= num_experts {cfg.num_experts}"
            )
        return bind(rule, cfg, layer, expert)
    raise CheckpointMismatchError(f"Megatron parameter {name} has no entry in the {arch.name} mapping table")


# ----------------------------------------------------------------------------- layouts


def fuse(weight: BoundWeight, tensors: list[torch.Tensor], cfg: ModelConfig) -> torch.Tensor:
    """The full Megatron tensor made of ``weight``'s HF tensors (exact copies, no arithmetic);
    a stacked rule takes each tensor's slice of its expert (the slice alone is accepted too)."""
    rule = weight.rule
    if rule.stacked:
        tensors = [t if tuple(t.shape) == s else t[weight.expert] for t, s in zip(tensors, piece_shapes(weight))]
    if rule.transpose:
        tensors = [t.transpose(0, 1) for t in tensors]
    if rule.fuse not in ("copy", "qkv", "gate_up"):
        return _fuse_layout(rule.fuse, tensors, cfg).contiguous()
    if rule.transpose:
        tensors = [t.contiguous() for t in tensors]
    if weight.rule.fuse == "copy":
        padding = weight.megatron_shape[0] - tensors[0].shape[0]
        if weight.rule.pads_vocab and padding > 0:
            return torch.cat([tensors[0], tensors[0].new_zeros(padding, *tensors[0].shape[1:])])
        return tensors[0]
    if weight.rule.fuse == "gate_up":
        return torch.cat(tensors, dim=0)
    # Megatron's fused QKV holds, per query group, that group's query heads, then its key
    # head, then its value head; TP then hands each rank a contiguous run of groups.
    groups = cfg.num_query_groups
    rest = tensors[0].shape[1:]  # (H,) for weights, () for biases
    per_group = [t.reshape(groups, -1, *rest) for t in tensors]
    return torch.cat(per_group, dim=1).reshape(-1, *rest)


def split(weight: BoundWeight, tensor: torch.Tensor, cfg: ModelConfig, *, copy: bool = True) -> list[torch.Tensor]:
    """Inverse of :func:`fuse`: the HF tensors (vocabulary padding dropped), each its own contiguous
    copy; ``copy=False``: views of ``tensor`` where the layout allows (Q, K and V interleave per
    query group, so theirs are still copies)."""
    own = (lambda t: t.clone()) if copy else (lambda t: t)
    if weight.rule.stacked or weight.rule.transpose or weight.rule.fuse not in ("copy", "qkv", "gate_up"):
        parts = _split_layout(weight.rule.fuse, tensor, [s[0] for s in _megatron_pieces(weight)], cfg)
        if weight.rule.transpose:
            parts = [part.transpose(0, 1) for part in parts]
        return [part.clone(memory_format=torch.contiguous_format) if copy else part for part in parts]
    if weight.rule.fuse == "copy":
        return [own(tensor[: weight.hf_shapes[0][0]])]
    rows = [shape[0] for shape in weight.hf_shapes]
    if weight.rule.fuse == "gate_up":
        return [own(part) for part in tensor.split(rows, dim=0)]
    groups = cfg.num_query_groups
    rest = tensor.shape[1:]
    per_group = tensor.reshape(groups, -1, *rest).split([r // groups for r in rows], dim=1)
    return [part.reshape(r, *rest).clone() for part, r in zip(per_group, rows)]


def write_part(weight: BoundWeight, target: torch.Tensor, part: int, tensor: torch.Tensor, cfg: ModelConfig) -> None:
    """Write HF tensor number ``part`` of ``weight`` in place into the full Megatron tensor
    ``target``, where :func:`fuse` puts it (vocabulary padding rows zeroed); the other parts stay.
    A stacked HF tensor gives ``weight``'s expert slice."""
    if weight.rule.stacked or weight.rule.transpose or weight.rule.fuse not in ("copy", "qkv", "gate_up"):
        if weight.rule.stacked and tuple(tensor.shape) != piece_shapes(weight)[part]:
            tensor = tensor[weight.expert]
        parts = split(weight, target, cfg)
        parts[part] = tensor
        target.copy_(fuse(weight, parts, cfg))
        return
    if weight.rule.fuse == "copy":
        rows = tensor.shape[0]
        target[:rows].copy_(tensor)
        target[rows:].zero_()
        return
    rows = [shape[0] for shape in weight.hf_shapes]
    if weight.rule.fuse == "gate_up":
        target.narrow(0, sum(rows[:part]), rows[part]).copy_(tensor)
        return
    groups = cfg.num_query_groups
    rest = target.shape[1:]
    per_group = [r // groups for r in rows]
    target.view(groups, -1, *rest).narrow(1, sum(per_group[:part]), per_group[part]).copy_(
        tensor.reshape(groups, -1, *rest))


def to_hf(weight: BoundWeight, full: torch.Tensor, cfg: ModelConfig, *, copy: bool = True) -> list[tuple[str, torch.Tensor]]:
    """HF ``(name, tensor)`` pairs of one full Megatron parameter (``copy``: as :func:`split`).

    Raises:
        CheckpointMismatchError: ``full`` does not have the shape the config implies.
    """
    if tuple(full.shape) != weight.megatron_shape:
        raise CheckpointMismatchError(
            f"Megatron parameter {weight.megatron} is {tuple(full.shape)}, "
            f"the config implies {weight.megatron_shape}"
        )
    return list(zip(weight.hf, split(weight, full, cfg, copy=copy)))


NameMap = Callable[[str, torch.Tensor], list[tuple[str, torch.Tensor]]]


def hf_name_map(arch: Architecture, cfg: ModelConfig, *, copy: bool = True) -> NameMap:
    """``(megatron_name, full_tensor) -> [(hf_name, tensor), ...]``: weight sync to HF-named servers
    (``copy=False``: views of the full tensor where the layout allows, as :func:`split`). Each
    name's binding is looked up once: a push maps every parameter again, tens of thousands of
    them for a large MoE, and matching a name against the table's rules is most of the cost.
    A stacked HF tensor (every expert of a layer in one, GPT-OSS) is given once, with its layer's
    last expert (:class:`StackedExperts`): pass every expert of a layer in one pass."""
    bound = functools.cache(lambda name: bound_for_megatron_name(arch, cfg, name))
    stacked = StackedExperts()

    def name_map(name: str, full: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        weight = bound(name)
        pairs = to_hf(weight, full, cfg, copy=copy)
        if not weight.rule.stacked:
            return pairs
        return [(hf, whole) for part, (hf, piece) in enumerate(pairs)
                if (whole := stacked.add(weight, hf, part, piece)) is not None]

    return name_map


def tp_shard(weight: BoundWeight, full: torch.Tensor, rank: int, size: int, cfg: ModelConfig | None = None) -> torch.Tensor:
    """The part of a full Megatron tensor that tensor-parallel rank ``rank`` of ``size`` holds.

    Column-parallel SwiGLU weights split gate and up separately (each rank keeps
    ``[gate_r; up_r]``), sectioned ones (``tp_sections``, needs ``cfg``) each section;
    every other split is a contiguous chunk along ``tp_axis``.
    """
    axis = weight.rule.tp_axis
    if axis is None or size == 1:
        return full
    if weight.rule.tp_sections is not None:
        dims = dimensions(cfg)
        return section_shard(full, [dims[d] for d in weight.rule.tp_sections], rank, size)
    if full.shape[axis] % size:
        raise CheckpointMismatchError(
            f"{weight.megatron}: dimension {axis} of size {full.shape[axis]} does not split over TP={size}"
        )
    if weight.rule.fuse == "gate_up":
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(size, dim=0)[rank], up.chunk(size, dim=0)[rank]], dim=0)
    return full.chunk(size, dim=axis)[rank]


def section_shard(full: torch.Tensor, sections: list[int], rank: int, size: int) -> torch.Tensor:
    """Rank ``rank`` of ``size``'s shard of a tensor whose rows are ``sections``, each split over
    TP (a Gated DeltaNet's in_proj: rank r holds its q, k, v, z, beta and alpha heads).

    Raises:
        CheckpointMismatchError: a section does not split over ``size``.
    """
    if any(section % size for section in sections):
        raise CheckpointMismatchError(f"sections {sections} do not split over TP={size}")
    return torch.cat([part.chunk(size, dim=0)[rank] for part in full.split(sections, dim=0)], dim=0)


def unshard_sections(shards: list[torch.Tensor], sections: list[int]) -> torch.Tensor:
    """Inverse of :func:`section_shard` over every rank's shard, in rank order."""
    size = len(shards)
    local = [section // size for section in sections]
    pieces = [shard.split(local, dim=0) for shard in shards]
    return torch.cat([pieces[r][i] for i in range(len(sections)) for r in range(size)], dim=0)


def _megatron_pieces(weight: BoundWeight) -> tuple[tuple[int, ...], ...]:
    """Each HF part's shape in Megatron's orientation (transposed back for ``transpose`` rules)."""
    pieces = piece_shapes(weight)
    return tuple(tuple(reversed(s)) for s in pieces) if weight.rule.transpose else pieces


def _gdn_sizes(cfg: ModelConfig) -> tuple[int, int, int, int]:
    """(key heads, key dim, value heads per key head, value dim) of the Gated DeltaNet."""
    heads = cfg.linear_num_key_heads
    return heads, cfg.linear_key_head_dim, cfg.linear_num_value_heads // heads, cfg.linear_value_head_dim


def _fuse_layout(kind: str, tensors: list[torch.Tensor], cfg: ModelConfig) -> torch.Tensor:
    """The Megatron rows of the layouts past copy / qkv / gate_up (a permutation of the HF rows)."""
    if kind == "concat":
        return torch.cat(tensors, dim=0)
    if kind == "glu_interleaved":
        (t,) = tensors
        return torch.cat([t[0::2], t[1::2]], dim=0)
    rest = tensors[0].shape[1:]
    if kind == "gated_qkv":
        groups, dim = cfg.num_query_groups, cfg.head_dim
        q, k, v = tensors
        # Each head's rows are [queries; gate] (transformers chunks the head's 2 D outputs in two).
        q_gate = q.reshape(groups, -1, 2, dim, *rest)
        parts = [q_gate[:, :, 0].reshape(groups, -1, *rest), q_gate[:, :, 1].reshape(groups, -1, *rest),
                 k.reshape(groups, -1, *rest), v.reshape(groups, -1, *rest)]
        return torch.cat(parts, dim=1).reshape(-1, *rest)
    if kind == "gdn_grouped":
        heads, dk, ratio, dv = _gdn_sizes(cfg)
        qkvz, ba = tensors
        q, k, v, z = qkvz.reshape(heads, -1, *rest).split([dk, dk, ratio * dv, ratio * dv], dim=1)
        b, a = ba.reshape(heads, -1, *rest).split([ratio, ratio], dim=1)
        return torch.cat([part.reshape(-1, *rest) for part in (q, k, v, z, b, a)], dim=0)
    raise ValueError(f"unknown weight layout {kind!r}")


def _split_layout(kind: str, tensor: torch.Tensor, rows: list[int], cfg: ModelConfig) -> list[torch.Tensor]:
    """Inverse of :func:`_fuse_layout`: the HF parts (``rows``: each part's row count)."""
    if kind in ("copy", "concat"):
        return list(tensor.split(rows, dim=0))
    if kind == "glu_interleaved":
        gate, up = tensor.chunk(2, dim=0)
        out = torch.empty_like(tensor)
        out[0::2], out[1::2] = gate, up
        return [out]
    rest = tensor.shape[1:]
    if kind == "gated_qkv":
        groups, dim = cfg.num_query_groups, cfg.head_dim
        per_group = tensor.reshape(groups, -1, *rest)
        q_rows, kv_rows = rows[0] // (2 * groups), rows[1] // groups
        q, gate, k, v = per_group.split([q_rows, q_rows, kv_rows, kv_rows], dim=1)
        q_gate = torch.stack([q.reshape(groups, -1, dim, *rest), gate.reshape(groups, -1, dim, *rest)], dim=2)
        return [q_gate.reshape(rows[0], *rest), k.reshape(rows[1], *rest), v.reshape(rows[2], *rest)]
    if kind == "gdn_grouped":
        heads, dk, ratio, dv = _gdn_sizes(cfg)
        sizes = [heads * dk, heads * dk, heads * ratio * dv, heads * ratio * dv, heads * ratio, heads * ratio]
        q, k, v, z, b, a = (part.reshape(heads, -1, *rest) for part in tensor.split(sizes, dim=0))
        return [torch.cat([q, k, v, z], dim=1).reshape(rows[0], *rest), torch.cat([b, a], dim=1).reshape(rows[1], *rest)]
    raise ValueError(f"unknown weight layout {kind!r}")


class StackedExperts:
    """Assembles HF tensors that stack every expert of a layer (GPT-OSS) from per-expert slices,
    giving each whole tensor once, when its last expert arrives (one layer's tensors held)."""

    def __init__(self) -> None:
        self._pending: dict[str, tuple[torch.Tensor, set[int]]] = {}

    def add(self, weight: BoundWeight, name: str, part: int, piece: torch.Tensor) -> torch.Tensor | None:
        """Place expert ``weight.expert``'s ``piece`` of HF tensor ``name``; the whole tensor when complete.

        Raises:
            CheckpointMismatchError: the expert's slice was given twice.
        """
        whole, seen = self._pending.get(name) or (piece.new_empty(weight.hf_shapes[part]), set())
        if weight.expert in seen:
            raise CheckpointMismatchError(f"HF tensor {name}: expert {weight.expert} given twice")
        whole[weight.expert].copy_(piece)
        seen.add(weight.expert)
        if len(seen) < whole.shape[0]:
            self._pending[name] = (whole, seen)
            return None
        self._pending.pop(name, None)
        return whole

    def unfinished(self) -> list[str]:
        """HF tensors still missing experts."""
        return sorted(self._pending)
