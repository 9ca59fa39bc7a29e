"""SGLang servers' GPU memory in colocated runs: release, resume, pause and continue, by SGLang 0.5.23's rules.

A colocated trainer and its servers take turns on the same GPUs (``rollout.placement:
colocated``). Between generations the servers hold no memory: generation is paused, then
every memory region is released; before the next generation the weights region is
resumed, the trainer pushes its weights into it (a weight-update session), the KV cache and
CUDA-graph regions are resumed, and generation continues. SGLang's endpoints and the rules
this module keeps on the client side, because the server dies rather than refuses (paths
under ``sglang/srt/``):

* ``/release_memory_occupation`` and ``/resume_memory_occupation`` take ``{"tags": [...]}``
  of ``kv_cache``, ``weights``, ``cuda_graph`` (``constants.py:2-10``; none or ``[]`` means
  all three, ``managers/scheduler_components/weight_updater.py:345-346``, ``:386-387``),
  ``entrypoints/http_server.py:1575-1596``; they need ``--enable-memory-saver``, without
  which nothing is freed (``utils/torch_memory_saver_adapter.py:50-52``, the no-op adapter);
* release only when the server is idle: a plain ``assert`` in the scheduler
  (``weight_updater.py:339-341``) kills the server otherwise, so release refuses while any
  of our requests is in flight, and pauses generation first (``/pause_generation`` mode
  ``abort`` waits until nothing is running, ``managers/tokenizer_manager.py:2267-2280``;
  release then ignores the waiting queue, ``weight_updater.py:340``);
* a region released twice is paused twice, and torch_memory_saver exits the process on a
  second pause ("Cannot pause allocation that is not active", its ``csrc/core.cpp``
  ``TorchMemorySaver::pause``): release refuses a region released already;
* resume only a released tag: ``self.offload_tags.remove(tag)`` raises an uncaught
  ``KeyError`` that kills the server (``weight_updater.py:389-390``);
* nothing refuses ``/generate`` or a weight update while memory is released (the regions
  are unmapped: the server faults), so generation refuses while any region is released or
  generation is paused (a paused server queues requests until ``/continue_generation``,
  ``tokenizer_manager.py:938-939``), and a push refuses while the weights are released;
* the weights come back empty unless the server keeps a CPU copy
  (``--enable-weights-cpu-backup``, ``arg_groups/fields/exec_.py:62-65``): the trainer pushes
  them after every resume, so servers run without it.

Owns :class:`ServerMemory` (what the servers hold, as this client made them, and its rules)
and the HTTP calls; the engine (:mod:`~megatron_rl.rollout.sglang.engine`) makes them
collective, the trainer (``megatron_rl.train.colocate``) orders them around its own offload.
"""

from __future__ import annotations

from typing import Sequence

from megatron_rl.rollout.sglang.control import server_facts
from megatron_rl.rollout.sglang.weight_transport import Limits, call_all

TAGS = ("kv_cache", "weights", "cuda_graph")
"""SGLang's memory regions (``constants.py:2-10``)."""
AFTER_PUSH = ("kv_cache", "cuda_graph")
"""The regions resumed after the weights are pushed (generation needs them; the push does not)."""


class MemoryProtocolError(RuntimeError):
    """A release, resume, push or generation that the servers would die of (see the module docstring)."""


