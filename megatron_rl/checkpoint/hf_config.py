"""HF ``config.json`` <-> :class:`~megatron_rl.sections.model.ModelConfig`, refusing what it cannot honour.

Owns: reading an HF model config as a plain dict (no transformers import, so conversion
workers stay light), generating one for a model that has no HF origin (the inverse, used
to export trainer checkpoints), and translating both ways with the architecture's table in
:mod:`megatron_rl.checkpoint.mapping`. Every config key that changes the math is either
translated or checked against the one value the Megatron model implements; anything else
(dense layers between MoE layers, sliding-window attention, tied embeddings, RoPE scaling
the family does not have) stops with a :class:`CheckpointMismatchError` naming the key.
The DeepSeek-V3 / GLM-4.5 / Qwen2-MoE features (MLA, YaRN, dense first layers, shared
experts, sigmoid routing, QKV biases, ...) are read and written by their architecture's
``read_extra`` / ``write_extra`` (:mod:`megatron_rl.checkpoint.families`).
Keys that only matter to training or generation (aux-loss coefficient, token ids, cache
flags) are not read. Does not own tensor names or shapes.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from megatron_rl.checkpoint.errors import CheckpointMismatchError
from megatron_rl.checkpoint.families import ARCHITECTURES
from megatron_rl.checkpoint.inputs import read_json
from megatron_rl.checkpoint.weight_rules import MIXER_FIELDS, Architecture
from megatron_rl.config_loading import ConfigError
from megatron_rl.registry import UnknownNameError
from megatron_rl.sections.model import ModelConfig, validate_model

_DTYPES = ("float32", "bfloat16", "float16")


def read_config(directory: str | Path) -> dict[str, Any]:
    """The ``config.json`` of an HF checkpoint directory as a dict."""
    path = Path(directory) / "config.json"
    if not path.exists():
        raise CheckpointMismatchError(f"{path}: no config.json in the HF checkpoint")
    return read_json(path, required=("model_type",))


def architecture_of(config: dict[str, Any]) -> Architecture:
    """The mapping table for ``config['model_type']``."""
    try:
        return ARCHITECTURES.get(config.get("model_type"))
    except UnknownNameError as err:
        raise CheckpointMismatchError(f"config.json model_type: {err}") from None


def language_config(config: dict[str, Any]) -> dict[str, Any]:
    """The keys of the language model: ``text_config`` for an architecture that nests them
    (Qwen3.5's vision-language checkpoints; the top level's ``model_type`` and
    ``tie_word_embeddings`` kept), else ``config`` itself."""
    if not architecture_of(config).text_config:
        return config
    text = config.get("text_config")
    if not isinstance(text, dict):
        raise CheckpointMismatchError(f"config.json: key 'text_config' is missing (model_type {config['model_type']!r})")
    return {**text, "model_type": config["model_type"],
            "tie_word_embeddings": config.get("tie_word_embeddings", text.get("tie_word_embeddings"))}


def _require(config: dict[str, Any], key: str) -> Any:
    if config.get(key) is None:
        raise CheckpointMismatchError(f"config.json: key {key!r} is missing")
    return config[key]


def _num_experts(arch: Architecture, config: dict[str, Any]) -> int:
    present = {key: config[key] for key in arch.experts_keys if config.get(key) is not None}
    if not present:
        raise CheckpointMismatchError(
            f"config.json: none of the expert-count keys {list(arch.experts_keys)} is set"
        )
    if len(set(present.values())) > 1:
        raise CheckpointMismatchError(f"config.json: expert-count keys disagree: {present}")
    return next(iter(present.values()))


def experts_key(arch: Architecture, config: dict[str, Any]) -> str:
    """The config key that holds E in this config (for error messages)."""
    return next((k for k in arch.experts_keys if config.get(k) is not None), arch.experts_keys[0])


def _rope_theta(config: dict[str, Any]) -> float:
    # transformers 5 writes rope_parameters; 4.x wrote rope_theta (+ rope_scaling).
    rope = config.get("rope_parameters")
    if rope is not None:
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind != "default":
            raise CheckpointMismatchError(
                f"config.json rope_parameters.rope_type={kind!r}: only the default RoPE is implemented"
            )
        if rope.get("rope_theta") is None:
            raise CheckpointMismatchError("config.json: key 'rope_parameters.rope_theta' is missing")
        return float(rope["rope_theta"])
    if config.get("rope_scaling") is not None:
        raise CheckpointMismatchError(
            f"config.json rope_scaling={config['rope_scaling']!r}: only the default RoPE is implemented"
        )
    return float(_require(config, "rope_theta"))


def model_config_from_hf(config: dict[str, Any], params_dtype: str) -> ModelConfig:
    """The Megatron model that computes what the HF config describes.

    Args:
        config: ``config.json`` contents.
        params_dtype: dtype of the checkpoint's tensors (the conversion keeps it).

    Raises:
        CheckpointMismatchError: a key is missing or holds a value the model cannot honour.
    """
    arch = architecture_of(config)
    config = language_config(config)
    for key, wanted in arch.supported_values.items():
        if key in config and config[key] != wanted:
            raise CheckpointMismatchError(
                f"config.json {key}={config[key]!r}: the {arch.name} conversion supports only {wanted!r}"
            )
    if params_dtype not in _DTYPES:
        raise CheckpointMismatchError(f"checkpoint dtype {params_dtype} is not one of {_DTYPES}")
    heads = _require(config, "num_attention_heads")
    hidden = _require(config, "hidden_size")
    normalized = bool(config.get(arch.norm_topk_key, False)) if arch.norm_topk_key else True
    fields = dict(
        vocab_size=_require(config, "vocab_size"),
        hidden_size=hidden,
        num_layers=_require(config, "num_hidden_layers"),
        num_attention_heads=heads,
        num_query_groups=_require(config, "num_key_value_heads"),
        # Mixtral configs may leave head_dim out; transformers then uses hidden / heads.
        head_dim=config.get("head_dim") or hidden // heads,
        num_experts=_num_experts(arch, config),
        moe_router_topk=_require(config, "num_experts_per_tok"),
        moe_ffn_hidden_size=_require(config, arch.expert_ffn_key),
        moe_router_score_function=arch.score_function,
        qk_layernorm=bool(arch.qk_layernorm),
        # HF renormalizes the top-K softmax weights when norm_topk_prob is set; Megatron
        # does that unless pre-softmax routing (softmax over all E, top-K kept as is).
        moe_router_pre_softmax=not normalized,
        max_position_embeddings=_require(config, "max_position_embeddings"),
        norm_epsilon=float(_require(config, "rms_norm_eps")),
        init_method_std=float(config.get("initializer_range", 0.02)),
        params_dtype=params_dtype,
        untie_embeddings_and_output_weights=True,
    )
    # Family features (MLA, YaRN, shared experts, sigmoid routing, ...: checkpoint.families)
    # bring their own RoPE reading; the others accept only the default RoPE.
    fields.update(arch.read_extra(config) if arch.read_extra else {"rotary_base": _rope_theta(config)})
    model = ModelConfig(**fields)
    if model.rotary_base != int(model.rotary_base):
        # build_model passes int(rotary_base) to Megatron's RotaryEmbedding.
        raise CheckpointMismatchError(f"config.json rope theta {model.rotary_base} is not an integer")
    try:
        validate_model(model)
    except ConfigError as err:
        raise CheckpointMismatchError(_in_config_json_terms(str(err), arch, config)) from None
    return model


_CONFIG_JSON_KEYS = {
    "num_layers": "num_hidden_layers",
    "num_query_groups": "num_key_value_heads",
    "moe_router_topk": "num_experts_per_tok",
    "norm_epsilon": "rms_norm_eps",
    "rotary_base": "rope_theta",
    "init_method_std": "initializer_range",
}
"""ModelConfig field -> the config.json key every family reads it from, where the names differ."""


def _in_config_json_terms(message: str, arch: Architecture, config: dict[str, Any]) -> str:
    """A broken model rule (``"model.<field>: <rule>"``) restated with the config.json keys the
    fields were read from, e.g. ``config.json n_group=3: must divide n_routed_experts (16)``;
    a field with no key of its own keeps Megatron's name."""
    keys = {**_CONFIG_JSON_KEYS, "num_experts": experts_key(arch, config),
            "moe_ffn_hidden_size": arch.expert_ffn_key, **arch.config_keys}

    def key_of(name: str) -> str | None:
        key = keys.get(name, name)
        return key if key in config else None

    field, rule = message.split(": ", 1)
    rule = re.sub(r"\bmodel\.(\w+)", lambda m: key_of(m[1]) or m[0], rule)
    key = key_of(field.removeprefix("model."))
    return f"config.json {key}={config[key]!r}: {rule}" if key else f"config.json: {field}: {rule}"


