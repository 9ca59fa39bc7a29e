"""Shared pytest setup: markers and the GPU skip."""

import pytest
import torch


def pytest_configure(config):
    config.addinivalue_line("markers", "parallel: runs gloo worlds of several processes on CPU")
    config.addinivalue_line("markers", "gpu: needs CUDA; skipped on CPU-only machines")
    # Megatron-Core warns at import about missing TE/apex fallbacks; those are expected here.
    for category in ("DeprecationWarning", "FutureWarning", "UserWarning"):
        config.addinivalue_line("filterwarnings", f"ignore::{category}")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
