"""The rollout-engine interface: what every engine (embedded, hf, SGLang) takes and returns.

Shape legend: N prompt+response tokens of a sample, L MoE layers, K top-K.

An engine turns prompts into :class:`RolloutSample` values carrying the generated tokens,
their log-probabilities under the distribution the engine sampled them from
(``log_softmax(logits / T)`` at the sample's temperature, over the whole vocabulary: top-p and
top-k are not renormalized in, see ``megatron_rl.rollout.sampling``), and the experts each forwarded position
was routed to in SGLang's layout (``[N - 1, L, K]``: every prompt+response position except
the last, which no engine forwards; with ``routes_from`` only the positions from there on,
as SGLang's ``routed_experts_start_len``). R3 replays those routes; train-versus-rollout
diagnostics compare the log-probs.

A multi-turn trajectory (``megatron_rl.rollout.multiturn``) is a :class:`RolloutSample`
too: its "response" is everything after the first prompt (the model's turns and what the
environment wrote between them), ``generated_mask`` says which of those tokens the policy
generated, and a single-turn sample is the special case where all of them were.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Protocol, Sequence

import torch


@dataclass(kw_only=True)
class SamplingParams:
    """Generation controls, as SGLang's ``sampling_params``."""

    temperature: float = 1.0
    """Softmax temperature; 0 is greedy."""
    top_p: float = 1.0
    """Nucleus sampling mass."""
    top_k: int = 0
    """Keep only the k most likely tokens (0: off)."""
    max_new_tokens: int = 16
    """Generation stops after this many tokens ("length")."""
    stop_token_ids: tuple[int, ...] = ()
    """Generation stops after any of these tokens ("stop")."""


@dataclass
class RolloutSample:
    """One generated response."""

    prompt_ids: list[int]
    """Prompt token ids."""
    output_ids: list[int]
    """Generated token ids (including the stop token, when one was produced)."""
    output_logprobs: torch.Tensor
    """``[len(output_ids)]`` fp32 log-probs of the generated tokens under the engine's policy
    at ``temperature`` (NaN at tokens an environment wrote: the policy never sampled them)."""
    finish_reason: Literal["stop", "length", "abort"]
    """Why generation ended ("length": cut at a length limit, for the overlong filter; "abort": a
    local engine's decoding stopped early, the CPU SGLang stand-in's pauses, never trained)."""
    weight_version: int
    """Version of the weights that generated it: the oldest version among its tokens (with
    partial rollouts a response may continue under newer weights; ``token_versions``)."""
    routed_experts: torch.Tensor | None = None
    """``[N - 1, L, K]`` expert ids per forwarded position (compact integer dtype), each row from
    the engine pass that computed that position first (the one that produced the next token)."""
    token_versions: torch.Tensor | None = None
    """``[len(output_ids)]`` int64 weight version that produced each output token (an
    environment's tokens: the version of the model turn before them); None: every token was
    produced by ``weight_version``."""
    temperature: float = 1.0
    """The sampling temperature the tokens were drawn at (``output_logprobs`` are of
    ``softmax(logits / temperature)``; 0: greedy, whose log-probs are of the raw logits)."""
    routed_gates: torch.Tensor | None = None
    """``[N - 1, L, K]`` fp32 gate weights the engine combined those experts with (hf and
    megatron engines; SGLang returns none): what R3w replays."""
    routed_probs: torch.Tensor | None = None
    """``[N - 1, L, K]`` fp32 router probabilities of those experts (softmax over all E), for the
    mismatch breakdown's router KL (hf and megatron engines)."""
    truncation_logratio: torch.Tensor | None = None
    """``[len(output_ids)]`` fp32 ``log pi_top-p/top-k(y) - log pi_T(y) = -log(kept mass)`` at each
    generated token: what the objective leaves out by scoring the whole T-scaled distribution
    (local engines, when top-p or top-k truncates; None otherwise)."""
    meta: dict = field(default_factory=dict)
    """Engine-specific extras."""
    generated_mask: torch.Tensor | None = None
    """``[len(output_ids)]`` bool: True where the policy generated the token, False where an
    environment or tool wrote it; None: every output token was generated (one turn)."""
    turns: list[tuple[int, int]] | None = None
    """``(start, end)`` in ``output_ids`` of each model turn's generated tokens (None: one turn)."""
    turn_rewards: list[float] | None = None
    """The reward the environment gave after each model turn (None: no environment)."""
    end_reason: str | None = None
    """Why a multi-turn trajectory ended (``megatron_rl.rollout.trajectory.END_REASONS``)."""

    @property
    def tokens(self) -> torch.Tensor:
        """Prompt + response ids as one int64 tensor."""
        return torch.tensor(self.prompt_ids + self.output_ids, dtype=torch.int64)

    def temperatures(self) -> torch.Tensor:
        """``[len(output_ids)]`` fp32 sampling temperature of each output token (one per sample today;
        per token is the general form every pass takes)."""
        return torch.full((len(self.output_ids),), float(self.temperature), dtype=torch.float32)

    def versions(self) -> torch.Tensor:
        """``[len(output_ids)]`` int64 weight version of each output token."""
        if self.token_versions is None:
            return torch.full((len(self.output_ids),), self.weight_version, dtype=torch.int64)
        return self.token_versions

    def loss_mask(self) -> torch.Tensor:
        """``[len(output_ids)]`` bool: the tokens the policy generated (the ones a loss may see)."""
        if self.generated_mask is None:
            return torch.ones(len(self.output_ids), dtype=torch.bool)
        return self.generated_mask


class RolloutEngine(Protocol):
    """What the trainer needs from a rollout engine."""

    weight_version: int
    """Version of the weights the engine currently serves."""

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams, *, return_routed_experts: bool, seed: int,
        routes_from: Sequence[int] | None = None,
    ) -> list[RolloutSample]:
        """Generate one response per prompt (repeat a prompt for a group).

        Args:
            prompts: token ids of each prompt (of this data-parallel rank).
            params: sampling parameters.
            return_routed_experts: also return SGLang-layout routes ``[N - 1, L, K]`` per sample.
            seed: generator seed; combine the step and round into it for reproducibility.
            routes_from: per prompt, the first position whose routes come back (SGLang's
                ``routed_experts_start_len``, in ``[0, len(prompt)]``): the routes are then
                ``[N - 1 - routes_from, L, K]``. A multi-turn caller asks only for the positions
                no earlier turn covered. None: 0 for every prompt.

        Engines say in their own docstring over which ranks the call is collective.
        """
        ...

    def update_weights(self, version: int) -> None:
        """Serve the trainer's current weights from now on, tagged ``version``."""
        ...

    def close(self) -> None:
        """Release connections and transports (collective, like ``update_weights``)."""
        ...


def check_routes_from(prompts: Sequence[Sequence[int]], routes_from: Sequence[int] | None) -> list[int]:
    """``routes_from`` (default 0 each), each in ``[0, len(prompt)]`` as SGLang requires (error names the sample)."""
    if routes_from is None:
        return [0] * len(prompts)
    if len(routes_from) != len(prompts):
        raise ValueError(f"routes_from has {len(routes_from)} entries for {len(prompts)} prompts")
    for i, (prompt, start) in enumerate(zip(prompts, routes_from)):
        if not 0 <= start <= len(prompt):
            raise ValueError(f"sample {i}: routes_from {start} is outside [0, {len(prompt)}] (the prompt's length)")
    return list(routes_from)
