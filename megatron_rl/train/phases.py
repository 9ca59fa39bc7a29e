"""Where an RL step's time and memory go: named phases, the step's clock, and the torch
profiler on chosen steps.

Owns :func:`phase_timer` (a named phase: its time and peak memory in the step's metrics, a
``torch.profiler.record_function`` range, and on CUDA an NVTX range for Nsight Systems),
:class:`StepWatch` (one step's wall time, the time no phase covers, and the profiler on the
steps of ``profile.steps``) and :func:`phase_table` (the breakdown as text).

Metrics, one value per step (phases run on every rank in lockstep; rank 0's are logged):

* ``time/<phase>``: seconds in the phase, the phases nested in it included; a phase entered
  several times in a step adds up;
* ``time/step``: the step's wall time, from its first rollout to the end of its checkpoint;
* ``perf/phase/<phase>/seconds``: seconds in the phase outside the phases nested in it (the
  ``reward`` phase runs inside ``rollout``); with ``perf/phase/other/seconds``, the step's time
  outside every phase, they sum to ``time/step``;
* ``perf/phase/<phase>/host_rss_peak_gib``: this process's peak resident memory during the
  phase (Linux: the kernel's high-water mark, reset as the phase starts; absent elsewhere);
  on CUDA also ``cuda_max_allocated_gib`` and ``cuda_max_reserved_gib`` (torch's peak
  statistics, reset likewise); ``perf/step/<kind>``: the same over the whole step.

Open phases are kept per thread (a context variable), so a phase in a background thread
never counts against the training thread's step. Does not own which phases exist (their
callers name them) nor logging the values.
"""

from __future__ import annotations

import contextlib
import functools
import re
import time
from collections.abc import Iterator, Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from megatron_rl.sections.logging import ProfileConfig

_GIB = float(1 << 30)
_PHASE_SECONDS = re.compile(r"perf/phase/(.+)/seconds")


@dataclass
class _Frame:
    """An open phase, or the step itself (the outermost frame)."""

    start: float
    """``time.perf_counter()`` when it opened."""
    nested_s: float = 0.0
    """Seconds spent in the phases directly inside it."""
    peaks: dict[str, int] = field(default_factory=dict)
    """Peak bytes seen so far, by memory kind (``host_rss_peak_gib``, ...)."""

    def absorb(self, peaks: Mapping[str, int]) -> None:
        for kind, value in peaks.items():
            self.peaks[kind] = max(self.peaks.get(kind, 0), value)


_OPEN: ContextVar[tuple[_Frame, ...]] = ContextVar("megatron_rl_open_phases", default=())


@contextlib.contextmanager
def phase_timer(metrics: dict[str, Any], phase: str) -> Iterator[None]:
    """Measures the ``with`` block as phase ``phase`` of the step whose ``metrics`` it adds to
    (see the module docstring for the keys), inside profiler and NVTX ranges ``phase/<phase>``.

    On CUDA the device is synchronized at both ends: kernels run asynchronously, and the
    wall clock would otherwise charge them to whichever later phase waits for them. The
    memory peaks are reset as the phase starts; the enclosing phase keeps the peak it had
    seen before, so it still reports the larger of its own and its nested phases' peaks.
    """
    outer = _OPEN.get()
    _synchronize()
    if outer:
        outer[-1].absorb(_read_peaks())
    _reset_peaks()
    frame = _Frame(start=time.perf_counter())
    token = _OPEN.set((*outer, frame))
    nvtx = _nvtx_push(f"phase/{phase}")
    try:
        with torch.profiler.record_function(f"phase/{phase}"):
            yield
    finally:
        _synchronize()
        elapsed = time.perf_counter() - frame.start
        frame.absorb(_read_peaks())
        _OPEN.reset(token)
        _nvtx_pop(nvtx)
        if outer:
            outer[-1].nested_s += elapsed
            outer[-1].absorb(frame.peaks)
        metrics[f"time/{phase}"] = metrics.get(f"time/{phase}", 0.0) + elapsed
        key = f"perf/phase/{phase}/seconds"
        metrics[key] = metrics.get(key, 0.0) + elapsed - frame.nested_s
        for kind, value in frame.peaks.items():
            key = f"perf/phase/{phase}/{kind}"
            metrics[key] = max(metrics.get(key, 0.0), value / _GIB)


