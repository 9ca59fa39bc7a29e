"""Transformer Engine layer-spec parameter names <-> the local spec's names (the tables' vocabulary).

The HF tables (``megatron_rl.checkpoint.mapping``) name Megatron parameters as Megatron's
local layer spec builds them. A model built with the Transformer Engine spec (chosen on a
GPU with TE) holds the same tensors under other names, because TE fuses a norm into the
linear layer that follows it and keeps a layer's grouped experts in one module. Names of
Megatron-Core 0.16's ``get_gpt_layer_with_transformer_engine_spec`` -> the local spec's:

- ``self_attention.linear_qkv.layer_norm_weight`` is ``input_layernorm.weight`` (GQA layers);
- ``mlp.linear_fc1.layer_norm_weight`` is ``pre_mlp_layernorm.weight`` (dense-MLP layers;
  an MoE layer keeps a separate ``TENorm`` under ``pre_mlp_layernorm.weight``);
- ``self_attention.linear_q_up_proj.layer_norm_weight`` is ``self_attention.q_layernorm.weight``
  and ``linear_kv_up_proj.layer_norm_weight`` is ``kv_layernorm.weight`` (MLA);
- ``mlp.experts.linear_fc1.weight{e}`` (``TEGroupedMLP``) is
  ``mlp.experts.local_experts.{e}.linear_fc1.weight``.

(``layer_norm_bias`` / ``.bias`` likewise, for LayerNorm models; fc2 like fc1.) Every other
name (q/k norms of GQA, router, shared experts, embedding, final norm, output layer) is the
same in both specs. No local-spec name contains a TE-only fragment, so
:func:`canonical_name` may be applied to the names of a model of either spec.

One place: :func:`canonical_name` is what ``megatron_io.global_parameter_names`` applies, so
the converters, HF init, HF export and weight sync see table names whatever the spec; and
:func:`te_checkpoint_prefixes` is the local spec's ``sharded_state_dict_keys_map``, so a
distributed checkpoint has the TE spec's keys whichever spec wrote it (Megatron-Core's own
local MoE spec maps ``pre_mlp_layernorm.`` to the dense layers' fused key, which a TE MoE
layer does not have, and does not map the MLA latent norms at all). Pure string functions.
"""

from __future__ import annotations

import re

from megatron_rl.sections import ModelConfig

_LAYER = r"^(?P<head>(?:.*\.)?layers\.\d+\.)"
_TO_CANONICAL: tuple[tuple[re.Pattern, str], ...] = (
    (re.compile(_LAYER + r"self_attention\.linear_qkv\.layer_norm_(?P<p>weight|bias)$"), r"\g<head>input_layernorm.\g<p>"),
    (re.compile(_LAYER + r"mlp\.linear_fc1\.layer_norm_(?P<p>weight|bias)$"), r"\g<head>pre_mlp_layernorm.\g<p>"),
    (
        re.compile(_LAYER + r"self_attention\.linear_q_up_proj\.layer_norm_(?P<p>weight|bias)$"),
        r"\g<head>self_attention.q_layernorm.\g<p>",
    ),
    (
        re.compile(_LAYER + r"self_attention\.linear_kv_up_proj\.layer_norm_(?P<p>weight|bias)$"),
        r"\g<head>self_attention.kv_layernorm.\g<p>",
    ),
    (
        re.compile(_LAYER + r"mlp\.experts\.(?P<fc>linear_fc[12])\.(?P<p>weight|bias)(?P<e>\d+)$"),
        r"\g<head>mlp.experts.local_experts.\g<e>.\g<fc>.\g<p>",
    ),
)
_LOCAL_EXPERT = re.compile(_LAYER + r"mlp\.experts\.local_experts\.(?P<e>\d+)\.(?P<fc>linear_fc[12])\.(?P<p>weight|bias)$")
_LAYER_INDEX = re.compile(r"layers\.(\d+)\.")


def canonical_name(name: str) -> str:
    """The local-spec (table) name of a parameter named by either spec; other names unchanged."""
    for pattern, replacement in _TO_CANONICAL:
        if pattern.match(name):
            return pattern.sub(replacement, name)
    return name


def te_checkpoint_prefixes(*, dense_mlp: bool, mla: bool) -> dict[str, str]:
    """Layer-relative local-spec prefix -> the TE spec's, for one kind of layer.

    Args:
        dense_mlp: the layer has a dense MLP (TE fuses its pre-MLP norm into ``linear_fc1``);
            False for an MoE layer (TE keeps ``pre_mlp_layernorm``).
        mla: multi-latent attention (TE keeps ``input_layernorm`` and fuses the latent
            norms into the up projections) instead of GQA (TE fuses ``input_layernorm``
            into ``linear_qkv``; its q/k norms keep their names).
    """
    prefixes = {}
    if mla:
        prefixes["self_attention.q_layernorm."] = "self_attention.linear_q_up_proj.layer_norm_"
        prefixes["self_attention.kv_layernorm."] = "self_attention.linear_kv_up_proj.layer_norm_"
    else:
        prefixes["input_layernorm."] = "self_attention.linear_qkv.layer_norm_"
    if dense_mlp:
        prefixes["pre_mlp_layernorm."] = "mlp.linear_fc1.layer_norm_"
    return prefixes


def te_name(name: str, cfg: ModelConfig) -> str:
    """Inverse of :func:`canonical_name`: the TE spec's name of a local-spec (table) name of ``cfg``.

    Layer indices are global (0-based), as in the tables; a layer below
    ``cfg.num_dense_layers`` has a dense MLP.
    """
    expert = _LOCAL_EXPERT.match(name)
    if expert is not None:
        return f"{expert['head']}mlp.experts.{expert['fc']}.{expert['p']}{expert['e']}"
    layer = _LAYER_INDEX.search(name)
    if layer is None or not name.startswith("decoder."):
        return name
    head = name[: layer.end()]
    rest = name[layer.end():]
    dense = int(layer.group(1)) < cfg.num_dense_layers
    for local, te in te_checkpoint_prefixes(dense_mlp=dense, mla=cfg.multi_latent_attention).items():
        if rest.startswith(local):
            return head + te + rest[len(local):]
    return name
