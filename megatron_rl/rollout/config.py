"""The ``rollout`` section: how responses are sampled each step, by which engine, and (with
``rollout.env``) against which environment over several turns."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from megatron_rl.config_loading import ConfigError, require
from megatron_rl.rollout.envs.config import EnvConfig
from megatron_rl.rollout.sglang.config import SGLangConfig, check_sglang_section

MAX_STALENESS = 64
"""Deepest asynchronous pipeline offered (``rollout.max_staleness``): each version of lag
keeps one more batch in flight and in the checkpoint."""


@dataclass(kw_only=True)
class RolloutConfig:
    """How responses are sampled each step."""

    engine: Literal["hf", "megatron", "sglang"] = "hf"
    """hf: a transformers replica per rank, KV-cached (megatron_rl.rollout.local.hf_engine; CPU and
    small GPU runs); megatron: the training model itself generates, the exact train = rollout
    mode for debugging mismatch (no KV cache); sglang: SGLang servers."""
    hf_dtype: Literal["float32", "bfloat16", "float16"] | None = None
    """hf engine: dtype of its replica (None: model.params_dtype). bfloat16 under an fp32
    trainer gives CPU runs a GPU-sized train/rollout mismatch."""
    group_size: int = 8
    """Responses per prompt (G)."""
    prompts_per_step: int = 16
    """Groups per training step (over all data-parallel ranks)."""
    temperature: float = 1.0
    """Sampling temperature."""
    top_p: float = 1.0
    """Nucleus sampling mass."""
    top_k: int = 0
    """Top-k sampling (0: off)."""
    max_new_tokens: int = 8
    """Longest response."""
    return_routed_experts: bool = True
    """Ask the engine for routed experts (needed by R3 and routing diagnostics)."""
    max_sampling_rounds: int = 4
    """Dynamic sampling: draw at most this many rounds of prompts per step."""
    max_staleness: int = 0
    """Asynchronous rollouts: a sample may come from weights up to this many versions older
    than the ones it trains (0: synchronous; k: the first rounds of the next k steps are
    generated while a step trains; sglang, or hf in a thread beside the trainer; see
    megatron_rl.train.async_rollouts)."""
    partial: bool = False
    """Partial rollouts (with max_staleness > 0): weights are pushed while requests run, the
    servers paused around the push (partial_mode), and responses continue under the new
    weights, each token tagged with its version; false: a push waits for the requests in flight."""
    partial_mode: Literal["abort", "retract", "in_place"] = "abort"
    """SGLang's /pause_generation mode at a push: abort (a response goes on as a new request from
    its tokens: every token's log-prob and routes from the pass that produced it), retract (the
    server recomputes the KV under the new weights; the earlier positions' routes returned are
    the recompute's) or in_place (the old KV is kept: later tokens come from new weights over it).
    The hf engine: in_place keeps the KV, the others compute it again (routes of the earlier
    positions stay the first pass's)."""
    stale_samples: Literal["drop", "regenerate"] = "drop"
    """A group with a sample older than max_staleness versions when its step trains (a batch from
    a checkpoint of a deeper pipeline): drop it and draw fresh prompts (counted), or ask its
    prompts again under the current weights."""
    sglang: SGLangConfig = field(default_factory=SGLangConfig)
    """SGLang servers and weight sync (used when ``engine`` is sglang)."""
    placement: Literal["disaggregated", "colocated"] = "disaggregated"
    """disaggregated: the rollout engine keeps its memory (SGLang servers on GPUs of their own;
    the HF replica beside the trainer); colocated: the trainer and the engine (SGLang or hf)
    take turns on the same devices, each moving its memory out while the other works
    (``megatron_rl.train.colocate``; the servers need ``--enable-memory-saver``)."""
    env: EnvConfig = field(default_factory=EnvConfig)
    """Multi-turn rollouts against an environment (``env.name``; None: one response per prompt)."""


def check_rollout_section(r: RolloutConfig) -> None:
    """The section's own rules, the SGLang subsection's when it is the engine, and the
    asynchronous rollouts' (``rollout.max_staleness``)."""
    require(r.group_size >= 1, "rollout.group_size", "must be >= 1")
    require(r.prompts_per_step >= 1, "rollout.prompts_per_step", "must be >= 1")
    require(r.max_new_tokens >= 1, "rollout.max_new_tokens", "must be >= 1")
    require(r.temperature >= 0, "rollout.temperature", "must be >= 0")
    require(r.max_sampling_rounds >= 1, "rollout.max_sampling_rounds", "must be >= 1")
    if r.engine == "sglang":
        check_sglang_section(r.sglang)
    check_staleness(r)
    check_placement(r)


def check_placement(r: RolloutConfig) -> None:
    """Rules of ``rollout.placement: colocated``: an engine with memory of its own to release,
    turns that never overlap, and weights the trainer pushes after every resume."""
    if r.placement != "colocated":
        return
    if r.engine == "megatron":
        raise ConfigError("rollout.placement: colocated with rollout.engine=megatron: the embedded engine generates "
                          "with the trainer's own model, so there is nothing to take turns with; use sglang or hf")
    if r.max_staleness > 0:
        raise ConfigError(f"rollout.placement: colocated with rollout.max_staleness={r.max_staleness}: the trainer and "
                          "the engine take turns on the same GPUs, so no batch can be generated while a step trains; "
                          "use rollout.max_staleness=0")
    if r.engine == "sglang" and r.sglang.weight_sync == "none":
        raise ConfigError("rollout.placement: colocated with rollout.sglang.weight_sync=none: the servers' weights "
                          "are released between generations and must be pushed again before each one")


def check_staleness(r: RolloutConfig) -> None:
    """Rules of ``rollout.max_staleness`` and ``rollout.partial`` (see ``megatron_rl.train.async_rollouts``)."""
    k = r.max_staleness
    if not 0 <= k <= MAX_STALENESS:
        raise ConfigError(f"rollout.max_staleness: {k} is outside [0, {MAX_STALENESS}] (0: synchronous; k: batches "
                          "of the next k steps generated while a step trains, each held in memory and checkpoints)")
    if r.partial_mode != "abort" and not r.partial:
        raise ConfigError(f"rollout.partial_mode: {r.partial_mode} without rollout.partial=true: nothing is paused")
    if k == 0:
        if r.partial:
            raise ConfigError("rollout.partial: true with rollout.max_staleness=0: the synchronous loop pushes weights "
                              "with nothing in flight, so there is nothing to continue; set rollout.max_staleness >= 1")
        return
    if r.partial and r.engine == "megatron":
        raise ConfigError("rollout.partial: true with rollout.engine=megatron: the embedded engine generates with the "
                          "trainer's own model, it cannot pause and take new weights mid-response; use sglang or hf")
    if r.engine == "megatron":
        raise ConfigError(f"rollout.max_staleness: {k} with rollout.engine=megatron: the embedded engine generates "
                          "with the trainer's own model, which the update changes, so it is synchronous only "
                          "(rollout.max_staleness=0)")
    if r.engine == "hf" and r.env.name is not None:
        raise ConfigError(f"rollout.max_staleness: {k} with rollout.engine=hf and rollout.env: the hf engine's "
                          "multi-turn rollouts exchange trajectories between model-parallel peers at every turn, "
                          "which a background thread cannot; use rollout.engine=sglang")
    if r.engine == "hf":
        return
    if r.sglang.weight_sync == "none":
        raise ConfigError(f"rollout.max_staleness: {k} with rollout.sglang.weight_sync=none: the servers' weights "
                          "are managed elsewhere, so no sample's version can be held to the bound")
