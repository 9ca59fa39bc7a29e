"""MXFP4 expert weights (GPT-OSS's released checkpoints) read as the bf16 tensors they encode.

Shape legend: E experts, R rows of the quantized matrix, G blocks of 32 values per row, B = 16
bytes per block (two 4-bit values each).

The format, as GPT-OSS releases it and transformers and SGLang read it: a weight ``X`` is
stored as ``X_blocks`` (uint8 ``[E, R, G, B]``, the low nibble the even element) and
``X_scales`` (uint8 ``[E, R, G]``, an E8M0 exponent biased by 127); element ``2j`` / ``2j+1``
of block ``g`` is ``FP4_VALUES[nibble] * 2^(scale - 127)``, and the dequantized matrix is
``[E, R, G * 32]`` transposed to ``[E, G * 32, R]`` (the bf16 checkpoint's ``[E, in, out]``).
Every value is exactly representable in bf16, so the result does not depend on how it is
computed. Pure torch; ``tests/unit/test_mxfp4.py`` holds it to transformers'
``convert_moe_packed_tensors``. Does not own which tensors are MXFP4 (``hf_io`` pairs
``_blocks`` with ``_scales``).
"""

from __future__ import annotations

import torch

FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
"""E2M1 values by 4-bit code (OCP Microscaling format)."""
SCALE_BIAS = 127
"""E8M0 exponent bias of the scales."""
BLOCKS_SUFFIX, SCALES_SUFFIX = "_blocks", "_scales"
"""Name suffixes of the two tensors that encode one weight."""


def dequantized_shape(blocks_shape: tuple[int, ...]) -> tuple[int, ...]:
    """``[E, G * 32, R]``: the shape ``X_blocks`` of ``[E, R, G, B]`` decodes to."""
    *prefix, rows, groups, width = blocks_shape
    return (*prefix, groups * width * 2, rows)


def dequantize(blocks_ERGB: torch.Tensor, scales_ERG: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``[E, G * 32, R]`` values of one MXFP4 weight.

    Raises:
        ValueError: the scales' shape is not the blocks' without their last axis.
    """
    if tuple(blocks_ERGB.shape[:-1]) != tuple(scales_ERG.shape):
        raise ValueError(f"MXFP4 blocks {tuple(blocks_ERGB.shape)} and scales {tuple(scales_ERG.shape)} do not match")
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    blocks = blocks_ERGB.to(torch.uint8)
    values = torch.stack([lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]], dim=-1)  # [E, R, G, B, 2]
    exponents = scales_ERG.to(torch.int32) - SCALE_BIAS
    values = torch.ldexp(values, exponents[..., None, None].to(torch.float32))
    rows = values.reshape(*blocks.shape[:-2], -1)  # [E, R, G * 32]
    return rows.transpose(-1, -2).to(dtype).contiguous()
