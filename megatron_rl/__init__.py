"""Megatron-Core extension for RL post-training of Mixture-of-Experts models."""

from megatron_rl.deferred_imports import defer_optional_imports

defer_optional_imports()
