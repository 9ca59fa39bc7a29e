"""The checks of ``tests/gpu/test_packed_te.py`` on CPU: the local spec (``PackedCoreAttention``,
sequential experts) in float32 and in bfloat16, in one spawned one-process gloo world.
What is checked and the tolerances: ``tests/packed_checks.py``. ``pytest -s`` prints the
measured figures.
"""

import pytest
from packed_checks import BOUNDS, assert_within, cpu_worker

from megatron_rl.parallel.world import run_world

pytestmark = pytest.mark.parallel


@pytest.fixture(scope="module")
def measured():
    return run_world(cpu_worker, 1, tuple(BOUNDS))[0]


@pytest.mark.parametrize("dtype", list(BOUNDS))
def test_packed_equals_single_local_spec_on_cpu(measured, dtype):
    assert_within(measured[dtype], dtype)
