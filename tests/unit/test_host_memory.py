"""CPU ranks give freed host memory back (``parallel/host_memory.py``; issue 34: the planner's
bytes were the live tensors', but a CPU rank kept ~250-400 MiB of freed activations resident
after its first forward/backward: glibc's heaps)."""

import subprocess
import sys

import pytest

from megatron_rl.parallel.world import run_world

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="VmRSS and glibc's mallopt are Linux's")


def grown_mib() -> int:
    """Resident MiB left after freeing 39 of 40 4-MiB activations, once a 16 MiB block was freed
    (which raises glibc's default mmap threshold to 16 MiB)."""
    import torch

    def rss() -> int:
        for line in open("/proc/self/status"):
            if line.startswith("VmRSS"):
                return int(line.split()[1]) << 10
        raise AssertionError("no VmRSS")

    big = torch.ones(16 << 20, dtype=torch.uint8)
    del big
    before = rss()
    blocks = [torch.ones(4 << 20, dtype=torch.uint8) for _ in range(40)]
    del blocks[:-1]
    return (rss() - before) >> 20


def test_a_cpu_rank_returns_freed_activations_to_the_os():
    code = f"import sys; sys.path.insert(0, {str(__file__.rsplit('/', 1)[0])!r}); " \
           "from test_host_memory import grown_mib; print(grown_mib())"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert int(done.stdout.split()[-1]) >= 150  # a plain process: 39 freed blocks stay resident
    assert run_world(grown_mib, 1, timeout_s=300) == [pytest.approx(4, abs=12)]  # a rank: the last block
