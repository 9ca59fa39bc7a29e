"""The vocabulary of the HF <-> Megatron weight tables: one :class:`WeightRule` per Megatron
parameter, one :class:`Architecture` per HF model family, and the model features that decide
whether a weight exists. The tables themselves are in :mod:`megatron_rl.checkpoint.families`,
the tensor functions that apply them in :mod:`megatron_rl.checkpoint.mapping`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
import re
from typing import Any, Callable, Iterable, Literal

from megatron_rl.sections import ModelConfig

Fuse = Literal["copy", "qkv", "gate_up", "concat", "glu_interleaved", "gated_qkv", "gdn_grouped"]


@dataclass(frozen=True, kw_only=True)
class WeightRule:
    """One Megatron parameter and the HF tensors it is made of."""

    megatron: str
    """Megatron name template; ``{layer}`` and ``{expert}`` are global 0-based indices."""
    hf: tuple[str, ...]
    """HF name templates of the tensors that make it, in fuse order."""
    hf_dims: tuple[tuple[str, ...], ...]
    """Symbolic shape of each HF tensor (keys of :func:`dimensions`)."""
    fuse: Fuse = "copy"
    """copy: one tensor as is; qkv: Q, K, V interleaved per query group; gate_up: [gate; up];
    concat: the tensors' rows one after the other; glu_interleaved: one tensor whose rows
    alternate gate and up, made [gate; up]; gated_qkv: Q (each head's queries then its output
    gate), K and V made Megatron's gated layout (per query group: its queries, its gates, K, V);
    gdn_grouped: Qwen3-Next's in_proj_qkvz and in_proj_ba (per key head: q, k, v, z; b, a) made
    Megatron's [q; k; v; z; b; a]."""
    stacked: bool = False
    """The HF tensors hold every expert of the layer on axis 0 (GPT-OSS); the rule is one expert's slice."""
    transpose: bool = False
    """The HF matrix is stored [in, out] (GPT-OSS experts); Megatron's is [out, in]."""
    tp_sections: tuple[str, ...] | None = None
    """Symbolic sizes of the Megatron tensor's sections along ``tp_axis`` 0, each split over TP
    (Gated DeltaNet: every TP rank holds its heads of q, k, v, z, beta and alpha)."""
    tp_axis: int | None = None
    """Axis of the Megatron tensor split over tensor parallelism (None: replicated)."""
    fp8: bool = False
    """A linear weight the FP8 export quantizes; router, norms, embeddings, output stay high precision."""
    pads_vocab: bool = False
    """Rows are the vocabulary: Megatron holds ``padded_vocab_size`` of them, HF ``vocab_size``."""
    layers: Literal["all", "dense", "moe", "attention", "linear"] = "all"
    """Layers that have it: every layer, the dense first layers only, the MoE layers only, the
    attention layers only (full or sliding) or the linear_attention (Gated DeltaNet) layers only."""
    needs: str | None = None
    """Model feature it exists under (a key of :data:`FEATURES`); None: always."""
    buffer: bool = False
    """A persistent Megatron buffer, not a parameter (the router's expert bias, never trained)."""

    @property
    def scope(self) -> Literal["model", "layer", "expert"]:
        """Whether the rule exists once, once per layer, or once per layer and expert."""
        if "{expert}" in self.megatron:
            return "expert"
        return "layer" if "{layer}" in self.megatron else "model"


