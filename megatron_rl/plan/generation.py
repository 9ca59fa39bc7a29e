"""GPU memory of the rollout engines while they generate: SGLang servers, the hf replica, the
embedded Megatron engine.

SGLang (0.5.23, the version the project pins), per GPU of a server of TP size t:

- weights: the model in bf16, split t ways (experts and vocabulary sharded, norms and routers
  replicated: counted as split, an underestimate of a few MiB);
- KV cache: the sequences in flight at the run's longest length. Per token and GPU,
  grouped-query attention stores keys and values of ``max(1, groups / t)`` heads per layer
  (SGLang replicates KV heads when t exceeds them), multi-latent attention one
  ``kv_lora_rank + rope_dim`` latent per layer on every GPU; 2 bytes per element (the
  default KV dtype follows the bf16 model). Sliding-window layers (GPT-OSS) hold their
  window, Gated DeltaNet layers (Qwen3-Next, Qwen3.5) a fixed recurrent state per sequence
  (:func:`kv_bytes_per_sequence`). In flight: every sample of a step
  (``rollout.prompts_per_step x rollout.group_size``), at most
  ``rollout.sglang.max_concurrency`` per trainer model-parallel group, spread over the servers;
- SGLang's own reserve for activations and CUDA graphs, the formula it uses to choose
  ``--mem-fraction-static`` (``srt/arg_groups/memory_hook.py:297-315``): 512 MiB + 1.5 MiB per
  token of the prefill chunk (8192 on 60-160 GiB GPUs, 4096 on 20-60 GiB ones, :103-159)
  + 1 GiB x t/8 + 2 MiB per decode CUDA-graph batch size up to ``max_bs`` (512 at t >= 4,
  256 below on 60-160 GiB GPUs) + 8 MiB per prefill graph size (58 sizes up to 8192; MLA:
  1.5 GiB) (``reserve_for_graph_mb``, :359-397), at least 10 GiB on GPUs over 60 GiB.

The hf engine keeps a whole transformers replica per rank and a KV cache for the rank's
share of the samples (``rollout.local.hf_engine``); the embedded engine decodes with the
training model itself and no KV cache (``rollout.local.embedded``): its generation costs a
forward-only pass, planned like the log-prob pass. Pure arithmetic.
"""

from __future__ import annotations

from megatron_rl.config import RunConfig, longest_sequence
from megatron_rl.parallel.optimizer_memory import DTYPE_BYTES
from megatron_rl.plan.machine import GIB
from megatron_rl.plan.params import model_params
from megatron_rl.sections import ModelConfig

MIB = 1 << 20
KV_BYTES = 2
"""SGLang's KV cache holds bf16 (its ``kv_cache_dtype=auto`` follows the bf16 checkpoint)."""


