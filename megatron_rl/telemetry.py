"""GPU telemetry from NVML (nvidia-ml-py): memory, utilization, power, temperature per GPU.

Owns :class:`GpuTelemetry`, which initializes NVML once and returns, per call of
:meth:`GpuTelemetry.sample`, one flat dict of floats ready to merge into a step's metrics:

    gpu{i}/mem_used_gib   gpu{i}/mem_total_gib   gpu{i}/util_pct   gpu{i}/power_w   gpu{i}/temp_c

``i`` is the CUDA ordinal as this process sees it: with ``CUDA_VISIBLE_DEVICES`` set (Slurm
sets it for allocated GPUs) the listed devices in that order, otherwise every GPU NVML
finds on the node. A value the GPU does not report (power on some boards) is left out.

On a machine without NVML (no driver, as on CPU-only hosts) ``nvmlInit`` raises
``pynvml.NVMLError``; telemetry then prints one informational line and every sample is an
empty dict. It never raises for a missing or failing GPU: telemetry must not stop training.

Does not own the logging of the values (the trainer merges them into its metrics) nor any
collective: each node samples its own GPUs.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Callable, Sequence

_GIB = float(1 << 30)


def _default_log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def visible_device_ids(env: dict[str, str] | None = None) -> list[str] | None:
    """NVML identifiers of the CUDA-visible GPUs in CUDA order; None means all of them.

    Entries of ``CUDA_VISIBLE_DEVICES`` are indices or UUIDs (``GPU-...``/``MIG-...``);
    CUDA stops at the first invalid entry, and so does this.
    """
    raw = (os.environ if env is None else env).get("CUDA_VISIBLE_DEVICES")
    if raw is None:
        return None
    ids = []
    for entry in raw.split(","):
        entry = entry.strip()
        if not entry or not (entry.isdigit() or entry.startswith(("GPU-", "MIG-"))):
            break
        ids.append(entry)
    return ids


class GpuTelemetry:
    """Samples the local GPUs through NVML; inert (empty samples) without NVML.

    Args:
        device_ids: NVML indices or UUIDs to sample, in the order they get keys 0, 1, ...;
            None reads ``CUDA_VISIBLE_DEVICES`` and falls back to every GPU on the node.
        log: where the single informational line goes when NVML is unavailable.
        nvml: the ``pynvml`` module (tests inject a fake); None imports nvidia-ml-py.

    Attributes:
        available: NVML initialized and at least one GPU handle was obtained.
    """

    def __init__(
        self,
        device_ids: Sequence[int | str] | None = None,
        *,
        log: Callable[[str], None] = _default_log,
        nvml: Any = None,
    ) -> None:
        self._nvml = nvml
        self._handles: list[Any] = []
        self.available = False
        reason = self._init(device_ids)
        if reason is not None:
            log(f"telemetry: GPU telemetry is off ({reason})")

    def _init(self, device_ids: Sequence[int | str] | None) -> str | None:
        """Initializes NVML and resolves handles; returns why telemetry is off, or None."""
        if self._nvml is None:
            try:
                import pynvml
            except ImportError:
                return "nvidia-ml-py is not installed"
            self._nvml = pynvml
        nvml = self._nvml
        try:
            nvml.nvmlInit()
        except nvml.NVMLError as err:
            return f"NVML unavailable: {err}"
        try:
            ids = list(device_ids) if device_ids is not None else visible_device_ids()
            if ids is None:
                ids = list(range(nvml.nvmlDeviceGetCount()))
            for dev in ids:
                if isinstance(dev, str) and not dev.isdigit():
                    self._handles.append(nvml.nvmlDeviceGetHandleByUUID(dev))
                else:
                    self._handles.append(nvml.nvmlDeviceGetHandleByIndex(int(dev)))
        except nvml.NVMLError as err:
            self._handles = []
            nvml.nvmlShutdown()
            return f"NVML could not open the GPUs: {err}"
        if not self._handles:
            nvml.nvmlShutdown()
            return "NVML found no GPU"
        self.available = True
        return None

    def sample(self) -> dict[str, float]:
        """Current readings of every GPU, keyed ``gpu{i}/<metric>``; {} without NVML."""
        values: dict[str, float] = {}
        if not self.available:
            return values
        nvml = self._nvml
        for i, handle in enumerate(self._handles):
            mem = self._query(nvml.nvmlDeviceGetMemoryInfo, handle)
            util = self._query(nvml.nvmlDeviceGetUtilizationRates, handle)
            power_mw = self._query(nvml.nvmlDeviceGetPowerUsage, handle)
            temp = self._query(nvml.nvmlDeviceGetTemperature, handle, nvml.NVML_TEMPERATURE_GPU)
            if mem is not None:
                values[f"gpu{i}/mem_used_gib"] = mem.used / _GIB
                values[f"gpu{i}/mem_total_gib"] = mem.total / _GIB
            if util is not None:
                values[f"gpu{i}/util_pct"] = float(util.gpu)
            if power_mw is not None:
                values[f"gpu{i}/power_w"] = power_mw / 1000.0
            if temp is not None:
                values[f"gpu{i}/temp_c"] = float(temp)
        return values

    def _query(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)``, or None when NVML cannot answer (not supported on this board, or
        the GPU fell off the bus): one missing value must not cost the others."""
        try:
            return fn(*args)
        except self._nvml.NVMLError:
            return None

    def close(self) -> None:
        """Shuts NVML down; later samples are empty. Safe to call twice."""
        if self.available:
            self.available = False
            self._handles = []
            try:
                self._nvml.nvmlShutdown()
            except self._nvml.NVMLError:
                pass

    def __enter__(self) -> GpuTelemetry:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
