"""Bytes per parameter of the training state (``parallel/optimizer_memory.py``).

The worked numbers below are the allocation rules of Megatron-Core 0.16.1 the module cites;
``tests/parallel/test_distributed_optimizer.py`` measures the storages a real DDP model and
its plain and distributed optimizers hold on CPU (DP2; DP4 / expert-DP2; TP2 x DP2) against
this function.
"""

import pytest

from megatron_rl.parallel.optimizer_memory import (
    grad_buffer_dtype,
    optimizer_bytes_per_param,
)


@pytest.mark.parametrize("dtype, grads_fp32, distributed, dp, terms", [
    ("bfloat16", True, False, 8, (2, 4, 4, 8)),       # 18 B: weights, fp32 grads, fp32 main, Adam
    ("bfloat16", True, True, 8, (2, 4, 0.5, 1)),      # 6 + 12/8
    ("bfloat16", False, True, 4, (2, 2, 1, 2)),       # 4 + 12/4
    ("bfloat16", False, False, 4, (2, 2, 4, 8)),      # 16 B
    ("float32", True, False, 2, (4, 4, 0, 8)),        # 16 B: the optimizer steps the weights themselves
    ("float32", True, True, 2, (4, 4, 0, 4)),         # 8 + 8/2
    ("float16", True, True, 1, (2, 4, 4, 8)),         # D = 1: the same as plain
])
def test_adam_terms(dtype, grads_fp32, distributed, dp, terms):
    got = optimizer_bytes_per_param(dtype, distributed=distributed, data_parallel_size=dp,
                                    grad_reduce_in_fp32=grads_fp32)
    assert (got.weights, got.grads, got.main_weights, got.optimizer_state) == terms
    assert got.total == sum(terms)


def test_plain_optimizer_ignores_the_data_parallel_size():
    assert optimizer_bytes_per_param("bfloat16", distributed=False, data_parallel_size=64) == \
        optimizer_bytes_per_param("bfloat16", distributed=False, data_parallel_size=1)


def test_sgd_keeps_a_momentum_buffer_only_with_momentum():
    assert optimizer_bytes_per_param("float32", distributed=False, optimizer="sgd").optimizer_state == 0
    assert optimizer_bytes_per_param("float32", distributed=False, optimizer="sgd", sgd_momentum=0.9).total == 12


def test_grad_buffer_dtype():
    assert grad_buffer_dtype("bfloat16") == "float32"
    assert grad_buffer_dtype("bfloat16", grad_reduce_in_fp32=False) == "bfloat16"


@pytest.mark.parametrize("kwargs, message", [
    ({"params_dtype": "float8"}, "params_dtype 'float8'"),
    ({"params_dtype": "float32", "optimizer": "lion"}, "optimizer 'lion'"),
    ({"params_dtype": "float32", "data_parallel_size": 0}, "data_parallel_size 0"),
    ({"params_dtype": "float32", "optimizer": "sgd", "distributed": True}, "Adam only"),
])
def test_bad_arguments_are_named(kwargs, message):
    kwargs.setdefault("distributed", False)
    with pytest.raises(ValueError, match=message):
        optimizer_bytes_per_param(**kwargs)