def kv_bytes_per_token(m: ModelConfig, tp: int, element_bytes: int = KV_BYTES) -> int:
    """Bytes of KV cache one token takes in one attention layer on one GPU of a TP-``tp`` server."""
    if m.multi_latent_attention:
        return (m.kv_lora_rank + m.qk_rope_head_dim) * element_bytes
    heads = max(1, m.num_query_groups // tp)
    return 2 * heads * m.head_dim * element_bytes


def recurrent_state_bytes(m: ModelConfig, tp: int) -> int:
    """One sequence's state in one Gated DeltaNet layer on one GPU of a TP-``tp`` server: SGLang's
    mamba cache (``configs/qwen3_next.py:288-313``, ``mamba_utils.py:47-72``), a bf16 convolution
    window ``[(2 qk + v) / t, K - 1]`` and an fp32 delta-rule state ``[Hv / t, Dv, Dk]``."""
    conv = (2 * m.linear_num_key_heads * m.linear_key_head_dim + m.linear_num_value_heads * m.linear_value_head_dim)
    conv_bytes = conv // tp * (m.linear_conv_kernel_dim - 1) * 2
    return conv_bytes + m.linear_num_value_heads // tp * m.linear_value_head_dim * m.linear_key_head_dim * 4


def kv_bytes_per_sequence(m: ModelConfig, tp: int, length: int, element_bytes: int = KV_BYTES) -> int:
    """KV cache and recurrent state of one sequence of ``length`` tokens on one server GPU: full
    attention layers keep every token, sliding-window layers their window (SGLang's hybrid SWA
    pool for GPT-OSS, ``configs/model_config.py:88-96``, ``:2651-2676``), Gated DeltaNet layers a
    fixed state (:func:`recurrent_state_bytes`)."""
    kinds = m.mixer_types
    tokens = sum(length if k == "full_attention" else min(length, m.sliding_window) for k in kinds
                 if k != "linear_attention")
    return tokens * kv_bytes_per_token(m, tp, element_bytes) + kinds.count("linear_attention") * recurrent_state_bytes(m, tp)


def sglang_weights_bytes(m: ModelConfig, tp: int) -> int:
    """The served model's bf16 weights on one GPU of a TP-``tp`` server."""
    return model_params(m).total * KV_BYTES // tp


def sequences_in_flight(cfg: RunConfig, model_parallel_groups: int) -> int:
    """Samples generated at once over all servers: a step's samples, capped by the client."""
    r = cfg.rollout
    return min(r.prompts_per_step * r.group_size, r.sglang.max_concurrency * model_parallel_groups)


def sglang_kv_bytes(cfg: RunConfig, tp: int, servers: int, model_parallel_groups: int) -> int:
    """KV cache one server GPU needs for its share of the samples in flight at the longest length."""
    per_server = -(-sequences_in_flight(cfg, model_parallel_groups) // servers)
    return per_server * kv_bytes_per_sequence(cfg.model, tp, longest_sequence(cfg))


def sglang_reserve_bytes(m: ModelConfig, tp: int, gpu_memory: int) -> int:
    """SGLang's activation and CUDA-graph reserve on one GPU (its own mem_fraction_static formula)."""
    gpu_mib = gpu_memory / MIB
    chunk = 8192 if gpu_mib >= 60 * 1024 else 4096
    decode_max_bs = (512 if tp >= 4 else 256) if gpu_mib >= 60 * 1024 else 160
    prefill_graphs = 1.5 * 1024 if m.multi_latent_attention else 8 * _prefill_graph_sizes(chunk)
    reserve = 512 + 1.5 * max(chunk, 2048) + tp / 8 * 1024 + 2 * decode_max_bs + prefill_graphs
    if gpu_mib > 60 * 1024:
        reserve = max(reserve, 10 * 1024)
    return int(reserve * MIB)


def _prefill_graph_sizes(max_bs: int) -> int:
    """How many prefill CUDA graphs SGLang captures up to ``max_bs`` tokens (``cuda_graph_hook.py:486-495``)."""
    sizes = (list(range(4, 33, 4)) + list(range(48, 257, 16)) + list(range(288, 513, 32))
             + list(range(576, 1025, 64)) + list(range(1280, 4097, 256)) + list(range(4608, max_bs + 1, 512)))
    return sum(1 for s in sizes if s <= max_bs)


def hf_replica_bytes(cfg: RunConfig) -> int:
    """The hf engine's transformers replica: the whole model on every rank."""
    dtype = cfg.rollout.hf_dtype or cfg.model.params_dtype
    return model_params(cfg.model).total * DTYPE_BYTES[dtype]


def hf_kv_bytes(cfg: RunConfig, data_parallel: int, model_parallel: int) -> int:
    """The hf engine's KV cache for one rank's share of a step's samples at the longest length.

    transformers' cache keeps keys and values per KV head (MLA: per query head, expanded)."""
    m, r = cfg.model, cfg.rollout
    element = DTYPE_BYTES[r.hf_dtype or m.params_dtype]
    share = -(-r.prompts_per_step * r.group_size // (data_parallel * model_parallel))
    length = longest_sequence(cfg)
    if m.multi_latent_attention:
        per_token = m.num_attention_heads * (m.qk_nope_head_dim + m.qk_rope_head_dim + m.v_head_dim)
        return share * length * m.num_layers * per_token * element
    # transformers' hybrid caches: sliding layers keep their window, Gated DeltaNet layers their
    # state (the fp32 delta-rule state its torch kernel returns, and the conv window).
    return share * kv_bytes_per_sequence(m, 1, length, element)