def hf_config_from_model(arch: Architecture | str, model: ModelConfig, dtype: str | None = None) -> dict[str, Any]:
    """The ``config.json`` of ``arch`` that computes what ``model`` computes (inverse of
    :func:`model_config_from_hf`: ``model_config_from_hf(hf_config_from_model(a, m), dtype)``
    gives ``m`` back, up to ``moe_aux_loss_coeff``, which only matters to training).

    Args:
        arch: the HF architecture (or its ``model_type``).
        model: the Megatron model.
        dtype: dtype of the exported tensors (default: ``model.params_dtype``).

    Raises:
        CheckpointMismatchError: the architecture cannot represent the model (the
            ``model.<field>`` is named), or the model breaks its own consistency rules.
    """
    if isinstance(arch, str):
        try:
            arch = ARCHITECTURES.get(arch)
        except UnknownNameError as err:
            raise CheckpointMismatchError(f"HF architecture: {err}") from None
    dtype = dtype or model.params_dtype
    if dtype not in _DTYPES:
        raise CheckpointMismatchError(f"export dtype {dtype} is not one of {_DTYPES}")
    try:
        validate_model(model, prefix="model")
    except ConfigError as err:
        raise CheckpointMismatchError(str(err)) from None
    problems = _unexportable_fields(model, arch)
    if problems:
        raise CheckpointMismatchError(f"the model cannot be exported as {arch.name}: " + "; ".join(problems))
    theta = float(model.rotary_base)
    config: dict[str, Any] = {
        "architectures": [arch.hf_class],
        "model_type": arch.name,
        "vocab_size": model.vocab_size,
        "hidden_size": model.hidden_size,
        "num_hidden_layers": model.num_layers,
        "num_attention_heads": model.num_attention_heads,
        "num_key_value_heads": model.num_query_groups,
        "head_dim": model.head_dim,
        # The first key is the one the architecture's Hub checkpoints (and SGLang) read.
        arch.experts_keys[0]: model.num_experts,
        "num_experts_per_tok": model.moe_router_topk,
        arch.expert_ffn_key: model.moe_ffn_hidden_size,
        "max_position_embeddings": model.max_position_embeddings,
        "rms_norm_eps": model.norm_epsilon,
        "initializer_range": model.init_method_std,
        # Both spellings: transformers 4.x reads rope_theta, 5.x rope_parameters.
        "rope_theta": theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": theta},
        "router_aux_loss_coef": model.moe_aux_loss_coeff,
        "attention_dropout": 0.0,
        "use_cache": True,
        # Both spellings again: transformers 4.x reads torch_dtype, 5.x dtype.
        "torch_dtype": dtype,
        "dtype": dtype,
    }
    if arch.write_extra is not None:
        config.update(arch.write_extra(model))
    if arch.norm_topk_key is not None:
        # Megatron renormalizes the top-K gates unless pre-softmax routing is on.
        config[arch.norm_topk_key] = not model.moe_router_pre_softmax
    # Qwen3-MoE's dense-MLP width: unused when every layer is an MoE layer (the
    # supported values below), but its config class requires one.
    config.setdefault("intermediate_size", model.moe_ffn_hidden_size)
    # The values the reader insists on (every layer sparse, no biases, no sliding window,
    # untied output, SiLU), so that the generated config passes model_config_from_hf.
    config.update(arch.supported_values)
    if arch.text_config:
        # A vision-language checkpoint's language model (no vision tower: a model with no HF origin has none).
        text = {k: v for k, v in config.items() if k not in ("architectures", "torch_dtype", "dtype")}
        text["model_type"] = f"{arch.name}_text"
        return {"architectures": [arch.hf_class], "model_type": arch.name, "text_config": text,
                "tie_word_embeddings": False, "torch_dtype": dtype, "dtype": dtype}
    return config


