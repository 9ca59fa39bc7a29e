"""Megatron distributed checkpoint (any layout) -> HF safetensors, reproducing the source's shard layout.

Usage: python tools/convert_megatron_to_hf.py /ckpt/qwen3-mcore /ckpt/qwen3-hf
(`--help` lists every option.) Thin wrapper over :mod:`megatron_rl.checkpoint.cli`.
"""

import sys

from megatron_rl.checkpoint.cli import megatron_to_hf_main

if __name__ == "__main__":
    sys.exit(megatron_to_hf_main())
