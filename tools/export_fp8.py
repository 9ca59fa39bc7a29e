"""Block-wise (128 x 128) FP8 e4m3 export of an HF checkpoint for rollout engines.

Usage: python tools/export_fp8.py /ckpt/qwen3-hf /ckpt/qwen3-fp8
(`--help` lists every option.) Thin wrapper over :mod:`megatron_rl.checkpoint.cli`.
"""

import sys

from megatron_rl.checkpoint.cli import export_fp8_main

if __name__ == "__main__":
    sys.exit(export_fp8_main())
