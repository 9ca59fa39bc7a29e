"""The ``parallel`` section: how the model is laid out over processes, and the rules a layout
must meet for a given model and world size (checked before any process starts)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from megatron_rl.config_loading import require
from megatron_rl.sections.model import ModelConfig, vocab_padding_hint


@dataclass(kw_only=True)
class ParallelConfig:
    """How the model is laid out over processes (Megatron-Core parallel groups)."""

    tensor_model_parallel_size: int = 1
    """TP size; attention heads, the vocabulary and dense MLPs are split over it."""
    sequence_parallel: bool | None = None
    """Shard activations along the sequence over TP; None means on whenever TP > 1."""
    expert_model_parallel_size: int = 1
    """EP size; the experts of each MoE layer are split over it."""
    expert_tensor_parallel_size: int = 1
    """TP size inside each expert (ETP)."""
    pipeline_model_parallel_size: int = 1
    """PP size; layers are split into this many stages."""
    context_parallel_size: int = 1
    """CP size; every packed sequence is cut into 2 x CP chunks, two per CP rank (zig-zag)."""
    moe_token_dispatcher_type: Literal["alltoall", "allgather"] = "alltoall"
    """Megatron token dispatcher used for expert parallelism."""
    world_size: int | None = None
    """Expected number of processes; None takes it from the launcher at run time."""
    use_cpu_platform: bool | None = None
    """Patch Megatron for CPU (gloo); None means exactly when CUDA is unavailable."""

    @property
    def model_parallel_size(self) -> int:
        """TP x PP x CP: processes that together hold one data-parallel replica (its weights and
        its samples; CP ranks each hold the TP x PP shard of the weights)."""
        return (
            self.tensor_model_parallel_size
            * self.pipeline_model_parallel_size
            * self.context_parallel_size
        )

    def sequence_parallel_enabled(self) -> bool:
        """Resolved sequence-parallel flag (MoE with TP > 1 requires it in Megatron)."""
        if self.sequence_parallel is None:
            return self.tensor_model_parallel_size > 1
        return self.sequence_parallel

    def data_parallel_size(self, world_size: int) -> int:
        """DP size for a given world size (validated to divide evenly)."""
        return world_size // self.model_parallel_size


def thd_slot_multiple(cp_size: int) -> int:
    """What each packed sequence's slot is padded to a multiple of: 2 x CP under context
    parallelism (Transformer Engine's THD split: 2 x CP equal chunks per sequence), else 1."""
    return 2 * cp_size if cp_size > 1 else 1


def thd_row_multiple(split_multiple: int, cp_size: int) -> int:
    """What a packed row's length is padded to a multiple of: whole slots' multiple, and each
    CP rank's share (row / CP) a multiple of ``split_multiple`` (the TP size under SP)."""
    if cp_size == 1:
        return split_multiple
    return math.lcm(thd_slot_multiple(cp_size), cp_size * split_multiple)


def validate_layout(
    m: ModelConfig, p: ParallelConfig, world_size: int | None = None, prefix: str = "parallel"
) -> None:
    """Check that the layout fits the model and, when known, the world size."""
    _check_group_sizes(p, prefix)
    _check_model_splits(m, p, prefix)
    _check_mixer_layout(m, p, prefix)
    _check_sequence_parallel(p, prefix)
    _check_world_size(p, world_size, prefix)


def _check_group_sizes(p: ParallelConfig, prefix: str) -> None:
    """Every parallel size is at least 1."""
    for name, val in (
        ("tensor_model_parallel_size", p.tensor_model_parallel_size),
        ("pipeline_model_parallel_size", p.pipeline_model_parallel_size),
        ("expert_model_parallel_size", p.expert_model_parallel_size),
        ("expert_tensor_parallel_size", p.expert_tensor_parallel_size),
        ("context_parallel_size", p.context_parallel_size),
    ):
        require(val >= 1, f"{prefix}.{name}", "must be >= 1")


def _check_model_splits(m: ModelConfig, p: ParallelConfig, prefix: str) -> None:
    """Each parallel size divides the model dimensions it splits."""
    tp, pp, ep = p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.expert_model_parallel_size
    etp = p.expert_tensor_parallel_size
    require(
        m.num_experts % ep == 0,
        f"{prefix}.expert_model_parallel_size",
        f"EP ({ep}) must divide model.num_experts ({m.num_experts})",
    )
    require(
        m.num_attention_heads % tp == 0,
        f"{prefix}.tensor_model_parallel_size",
        f"TP ({tp}) must divide model.num_attention_heads ({m.num_attention_heads})",
    )
    require(
        m.num_query_groups % tp == 0,
        f"{prefix}.tensor_model_parallel_size",
        f"TP ({tp}) must divide model.num_query_groups ({m.num_query_groups})",
    )
    require(
        m.padded_vocab_size % tp == 0,
        f"{prefix}.tensor_model_parallel_size",
        f"TP ({tp}) must divide the padded vocabulary {m.padded_vocab_size} (model.vocab_size "
        f"{m.vocab_size} rounded up to model.vocab_padding_multiple {m.vocab_padding_multiple}); "
        f"{vocab_padding_hint(m, tp)}",
    )
    # Megatron splits these output dimensions over TP (MLA's down projections are replicated).
    for name, size in (
        ("ffn_hidden_size", m.ffn_hidden_size if m.num_dense_layers else 0),
        ("moe_shared_expert_intermediate_size", m.moe_shared_expert_intermediate_size),
    ):
        require(
            size % tp == 0,
            f"{prefix}.tensor_model_parallel_size",
            f"TP ({tp}) must divide model.{name} ({size})",
        )
    require(
        m.moe_ffn_hidden_size % etp == 0,
        f"{prefix}.expert_tensor_parallel_size",
        f"ETP ({etp}) must divide model.moe_ffn_hidden_size ({m.moe_ffn_hidden_size})",
    )
    require(
        m.num_layers % pp == 0,
        f"{prefix}.pipeline_model_parallel_size",
        f"PP ({pp}) must divide model.num_layers ({m.num_layers})",
    )


def _check_mixer_layout(m: ModelConfig, p: ParallelConfig, prefix: str) -> None:
    """What Megatron-Core allows the Gated DeltaNet layers and the biased experts."""
    tp = p.tensor_model_parallel_size
    if m.has_linear_attention:
        # Megatron's GatedDeltaNet splits its key and value heads over TP (TransformerConfig asserts it).
        for name in ("linear_num_key_heads", "linear_num_value_heads"):
            require(getattr(m, name) % tp == 0, f"{prefix}.tensor_model_parallel_size",
                    f"TP ({tp}) must divide model.{name} ({getattr(m, name)})")
        # megatron-core 0.16.1 asserts "Gated delta net does not support context parallel for now"
        # (transformer_config.py:982-985); 0.19.2 splits its heads over CP only inside its own
        # forward, on flash-linear-attention's CUDA kernels, which parallel.gated_delta_net replaces.
        require(p.context_parallel_size == 1, f"{prefix}.context_parallel_size",
                "must be 1 with Gated DeltaNet layers (model.layer_types linear_attention): Megatron-Core "
                "0.16.1 has no context parallelism for them, 0.19.2 only on flash-linear-attention's CUDA kernels")
    # Megatron-Core: "Bias in Moe is only supported when ETP==1" (TransformerConfig).
    require(not m.add_bias_linear or p.expert_tensor_parallel_size == 1, f"{prefix}.expert_tensor_parallel_size",
            "must be 1 with biased experts (model.add_bias_linear; a Megatron-Core rule)")


def _check_sequence_parallel(p: ParallelConfig, prefix: str) -> None:
    """Sequence parallelism needs TP > 1, and MoE with TP > 1 needs it."""
    tp = p.tensor_model_parallel_size
    require(
        not (p.sequence_parallel and tp == 1),
        f"{prefix}.sequence_parallel",
        "sequence parallelism needs parallel.tensor_model_parallel_size > 1",
    )
    require(
        not (tp > 1 and p.sequence_parallel is False),
        f"{prefix}.sequence_parallel",
        "MoE with tensor parallelism requires sequence parallelism (Megatron-Core rule)",
    )


def _check_world_size(p: ParallelConfig, world_size: int | None, prefix: str) -> None:
    """The configured and launched world sizes agree and hold whole model and expert groups."""
    etp, ep, pp = p.expert_tensor_parallel_size, p.expert_model_parallel_size, p.pipeline_model_parallel_size
    if p.world_size is not None:
        require(p.world_size >= 1, f"{prefix}.world_size", "must be >= 1")
        require(
            world_size is None or world_size == p.world_size,
            f"{prefix}.world_size",
            f"config expects {p.world_size} processes but the launcher started {world_size}",
        )
        world_size = p.world_size
    if world_size is not None:
        require(
            world_size % p.model_parallel_size == 0,
            f"{prefix}.world_size",
            f"world size {world_size} is not divisible by TP x PP x CP = {p.model_parallel_size}",
        )
        expert_span = etp * ep * pp
        require(
            world_size % expert_span == 0,
            f"{prefix}.expert_model_parallel_size",
            f"world size {world_size} is not divisible by ETP x EP x PP = {expert_span}",
        )
