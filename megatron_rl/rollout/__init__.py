"""Rollout engines (embedded, SGLang), sampling, verifiable tasks and rewards."""