def _unexportable_fields(model: ModelConfig, arch: Architecture) -> list[str]:
    """One line per ``model.<field>`` that ``arch``'s config.json cannot express."""
    problems = []
    if model.moe_router_score_function != arch.score_function:
        problems.append(
            f"model.moe_router_score_function={model.moe_router_score_function!r}: "
            f"{arch.name} routes with {arch.score_function} scores"
        )
    if arch.read_extra is None:
        problems.extend(_family_features_used(model, arch))
    defaults = ModelConfig()
    problems.extend(
        f"model.{name}={getattr(model, name)!r}: {arch.name} has no such feature"
        for name in MIXER_FIELDS if name not in arch.features and getattr(model, name) != getattr(defaults, name)
    )
    if arch.qk_layernorm is not None and model.qk_layernorm != arch.qk_layernorm:
        problems.append(f"model.qk_layernorm={model.qk_layernorm}: {arch.name} has qk_layernorm={arch.qk_layernorm}")
    if not model.untie_embeddings_and_output_weights:
        problems.append(
            f"model.untie_embeddings_and_output_weights=False: the {arch.name} conversion supports only "
            "a separate output layer (tie_word_embeddings false)"
        )
    if arch.norm_topk_key is None and model.moe_router_pre_softmax:
        problems.append(f"model.moe_router_pre_softmax=True: {arch.name} always renormalizes its top-K gates")
    if model.rotary_base != int(model.rotary_base):
        # model_config_from_hf refuses it too: build_model passes int(rotary_base) to Megatron.
        problems.append(f"model.rotary_base={model.rotary_base} is not an integer")
    return problems


