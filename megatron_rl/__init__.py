"""Megatron-Core extension for RL post-training of Mixture-of-Experts models."""
