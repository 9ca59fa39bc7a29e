"""Block-wise FP8 (e4m3) export of an HF checkpoint for rollout engines.

Layout, as in the FP8 checkpoints of DeepSeek-V3 and Qwen3 (``quant_method: fp8``,
``fmt: e4m3``, ``weight_block_size: [128, 128]``, dynamic activations): each quantized
linear weight ``X.weight`` ``[O, I]`` is stored as ``float8_e4m3fn`` next to
``X.weight_scale_inv``, float32 ``[ceil(O/128), ceil(I/128)]``, one scale per 128 x 128
block (edge blocks are partial), and ``W ~= weight.float() * weight_scale_inv`` broadcast
over each block. The scale of a block is ``amax / 448`` (448 = largest finite e4m3), so the
block's largest entry maps to 448. Router, norms, embeddings and the output layer keep
their dtype (``modules_to_not_convert``); which weights are quantized comes from the
``fp8`` flag of the mapping table.

Error bound (what the tests hold every element to). e4m3 has 3 mantissa bits: in a
binade ``[2^e, 2^(e+1))`` (normal numbers, ``|y| >= 2^-6``) the spacing is ``2^(e-3)``,
so round-to-nearest errs by at most ``2^(e-4) <= 2^-4 |y|``; below ``2^-6`` the
subnormal spacing is ``2^-9`` and the error at most ``2^-10``. With ``y = w / s``:
``|dequant(w) - w| <= max(2^-4 |w|, 2^-10 s)``, times ``(1 + 2^-18)`` for the three float32
roundings (the division, the clamp at 448, the product), each below ``2^-24`` relative.

Owns: quantize / dequantize / the bound, the ``quantization_config`` entry and the export
of a validated HF checkpoint. Does not own the HF <-> Megatron mapping (an export from
Megatron goes through ``convert_megatron_to_hf`` first).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from megatron_rl.checkpoint.hf_io import (
    HFCheckpoint,
    ShardPlan,
    ShardWriter,
    atomic_output_dir,
    copy_files,
)
from megatron_rl.checkpoint.hf_source import inspect_hf_checkpoint
from megatron_rl.checkpoint.mapping import all_weights
from megatron_rl.checkpoint.weight_rules import Architecture
from megatron_rl.sections import ModelConfig

BLOCK = 128
E4M3_MAX = 448.0
SCALE_SUFFIX = "_scale_inv"
_BOUND_SLACK = 1 + 2.0**-18


def _blocks(shape: tuple[int, int], block: int) -> tuple[int, int]:
    return math.ceil(shape[0] / block), math.ceil(shape[1] / block)


def _expand(scale_inv: torch.Tensor, shape: tuple[int, int], block: int) -> torch.Tensor:
    """Per-element scale ``[O, I]`` from per-block scales."""
    return scale_inv.repeat_interleave(block, 0)[: shape[0]].repeat_interleave(block, 1)[:, : shape[1]]


def quantize_blockwise(weight_OI: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """float8_e4m3fn weight ``[O, I]`` and float32 inverse scales ``[ceil(O/b), ceil(I/b)]``."""
    if weight_OI.dim() != 2:
        raise ValueError(f"block-wise FP8 needs a 2-D weight, got shape {tuple(weight_OI.shape)}")
    rows, cols = weight_OI.shape
    n_rows, n_cols = _blocks((rows, cols), block)
    padded = weight_OI.new_zeros((n_rows * block, n_cols * block), dtype=torch.float32)
    padded[:rows, :cols] = weight_OI.float()
    blocks = padded.view(n_rows, block, n_cols, block)
    amax = blocks.abs().amax(dim=(1, 3))
    # An all-zero block quantizes to zeros under any scale; 1 keeps the division finite.
    scale_inv = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    scaled = (blocks / scale_inv[:, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX)
    quantized = scaled.to(torch.float8_e4m3fn).view(n_rows * block, n_cols * block)
    return quantized[:rows, :cols].contiguous(), scale_inv


def dequantize_blockwise(
    quantized_OI: torch.Tensor, scale_inv: torch.Tensor, block: int = BLOCK
) -> torch.Tensor:
    """float32 weight ``[O, I]`` from an FP8 weight and its per-block inverse scales."""
    shape = tuple(quantized_OI.shape)
    if tuple(scale_inv.shape) != _blocks(shape, block):
        raise ValueError(
            f"scale_inv shape {tuple(scale_inv.shape)} does not tile weight {shape} in {block}-blocks"
        )
    return quantized_OI.float() * _expand(scale_inv.float(), shape, block)


def error_bound(weight_OI: torch.Tensor, scale_inv: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """Per-element bound on ``|dequantize(quantize(w)) - w|`` (see the module docstring)."""
    scale = _expand(scale_inv.double(), tuple(weight_OI.shape), block)
    return torch.maximum(2.0**-4 * weight_OI.double().abs(), 2.0**-10 * scale) * _BOUND_SLACK


def fp8_weight_names(arch: Architecture, model: ModelConfig) -> set[str]:
    """HF names of the weights the export quantizes."""
    return {name for w in all_weights(arch, model) if w.rule.fp8 for name in w.hf}


def quantization_config(arch: Architecture, model: ModelConfig) -> dict:
    """The ``quantization_config`` entry of the exported config.json."""
    kept = sorted(
        name.removesuffix(".weight") for w in all_weights(arch, model) if not w.rule.fp8 for name in w.hf
    )
    return {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [BLOCK, BLOCK],
        "modules_to_not_convert": kept,
    }


def export_fp8(hf_dir: str | Path, out_dir: str | Path, progress: bool = True) -> Path:
    """Write a block-wise FP8 copy of a validated HF checkpoint, tensor by tensor.

    Each quantized weight's scale goes to the same shard file as the weight; the shard
    layout is otherwise the source's. The output directory appears only when complete.

    Raises:
        CheckpointMismatchError: the source does not fit its config or the mapping table.
        FileExistsError: ``out_dir`` exists.
    """
    source = inspect_hf_checkpoint(hf_dir)
    checkpoint = HFCheckpoint(hf_dir)
    quantized = fp8_weight_names(source.arch, source.model)
    weight_map = {}
    for name, file in checkpoint.weight_map.items():
        weight_map[name] = file
        if name in quantized:
            weight_map[name + SCALE_SUFFIX] = file
    plan = ShardPlan(weight_map=weight_map, sharded=checkpoint.index is not None)
    config = json.loads((Path(hf_dir) / "config.json").read_text())
    config["quantization_config"] = quantization_config(source.arch, source.model)
    with atomic_output_dir(out_dir) as staging:
        copy_files([p for p in checkpoint.extra_files() if p.name != "config.json"], staging)
        (staging / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        writer = ShardWriter(staging, plan, progress)
        for name in checkpoint.names():
            tensor = checkpoint.get(name)
            if name in quantized:
                weight, scale_inv = quantize_blockwise(tensor)
                writer.add(name, weight)
                writer.add(name + SCALE_SUFFIX, scale_inv)
            else:
                writer.add(name, tensor)
        writer.finish()
    return Path(out_dir)
