"""Typed configuration: dataclasses, YAML presets, dotted overrides, strict validation.

Every section is a kw_only dataclass whose attributes carry one-line docstrings. A YAML
preset is a partial instance of :class:`RunConfig`; ``key.sub=value`` overrides from the
command line are applied on top. Validation runs before any model is built: an unknown
key, a value of the wrong type or a rule that the layout breaks raises
:class:`ConfigError` naming the dotted key and the rule.

Sections owned elsewhere live next to their code and are imported here (tokenizer and
prompt data: ``megatron_rl.data``; rewards: ``megatron_rl.rewards``; evaluation:
``megatron_rl.train.evaluation``; FP8: ``megatron_rl.fp8``; objective:
``megatron_rl.algos.section``); those modules import nothing
from this one, so there is no import cycle. Checks that need files (the starting
checkpoint, tokenizer, prompt files, reward import paths) run in
``megatron_rl.train.prepare`` before any process starts.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Sequence, TypeVar

import yaml

from megatron_rl.algos.config import ObjectiveConfig, ObjectiveConfigError
from megatron_rl.algos.section import ObjectiveSection
from megatron_rl.config_loading import ConfigError, from_dict, merge, parse_overrides, to_dict
from megatron_rl.data.prompts import DataConfig
from megatron_rl.family_rules import check_family_fields
from megatron_rl.data.tokenizer import TokenizerConfig
from megatron_rl.fp8 import FP8Config, check_fp8
from megatron_rl.rewards import RewardConfig
from megatron_rl.train.evaluation import EvalConfig, check_eval_config

__all__ = ["ConfigError", "from_dict", "parse_overrides", "to_dict", "load_config", "validate"]

T = TypeVar("T")


@dataclass(kw_only=True)
class ModelConfig:
    """A MoE decoder: RMSNorm, RoPE, SwiGLU experts; by default Qwen3-MoE-style (GQA with
    QK-norm, softmax router, every layer MoE, no biases). The fields past ``qk_layernorm``
    add what DeepSeek-V3, GLM-4.5 and Qwen2-MoE need; each maps onto Megatron-Core's own
    ``TransformerConfig`` field or layer spec (``megatron_rl.parallel.model``)."""

    vocab_size: int = 256
    """Vocabulary size V (the HF config's): token ids in [0, V); padding rows are never ids."""
    vocab_padding_multiple: int = 1
    """Megatron's vocabulary is V rounded up to a multiple of this (1: no padding); TP must divide it."""
    hidden_size: int = 64
    """Model width H."""
    num_layers: int = 4
    """Number of transformer layers (MoE layers, after the first ``num_dense_layers``)."""
    num_attention_heads: int = 4
    """Query heads."""
    num_query_groups: int = 2
    """Key/value heads (grouped-query attention)."""
    head_dim: int = 16
    """Channels per attention head (kv_channels in Megatron)."""
    num_experts: int = 8
    """Routed experts E per MoE layer."""
    moe_router_topk: int = 2
    """Experts K each token is routed to."""
    moe_ffn_hidden_size: int = 32
    """Hidden size of one expert's SwiGLU MLP."""
    moe_router_score_function: Literal["softmax", "sigmoid"] = "softmax"
    """Score function over all experts (Qwen3/Mixtral: softmax; DeepSeek-V3: sigmoid)."""
    moe_router_pre_softmax: bool = False
    """Softmax over all experts before top-K (un-normalized gates); False renormalizes top-K."""
    moe_aux_loss_coeff: float = 0.0
    """Load-balancing auxiliary loss coefficient (0 disables it, usual for RL)."""
    max_position_embeddings: int = 512
    """Longest sequence the model accepts."""
    rotary_base: float = 1_000_000.0
    """RoPE base frequency."""
    norm_epsilon: float = 1e-6
    """RMSNorm epsilon."""
    init_method_std: float = 0.02
    """Standard deviation of the normal weight initialization."""
    params_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Parameter dtype."""
    untie_embeddings_and_output_weights: bool = True
    """Separate output layer (Qwen3-MoE) instead of reusing the input embedding."""
    qk_layernorm: bool = True
    """Per-head RMSNorm on queries and keys before RoPE (Qwen3-MoE: true; Mixtral: false)."""
    add_qkv_bias: bool = False
    """Biases on the Q, K and V projections (Qwen2-MoE, GLM-4.5); the output projection has none."""
    rotary_percent: float = 1.0
    """Fraction of each head's channels that RoPE rotates (GLM-4.5: 0.5, the rest pass through)."""
    multi_latent_attention: bool = False
    """DeepSeek-V3 multi-latent attention (MLA) instead of grouped-query attention."""
    q_lora_rank: int | None = None
    """MLA: rank of the query down-projection (None: queries are projected directly)."""
    kv_lora_rank: int = 0
    """MLA: rank of the compressed key/value latent."""
    qk_nope_head_dim: int = 0
    """MLA: per-head query/key channels without RoPE."""
    qk_rope_head_dim: int = 0
    """MLA: per-head query/key channels with RoPE (the key part is shared by all heads)."""
    v_head_dim: int = 0
    """MLA: per-head value channels."""
    rope_scaling: Literal["none", "yarn"] = "none"
    """RoPE frequency scaling: none, or YaRN (MLA only, DeepSeek-V3's long-context RoPE)."""
    yarn_factor: float = 1.0
    """YaRN: context extension factor."""
    yarn_original_max_position_embeddings: int = 4096
    """YaRN: context length the model was pre-trained with before extension."""
    yarn_beta_fast: float = 32.0
    """YaRN: high-frequency boundary of the ramp (rotations per context)."""
    yarn_beta_slow: float = 1.0
    """YaRN: low-frequency boundary of the ramp."""
    yarn_mscale: float = 1.0
    """YaRN: magnitude-scale coefficient of cos/sin."""
    yarn_mscale_all_dim: float = 0.0
    """YaRN: magnitude-scale coefficient of the softmax scale and divisor of cos/sin's (0: off)."""
    num_dense_layers: int = 0
    """The first this many layers have a dense SwiGLU MLP instead of an MoE (DeepSeek-V3: 3)."""
    ffn_hidden_size: int = 0
    """Hidden size of the dense layers' MLP (used only when ``num_dense_layers`` > 0)."""
    moe_shared_expert_intermediate_size: int = 0
    """Hidden size of the shared expert every token also goes through (0: none)."""
    moe_shared_expert_gate: bool = False
    """Scale the shared expert's output by a learned per-token sigmoid gate (Qwen2-MoE)."""
    moe_router_enable_expert_bias: bool = False
    """Per-expert bias added to the sigmoid scores for selection only (aux-loss-free balancing);
    it is frozen during RL (never updated), so every policy selects with the same bias."""
    moe_router_num_groups: int = 0
    """Group-limited routing: experts split into this many groups (0: off)."""
    moe_router_group_topk: int = 0
    """Group-limited routing: groups each token may use (scored by the sum of their top
    ``K / group_topk`` selection scores)."""
    moe_router_topk_scaling_factor: float = 1.0
    """Routed scaling factor multiplying the top-K gate weights (DeepSeek-V3: 2.5)."""

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """Global 0-based indices of the MoE layers (every layer past the dense ones)."""
        return tuple(range(self.num_dense_layers, self.num_layers))

    @property
    def padded_vocab_size(self) -> int:
        """Rows of Megatron's embedding and output layer: V rounded up to ``vocab_padding_multiple``.

        The padding depends on the config alone, never on TP, so that a checkpoint (which
        stores global shapes) loads into every layout whose TP divides this size. The rows
        past V are zeros on import, dropped on export, and masked out of every softmax.
        """
        multiple = self.vocab_padding_multiple
        return -(-self.vocab_size // multiple) * multiple


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
    """CP size (only 1 is supported by this project so far)."""
    moe_token_dispatcher_type: Literal["alltoall", "allgather"] = "alltoall"
    """Megatron token dispatcher used for expert parallelism."""
    world_size: int | None = None
    """Expected number of processes; None takes it from the launcher at run time."""
    use_cpu_platform: bool | None = None
    """Patch Megatron for CPU (gloo); None means exactly when CUDA is unavailable."""

    @property
    def model_parallel_size(self) -> int:
        """TP x PP x CP: processes that together hold one copy of the dense weights."""
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


@dataclass(kw_only=True)
class OptimConfig:
    """Optimizer hyperparameters (Megatron-Core's optimizer)."""

    optimizer: Literal["adam", "sgd"] = "adam"
    """Adam (decoupled weight decay) or SGD with momentum."""
    lr: float = 1e-6
    """Learning rate."""
    weight_decay: float = 0.0
    """Decoupled weight decay."""
    adam_beta1: float = 0.9
    """Adam beta1."""
    adam_beta2: float = 0.999
    """Adam beta2."""
    adam_eps: float = 1e-8
    """Adam epsilon."""
    sgd_momentum: float = 0.0
    """SGD momentum."""
    clip_grad: float = 1.0
    """Clip the global gradient norm to this (0 disables)."""


@dataclass(kw_only=True)
class SGLangConfig:
    """SGLang servers as the rollout engine (``rollout.engine: sglang``)."""

    urls: list[str] = field(default_factory=list)
    """Base URLs of running servers, e.g. ``http://node3:30000``; requests are load-balanced."""
    url_dir: str | None = None
    """Instead of ``urls``: a directory where each server's launcher writes its URL once
    healthy (``megatron_rl.rollout.sglang_server --url-file``; the SLURM path)."""
    num_servers: int = 1
    """With ``url_dir``: wait for this many URL files."""
    server_wait_s: float = 1800.0
    """With ``url_dir``: how long to wait for the servers to come up."""
    server_tp_size: int = 1
    """TP size each server was launched with (weight-sync payload layout)."""
    request_timeout_s: float = 300.0
    """Limit for one ``/generate`` attempt."""
    max_concurrency: int = 256
    """Requests in flight at once per model-parallel group (bounds client memory)."""
    retry_budget_s: float = 300.0
    """A sample keeps retrying for this long after its first failure: long enough for a
    killed server to be restarted and load its model (weight syncs wait as long for it)."""
    max_retries: int = 1000
    """Cap on retries per sample, a backstop: ``retry_budget_s`` is the limit that normally
    applies (at the default backoff it spends 40 to 75 retries)."""
    retry_backoff_s: float = 0.5
    """First retry delay; doubles per retry, with jitter."""
    retry_backoff_max_s: float = 8.0
    """Longest retry delay."""
    hang_check_after_s: float = 15.0
    """A ``/generate`` attempt unanswered this long makes the client probe the server's ``/health``."""
    health_timeout_s: float = 30.0
    """A server whose ``/health`` gives no 200 within this is hung: the step fails naming it,
    within ``hang_check_after_s + health_timeout_s`` of the hang. The startup probe uses it too."""
    max_resyncs: int = 2
    """Weight re-pushes per rollout call to servers that came back behind the trainer's version."""
    weight_sync: Literal["tensor", "distributed", "none"] = "tensor"
    """tensor: /update_weights_from_tensor (colocated); distributed: NCCL broadcast group
    (disaggregated); none: the servers' weights are managed elsewhere (no version check)."""
    weight_sync_bucket_mb: int = 512
    """Largest weight-sync bucket in MiB."""
    weight_sync_backend: Literal["nccl", "gloo"] = "nccl"
    """Backend of the distributed weight-sync group."""
    weight_sync_master_address: str | None = None
    """Address the servers reach trainer rank 0 at for the distributed group (None: its host name)."""
    hf_architecture: str = "qwen3_moe"
    """HF architecture whose parameter names the servers load (megatron_rl.checkpoint.mapping)."""


@dataclass(kw_only=True)
class RolloutConfig:
    """How responses are sampled each step."""

    engine: Literal["hf", "megatron", "sglang"] = "hf"
    """hf: a transformers replica per rank, KV-cached (megatron_rl.rollout.hf_engine; CPU and
    small GPU runs); megatron: the training model itself generates, the exact train = rollout
    mode for debugging mismatch (no KV cache); sglang: SGLang servers."""
    hf_dtype: Literal["float32", "bfloat16", "float16"] | None = None
    """hf engine: dtype of its replica (None: model.params_dtype). bfloat16 under an fp32
    trainer gives CPU runs a GPU-sized train/rollout mismatch."""
    group_size: int = 8
    """Responses per prompt (G)."""
    prompts_per_step: int = 16
    """Groups per training step (over all data-parallel ranks)."""
    temperature: float = 1.0
    """Sampling temperature."""
    top_p: float = 1.0
    """Nucleus sampling mass."""
    top_k: int = 0
    """Top-k sampling (0: off)."""
    max_new_tokens: int = 8
    """Longest response."""
    return_routed_experts: bool = True
    """Ask the engine for routed experts (needed by R3 and routing diagnostics)."""
    max_sampling_rounds: int = 4
    """Dynamic sampling: draw at most this many rounds of prompts per step."""
    max_staleness: int = 0
    """Asynchronous rollouts: a sample may come from weights up to this many versions older
    than the ones it trains (0: synchronous; 1: the next step's first round is generated
    while a step trains; SGLang engine only; see megatron_rl.train.async_rollouts)."""
    sglang: SGLangConfig = field(default_factory=SGLangConfig)
    """SGLang servers and weight sync (used when ``engine`` is sglang)."""


@dataclass(kw_only=True)
class TrainerConfig:
    """The RL loop."""

    steps: int = 30
    """RL steps (each: rollouts, old-policy pass, updates)."""
    mini_batches: int = 1
    """Policy updates per step (the step's groups split into this many mini-batches)."""
    epochs: int = 1
    """Passes over the step's mini-batches."""
    micro_batch_sequences: int = 32
    """Sequences packed per micro-batch (when ``micro_batch_tokens`` is null)."""
    micro_batch_tokens: int | None = None
    """Token budget of a micro-batch (prompt + response tokens) in the log-prob passes, the
    updates and the embedded engine: samples are packed into as few micro-batches of at most
    this many tokens as fit, balanced, and each step's groups are balanced over data-parallel
    ranks by tokens. Null: ``micro_batch_sequences`` consecutive samples per micro-batch."""
    routing_replay: Literal["none", "R2", "R3"] = "R2"
    """Routing plan during updates."""
    routing_diagnostics: bool = True
    """Measure replay agreement, flip rate and router shift each update (one extra forward)."""
    eval_every: int = 5
    """Held-out evaluation every N steps (and at the start and the end)."""
    save_every: int = 10
    """Checkpoint every N steps (and at the end)."""
    save_hf: bool = True
    """Write a Hugging Face checkpoint of the policy at the end (``<run_dir>/hf/step_NNNNNN``)."""
    save_hf_every: int = 0
    """Also write one every N steps (0: only at the end)."""
    run_dir: str = "runs/demo"
    """Metrics, plots and checkpoints go here."""
    resume: bool = True
    """Continue from the latest checkpoint in run_dir when there is one."""
    sft_steps: int = 0
    """Supervised warm-start steps on the training prompts' reference answers before RL
    (for a model that starts from random weights; 0 for a pretrained checkpoint)."""
    sft_lr: float = 3e-3
    """Warm-start learning rate (Adam)."""
    sft_batch_size: int = 64
    """Warm-start examples per step (over all data-parallel ranks)."""
    progress: bool = True
    """Show progress bars on rank 0."""


GROUP_RELATIVE_ADVANTAGES = ("grpo", "dr_grpo", "rloo", "reinforce_pp_baseline")


@dataclass(kw_only=True)
class RunConfig:
    """A whole run."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """Model architecture."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Parallel layout."""
    fp8: FP8Config = field(default_factory=FP8Config)
    """FP8 training through Transformer Engine (megatron_rl.fp8)."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Optimizer."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Rollouts."""
    train: TrainerConfig = field(default_factory=TrainerConfig)
    """The RL loop."""
    init_checkpoint: str | None = None
    """Where the policy starts: an HF checkpoint directory (config.json + safetensors) or a
    Megatron checkpoint written by megatron-rl-convert-hf-to-megatron; the ``model`` section
    is then read from it. None: random weights. A run's own latest checkpoint wins (resume)."""
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    """Tokenizer and chat template (default: the starting checkpoint's)."""
    data: DataConfig = field(default_factory=DataConfig)
    """Train and eval prompts: JSONL/Parquet files, or a built-in task."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """How responses are scored."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """Held-out evaluation."""
    objective: ObjectiveSection = field(default_factory=ObjectiveSection)
    """Objective: ``preset`` plus typed ObjectiveConfig overrides (megatron_rl.algos.section)."""
    seed: int = 1234
    """Seed for weights, data order and sampling."""


# --------------------------------------------------------------------------- validation


def _require(ok: bool, key: str, rule: str) -> None:
    if not ok:
        raise ConfigError(f"{key}: {rule}")


def validate_model(m: ModelConfig, prefix: str = "model") -> None:
    """Check the architecture's own consistency rules."""
    for name in (
        "vocab_size",
        "vocab_padding_multiple",
        "hidden_size",
        "num_layers",
        "num_attention_heads",
        "num_query_groups",
        "head_dim",
        "num_experts",
        "moe_router_topk",
        "moe_ffn_hidden_size",
        "max_position_embeddings",
    ):
        _require(getattr(m, name) > 0, f"{prefix}.{name}", "must be a positive integer")
    _require(
        m.moe_router_topk <= m.num_experts,
        f"{prefix}.moe_router_topk",
        f"top-K ({m.moe_router_topk}) must not exceed model.num_experts ({m.num_experts})",
    )
    _require(
        m.num_attention_heads % m.num_query_groups == 0,
        f"{prefix}.num_query_groups",
        f"must divide model.num_attention_heads ({m.num_attention_heads})",
    )
    _require(m.norm_epsilon > 0, f"{prefix}.norm_epsilon", "must be > 0")
    _require(m.rotary_base > 0, f"{prefix}.rotary_base", "must be > 0")
    _require(m.init_method_std > 0, f"{prefix}.init_method_std", "must be > 0")
    _require(m.moe_aux_loss_coeff >= 0, f"{prefix}.moe_aux_loss_coeff", "must be >= 0")
    _require(
        not (m.moe_router_pre_softmax and m.moe_router_score_function == "sigmoid"),
        f"{prefix}.moe_router_pre_softmax",
        "only applies to softmax routing (model.moe_router_score_function=softmax)",
    )
    check_family_fields(m, prefix)


def vocab_padding_hint(m: ModelConfig, tp: int) -> str:
    """How to pad the vocabulary so that ``tp`` divides it, with the size that gives."""
    # 128 is Megatron's make_vocab_size_divisible_by: it keeps every power-of-two TP up to 128.
    multiple = math.lcm(128, tp)
    padded = -(-m.vocab_size // multiple) * multiple
    return f"set model.vocab_padding_multiple={multiple} (pads to {padded})"


def validate_layout(
    m: ModelConfig, p: ParallelConfig, world_size: int | None = None, prefix: str = "parallel"
) -> None:
    """Check that the layout fits the model and, when known, the world size."""
    tp, pp, ep = p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.expert_model_parallel_size
    etp, cp = p.expert_tensor_parallel_size, p.context_parallel_size
    for name, val in (
        ("tensor_model_parallel_size", tp),
        ("pipeline_model_parallel_size", pp),
        ("expert_model_parallel_size", ep),
        ("expert_tensor_parallel_size", etp),
        ("context_parallel_size", cp),
    ):
        _require(val >= 1, f"{prefix}.{name}", "must be >= 1")
    _require(cp == 1, f"{prefix}.context_parallel_size", "context parallelism is not supported yet")
    _require(
        m.num_experts % ep == 0,
        f"{prefix}.expert_model_parallel_size",
        f"EP ({ep}) must divide model.num_experts ({m.num_experts})",
    )
    _require(
        m.num_attention_heads % tp == 0,
        f"{prefix}.tensor_model_parallel_size",
        f"TP ({tp}) must divide model.num_attention_heads ({m.num_attention_heads})",
    )
    _require(
        m.num_query_groups % tp == 0,
        f"{prefix}.tensor_model_parallel_size",
        f"TP ({tp}) must divide model.num_query_groups ({m.num_query_groups})",
    )
    _require(
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
        _require(
            size % tp == 0,
            f"{prefix}.tensor_model_parallel_size",
            f"TP ({tp}) must divide model.{name} ({size})",
        )
    _require(
        m.moe_ffn_hidden_size % etp == 0,
        f"{prefix}.expert_tensor_parallel_size",
        f"ETP ({etp}) must divide model.moe_ffn_hidden_size ({m.moe_ffn_hidden_size})",
    )
    _require(
        m.num_layers % pp == 0,
        f"{prefix}.pipeline_model_parallel_size",
        f"PP ({pp}) must divide model.num_layers ({m.num_layers})",
    )
    _require(
        m.num_layers % pp != 0 or m.num_layers // pp > m.num_dense_layers,
        f"{prefix}.pipeline_model_parallel_size",
        f"PP ({pp}) leaves the first stage without an MoE layer ({m.num_layers // pp} layers per stage, "
        f"model.num_dense_layers={m.num_dense_layers}); routing records need one per stage",
    )
    _require(
        not (p.sequence_parallel and tp == 1),
        f"{prefix}.sequence_parallel",
        "sequence parallelism needs parallel.tensor_model_parallel_size > 1",
    )
    _require(
        not (tp > 1 and p.sequence_parallel is False),
        f"{prefix}.sequence_parallel",
        "MoE with tensor parallelism requires sequence parallelism (Megatron-Core rule)",
    )
    if p.world_size is not None:
        _require(p.world_size >= 1, f"{prefix}.world_size", "must be >= 1")
        _require(
            world_size is None or world_size == p.world_size,
            f"{prefix}.world_size",
            f"config expects {p.world_size} processes but the launcher started {world_size}",
        )
        world_size = p.world_size
    if world_size is not None:
        _require(
            world_size % p.model_parallel_size == 0,
            f"{prefix}.world_size",
            f"world size {world_size} is not divisible by TP x PP x CP = {p.model_parallel_size}",
        )
        expert_span = etp * ep * pp
        _require(
            world_size % expert_span == 0,
            f"{prefix}.expert_model_parallel_size",
            f"world size {world_size} is not divisible by ETP x EP x PP = {expert_span}",
        )


def resolve_objective(cfg: RunConfig) -> ObjectiveConfig:
    """The run's ``ObjectiveConfig`` (preset + overrides); errors name ``objective.<key>``."""
    try:
        return cfg.objective.resolve(prefix="objective")
    except ObjectiveConfigError as err:
        raise ConfigError(str(err)) from None


def validate_run(cfg: RunConfig) -> None:
    """Rules across sections of an RL run (cheap: no file is read, no model is built)."""
    objective = resolve_objective(cfg)
    for key, rule in check_eval_config(cfg.eval):
        raise ConfigError(f"{key}: {rule}")
    r, t = cfg.rollout, cfg.train
    _require(
        r.max_new_tokens < cfg.model.max_position_embeddings,
        "rollout.max_new_tokens",
        f"{r.max_new_tokens} leaves no room for a prompt within model.max_position_embeddings "
        f"({cfg.model.max_position_embeddings})",
    )
    _require(cfg.data.source != "task" or cfg.init_checkpoint is None, "data.source",
             "the built-in tasks use a character tokenizer, which no pretrained checkpoint shares; "
             "use prompt files (data.source=files) with init_checkpoint")
    _require(t.save_hf_every >= 0, "train.save_hf_every", "must be >= 0")
    _require(
        not (objective.advantage in GROUP_RELATIVE_ADVANTAGES and r.group_size < 2),
        "rollout.group_size",
        f"the {objective.advantage!r} advantage is group-relative and needs a group size >= 2",
    )
    _require(r.group_size >= 1, "rollout.group_size", "must be >= 1")
    _require(r.prompts_per_step >= 1, "rollout.prompts_per_step", "must be >= 1")
    _require(r.max_new_tokens >= 1, "rollout.max_new_tokens", "must be >= 1")
    _require(r.temperature >= 0, "rollout.temperature", "must be >= 0")
    _require(r.max_sampling_rounds >= 1, "rollout.max_sampling_rounds", "must be >= 1")
    _require(
        not (t.routing_replay == "R3" and not r.return_routed_experts),
        "train.routing_replay",
        "R3 replays the rollout engine's routes, but rollout.return_routed_experts is false",
    )
    if r.engine == "sglang":
        validate_sglang(r.sglang, cfg.model)
    from megatron_rl.train.async_rollouts import check_staleness  # its rules live with the feature

    check_staleness(cfg)
    _require(t.steps >= 0, "train.steps", "must be >= 0")
    _require(t.mini_batches >= 1, "train.mini_batches", "must be >= 1")
    _require(t.epochs >= 1, "train.epochs", "must be >= 1")
    _require(t.eval_every >= 1, "train.eval_every", "must be >= 1")
    _require(t.save_every >= 1, "train.save_every", "must be >= 1")
    _require(t.micro_batch_sequences >= 1, "train.micro_batch_sequences", "must be >= 1")
    if t.micro_batch_tokens is not None:
        check_micro_batch_tokens(cfg)
    _require(cfg.optim.lr > 0, "optim.lr", "must be > 0")


def longest_sequence(cfg: RunConfig) -> int:
    """The most prompt + response tokens one sample can have under this config."""
    room = cfg.model.max_position_embeddings
    if cfg.data.max_prompt_tokens is None:
        return room
    return min(room, cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens)


def check_micro_batch_tokens(cfg: RunConfig) -> None:
    """A token budget must hold the longest possible sample and split evenly over TP under SP."""
    budget, p = cfg.train.micro_batch_tokens, cfg.parallel
    longest = longest_sequence(cfg)
    _require(budget >= longest, "train.micro_batch_tokens",
             f"{budget} is smaller than the longest possible sample, {longest} tokens (data.max_prompt_tokens + "
             "rollout.max_new_tokens, at most model.max_position_embeddings)")
    tp = p.tensor_model_parallel_size
    _require(not p.sequence_parallel_enabled() or budget % tp == 0, "train.micro_batch_tokens",
             f"{budget} is not a multiple of parallel.tensor_model_parallel_size ({tp}): sequence parallelism "
             "splits every micro-batch row over the TP ranks")


def validate_sglang(s: SGLangConfig, model: ModelConfig, prefix: str = "rollout.sglang") -> None:
    """Rules for the SGLang engine section (checked only when it is the engine)."""
    from megatron_rl.checkpoint.mapping import ARCHITECTURES

    _require(bool(s.urls) != (s.url_dir is not None), f"{prefix}.urls",
             "rollout.engine is sglang: give either server URLs or url_dir (exactly one)")
    _require(s.num_servers >= 1, f"{prefix}.num_servers", "must be >= 1")
    _require(s.server_wait_s > 0, f"{prefix}.server_wait_s", "must be > 0")
    for i, url in enumerate(s.urls):
        _require(
            isinstance(url, str) and url.startswith(("http://", "https://")) and len(url.split("://", 1)[1]) > 0,
            f"{prefix}.urls[{i}]", f"{url!r} is not an http(s) base URL",
        )
    _require(len(set(s.urls)) == len(s.urls), f"{prefix}.urls", "lists a server twice")
    for key in ("server_tp_size", "max_concurrency", "weight_sync_bucket_mb"):
        _require(getattr(s, key) >= 1, f"{prefix}.{key}", "must be >= 1")
    _require(s.max_retries >= 0, f"{prefix}.max_retries", "must be >= 0")
    _require(s.request_timeout_s > 0, f"{prefix}.request_timeout_s", "must be > 0")
    _require(s.retry_backoff_s >= 0, f"{prefix}.retry_backoff_s", "must be >= 0")
    for key in ("retry_budget_s", "retry_backoff_max_s", "max_resyncs"):
        _require(getattr(s, key) >= 0, f"{prefix}.{key}", "must be >= 0")
    for key in ("hang_check_after_s", "health_timeout_s"):
        _require(getattr(s, key) > 0, f"{prefix}.{key}", "must be > 0")
    _require(
        s.hf_architecture in ARCHITECTURES.names(), f"{prefix}.hf_architecture",
        f"unknown architecture {s.hf_architecture!r}; available: {sorted(ARCHITECTURES.names())}",
    )
    if s.weight_sync != "none":
        # The servers run the HF architecture's own block: weights synced into it must mean
        # the same model, or rollouts would silently come from a different policy.
        # The exported config.json's own checks (score function, QK norm, MLA, shared
        # experts, dense layers, ... as the architecture has them) name the model field.
        from megatron_rl.checkpoint.errors import CheckpointMismatchError
        from megatron_rl.checkpoint.hf_config import hf_config_from_model

        try:
            hf_config_from_model(s.hf_architecture, model)
        except CheckpointMismatchError as err:
            _require(False, f"{prefix}.hf_architecture", str(err))


def validate(cfg: RunConfig, world_size: int | None = None) -> RunConfig:
    """Validate a whole run config; returns it for chaining."""
    validate_model(cfg.model)
    validate_layout(cfg.model, cfg.parallel, world_size)
    check_fp8(cfg.fp8)
    validate_run(cfg)
    world = cfg.parallel.world_size or world_size
    if world is not None:
        validate_batch_split(cfg, cfg.parallel.data_parallel_size(world))
    return cfg


def validate_batch_split(cfg: RunConfig, dp_size: int) -> None:
    """Prompts (and warm-start examples) must split evenly over the data-parallel ranks."""
    r, t = cfg.rollout, cfg.train
    _require(r.prompts_per_step % dp_size == 0 and (r.prompts_per_step // dp_size) % t.mini_batches == 0,
             "rollout.prompts_per_step",
             f"{r.prompts_per_step} must split evenly over {dp_size} data-parallel ranks and then into "
             f"train.mini_batches ({t.mini_batches})")
    _require(t.sft_steps == 0 or t.sft_batch_size % dp_size == 0, "train.sft_batch_size",
             f"{t.sft_batch_size} must split evenly over {dp_size} data-parallel ranks")


PATH_KEYS = (("init_checkpoint",), ("tokenizer", "path"), ("data", "train_files"), ("data", "eval_files"))
"""Input paths; a relative one in a YAML preset is relative to that file (on the command line: to the cwd)."""


def _anchor_paths(loaded: dict[str, Any], directory: Path) -> dict[str, Any]:
    """``loaded`` with the relative input paths of :data:`PATH_KEYS` made relative to ``directory``."""

    def anchor(value: Any) -> Any:
        if isinstance(value, str) and value and not Path(value).is_absolute():
            return os.path.normpath(directory / value)
        if isinstance(value, list):
            return [anchor(v) for v in value]
        return value

    for keys in PATH_KEYS:
        node = loaded
        for key in keys[:-1]:
            node = node.get(key) if isinstance(node, dict) else None
        if isinstance(node, dict) and keys[-1] in node:
            node[keys[-1]] = anchor(node[keys[-1]])
    return loaded


def read_preset(path: str | Path, _seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    """A YAML preset as a nested dict, with its ``base:`` chain merged in first.

    ``base: other.yaml`` (relative to the file) makes a preset a small diff of another,
    e.g. one file per objective preset on top of the demo config. Relative input paths
    (:data:`PATH_KEYS`) are taken relative to the file that names them.
    """
    path = Path(path).resolve()
    if path in _seen:
        raise ConfigError(f"{path}: base chain loops back to itself")
    if not path.is_file():
        raise ConfigError(f"--config: {path} is not a file")
    try:
        loaded = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML: {' '.join(str(err).split())}") from None
    if not isinstance(loaded, dict):
        raise ConfigError(f"{path}: top level must be a mapping")
    loaded = _anchor_paths(loaded, path.parent)
    base = loaded.pop("base", None)
    if base is None:
        return loaded
    if not isinstance(base, str):
        raise ConfigError(f"{path}: base: expected a file name, got {base!r}")
    return merge(read_preset(path.parent / base, (*_seen, path)), loaded)


def load_config(
    path: str | Path | None = None,
    overrides: Sequence[str] = (),
    cls: type[T] = RunConfig,  # type: ignore[assignment]
    world_size: int | None = None,
    validate_fn=None,
) -> T:
    """Load a YAML preset, apply dotted overrides, build and validate ``cls``.

    Args:
        path: YAML preset; None starts from the dataclass defaults.
        overrides: ``key.path=value`` strings, applied after the preset.
        cls: the top-level config dataclass.
        world_size: number of processes, when known, for layout validation.
        validate_fn: validation hook; defaults to :func:`validate` for RunConfig.
    """
    data = read_preset(path) if path is not None else {}
    data = merge(data, parse_overrides(overrides))
    cfg = from_dict(cls, data)
    check = validate_fn or (validate if cls is RunConfig else None)
    if check is not None:
        check(cfg, world_size)
    return cfg
