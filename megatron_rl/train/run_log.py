"""Where a run's rows go: the metrics file, the trackers and the history the run returns.

Owns :class:`RunLog`: one row per step (step 0: the evaluation before any update), each
value a float, written by rank 0 to ``<run_dir>/metrics.jsonl`` and TensorBoard
(:class:`~megatron_rl.train.metrics.MetricsLogger`), handed to W&B and MLflow
(``train.sinks``) with each HF checkpoint, and kept for the caller; what every step's row
carries besides the step's own metrics (node 0's GPU telemetry, the SGLang client's
counters); and the progress bars, drawn by rank 0. Does not own computing or reducing a
step's metrics (the trainer and the modules it calls reduce each once per step).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

import torch

from megatron_rl.train.metrics import MetricsLogger, progress

if TYPE_CHECKING:
    from pathlib import Path

    from megatron_rl.telemetry import GpuTelemetry
    from megatron_rl.train.sinks import Trackers


class RunLog:
    """A run's rows (construct and use on every rank together; rank 0 writes).

    Args:
        run_dir: the run directory.
        rank0: whether this is global rank 0.
        show_progress: draw progress bars (``train.progress``), on rank 0.
        engine: the rollout engine (its client's counters, for SGLang).
        telemetry: node 0's GPU telemetry on rank 0, else None.
    """

    def __init__(self, run_dir: str | Path, rank0: bool, show_progress: bool, engine,
                 telemetry: GpuTelemetry | None) -> None:
        self.run_dir, self.rank0, self.show_progress = run_dir, rank0, show_progress
        self.engine, self.telemetry = engine, telemetry
        self.history: list[dict] = []
        """Every row logged by this run, as floats."""
        self._logger: MetricsLogger | None = None
        self._trackers: Trackers | None = None

    @contextlib.contextmanager
    def open(self, trackers: Trackers | None, resume_step: int | None) -> Iterator[RunLog]:
        """The metrics file, continued after ``resume_step`` (None: afresh), for the run's rows."""
        with MetricsLogger(self.run_dir, enabled=self.rank0, resume_from_step=resume_step) as logger:
            self._logger, self._trackers = logger, trackers
            yield self

    def log(self, step: int, metrics: dict[str, torch.Tensor]) -> None:
        """One row: to the metrics file, the trackers and the history."""
        row = {k: float(v) for k, v in metrics.items()}
        self.history.append({"step": step, **row})
        self._logger.log(step, row)
        if self._trackers is not None:
            self._trackers.log(step, row)

    def log_checkpoint(self, step: int, path: Path) -> None:
        """An HF checkpoint written at ``step``, for the trackers (as a reference)."""
        if self._trackers is not None:
            self._trackers.log_checkpoint(step, path)

    def engine_metrics(self) -> dict[str, torch.Tensor]:
        """The SGLang client's counters since the last call (``sglang/attempts``, ``retries``,
        ``duplicates``, ``resyncs``, ``timeouts``), the same on every rank: a collective the
        engine reduces over the world itself. Nothing for the local engines."""
        step_metrics = getattr(self.engine, "step_metrics", None)
        return step_metrics() if step_metrics is not None else {}

    def step_extras(self) -> dict[str, torch.Tensor]:
        """Collective: what every step's row carries besides the step's metrics."""
        extras = {}
        if self.telemetry is not None:
            extras.update({k: torch.tensor(v) for k, v in self.telemetry.sample().items()})
        extras.update(self.engine_metrics())
        return extras

    def progress(self, iterable: Iterable, desc: str):
        """A progress bar over ``iterable`` (silent off rank 0 or with ``train.progress`` off)."""
        return progress(iterable, desc, self.rank0 and self.show_progress)

    def close(self) -> None:
        """Stop the telemetry."""
        if self.telemetry is not None:
            self.telemetry.close()
