"""What a user watches during a run: the metrics file, TensorBoard, plots, a summary table.

Owns :class:`MetricsLogger` (``<run_dir>/metrics.jsonl`` plus TensorBoard scalars under
``<run_dir>/tensorboard``, resumable without duplicate steps), :func:`read_metrics`,
:func:`plot_run` (PNG curves), :func:`summary_table` and :func:`progress` (a tqdm bar that is
silent off the logging rank). The phase breakdown is measured in ``train.phases``; W&B and
MLflow are fed by ``train.sinks``.

It does not compute or reduce metrics: callers pass values already reduced once per step
(a tensor is read here with one host sync per value) and choose the logging rank by
creating the logger with ``enabled=True`` on that rank only.

File format: one JSON object per line, ``{"step": int, "<name>": float | int | null}``, in
non-decreasing step order; null stands for a non-finite value, which JSON cannot hold.

Default plots (``DEFAULT_PLOTS``). Each plot is drawn only if a metric matches one of its
keys; keys are ``fnmatch`` patterns, where ``*`` also matches ``/``:

* ``reward``: train reward (``*reward*mean``, ``*reward``) and accuracy (``*accuracy``,
  e.g. ``eval/accuracy``), not the seconds spent scoring (``time/*``, ``perf/*``);
* ``entropy``: policy entropy (``*entropy/mean``, ``*entropy``);
* ``clip_fraction``: shares on a clip bound (``*clip/*_frac``, ``*clip_frac*``);
* ``rspo_gamma``: RSPO router-shift weights (``*gamma/min``, ``*gamma/mean``,
  ``*rspo/min``, ``*rspo/mean``);
* ``time``: seconds per phase, nested phases included, and per step (``time/*``);
* ``phases``: the step's time by phase, stacked, nested phases apart (``perf/phase/*/seconds``,
  which sum to ``time/step``);
* ``memory``: peak memory per phase (``perf/phase/*/host_rss_peak_gib``,
  ``perf/phase/*/cuda_max_allocated_gib``).
"""

from __future__ import annotations

import json
import math
import numbers
import os
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any, TypeVar

import torch
from tqdm import tqdm

from megatron_rl.train.disk_space import reporting_a_full_disk

T = TypeVar("T")

METRICS_FILE = "metrics.jsonl"
"""Name of the metrics file inside a run directory."""


