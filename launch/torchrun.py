"""Start a megatron-rl run under torchrun on this node (see ``megatron_rl/launcher.py``).

    python launch/torchrun.py --config configs/demo_cpu.yaml                        # one node
    python launch/torchrun.py --config configs/qwen3_30b_a3b.yaml --nnodes 2 \\
        --rdzv-endpoint node001:29500                                             # on each node

Same as ``python -m megatron_rl.launcher``; the Slurm scripts in ``launch/slurm/`` call that.
"""

import sys

from megatron_rl.launcher import main

if __name__ == "__main__":
    sys.exit(main())