class StepWatch:
    """Times one RL step at a time and runs the torch profiler on the chosen ones.

    Call :meth:`begin` first in a step and :meth:`end` last: the phases entered between them
    in this thread are the step's. Every rank profiles the chosen steps and writes its own
    Chrome trace, ``<run_dir>/profile/step_NNNNNN/rank<r>.pt.trace.json`` (Perfetto opens it;
    ``tensorboard --logdir <run_dir>/profile`` shows it with the PyTorch profiler plugin).

    Args:
        profile: which steps to profile and what to record.
        run_dir: the run directory.
        rank: this process's global rank (names its trace; rank 0 prints where traces go).
    """

    def __init__(self, profile: ProfileConfig, run_dir: str | Path, rank: int) -> None:
        self.profile, self.run_dir, self.rank = profile, Path(run_dir), rank
        self._step: _Frame | None = None
        self._nvtx = False
        self._profiler: torch.profiler.profile | None = None

    def begin(self, step: int) -> None:
        """Starts the step's clock (and the profiler when ``step`` is chosen)."""
        if step in self.profile.steps:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._profiler = torch.profiler.profile(
                activities=activities, record_shapes=self.profile.record_shapes, with_stack=self.profile.with_stack)
            self._profiler.start()
        _synchronize()
        _reset_peaks()
        self._step = _Frame(start=time.perf_counter())
        # Set, not stacked: whatever a step that raised left open is dropped here.
        _OPEN.set((self._step,))
        self._nvtx = _nvtx_push(f"step {step}")

    def end(self, step: int, metrics: dict[str, Any]) -> None:
        """Adds ``time/step``, ``perf/phase/other/seconds`` and ``perf/step/<kind>`` to
        ``metrics``; writes the trace of a profiled step."""
        _synchronize()
        frame, self._step = self._step, None
        if frame is None:
            raise RuntimeError(f"StepWatch.end({step}) without begin")
        elapsed = time.perf_counter() - frame.start
        frame.absorb(_read_peaks())
        _OPEN.set(())
        _nvtx_pop(self._nvtx)
        metrics["time/step"] = elapsed
        metrics["perf/phase/other/seconds"] = elapsed - frame.nested_s
        for kind, value in frame.peaks.items():
            metrics[f"perf/step/{kind}"] = value / _GIB
        if self._profiler is not None:
            profiler, self._profiler = self._profiler, None
            profiler.stop()
            path = self.run_dir / "profile" / f"step_{step:06d}" / f"rank{self.rank}.pt.trace.json"
            path.parent.mkdir(parents=True, exist_ok=True)
            profiler.export_chrome_trace(str(path))
            if self.rank == 0:
                print(f"profile of step {step}: {path.parent} (one trace per rank)", flush=True)


def phase_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """The run's phase breakdown as a fixed-width table: per phase, the mean seconds per step
    outside nested phases, its share of the mean step time and the largest peak of each
    memory kind over the steps; then ``other`` and the step itself. Rows are
    ``read_metrics``'s; only those with ``time/step`` (RL steps) count."""
    steps = [row for row in rows if row.get("time/step") is not None]
    if not steps:
        return "(no step timed)"
    phases = list(dict.fromkeys(match.group(1) for row in steps for key in row
                                if (match := _PHASE_SECONDS.fullmatch(key)) and match.group(1) != "other"))
    kinds = list(dict.fromkeys(key.removeprefix("perf/step/") for row in steps for key in row
                               if key.startswith("perf/step/")))
    mean_step = sum(row["time/step"] for row in steps) / len(steps)

    def line(name: str, seconds: float, prefix: str) -> list[str]:
        peaks = [max(row.get(f"{prefix}/{kind}") or 0.0 for row in steps) for kind in kinds]
        share = f"{100 * seconds / mean_step:.1f}%" if mean_step > 0 else "-"
        return [name, f"{seconds:.3f}", share, *(f"{peak:.3f}" if peak else "-" for peak in peaks)]

    body = [line(p, sum(row.get(f"perf/phase/{p}/seconds") or 0.0 for row in steps) / len(steps), f"perf/phase/{p}")
            for p in (*phases, "other")]
    body.append(line("step", mean_step, "perf/step"))
    header = ["phase", "s/step", "share", *(kind.removesuffix("_gib") + " GiB" for kind in kinds)]
    widths = [max(len(cells[c]) for cells in [header, *body]) for c in range(len(header))]
    lines = ["  ".join(text.ljust(w) if c == 0 else text.rjust(w) for c, (text, w) in enumerate(zip(cells, widths)))
             for cells in [header, *body]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _synchronize() -> None:
    if _cuda_active():
        torch.cuda.synchronize()


def _cuda_active() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def _nvtx_push(name: str) -> bool:
    """Opens an NVTX range on a CUDA machine (a no-op without Nsight attached); True if opened."""
    if not torch.cuda.is_available():
        return False
    torch.cuda.nvtx.range_push(name)
    return True


def _nvtx_pop(opened: bool) -> None:
    if opened:
        torch.cuda.nvtx.range_pop()


_CLEAR_REFS = Path("/proc/self/clear_refs")
_STATUS = Path("/proc/self/status")


@functools.cache
def _host_peak_resettable() -> bool:
    """Whether this kernel lets a process reset its resident-memory high-water mark (Linux >= 4.0)."""
    try:
        _CLEAR_REFS.write_text("5")
    except OSError:
        return False
    return _STATUS.is_file()


def _reset_peaks() -> None:
    if _host_peak_resettable():
        # "5" resets VmHWM to the current resident size; the page-table bits ("1"-"4") stay.
        _CLEAR_REFS.write_text("5")
    if _cuda_active():
        torch.cuda.reset_peak_memory_stats()


def _read_peaks() -> dict[str, int]:
    """Peak bytes since the last reset, by memory kind."""
    peaks = {}
    if _host_peak_resettable():
        match = re.search(r"^VmHWM:\s+(\d+) kB", _STATUS.read_text(), re.MULTILINE)
        if match:
            peaks["host_rss_peak_gib"] = int(match.group(1)) * 1024
    if _cuda_active():
        peaks["cuda_max_allocated_gib"] = torch.cuda.max_memory_allocated()
        peaks["cuda_max_reserved_gib"] = torch.cuda.max_memory_reserved()
    return peaks
