"""One sample's request across pauses: a response that a weight push interrupts goes on as a new request.

Shape legend: P prompt tokens, n tokens generated so far, L MoE layers, K top-K.

With partial rollouts (``rollout.partial``) the trainer pauses the servers at every weight push
(``/pause_generation``), pushes, and continues them (``/continue_generation``). In mode
``retract`` or ``in_place`` a request goes on inside the server and its one response says which
version produced which tokens (``meta_info.weight_versions``). In mode ``abort`` the server
ends every running request with the tokens it has (``finish_reason`` abort), and the client
asks for the rest as a new request: the prompt followed by those tokens, ``max_new_tokens``
less what it has, and routes from the first position the earlier piece did not forward
(``routed_experts_start_len = P + n - 1``). :class:`ContinuedRequest` is that state; its
:meth:`~ContinuedRequest.result` stitches the pieces into one result whose tokens, log-probs,
versions and routes each come from the request (and so the engine pass and the weights) that
produced them, as multi-turn trajectories stitch their turns (``rollout/trajectory.py``).

Owns no HTTP (the client sends each piece, :mod:`~megatron_rl.rollout.sglang.client`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Sequence

import torch

from megatron_rl.rollout.engine import SamplingParams
from megatron_rl.rollout.sglang.wire import GenerateResult


def is_behind(served: str, expected: str) -> bool:
    """Whether a server at ``served`` lacks weights the trainer at ``expected`` pushed: an
    older number, or a launch tag such as SGLang's "default" (a restarted server). A newer
    number means another writer, which a re-push would fight, so it is not "behind"."""
    if not expected.lstrip("-").isdigit():
        return False
    return not served.lstrip("-").isdigit() or int(served) < int(expected)


def piece_seed(seed: int | None, generated: int) -> int | None:
    """The ``sampling_seed`` of the piece that continues after ``generated`` tokens (the first
    piece keeps the sample's seed): fixed by the sample's seed and where it was cut."""
    if seed is None or generated == 0:
        return seed
    return (seed * 1_000_033 + generated * 7_919) % 2**31


@dataclass
class ContinuedRequest:
    """A sample's request and what its earlier pieces produced (see the module docstring)."""

    prompt: list[int]
    """The sample's prompt (P tokens)."""
    params: SamplingParams
    """Its sampling parameters."""
    start_len: int = 0
    """Its ``routed_experts_start_len``."""
    seed: int | None = None
    """Its ``sampling_seed``."""
    output_ids: list[int] = field(default_factory=list)
    """Tokens the earlier pieces produced (n)."""
    logprobs: list[torch.Tensor] = field(default_factory=list)
    """Their log-probs, one tensor per piece."""
    versions: list[str] = field(default_factory=list)
    """The weight version of each of those tokens."""
    routes: list[torch.Tensor] = field(default_factory=list)
    """Per piece, the routes of the positions it forwarded first."""
    pieces: int = 0
    """Pieces that ended in an abort (the next one continues them)."""

    @property
    def piece_prompt(self) -> list[int]:
        """The next piece's ``input_ids``: the prompt and the tokens so far."""
        return self.prompt + self.output_ids

    @property
    def piece_start(self) -> int:
        """The next piece's ``routed_experts_start_len``: the first position no piece forwarded."""
        return self.start_len if not self.output_ids else len(self.prompt) + len(self.output_ids) - 1

    @property
    def piece_params(self) -> SamplingParams:
        """The next piece's sampling parameters: ``max_new_tokens`` less the tokens so far."""
        return dataclasses.replace(self.params, max_new_tokens=self.params.max_new_tokens - len(self.output_ids))

    @property
    def piece_seed(self) -> int | None:
        """The next piece's ``sampling_seed``."""
        return piece_seed(self.seed, len(self.output_ids))

    def continue_after(self, aborted: GenerateResult) -> GenerateResult | None:
        """Keep what an aborted piece produced and return None: the next piece continues from
        there. A piece that had ended anyway (the abort lets one more decode step run,
        ``scheduler.py:5800-5812``: its last token a stop token, or ``max_new_tokens`` reached)
        is the sample's last: its result is returned, ending as it would have."""
        total = len(self.output_ids) + len(aborted.output_ids)
        if aborted.output_ids and aborted.output_ids[-1] in self.params.stop_token_ids:
            return self.result(dataclasses.replace(aborted, finish_reason="stop"))
        if total >= self.params.max_new_tokens:
            return self.result(dataclasses.replace(aborted, finish_reason="length"))
        self._keep(aborted)
        self.pieces += 1
        return None

    def _keep(self, piece: GenerateResult) -> None:
        self.output_ids.extend(piece.output_ids)
        self.logprobs.append(piece.output_logprobs)
        self.versions.extend(piece.token_versions if piece.token_versions is not None
                             else [str(piece.weight_version)] * len(piece.output_ids))
        if piece.routed_experts is not None:
            self.routes.append(piece.routed_experts)

    def result(self, last: GenerateResult) -> GenerateResult:
        """The sample's result: the earlier pieces followed by ``last`` (returned as is when there
        were none), its meta counting the pieces in ``pieces``."""
        if not self.pieces:
            return last
        self._keep(last)
        self.pieces += 1
        routes = torch.cat(self.routes) if last.routed_experts is not None else None
        meta = {**last.meta, "pieces": self.pieces, "prompt_tokens": len(self.prompt),
                "completion_tokens": len(self.output_ids)}
        return GenerateResult(rid=last.rid, output_ids=list(self.output_ids), output_logprobs=torch.cat(self.logprobs),
                              finish_reason=last.finish_reason, weight_version=last.weight_version,
                              token_versions=list(self.versions), routed_experts=routes, meta=meta)


def behind_versions(result: GenerateResult, expected: str, *, partial: bool) -> str | None:
    """The version that makes ``result`` stale for a trainer that pushed ``expected`` (None: it
    is not): without partial rollouts the one version must be ``expected``; with them no token
    may come from weights older than ``expected`` (newer ones are pushes made since)."""
    if not partial:
        return None if result.weight_version == expected else str(result.weight_version)
    served: Sequence[str] = result.token_versions or [str(result.weight_version)]
    return next((v for v in served if is_behind(v, expected)), None)
