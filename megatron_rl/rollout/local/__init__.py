"""Rollout engines that run inside the trainer's processes: the KV-cached transformers
replica (``hf``, the default on CPU and small GPUs) and the embedded Megatron model
(``megatron``, the exact train = rollout mode)."""
