"""Rollouts: the engine interface and sampling shared by every engine; the engines live in
``rollout.local`` (hf, megatron) and ``rollout.sglang`` (SGLang servers and the CPU stand-in)."""
