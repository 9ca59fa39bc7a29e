"""HF <-> Megatron weight names, shapes and layouts: one table per architecture.

Shape legend: V vocabulary, H hidden size, Q query width (heads x head_dim), G key/value
width (query groups x head_dim), D head_dim, E experts per layer, F one expert's FFN width.

Owns: applying the per-architecture tables (:mod:`megatron_rl.checkpoint.families`), which say
which HF tensors make each Megatron parameter and how (copied; Q, K, V interleaved per query group; SwiGLU gate and
up stacked), which HF config keys describe the model, the shapes both sides must have for
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
    }


def bind(
    rule: WeightRule, cfg: ModelConfig, layer: int | None = None, expert: int | None = None
) -> BoundWeight:
    """Instantiate ``rule`` at one layer (and expert) with the shapes ``cfg`` implies."""
    dims = dimensions(cfg)
    hf_shapes = tuple(tuple(dims[d] for d in shape) for shape in rule.hf_dims)
    if rule.pads_vocab:
        megatron_shape = (cfg.padded_vocab_size, *hf_shapes[0][1:])
    elif rule.fuse == "copy":
        megatron_shape = hf_shapes[0]
    else:  # qkv and gate_up stack their parts along the output dimension
        megatron_shape = (sum(s[0] for s in hf_shapes), *hf_shapes[0][1:])
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
    """The full Megatron tensor made of ``weight``'s HF tensors (exact copies, no arithmetic)."""
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
    ``target``, where :func:`fuse` puts it (vocabulary padding rows zeroed); the other parts stay."""
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
    them for a large MoE, and matching a name against the table's rules is most of the cost."""
    bound = functools.cache(lambda name: bound_for_megatron_name(arch, cfg, name))

    def name_map(name: str, full: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        return to_hf(bound(name), full, cfg, copy=copy)

    return name_map


def tp_shard(weight: BoundWeight, full: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """The part of a full Megatron tensor that tensor-parallel rank ``rank`` of ``size`` holds.

    Column-parallel SwiGLU weights split gate and up separately (each rank keeps
    ``[gate_r; up_r]``); every other split is a contiguous chunk along ``tp_axis``.
    """
    axis = weight.rule.tp_axis
    if axis is None or size == 1:
        return full
    if full.shape[axis] % size:
        raise CheckpointMismatchError(
            f"{weight.megatron}: dimension {axis} of size {full.shape[axis]} does not split over TP={size}"
        )
    if weight.rule.fuse == "gate_up":
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(size, dim=0)[rank], up.chunk(size, dim=0)[rank]], dim=0)
    return full.chunk(size, dim=axis)[rank]
