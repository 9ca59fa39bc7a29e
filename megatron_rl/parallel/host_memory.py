"""Freed host memory goes back to the OS in CPU ranks: glibc's mmap threshold, fixed.

glibc serves a block of at least ``M_MMAP_THRESHOLD`` bytes with its own ``mmap`` and unmaps it
when freed; a smaller one comes from its heaps, which keep freed pages resident. By default the
threshold starts at 128 KiB and rises to the size of each mmapped block freed (up to 32 MiB), so
after the first forward/backward of a CPU rank every activation is a heap block, and the freed
ones stay resident: in ``tools/bench_memory_plan.py``'s tp1-1k case (30M parameters), 244 MiB
(bf16) and 392 MiB (fp32) above what the live tensors hold after it, which
``malloc_trim`` gives back; the planner counts live tensors (docs/memory.md). Setting the
threshold also fixes it: blocks of 128 KiB and more are mapped and unmapped each time.

Owns :func:`return_freed_memory`. Does not own GPU memory (the CUDA caching allocator) or
pinned host buffers (CUDA's host allocator).
"""

from __future__ import annotations

import ctypes

MMAP_THRESHOLD_BYTES = 128 << 10
"""glibc's initial threshold (``DEFAULT_MMAP_THRESHOLD_MIN``), kept from growing."""
_M_MMAP_THRESHOLD = -3
"""``mallopt``'s parameter number for the threshold (glibc ``malloc.h``)."""


def return_freed_memory(threshold_bytes: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Fix the C allocator's mmap threshold at ``threshold_bytes`` for this process (and its forks).

    Returns:
        True when the C library took it (glibc); False where there is no ``mallopt`` (musl
        answers 0 too: its allocator returns large blocks by itself).
    """
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return mallopt(_M_MMAP_THRESHOLD, threshold_bytes) == 1