class MetricsLogger:
    """Appends one JSON line per :meth:`log` call and mirrors the scalars to TensorBoard.

    Use as a context manager, or call :meth:`close`. Every call flushes both sinks, so a
    killed run keeps everything it logged before the kill.

    Args:
        run_dir: Directory of the run; created if missing.
        enabled: False makes every method a no-op that touches no file, so every rank can
            create the logger with ``enabled=(rank == 0)``.
        resume_from_step: The last step the restarted run keeps. Lines with a larger step
            are dropped from the metrics file, and TensorBoard hides earlier events after
            it, so the continued curves have no duplicate steps. None starts afresh: the
            file is emptied and all earlier TensorBoard events are hidden.
        tensorboard: Also write TensorBoard scalars to ``<run_dir>/tensorboard``.

    Attributes:
        path: The metrics file, ``<run_dir>/metrics.jsonl``.
        nonfinite_counts: Per metric name, how many non-finite values were written as null.
    """

    def __init__(
        self,
        run_dir: str | Path,
        *,
        enabled: bool = True,
        resume_from_step: int | None = None,
        tensorboard: bool = True,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / METRICS_FILE
        self.enabled = enabled
        self.nonfinite_counts: dict[str, int] = {}
        self._last_step: int | None = None
        self._file = None
        self._writer = None
        if not enabled:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        kept = [] if resume_from_step is None else _rows_up_to(self.path, resume_from_step)
        with reporting_a_full_disk(self.run_dir, "rewriting the metrics file of the resumed run"):
            _replace_lines(self.path, [line for line, _ in kept])
        self._last_step = kept[-1][1]["step"] if kept else None
        self._file = self.path.open("a", encoding="utf-8")
        if tensorboard:
            # Imported here: tensorboard and protobuf are slow to import and only the
            # logging rank needs them.
            from torch.utils.tensorboard import SummaryWriter

            # TensorBoard hides events a previous attempt wrote at or after purge_step.
            purge_step = 0 if resume_from_step is None else resume_from_step + 1
            self._writer = SummaryWriter(str(self.run_dir / "tensorboard"), purge_step=purge_step)

    def log(self, step: int, metrics: Mapping[str, float | int | torch.Tensor]) -> None:
        """Writes ``{"step": step, **metrics}`` as one line and each value as a scalar.

        Args:
            step: The step the values belong to; never below the last logged step.
            metrics: Python numbers or one-element tensors. Integer values stay integers;
                non-finite values become null in the file (with a warning the first time
                per name) and are written to TensorBoard as they are.

        Raises:
            ValueError: ``step`` goes backwards, a metric is named "step", or a tensor has
                more than one element.
            TypeError: ``step`` is not an int, or a value is not a number or tensor.
            RuntimeError: the logger was closed.
        """
        if not self.enabled:
            return
        if self._file is None:
            raise RuntimeError(f"metrics logger for {self.run_dir} is closed")
        if isinstance(step, bool) or not isinstance(step, int):
            raise TypeError(f"step must be an int, got {type(step).__name__}")
        if self._last_step is not None and step < self._last_step:
            raise ValueError(
                f"step {step} is before the last logged step {self._last_step}; steps must "
                "not go backwards (a restarted run passes resume_from_step)"
            )
        # Convert everything before writing anything, so a bad value leaves no half record.
        values = {name: _to_number(name, value) for name, value in metrics.items()}
        if "step" in values:
            raise ValueError('a metric may not be named "step"; the record already has one')
        record: dict[str, float | int | None] = {"step": step}
        for name, value in values.items():
            finite = not isinstance(value, float) or math.isfinite(value)
            record[name] = value if finite else None
            if not finite:
                self._count_nonfinite(name, value, step)
        with reporting_a_full_disk(self.run_dir, f"writing the metrics of step {step}"):
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()
            if self._writer is not None:
                for name, value in values.items():
                    self._writer.add_scalar(name, value, global_step=step)
                self._writer.flush()
        self._last_step = step

    def close(self) -> None:
        """Closes both sinks; safe to call twice."""
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _count_nonfinite(self, name: str, value: float, step: int) -> None:
        count = self.nonfinite_counts.get(name, 0)
        if count == 0:
            # Once per name: a metric that diverges stays non-finite, and one warning says so.
            warnings.warn(
                f"metric {name!r} is {value} at step {step}; written as null in {self.path}",
                RuntimeWarning,
                stacklevel=3,
            )
        self.nonfinite_counts[name] = count + 1


def _to_number(name: str, value: object) -> float | int:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(
                f"metric {name!r} is a tensor of shape {tuple(value.shape)}; "
                "log one value per name"
            )
        value = value.detach().item()
    if isinstance(value, (bool, numbers.Integral)):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    raise TypeError(f"metric {name!r} must be a number or a tensor, got {type(value).__name__}")


def _parse(path: Path) -> list[tuple[str, dict[str, Any]]]:
    """``(line, row)`` pairs of a metrics file; a cut-off last line is dropped."""
    text = path.read_text(encoding="utf-8")
    lines = text.splitlines()
    parsed = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            # Only a process killed in the middle of a write leaves a last line unfinished.
            if number == len(lines) and not text.endswith("\n"):
                break
            raise ValueError(f"{path}:{number}: not a JSON line") from None
        if not isinstance(row, dict) or not isinstance(row.get("step"), int):
            raise ValueError(f"{path}:{number}: not an object with an integer 'step'")
        parsed.append((line, row))
    return parsed


def _rows_up_to(path: Path, last_step: int) -> list[tuple[str, dict[str, Any]]]:
    if not path.exists():
        return []
    return [(line, row) for line, row in _parse(path) if row["step"] <= last_step]


def _replace_lines(path: Path, lines: Sequence[str]) -> None:
    # Written next to the file, then renamed over it: a crash here leaves the old or the
    # new file, never a truncated one.
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    os.replace(tmp, path)


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """Rows of a metrics file, in file order.

    Args:
        path: The ``metrics.jsonl`` file or the run directory holding it.

    Raises:
        FileNotFoundError: no metrics file.
        ValueError: a line other than an unfinished last one is not a JSON object with
            an integer ``step``; names the file and line.
    """
    path = Path(path)
    if path.is_dir():
        path = path / METRICS_FILE
    return [row for _, row in _parse(path)]


@dataclass(frozen=True, kw_only=True)
class PlotSpec:
    """One figure: every metric matching one of ``keys`` is drawn as a line over steps."""

    title: str
    """Figure title."""
    ylabel: str
    """Y-axis label."""
    keys: tuple[str, ...]
    """``fnmatch`` patterns of metric names, tried in order (``*`` also matches ``/``)."""
    stacked: bool = False
    """Stack the series as areas (parts of a whole); a step a series lacks counts as 0."""
    exclude: tuple[str, ...] = ()
    """``fnmatch`` patterns of names never drawn here, though a key matches them."""

    def matching(self, names: Sequence[str]) -> list[str]:
        """The names drawn, in the order of :attr:`keys`, then of ``names``."""
        return [name for name in dict.fromkeys(n for p in self.keys for n in names if fnmatchcase(n, p))
                if not any(fnmatchcase(name, p) for p in self.exclude)]


DEFAULT_PLOTS: dict[str, PlotSpec] = {
    "reward": PlotSpec(
        title="Train reward and held-out accuracy",
        ylabel="reward / accuracy",
        keys=("*reward*mean", "*reward", "*accuracy"),
        exclude=("time/*", "perf/*"),  # seconds (time/reward), not a reward
    ),
    "entropy": PlotSpec(title="Policy entropy", ylabel="nats", keys=("*entropy/mean", "*entropy")),
    "clip_fraction": PlotSpec(
        title="Clip fractions", ylabel="fraction", keys=("*clip/*_frac", "*clip_frac*")
    ),
    "rspo_gamma": PlotSpec(
        title="RSPO router-shift weight gamma",
        ylabel="gamma",
        keys=("*gamma/min", "*gamma/mean", "*rspo/min", "*rspo/mean"),
    ),
    "mismatch": PlotSpec(title="Train-vs-rollout log-prob gap by cause (train.mismatch.breakdown)",
                         ylabel="nats (mean |gap|)", keys=("mismatch/breakdown/gap/*",), stacked=True),
    "time": PlotSpec(title="Time per phase", ylabel="seconds", keys=("time/*",)),
    "phases": PlotSpec(title="Step time by phase (nested phases apart)", ylabel="seconds",
                       keys=("perf/phase/*/seconds",), stacked=True),
    "memory": PlotSpec(title="Peak memory per phase", ylabel="GiB",
                       keys=("perf/phase/*/host_rss_peak_gib", "perf/phase/*/cuda_max_allocated_gib")),
}
"""The plots :func:`plot_run` draws by default, by file stem."""


def plot_run(
    run_dir: str | Path,
    out_dir: str | Path | None = None,
    plots: Mapping[str, PlotSpec] = DEFAULT_PLOTS,
) -> list[Path]:
    """Draws PNG curves over steps of a run's metrics.

    A plot none of whose keys matches a logged value is skipped. Null (non-finite) values
    leave gaps.

    Args:
        run_dir: The run directory holding ``metrics.jsonl``.
        out_dir: Where to write ``<plot name>.png``; default ``<run_dir>/plots``.
        plots: Plot name -> :class:`PlotSpec`; default :data:`DEFAULT_PLOTS`.

    Returns:
        The written files, in the order of ``plots``.
    """
    # Imported here, and without pyplot, so importing this module stays cheap on every
    # rank and drawing never touches a display or the process-wide backend.
    from matplotlib.figure import Figure

    rows = read_metrics(run_dir)
    out = Path(run_dir) / "plots" if out_dir is None else Path(out_dir)
    names = list(dict.fromkeys(key for row in rows for key in row if key != "step"))
    written = []
    for plot_name, spec in plots.items():
        series = {}
        for key in spec.matching(names):
            points = [(row["step"], row[key]) for row in rows if row.get(key) is not None]
            if points:
                series[key] = points
        if not series:
            continue
        fig = Figure(figsize=(7, 4), layout="constrained")
        ax = fig.subplots()
        if spec.stacked:
            steps = sorted({step for points in series.values() for step, _ in points})
            stacks = [[dict(points).get(step, 0.0) for step in steps] for points in series.values()]
            ax.stackplot(steps, *stacks, labels=_distinct_parts(list(series)))
        else:
            for key, points in series.items():
                steps, values = zip(*points)
                ax.plot(steps, values, marker=".", label=key)
        ax.set_title(spec.title)
        ax.set_xlabel("step")
        ax.set_ylabel(spec.ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
        out.mkdir(parents=True, exist_ok=True)
        path = out / f"{plot_name}.png"
        fig.savefig(path, dpi=100)
        written.append(path)
    return written


def _distinct_parts(names: list[str]) -> list[str]:
    """``names`` without the ``/``-separated parts they all start and end with
    (``perf/phase/<x>/seconds`` -> ``<x>``)."""
    if len(names) < 2:
        return names
    split = [name.split("/") for name in names]
    head = len(os.path.commonprefix(split))
    tail = len(os.path.commonprefix([parts[::-1] for parts in split]))
    short = ["/".join(parts[head : len(parts) - tail]) for parts in split]
    return short if all(short) else names


def summary_table(
    rows: Sequence[Mapping[str, Any]],
    keys: Sequence[str],
    *,
    max_rows: int = 9,
    accuracy_key: str = "eval/accuracy",
    also: Sequence[str] = (),
) -> str:
    """A fixed-width text table of selected metrics at a few steps.

    Shows the first and the last row and evenly spaced rows between them. A value absent
    from a row shows as ``-``, a null (non-finite) one as ``null``. If ``accuracy_key``
    was ever logged, a last line reads ``held-out accuracy (<key>): <first> (step a) ->
    <last> (step b)`` over all rows, not just the shown ones; each metric of ``also`` that
    was logged adds a line ``<key>: <first> (step a) -> <last> (step b)``.

    Args:
        rows: Rows as returned by :func:`read_metrics`, in step order.
        keys: Metric names, one column each after ``step``.
        max_rows: Most rows to show; at least 2.
        accuracy_key: The held-out accuracy metric.
        also: More metrics whose first and last logged values are printed.
    """
    if max_rows < 2:
        raise ValueError(f"max_rows must be >= 2, got {max_rows}")
    if not rows:
        return "(no metrics logged)"
    count = len(rows)
    shown = sorted({round(i * (count - 1) / (max_rows - 1)) for i in range(max_rows)})
    header = ["step", *keys]
    body = [[_cell(rows[i], name) for name in header] for i in shown]
    widths = [max(len(line[c]) for line in [header, *body]) for c in range(len(header))]
    lines = ["  ".join(text.rjust(w) for text, w in zip(line, widths)) for line in [header, *body]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    accuracy = [(r["step"], r[accuracy_key]) for r in rows if r.get(accuracy_key) is not None]
    if accuracy:
        (first_step, first), (last_step, last) = accuracy[0], accuracy[-1]
        lines.append(
            f"held-out accuracy ({accuracy_key}): {first:.3f} (step {first_step}) -> "
            f"{last:.3f} (step {last_step})"
        )
    for key in also:
        logged = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
        if logged:
            (first_step, first), (last_step, last) = logged[0], logged[-1]
            lines.append(f"{key}: {first:.3f} (step {first_step}) -> {last:.3f} (step {last_step})")
    return "\n".join(lines)


def _cell(row: Mapping[str, Any], name: str) -> str:
    if name not in row:
        return "-"
    value = row[name]
    if value is None:
        return "null"
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def progress(iterable_or_total: Iterable[T] | int, desc: str, enabled: bool = True) -> tqdm:
    """A tqdm bar over an iterable, or over ``range(total)`` for an int; silent if not enabled.

    Pass ``enabled=(rank == 0)`` so one process draws. The bar iterates like its input
    and accepts ``set_postfix`` either way.
    """
    if isinstance(iterable_or_total, int):
        iterable_or_total = range(iterable_or_total)
    return tqdm(iterable_or_total, desc=desc, disable=not enabled, dynamic_ncols=True)
