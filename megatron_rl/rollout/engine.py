"""The rollout-engine interface: what every engine (embedded, SGLang) takes and returns.

Shape legend: N prompt+response tokens of a sample, L MoE layers, K top-K.

An engine turns prompts into :class:`RolloutSample` values carrying the generated tokens,
their log-probabilities under the engine's policy, and the experts each forwarded position
was routed to in SGLang's layout (``[N - 1, L, K]``: every prompt+response position except
the last, which no engine forwards). R3 replays those routes; train-versus-rollout
diagnostics compare the log-probs.
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
    """``[len(output_ids)]`` fp32 log-probs of the generated tokens under the engine's policy."""
    finish_reason: Literal["stop", "length"]
    """Why generation ended."""
    weight_version: int
    """Version of the weights that generated it."""
    routed_experts: torch.Tensor | None = None
    """``[N - 1, L, K]`` expert ids per forwarded position (compact integer dtype)."""
    meta: dict = field(default_factory=dict)
    """Engine-specific extras."""

    @property
    def tokens(self) -> torch.Tensor:
        """Prompt + response ids as one int64 tensor."""
        return torch.tensor(self.prompt_ids + self.output_ids, dtype=torch.int64)


class RolloutEngine(Protocol):
    """What the trainer needs from a rollout engine."""

    weight_version: int
    """Version of the weights the engine currently serves."""

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams, *, return_routed_experts: bool, seed: int
    ) -> list[RolloutSample]:
        """Generate one response per prompt (repeat a prompt for a group).

        Args:
            prompts: token ids of each prompt (of this data-parallel rank).
            params: sampling parameters.
            return_routed_experts: also return SGLang-layout routes ``[N - 1, L, K]`` per sample.
            seed: generator seed; combine the step and round into it for reproducibility.

        Engines say in their own docstring over which ranks the call is collective.
        """
        ...

    def update_weights(self, version: int) -> None:
        """Serve the trainer's current weights from now on, tagged ``version``."""
        ...

    def close(self) -> None:
        """Release connections and transports (collective, like ``update_weights``)."""
        ...
