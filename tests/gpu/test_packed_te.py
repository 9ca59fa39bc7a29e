"""Packed vs one-sequence-at-a-time log-probs, router records and an R2 train step under the
Transformer Engine spec (fused attention on THD ``PackedSeqParams``, grouped-GEMM experts)
in bfloat16 on one GPU; skipped without CUDA or TE. What is checked and the tolerances:
``tests/packed_checks.py``; the same checks run on CPU with the local spec in
``tests/parallel/test_packed_checks_cpu.py``. ``pytest -s`` prints the measured figures.
"""

import pytest
from packed_checks import assert_within, run_checks

pytestmark = pytest.mark.gpu


def test_packed_equals_single_te_spec_on_gpu(one_gpu_world):
    from megatron_rl.parallel.model import transformer_engine_available

    if not transformer_engine_available():
        pytest.skip("Transformer Engine does not import here")
    assert_within(run_checks(use_te=True, dtype="bfloat16", groups=one_gpu_world), "bfloat16")
