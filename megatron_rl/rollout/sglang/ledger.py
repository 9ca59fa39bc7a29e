"""The SGLang client's exactly-once bookkeeping: the ledger of a batch's results, the
client's counters, and the errors a ``generate`` call ends with.

A batch's samples are keyed by index; :class:`SampleLedger` keeps the first result of each
and counts the duplicates, and hands the results back only when every index holds one.
Owns no HTTP, no retry policy and no server choice (:mod:`~megatron_rl.rollout.sglang.client`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from megatron_rl.rollout.sglang.wire import GenerateResult


class RolloutRequestError(RuntimeError):
    """A sample could not be generated within the retry budget, or a request was refused."""


class StaleWeightVersionError(RolloutRequestError):
    """A server kept answering with another weight version than the trainer expects."""


class ServersBehindError(StaleWeightVersionError):
    """Servers answered with weights older than expected (restarted); a re-push can fix them.

    Attributes:
        behind: URL -> the weight version it served.
        partial: sample index -> result, for the samples that did get a current answer.
    """

    def __init__(self, message: str, behind: dict[str, str], partial: dict[int, GenerateResult]) -> None:
        super().__init__(message)
        self.behind, self.partial = behind, partial


class ServerHungError(RolloutRequestError):
    """A server holds requests but does not answer ``/health`` (stopped or wedged)."""


@dataclass
class ClientStats:
    """Counters of one client (reset per ``generate`` call by the engine)."""

    attempts: int = 0
    """``/generate`` attempts sent."""
    retries: dict[str, int] = field(default_factory=dict)
    """Failed attempts by cause (connection, timeout, http_5xx, malformed_json, bad_payload, ...)."""
    duplicates_dropped: int = 0
    """Results that arrived for a sample already accounted for."""
    timeouts: int = 0
    """Attempts abandoned for time: ``request_timeout_s`` passed, or the server was hung."""
    resyncs: int = 0
    """Engine: weight re-pushes to servers that came back behind the trainer's version."""
    continued: int = 0
    """Responses a pause in mode ``abort`` cut short, asked to go on as new requests (partial rollouts)."""
    max_in_flight: int = 0
    """Most requests in flight at once."""
    per_server: dict[str, int] = field(default_factory=dict)
    """Successful responses by server URL."""

    def add(self, other: "ClientStats") -> None:
        """Accumulate ``other`` into these counters."""
        self.attempts += other.attempts
        for cause, n in other.retries.items():
            self.retries[cause] = self.retries.get(cause, 0) + n
        self.duplicates_dropped += other.duplicates_dropped
        self.timeouts += other.timeouts
        self.resyncs += other.resyncs
        self.continued += other.continued
        self.max_in_flight = max(self.max_in_flight, other.max_in_flight)
        for url, n in other.per_server.items():
            self.per_server[url] = self.per_server.get(url, 0) + n


class SampleLedger:
    """Results of one batch keyed by sample index: first result wins, the end checks all."""

    def __init__(self, batch: str, count: int) -> None:
        self.batch, self.count = batch, count
        self._results: dict[int, Any] = {}
        self.duplicates = 0

    def add(self, index: int, result: Any) -> bool:
        """Record ``result`` for ``index``; False (and counted) when it is a duplicate."""
        if not 0 <= index < self.count:
            raise RolloutRequestError(f"batch {self.batch}: result for unknown sample {index}")
        if index in self._results:
            self.duplicates += 1
            return False
        self._results[index] = result
        return True

    def results(self) -> list[Any]:
        """Every sample's result in index order; raises unless each is present exactly once."""
        missing = [i for i in range(self.count) if i not in self._results]
        if missing:
            raise RolloutRequestError(
                f"batch {self.batch}: {len(missing)} of {self.count} samples have no result: {missing[:20]}"
            )
        return [self._results[i] for i in range(self.count)]

    def received(self) -> dict[int, Any]:
        """The results so far, by sample index."""
        return dict(self._results)