@dataclass(frozen=True, kw_only=True)
class Architecture:
    """Everything about one HF model family that conversion needs."""

    name: str
    """HF ``model_type`` (the registry key)."""
    hf_class: str
    """transformers model class (the ``architectures`` entry of a config.json)."""
    transformers_model_type: str | None = None
    """The ``model_type`` transformers builds this family's config as, when it does not know
    :attr:`name` itself (None: it does)."""
    experts_keys: tuple[str, ...]
    """config.json keys that may hold E (the first present one is used)."""
    expert_ffn_key: str
    """config.json key that holds F."""
    norm_topk_key: str | None
    """config.json key saying whether top-K gates are renormalized (None: always)."""
    qk_layernorm: bool | None
    """Per-head RMSNorm on queries and keys before RoPE (None: the config says, see ``read_extra``)."""
    supported_values: dict[str, Any] = field(default_factory=dict)
    """config.json keys that must hold these values (when present) for the mapping to hold."""
    rules: tuple[WeightRule, ...]
    """The name and layout table."""
    score_function: Literal["softmax", "sigmoid"] = "softmax"
    """Router score function of the family."""
    read_extra: Callable[[dict[str, Any]], dict[str, Any]] | None = None
    """config.json -> extra ModelConfig fields (family features); raises on what it cannot honour."""
    write_extra: Callable[[ModelConfig], dict[str, Any]] | None = None
    """ModelConfig -> extra config.json keys (inverse of ``read_extra``)."""
    text_config: bool = False
    """config.json holds the language model's keys under ``text_config`` (Qwen3.5's checkpoints,
    which carry a vision tower's ``vision_config`` beside it)."""
    passthrough: tuple[str, ...] = ()
    """Regexes of HF tensor names kept aside: no part of the Megatron model (a vision tower, MTP
    layers), stored with a conversion and written back unchanged on export; never routed."""
    features: tuple[str, ...] = ()
    """The :data:`MIXER_FIELDS` this family's config.json expresses (any other set off its
    default makes a model the family cannot be exported as)."""
    config_keys: dict[str, str] = field(default_factory=dict)
    """ModelConfig field -> the config.json key ``read_extra`` reads it from, where the names
    differ, so that a broken model rule names the key the user edits."""


MIXER_FIELDS = (
    "yarn_truncate", "layer_types", "sliding_window", "attention_sinks", "attention_output_gate", "add_bias_linear",
    "activation_func", "activation_func_clamp_value", "glu_linear_offset", "norm_zero_centered",
    "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
    "linear_conv_kernel_dim",
)
"""ModelConfig fields of the GPT-OSS and Qwen3-Next / Qwen3.5 families (``Architecture.features``)."""

FEATURES: dict[str, Callable[[ModelConfig], bool]] = {
    "q_lora": lambda m: m.q_lora_rank is not None,
    "no_q_lora": lambda m: m.q_lora_rank is None,
    "qkv_bias": lambda m: m.add_qkv_bias or m.add_bias_linear,
    "qk_norm": lambda m: m.qk_layernorm,
    "shared_expert": lambda m: m.moe_shared_expert_intermediate_size > 0,
    "shared_expert_gate": lambda m: m.moe_shared_expert_gate,
    "expert_bias": lambda m: m.moe_router_enable_expert_bias,
    "bias_linear": lambda m: m.add_bias_linear,
    "sinks": lambda m: m.attention_sinks,
}
"""Model features that decide whether a weight exists (``WeightRule.needs``)."""


def applies(rule: WeightRule, cfg: ModelConfig, layer: int | None = None) -> bool:
    """Whether ``rule`` makes a weight of ``cfg`` (at ``layer``, for per-layer rules)."""
    if rule.needs is not None and not FEATURES[rule.needs](cfg):
        return False
    if layer is None or rule.layers == "all":
        return True
    if rule.layers in ("attention", "linear"):
        return (cfg.mixer_types[layer] == "linear_attention") == (rule.layers == "linear")
    return (layer < cfg.num_dense_layers) == (rule.layers == "dense")


def weight_rule(megatron: str, hf: str | tuple[str, ...], dims, **kw) -> WeightRule:
    """A :class:`WeightRule`; one HF name may be given bare, and one symbolic shape for all of them."""
    hf = (hf,) if isinstance(hf, str) else hf
    dims = (dims,) * len(hf) if isinstance(dims[0], str) else dims
    return WeightRule(megatron=megatron, hf=hf, hf_dims=tuple(dims), **kw)


def passthrough_names(arch: Architecture, names: Iterable[str]) -> list[str]:
    """The tensors of ``names`` the architecture keeps aside (``Architecture.passthrough``)."""
    patterns = [re.compile(p) for p in arch.passthrough]
    return [n for n in names if any(p.match(n) for p in patterns)]
