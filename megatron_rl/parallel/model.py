"""Build the Megatron ``GPTModel`` (Qwen3-MoE-style, or with the DeepSeek-V3 / GLM-4.5 /
Qwen2-MoE features of ``parallel.families``) for the current parallel rank.

Owns: the mapping from :class:`~megatron_rl.config.ModelConfig` and
:class:`~megatron_rl.config.ParallelConfig` to Megatron's ``TransformerConfig``, the layer
spec (Transformer Engine when TE and CUDA are present, Megatron's local modules otherwise)
and the pipeline-stage model itself. Does not own process groups (see ``groups.py``) or
weights on disk (see ``checkpoint.py``).

The vocabulary is built padded (``ModelConfig.padded_vocab_size``: Megatron's
``vocab_size``); the model carries the true size as ``true_vocab_size``, which every
consumer of its logits passes on so that padded ids never enter a softmax or a sample.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer import (
    MLATransformerConfig,
    ModuleSpec,
    TransformerConfig,
)

from megatron_rl.config_loading import ConfigError
from megatron_rl.parallel import mcore_compat as mc
from megatron_rl.parallel import mcore_layers
from megatron_rl.parallel.mcore_optimizer import EXPERT_GROUPS_WHEN_ETP_DIFFERS
from megatron_rl.parallel.families import (
    family_fields,
    replicated_mla_down_projections,
    yarn_rope_attributes,
)
from megatron_rl.parallel.mcore_compat import (
    IdentityOp,
    MLASelfAttention,
    MoELayer,
    TransformerBlockSubmodules,
    get_gpt_decoder_block_spec,
)
from megatron_rl.parallel.packed_attention import PackedCoreAttention
from megatron_rl.parallel.te_names import te_checkpoint_prefixes
from megatron_rl.sections import ModelConfig, ParallelConfig

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

RECOMPUTE_FIELDS = {
    "none": {},
    # The MoE block (router, dispatch, experts) holds most of an MoE layer's activations. Of
    # Megatron's other selective modules, "moe_act" needs grouped GEMMs, "layernorm" Transformer
    # Engine, and "core_attn" saves nothing under TE's fused attention (Megatron warns so).
    "selective": {"recompute_granularity": "selective", "recompute_modules": ["moe"]},
    "full": {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1},
}
"""``TransformerConfig`` fields of each ``train.recompute`` choice."""


def recompute_fields(recompute: str) -> dict:
    """The ``TransformerConfig`` fields that make the policy update recompute as ``train.recompute`` says."""
    return dict(RECOMPUTE_FIELDS[recompute])


def transformer_engine_available() -> bool:
    """True when Transformer Engine imports and CUDA is present (the TE spec needs both)."""
    if not torch.cuda.is_available():
        return False
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


class SequenceParallelRMSNorm(torch.nn.RMSNorm):
    """``torch.nn.RMSNorm`` usable under sequence parallelism, zero-centred when the config says.

    Megatron's ``WrappedTorchNorm`` refuses sequence parallelism; the only thing SP needs
    from a norm is that its weight is flagged ``sequence_parallel`` so that
    ``finalize_model_grads`` all-reduces the partial gradients over the TP group. With
    ``layernorm_zero_centered_gamma`` (Qwen3-Next) it scales by ``1 + weight`` in fp32, as
    transformers' ``Qwen3NextRMSNorm`` and Transformer Engine's ``zero_centered_gamma`` do.
    """

    zero_centered_allowed = True

    def __init__(
        self,
        config: TransformerConfig,
        hidden_size: int,
        eps: float = 1e-6,
        **unused_kwargs,
    ) -> None:
        super().__init__(hidden_size, eps=eps, dtype=config.params_dtype)
        self.zero_centered = self.zero_centered_allowed and config.layernorm_zero_centered_gamma
        if self.zero_centered:
            torch.nn.init.zeros_(self.weight)
        setattr(self.weight, "sequence_parallel", config.sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.zero_centered:
            return super().forward(x)
        normed = F.rms_norm(x.float(), self.normalized_shape, eps=self.eps)
        return (normed * (1.0 + self.weight.float())).to(x.dtype)


class PlainRMSNorm(SequenceParallelRMSNorm):
    """:class:`SequenceParallelRMSNorm` that never zero-centres (the Gated DeltaNet output norm,
    whose weight multiplies as is in every Qwen3-Next / Qwen3.5 checkpoint)."""

    zero_centered_allowed = False


def build_transformer_config(
    model: ModelConfig, parallel: ParallelConfig, use_te: bool = False, **overrides
) -> TransformerConfig:
    """Megatron ``TransformerConfig`` for the model under the given layout.

    Args:
        model: architecture.
        parallel: layout.
        use_te: the Transformer Engine spec will be used (its experts are grouped GEMMs).
        **overrides: extra ``TransformerConfig`` fields (e.g. ``moe_enable_routing_replay``,
            ``recompute_granularity``, the FP8 fields of ``megatron_rl.fp8``), applied last.
    """
    dtype = _DTYPES[model.params_dtype]
    on_gpu = torch.cuda.is_available()
    fields = dict(
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        num_attention_heads=model.num_attention_heads,
        num_query_groups=model.num_query_groups,
        kv_channels=model.head_dim,
        # The dense MLP width; families.family_fields sets it when there are dense layers.
        ffn_hidden_size=model.moe_ffn_hidden_size,
        num_moe_experts=model.num_experts,
        moe_router_topk=model.moe_router_topk,
        moe_ffn_hidden_size=model.moe_ffn_hidden_size,
        moe_router_score_function=model.moe_router_score_function,
        moe_router_pre_softmax=model.moe_router_pre_softmax,
        moe_router_load_balancing_type="aux_loss" if model.moe_aux_loss_coeff > 0 else "none",
        moe_aux_loss_coeff=model.moe_aux_loss_coeff,
        moe_router_dtype="fp32",
        moe_token_dispatcher_type=parallel.moe_token_dispatcher_type,
        # TE's spec builds grouped experts; the flag also makes them pad tokens for FP8 GEMMs.
        moe_grouped_gemm=use_te,
        normalization="RMSNorm",
        layernorm_epsilon=model.norm_epsilon,
        qk_layernorm=model.qk_layernorm,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=model.init_method_std,
        attention_softmax_in_fp32=True,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype is torch.bfloat16,
        fp16=dtype is torch.float16,
        tensor_model_parallel_size=parallel.tensor_model_parallel_size,
        pipeline_model_parallel_size=parallel.pipeline_model_parallel_size,
        expert_model_parallel_size=parallel.expert_model_parallel_size,
        expert_tensor_parallel_size=parallel.expert_tensor_parallel_size,
        context_parallel_size=parallel.context_parallel_size,
        # Transformer Engine's CP flavour for THD rows: p2p takes them (its all_gather and a2a+p2p
        # flavours refuse THD: TE's attention/dot_product_attention/context_parallel.py); the
        # local spec's core attention (packed_attention) all-gathers keys and values regardless.
        cp_comm_type="p2p" if parallel.context_parallel_size > 1 else None,
        sequence_parallel=parallel.sequence_parallel_enabled(),
        # Micro-batches of a packed batch differ in length; p2p must exchange shapes.
        variable_seq_lengths=parallel.pipeline_model_parallel_size > 1,
        # Fused CUDA kernels: TE/apex are absent on CPU, and the torch paths are exact.
        gradient_accumulation_fusion=False,
        bias_dropout_fusion=on_gpu,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        use_cpu_initialization=not on_gpu,
    )
    fields.update(family_fields(model))
    fields.update(mc.spec_fields(use_te))
    fields.update(overrides)
    check_replay_fields(fields)
    config_class = MLATransformerConfig if model.multi_latent_attention else TransformerConfig
    return config_class(**fields)


def check_replay_fields(fields: dict) -> None:
    """Refuse a routing-replay model whose TransformerConfig fields would make replay silently wrong.

    The run config cannot express these features; a caller's ``build_model`` overrides can.

    Raises:
        ConfigError: one line naming every offending field (``mcore_compat.replay_hazards``).
    """
    if not fields.get("moe_enable_routing_replay"):
        return
    hazards = mc.replay_hazards(fields)
    if hazards:
        raise ConfigError("moe_enable_routing_replay=True conflicts with " + "; ".join(hazards))


def _with_norm(spec: ModuleSpec, norm: type, qk_norm: bool, q_latent: bool = True) -> ModuleSpec:
    """Copy of a local layer spec whose norms are ``norm`` (q/k norms only if ``qk_norm``)
    and whose core attention consumes THD ``PackedSeqParams`` (no dense mask).

    ``q_latent``: an MLA layer compresses queries (``q_lora_rank`` set); without that
    latent its q norm is an ``IdentityOp`` (0.16.1 never builds it, 0.19.2 refuses a norm).
    """
    layer = spec.submodules
    attn = layer.self_attention.submodules
    qk = norm if qk_norm else IdentityOp
    # MLA's submodules norm the q and kv latents (q_layernorm, kv_layernorm) instead.
    norms = {name: qk for name in ("q_layernorm", "k_layernorm", "kv_layernorm") if hasattr(attn, name)}
    if hasattr(attn, "kv_layernorm") and not q_latent:
        norms["q_layernorm"] = IdentityOp
    attn = dataclasses.replace(attn, **norms, core_attention=PackedCoreAttention)
    self_attention = dataclasses.replace(layer.self_attention, submodules=attn)
    # Checkpoint keys as the TE spec writes them, so either spec reads the other's
    # checkpoints (Megatron's local MoE spec maps its pre-MLP norm to the dense key).
    keys = te_checkpoint_prefixes(
        dense_mlp=not issubclass(mc.spec_class(layer.mlp), MoELayer),
        mla=issubclass(mc.spec_class(layer.self_attention), MLASelfAttention),
    )
    layer = dataclasses.replace(
        layer, input_layernorm=norm, pre_mlp_layernorm=norm, self_attention=self_attention,
        sharded_state_dict_keys_map=keys,
    )
    return dataclasses.replace(spec, submodules=layer)


def build_layer_spec(config: TransformerConfig, use_te: bool | None = None,
                     linear_attention_layers: tuple[int, ...] = ()):
    """Transformer-block spec: TE modules on GPU with TE, Megatron local modules otherwise.

    Both attend over THD-packed rows: TE's fused attention reads ``PackedSeqParams`` itself;
    the local spec's core attention is :class:`PackedCoreAttention`, which reads the same.
    ``linear_attention_layers`` (global 0-based; local spec only) become Gated DeltaNet layers.
    """
    if use_te is None:
        use_te = transformer_engine_available()
    # Megatron's block spec picks, per layer of this pipeline stage, the dense or the MoE
    # layer (config.moe_layer_freq) with GQA or MLA attention (config.multi_latent_attention).
    block = get_gpt_decoder_block_spec(config, use_transformer_engine=use_te, normalization="RMSNorm")
    if use_te:
        return block
    layers = [
        replicated_mla_down_projections(_with_norm(
            spec, SequenceParallelRMSNorm, config.qk_layernorm, q_latent=getattr(config, "q_lora_rank", None) is not None
        ))
        for spec in block.layer_specs
    ]
    if linear_attention_layers:
        layers = _with_gated_delta_net(layers, linear_attention_layers, config)
    return TransformerBlockSubmodules(layer_specs=layers, layer_norm=SequenceParallelRMSNorm)


def _with_gated_delta_net(layers: list, linear_layers: tuple[int, ...], config: TransformerConfig) -> list:
    """This stage's layer specs with the self-attention of its linear_attention layers (global
    0-based ``linear_layers``) replaced by a Gated DeltaNet (``parallel.gated_delta_net``).

    Stages hold equal runs of layers (``sections.parallel`` requires PP to divide them)."""
    from megatron_rl.parallel.gated_delta_net import gated_delta_net_spec

    offset = parallel_state.get_pipeline_model_parallel_rank() * len(layers)
    gdn = gated_delta_net_spec(PlainRMSNorm)
    out = []
    for index, spec in enumerate(layers):
        if offset + index in linear_layers:
            spec = dataclasses.replace(spec, submodules=dataclasses.replace(spec.submodules, self_attention=gdn))
        out.append(spec)
    return out


def build_model(
    model: ModelConfig,
    parallel: ParallelConfig,
    use_te: bool | None = None,
    **config_overrides,
) -> GPTModel:
    """The ``GPTModel`` stage owned by this rank (parallel state must be initialized).

    Its ``vocab_size`` is the padded one; ``true_vocab_size`` is ``model.vocab_size``, the
    ids that are tokens (logit columns past it are padding).

    Args:
        model: architecture.
        parallel: layout, matching the initialized parallel state.
        use_te: force the TE (True) or local (False) spec; None picks automatically.
        **config_overrides: forwarded to :func:`build_transformer_config`.
    """
    if use_te is None:
        # The Gated DeltaNet layers are placed in the local spec only (parallel.gated_delta_net).
        use_te = transformer_engine_available() and not model.has_linear_attention
    if use_te and model.has_linear_attention:
        raise ValueError("model.layer_types: Gated DeltaNet layers are built with the local layer spec only")
    config = build_transformer_config(model, parallel, use_te=use_te, **config_overrides)
    if config.fp8 and not use_te:
        raise ValueError("fp8.enabled: FP8 training needs the Transformer Engine layer spec (TE + CUDA)")
    with mc.mla_without_transformer_engine():
        gpt = _build_gpt(model, parallel, config, use_te)
    if torch.cuda.is_available():
        # Megatron creates its linear layers on the GPU, but the torch norms the local spec falls
        # back to without TE or apex are made on the CPU; Megatron-LM's get_model moves the whole
        # module the same way (parameters keep their identity and Megatron's attributes).
        gpt.cuda(torch.cuda.current_device())
    gpt.true_vocab_size = model.vocab_size
    if model.add_bias_linear and not use_te:
        mcore_layers.expert_biases_trainable(gpt)
    mcore_layers.sum_replicated_expert_grads_over_tp(gpt, config, EXPERT_GROUPS_WHEN_ETP_DIFFERS)
    if config.moe_enable_routing_replay:
        # Replay addresses routers by layer number; Megatron's class-level list would only
        # keep every model ever built alive.
        mc.forget_replay_instances(gpt)
    return gpt


def _build_gpt(model: ModelConfig, parallel: ParallelConfig, config: TransformerConfig, use_te: bool) -> GPTModel:
    linear = tuple(i for i, kind in enumerate(model.mixer_types) if kind == "linear_attention")
    yarn = model.rope_scaling == "yarn" and not model.multi_latent_attention
    if yarn:
        for name, value in yarn_rope_attributes(model).items():
            setattr(config, name, value)
    return GPTModel(
        config=config,
        transformer_layer_spec=build_layer_spec(config, use_te, linear_attention_layers=linear),
        vocab_size=model.padded_vocab_size,
        max_sequence_length=model.max_position_embeddings,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=not model.untie_embeddings_and_output_weights,
        position_embedding_type="yarn" if yarn else "rope",
        rotary_base=int(model.rotary_base),
        rotary_percent=model.rotary_percent,
        parallel_output=True,
    )
