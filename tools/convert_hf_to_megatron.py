"""HF safetensors checkpoint -> Megatron distributed checkpoint at any TP/EP/PP layout.

Usage: python tools/convert_hf_to_megatron.py /ckpt/Qwen3-30B-A3B /ckpt/qwen3-mcore --tp 2 --ep 4
(`--help` lists every option.) Thin wrapper over :mod:`megatron_rl.checkpoint.cli`.
"""

import sys

from megatron_rl.checkpoint.cli import hf_to_megatron_main

if __name__ == "__main__":
    sys.exit(hf_to_megatron_main())
