"""GPU-test fixtures (the tests here are skipped without CUDA, see ../conftest.py)."""

import pytest
import torch
import torch.distributed as dist

from megatron_rl.sections import ParallelConfig


@pytest.fixture(scope="module")
def one_gpu_world():
    """A one-process NCCL world on GPU 0 with Megatron's groups for the default layout (over an
    in-memory store: no port that another process could take first)."""
    from megatron_rl.parallel.groups import model_parallel

    torch.cuda.set_device(0)
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with model_parallel(ParallelConfig(), seed=1234) as groups:
            yield groups
    finally:
        dist.destroy_process_group()