def _family_features_used(model: ModelConfig, arch: Architecture) -> list[str]:
    """The DeepSeek-V3 / GLM-4.5 / Qwen2-MoE features ``model`` uses, which ``arch`` lacks."""
    defaults = ModelConfig()
    names = (
        "add_qkv_bias", "rotary_percent", "multi_latent_attention", "rope_scaling", "num_dense_layers",
        "moe_shared_expert_intermediate_size", "moe_router_enable_expert_bias", "moe_router_num_groups",
        "moe_router_topk_scaling_factor",
    )
    return [
        f"model.{name}={getattr(model, name)!r}: {arch.name} has no such feature"
        for name in names
        if getattr(model, name) != getattr(defaults, name)
    ]


def check_architecture_holds(name: str, model: ModelConfig | None, key: str) -> None:
    """Raise :class:`ConfigError` naming ``key`` unless ``name`` is a known HF architecture whose
    own block computes ``model`` (its config.json checks name the model field that differs);
    ``model`` None checks the name only."""
    if name not in ARCHITECTURES.names():
        raise ConfigError(f"{key}: unknown architecture {name!r}; available: {sorted(ARCHITECTURES.names())}")
    if model is None:
        return
    try:
        hf_config_from_model(name, model)
    except CheckpointMismatchError as err:
        raise ConfigError(f"{key}: {err}") from None


def dequantized_config(config: dict[str, Any]) -> dict[str, Any] | None:
    """The config.json an export writes for a checkpoint that was read dequantized (GPT-OSS's
    MXFP4 experts: the export is bf16, without ``quantization_config``); None when ``config``
    has no quantization to drop."""
    if config.get("quantization_config") is None:
        return None
    return {k: v for k, v in config.items() if k != "quantization_config"}
