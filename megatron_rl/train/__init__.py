"""The RL loop: trainer, metrics, checkpoints."""
