"""The CPU stand-in's memory occupation, by SGLang 0.5.23's rules (colocated runs).

SGLang keeps a set of released tags and, with ``--enable-memory-saver``, one
torch_memory_saver region per tag whose memory it unmaps; every rule here is SGLang's
(paths under ``sglang/srt/``) or torch_memory_saver's (``csrc/core.cpp``), and where they
kill the server the stand-in dies too (:class:`~megatron_rl.sglang_standin.weights.
SchedulerCrash`), so a client that breaks one is caught by the crash, not forgiven:

* **Release** (``managers/scheduler_components/weight_updater.py:337-381``): a plain
  ``assert`` that the scheduler is idle, ignoring the waiting queue while generation is
  paused (``:339-341``); tags ``None`` or ``[]`` mean all three (``:345-346``; names
  ``constants.py:2-10``), each added to the set, then each region paused;
  torch_memory_saver exits the process when it pauses a region that is paused already
  (``TorchMemorySaver::pause``: "Cannot pause allocation that is not active").
* **Resume** (``:383-422``): each tag removed from the set, an uncaught ``KeyError`` for one
  that is not in it (``:389-390``); then the regions mapped again. The weights come back
  with undefined contents unless ``--enable-weights-cpu-backup`` kept a copy (the model's
  buffers are stashed at release and restored, ``:369-373``, ``:396-402``); the stand-in
  writes NaN into them, so a client that forgets to push them again is found out.
* **Using released memory**: nothing refuses ``/generate`` or a weight load while a region is
  released (only the DP-attention sync group looks at the tags,
  ``managers/scheduler_components/dp_attn.py:607``): the GPU faults on the unmapped memory
  and the scheduler dies. Without ``--enable-memory-saver`` nothing is unmapped (the no-op
  adapter, ``utils/torch_memory_saver_adapter.py:50-52``): the tags are kept, the KV cache is
  flushed, and everything keeps working.
* **Pause**: ``/pause_generation`` and ``/continue_generation`` are
  :mod:`~megatron_rl.sglang_standin.pausing`'s.

Owns the tags, the regions, their endpoints (:class:`MemoryRoutes`, a part of the
stand-in's :class:`~megatron_rl.sglang_standin.server.ProtocolServer`) and the report
(``GET /memory_occupation``, the stand-in's own: SGLang has no such endpoint); freeing the
weights is :mod:`~megatron_rl.sglang_standin.engine`'s.
"""

from __future__ import annotations

from typing import Any, Sequence

from aiohttp import web

from megatron_rl.sglang_standin.weights import SchedulerCrash

TAGS = ("kv_cache", "weights", "cuda_graph")
"""``GPU_MEMORY_ALL_TYPES`` (constants.py:2-10), in SGLang's order."""
NOT_IDLE = "release_memory_occupation should be called only when server is idle."
"""weight_updater.py:339-341."""
PAUSED_TWICE = "Cannot pause allocation that is not active."
"""torch_memory_saver, csrc/core.cpp, TorchMemorySaver::pause."""


def parse_tags(body: Any) -> list[str] | None:
    """``tags`` of a release or resume body (``io_struct.py:2177-2190``: ``Optional[List[str]]``).

    Raises:
        ValueError: ``tags`` is neither null nor a list of strings (FastAPI answers 422).
    """
    tags = body.get("tags") if isinstance(body, dict) else None
    if tags is not None and not (isinstance(tags, list) and all(isinstance(t, str) for t in tags)):
        raise ValueError(f"tags must be null or a list of strings, got {tags!r}")
    return tags