class ServerMemory:
    """What the colocated servers hold, as this client made them, and the calls that change it.

    Every rank keeps the same state (the engine calls it collectively); only the rank that
    talks to the servers sends.

    Args:
        urls: server base URLs.
        limits: time limits of one control call.
        released: the servers start with every region released (:func:`release_servers`
            already ran) rather than resident.
    """

    def __init__(self, urls: Sequence[str], limits: Limits, *, released: bool = False) -> None:
        self.urls, self.limits = [u.rstrip("/") for u in urls], limits
        self.released: set[str] = set(TAGS) if released else set()
        """Regions released now."""
        self.paused = released
        """Generation paused (it is whenever anything is released)."""

    def describe(self) -> str:
        """``released [..], paused`` or ``resident``, for messages."""
        if not self.released and not self.paused:
            return "resident"
        return f"released {sorted(self.released)}" + (", generation paused" if self.paused else "")

    def check_generate(self) -> None:
        """Refuse generation unless every region is resident and generation continues."""
        if self.released or self.paused:
            raise MemoryProtocolError(f"generate while the SGLang servers' memory is {self.describe()}: the server "
                                      "would fault on unmapped memory (or queue the requests forever); resume first")

    def check_push(self) -> None:
        """Refuse a weight push into released weights."""
        if "weights" in self.released:
            raise MemoryProtocolError("weight push while the SGLang servers' weights are released: the load would "
                                      "write unmapped memory; resume the weights region first")

    def check_release(self, in_flight: int) -> None:
        """Refuse a release with requests in flight, or of a region released already."""
        if in_flight:
            raise MemoryProtocolError(f"release_memory_occupation with {in_flight} generation(s) in flight: SGLang "
                                      "asserts that its scheduler is idle and dies otherwise (weight_updater.py:339-341)")
        if self.released:
            raise MemoryProtocolError(f"release_memory_occupation of {sorted(self.released)} released already: "
                                      "torch_memory_saver exits the server on a second pause")

    def check_resume(self, tags: Sequence[str]) -> None:
        """Refuse to resume an unknown tag or one that is not released."""
        unknown = [t for t in tags if t not in TAGS]
        resident = [t for t in tags if t in TAGS and t not in self.released]
        if unknown or resident or not tags:
            raise MemoryProtocolError(f"resume_memory_occupation of {list(tags)}: "
                                      + (f"unknown tags {unknown} (SGLang's: {list(TAGS)})" if unknown else
                                         f"{resident or 'nothing'} not released (SGLang raises KeyError and dies, "
                                         "weight_updater.py:389-390)"))

    def send_release(self) -> None:
        """Pause generation (abort mode: waits until nothing runs), then release every region."""
        _post(self.urls, "/pause_generation", {"mode": "abort"}, self.limits)
        _post(self.urls, "/release_memory_occupation", {"tags": list(TAGS)}, self.limits)

    def send_resume(self, tags: Sequence[str]) -> None:
        """Resume ``tags``; generation continues once nothing is released any more."""
        _post(self.urls, "/resume_memory_occupation", {"tags": list(tags)}, self.limits)
        if not self.released - set(tags):
            _post(self.urls, "/continue_generation", {}, self.limits)

    def mark_released(self) -> None:
        self.released, self.paused = set(TAGS), True

    def mark_resumed(self, tags: Sequence[str]) -> None:
        self.released -= set(tags)
        self.paused = bool(self.released)


def release_servers(urls: Sequence[str], limits: Limits) -> None:
    """Before the trainer builds its model: check that every server can release its memory
    (``enable_memory_saver`` in its ``/server_info``), then pause and release all of it.

    Raises:
        MemoryProtocolError: a server runs without ``--enable-memory-saver`` (named).
    """
    facts = server_facts(urls, timeout_s=limits.liveness_s, hang_check_after_s=limits.hang_check_after_s)
    missing = [u for u, info in facts.items() if not info.get("enable_memory_saver")]
    if missing:
        raise MemoryProtocolError(f"rollout.placement=colocated: SGLang server(s) {', '.join(missing)} run without "
                                  "--enable-memory-saver (their /server_info): releasing their memory would free "
                                  "nothing (megatron-rl-launch --sglang starts them with it for a colocated config)")
    ServerMemory(urls, limits).send_release()


def _post(urls: Sequence[str], path: str, body: dict, limits: Limits) -> None:
    """POST ``body`` to every server; raise naming each that did not answer 200."""
    failures = [f"{url}{path}: HTTP {status}: {str(answer)[:300]}"
                for url, status, answer in call_all(urls, path, lambda _: body, limits) if status != 200]
    if failures:
        raise MemoryProtocolError("; ".join(failures))
