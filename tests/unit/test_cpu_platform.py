"""The CPU platform layer is opt-in, inactive with CUDA, and leaves no trace after exit."""

from pathlib import Path

import pytest
import torch

from megatron_rl.parallel import cpu_platform as platform

PATCHED_TORCH_CUDA = ("current_device", "Stream", "Event", "current_stream", "stream",
                      "synchronize", "get_rng_state", "set_rng_state", "manual_seed", "empty_cache")


def _snapshot():
    import megatron.core.optimizer.clip_grads as clip_grads
    import megatron.core.optimizer.optimizer as optimizer
    import megatron.core.tensor_parallel.random as random
    import megatron.core.transformer.moe.moe_utils as moe_utils
    import megatron.core.transformer.moe.token_dispatcher as dispatcher

    return {
        **{f"torch.cuda.{n}": getattr(torch.cuda, n) for n in PATCHED_TORCH_CUDA},
        "random._get_cuda_rng_state": random._get_cuda_rng_state,
        "random._set_cuda_rng_state": random._set_cuda_rng_state,
        "dispatcher.all_to_all": dispatcher.all_to_all,
        "clip_grads.clip": clip_grads.clip_grad_by_total_norm_fp32,
        "optimizer.clip": optimizer.clip_grad_by_total_norm_fp32,
        "moe_utils.te_general_gemm": getattr(moe_utils, "te_general_gemm", "<absent>"),
    }


def _cuda_factory_device():
    return torch.zeros(2, device="cuda").device


@pytest.fixture(scope="module")
def original():
    return _snapshot()


def test_import_alone_changes_nothing(original):
    assert _snapshot() == original
    assert not platform.cpu_platform_active()
    if not torch.cuda.is_available():
        with pytest.raises((AssertionError, RuntimeError)):
            torch.cuda.current_device()


def test_disabled_context_is_a_no_op(original):
    with platform.cpu_platform(enable=False) as active:
        assert active is False
        assert _snapshot() == original
        assert not platform.cpu_platform_active()


def test_inactive_when_cuda_is_available(original, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with platform.cpu_platform() as active:
        assert active is False
        assert not platform.cpu_platform_active()
        current = _snapshot()
    monkeypatch.undo()
    assert current == original


@pytest.mark.skipif(torch.cuda.is_available(), reason="the patches only apply without CUDA")
def test_active_patches_apply_and_are_restored(original):
    with platform.cpu_platform() as active:
        assert active is True and platform.cpu_platform_active()
        assert torch.cuda.current_device() == torch.device("cpu")
        assert _cuda_factory_device() == torch.device("cpu")
        assert torch.ones(1).to("cuda").device == torch.device("cpu")
        with platform.cpu_platform() as nested:  # re-entrant
            assert nested is True
        assert platform.cpu_platform_active()
    assert _snapshot() == original
    assert not platform.cpu_platform_active()
    with pytest.raises((AssertionError, RuntimeError)):
        _cuda_factory_device()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the patches only apply without CUDA")
def test_patches_are_restored_after_an_exception(original):
    with pytest.raises(KeyError):
        with platform.cpu_platform():
            raise KeyError("boom")
    assert _snapshot() == original


@pytest.mark.skipif(torch.cuda.is_available(), reason="the patches only apply without CUDA")
def test_float_tensors_answer_cuda_type_names_and_cuda_is_the_tensor():
    """Megatron's optimizers accept parameters by their ``torch.cuda.*Tensor`` type name; the
    distributed optimizer's checkpoint gather calls ``.cuda()``."""
    import megatron.core.optimizer.distrib_optimizer as distrib_optimizer

    source = Path(distrib_optimizer.__file__).read_text()
    assert "model_param.type() == 'torch.cuda.FloatTensor'" in source  # what the rewrite serves
    assert "send_tensor = send_tensor.cuda()" in source
    tensors = {torch.float32: "torch.cuda.FloatTensor", torch.bfloat16: "torch.cuda.BFloat16Tensor",
               torch.float16: "torch.cuda.HalfTensor"}
    with platform.cpu_platform():
        for dtype, name in tensors.items():
            assert torch.zeros(2, dtype=dtype).type() == name
        assert torch.zeros(2, dtype=torch.int64).type() == "torch.LongTensor"
        assert torch.zeros(2).type(torch.float64).dtype == torch.float64  # a conversion stays one
        plain = torch.ones(3)
        assert plain.cuda() is plain
    assert torch.zeros(2).type() == "torch.FloatTensor"


def test_split_sizes_become_int_lists():
    assert platform._split_sizes_as_ints(None) is None
    assert platform._split_sizes_as_ints(torch.tensor([3, 1])) == [3, 1]
    import numpy as np

    assert platform._split_sizes_as_ints(np.array([2, 5])) == [2, 5]