class MemoryOccupation:
    """SGLang's released tags and the memory saver's regions.

    Args:
        memory_saver: ``--enable-memory-saver`` (regions are unmapped).
        weights_cpu_backup: ``--enable-weights-cpu-backup`` (released weights come back as they were).
    """

    def __init__(self, memory_saver: bool = False, weights_cpu_backup: bool = False) -> None:
        self.memory_saver, self.weights_cpu_backup = memory_saver, weights_cpu_backup
        self.offload_tags: set[str] = set()
        """SGLang's ``offload_tags``."""
        self.paused_regions: set[str] = set()
        """Regions whose memory is unmapped now."""

    def release(self, tags: Sequence[str] | None, *, idle: bool) -> list[str]:
        """Apply a release; returns the regions it unmapped (the caller frees their memory).

        Raises:
            SchedulerCrash: the server would die (not idle, or a region paused twice).
        """
        if not idle:
            raise SchedulerCrash(f"AssertionError: {NOT_IDLE}")
        tags = list(tags) if tags else list(TAGS)
        self.offload_tags.update(tags)
        regions = [t for t in TAGS if t in tags] if self.memory_saver else []
        for region in regions:
            if region in self.paused_regions:
                raise SchedulerCrash(f"torch_memory_saver: {PAUSED_TWICE} tag={region}")
            self.paused_regions.add(region)
        return regions

    def resume(self, tags: Sequence[str] | None) -> list[str]:
        """Apply a resume; returns the regions it mapped again.

        Raises:
            SchedulerCrash: a tag that is not released (SGLang's ``KeyError``).
        """
        tags = list(tags) if tags else list(TAGS)
        for tag in tags:
            if tag not in self.offload_tags:
                raise SchedulerCrash(f"KeyError: {tag!r}")
            self.offload_tags.remove(tag)
        regions = [t for t in TAGS if t in tags and t in self.paused_regions]
        self.paused_regions.difference_update(regions)
        return regions

    def fault(self, needs: Sequence[str]) -> str | None:
        """Why using ``needs`` now would fault the GPU, or None."""
        unmapped = [t for t in needs if t in self.paused_regions]
        if not unmapped:
            return None
        return (f"CUDA error: an illegal memory access was encountered (the {', '.join(unmapped)} memory is "
                "released: resume_memory_occupation first)")

    def report(self, paused: bool) -> dict:
        """What ``GET /memory_occupation`` answers."""
        return {"enable_memory_saver": self.memory_saver, "enable_weights_cpu_backup": self.weights_cpu_backup,
                "generation_paused": paused, "offload_tags": sorted(self.offload_tags),
                "regions": {t: "released" if t in self.paused_regions else "resident" for t in TAGS}}


class MemoryRoutes:
    """The memory endpoints of the stand-in's server, which provides ``memory``
    (:class:`MemoryOccupation`), ``host`` (the engine), ``scheduler_idle()`` (no request in
    the scheduler, queued ones ignored while paused), ``running`` (an ``asyncio.Event`` set
    unless generation is paused) and ``_crash`` (the scheduler dies); its ``/generate`` waits
    on ``running`` and dies on :meth:`MemoryOccupation.fault`, its weight loads call
    :meth:`_weights_mapped` first."""

    def memory_routes(self) -> list:
        """The routes, to add to the application."""
        return [*(route(path, handler) for path, handler in (("/release_memory_occupation", self.release_memory),
                                                           ("/resume_memory_occupation", self.resume_memory))
                  for route in (web.get, web.post)),
                web.get("/memory_occupation", self.memory_occupation)]

    def _weights_mapped(self) -> None:
        """A weight load writes the weights' memory: the server dies if it is released."""
        fault = self.memory.fault(("weights",))
        if fault is not None:
            self._crash(SchedulerCrash(fault))

    async def release_memory(self, request: web.Request) -> web.Response:
        """``/release_memory_occupation`` ``{"tags": [...]}``: answers null."""
        try:
            tags = parse_tags(await _body(request))
            regions = self.memory.release(tags, idle=self.scheduler_idle())
        except ValueError as err:
            return web.json_response({"detail": str(err)}, status=422)
        except SchedulerCrash as err:
            self._crash(err)
        if "weights" in regions:
            await self.host.call(self.host.release_weights, self.memory.weights_cpu_backup)
        return web.json_response(None)

    async def resume_memory(self, request: web.Request) -> web.Response:
        """``/resume_memory_occupation`` ``{"tags": [...]}``: answers null."""
        try:
            regions = self.memory.resume(parse_tags(await _body(request)))
        except ValueError as err:
            return web.json_response({"detail": str(err)}, status=422)
        except SchedulerCrash as err:
            self._crash(err)
        if "weights" in regions:
            await self.host.call(self.host.resume_weights)
        return web.json_response(None)

    async def memory_occupation(self, request: web.Request) -> web.Response:
        """``GET /memory_occupation``: what the stand-in holds (its own endpoint)."""
        return web.json_response(self.memory.report(paused=not self.running.is_set()))


async def _body(request: web.Request) -> dict:
    """A JSON object body, or {} when there is none (SGLang's memory routes accept GET)."""
    if not request.body_exists:
        return {}
    body = await request.json()
    return body if isinstance(body, dict) else {}
