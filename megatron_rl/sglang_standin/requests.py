"""The CPU stand-in's ``/generate`` request: its fields read and checked as SGLang reads them.

Owns the request body's parsing (``input_ids``, ``sampling_params``, ``rid``, the seed SGLang
would sample with), the stand-in's benchmark knob ``long_tail`` and SGLang's reading of a
boolean environment variable. Does not own HTTP
(:mod:`~megatron_rl.sglang_standin.server`).
"""

from __future__ import annotations

import dataclasses
import os
import random
from typing import Any

from megatron_rl.rollout.engine import SamplingParams

TOP_K_ALL = 1 << 30
"""SGLang's "no top-k" value (``-1`` on the wire is mapped to it)."""


def bool_env(name: str) -> bool:
    """SGLang's ``get_bool_env_var`` (utils/common.py:1424-1442): "true"/"1" (any case) only."""
    return os.environ.get(name, "false").lower() in ("true", "1")


def is_long(seed: int, share: float) -> bool:
    """Whether a request seeded ``seed`` is one of the ``share`` that ignore their stop tokens
    (a fixed hash of the seed: the same requests every run)."""
    return share > 0 and (seed * 2654435761 % 2**32) / 2**32 < share


def parse_generate(body: Any, model_cfg, *, deterministic: bool, seeds: random.Random, default_rid: str,
                   long_tail: float = 0.0) -> tuple[str, list[int], SamplingParams, bool, int]:
    """``(rid, input_ids, sampling params, return_routed_experts, the seed sampled with)``.

    The seed: ``sampling_seed`` (42 without one) with deterministic inference, else a fresh one,
    as SGLang ignores it (``sampling/sampling_batch_info.py:128``, ``:157-172``). ``long_tail``
    (the stand-in's benchmark knob, ``--long-tail``): that share of requests, chosen by their
    ``sampling_seed`` (or the seed drawn), ignore their stop tokens, as SGLang's ``ignore_eos``
    would make them: they run to ``max_new_tokens``, a long-tailed task's few long responses.

    Raises:
        ValueError: a body SGLang refuses (the server answers 400).
    """
    if not isinstance(body, dict) or not isinstance(body.get("input_ids"), list) or not body["input_ids"]:
        raise ValueError("the request needs a non-empty input_ids list (text prompts are not supported)")
    prompt = body["input_ids"]
    vocab, longest = model_cfg.vocab_size, model_cfg.max_position_embeddings
    if not all(isinstance(t, int) and 0 <= t < vocab for t in prompt):
        raise ValueError(f"input_ids must be token ids in [0, {vocab})")
    sp = body.get("sampling_params") or {}
    top_k = int(sp.get("top_k", -1))
    params = SamplingParams(
        temperature=float(sp.get("temperature", 1.0)), top_p=float(sp.get("top_p", 1.0)),
        top_k=0 if top_k in (-1, TOP_K_ALL) else top_k, max_new_tokens=int(sp.get("max_new_tokens", 128)),
        stop_token_ids=tuple(sorted(int(t) for t in sp.get("stop_token_ids") or ())),
    )
    if params.temperature < 0 or not 0 < params.top_p <= 1 or params.top_k < 0 or params.max_new_tokens < 1:
        raise ValueError(f"bad sampling_params {sp}")
    if len(prompt) + params.max_new_tokens > longest:
        raise ValueError(f"prompt ({len(prompt)}) + max_new_tokens ({params.max_new_tokens}) exceeds {longest}")
    if body.get("stream"):
        raise ValueError("streaming is not supported by the protocol server")
    rid = str(body.get("rid") or default_rid)
    given = sp.get("sampling_seed")
    if deterministic:
        seed = 42 if given is None else int(given)
    else:
        seed = seeds.randrange(2**31)  # the seed is ignored: sampling_batch_info.py:157-172
    if is_long(seed if given is None else int(given), long_tail):
        params = dataclasses.replace(params, stop_token_ids=())
    return rid, prompt, params, bool(body.get("return_routed_experts")), seed
