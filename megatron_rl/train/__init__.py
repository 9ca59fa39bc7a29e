"""The RL loop (``trainer``) and what sits beside it: the run's parts (``build``), rollouts, the
checkpoint lifecycle, evaluation, frozen models, HF exports, metrics and the entry point."""
