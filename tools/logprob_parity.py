"""Log-prob and router top-K parity of HF transformers and the Megatron model (exit 1 beyond tolerance).

Usage: python tools/logprob_parity.py --hf /ckpt/Qwen3-30B-A3B --megatron /ckpt/qwen3-mcore --tp 2 --ep 2
(`--help` lists every option.) Thin wrapper over :mod:`megatron_rl.checkpoint.cli`.
"""

import sys

from megatron_rl.checkpoint.cli import parity_main

if __name__ == "__main__":
    sys.exit(parity_main())
