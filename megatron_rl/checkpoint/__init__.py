"""HF <-> Megatron checkpoint conversion, log-prob/routing parity and FP8 export for MoE models.

Modules: ``mapping`` (one HF <-> Megatron name, shape and layout table per architecture,
shared with weight sync), ``hf_config`` (HF config.json <-> ModelConfig), ``hf_io``
(streaming safetensors reads, planned shard writes, atomic output directories),
``megatron_io`` (filling a model of any layout, reading a distributed checkpoint box by
box), ``trainer_source`` (what a trainer checkpoint's run config says; its optimizer
keys), ``inputs`` (damaged JSON, safetensors, torch and ``.distcp`` files and unusable
output locations, named before any rank starts), ``local_world`` (the layouts the tools
accept and the local worlds they run in), ``convert`` (validation and orchestration of
both directions), ``parity`` (HF transformers vs Megatron log-probs and routing), ``fp8``
(block-wise float8 export).
Imports here stay free of Megatron so that validation and FP8 export run without it.
"""

from megatron_rl.checkpoint.errors import CheckpointMismatchError
from megatron_rl.checkpoint.families import ARCHITECTURES, MIXTRAL, QWEN3_MOE
from megatron_rl.checkpoint.weight_rules import Architecture, WeightRule

__all__ = ["ARCHITECTURES", "MIXTRAL", "QWEN3_MOE", "Architecture", "CheckpointMismatchError", "WeightRule"]
