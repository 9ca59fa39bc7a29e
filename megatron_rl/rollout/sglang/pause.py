"""Pausing SGLang servers around a weight push with requests in flight (partial rollouts).

SGLang 0.5.23's rules (paths under ``sglang/srt/``):

* ``POST /pause_generation {"mode": m}`` (``entrypoints/http_server.py:1831-1841``;
  ``managers/tokenizer_manager.py:2267-2280``): the tokenizer manager marks itself paused, so
  a ``/generate`` that arrives waits before it reaches the scheduler (``:938-939``). Mode
  ``abort`` aborts every request and returns once none holds the model-update lock: each
  running request answers with the tokens it has (``managers/scheduler.py:5800-5812``); modes
  ``retract`` and ``in_place`` go to the scheduler (``scheduler.py:5817-5932``): ``in_place``
  stops the event loop with every request and its KV cache as they are, ``retract`` moves
  the running requests back to the waiting queue and frees their KV, which is recomputed
  after ``/continue_generation`` (``io_struct.py:1927-1946``).
* **Weight updates while paused** do not wait for the model-update lock
  (``managers/tokenizer_control_mixin.py:471-483`` for a session's begin and end,
  ``:503-526`` and ``:563-590`` for the updates); unpaused, each call waits until no request
  runs, and requests that arrive meanwhile may run between a session's calls on weights half
  updated. So weights are pushed with requests in flight only while paused.
* **flush_cache** succeeds only when no request runs (``scheduler.py:5518-5548``, the waiting
  queue ignored while paused), and an update that asks for it fails when the flush does
  (``managers/scheduler_components/weight_updater.py:120-133``): after ``in_place`` the
  push must not flush (the paused requests keep their KV, computed by the old weights);
  after ``retract`` or ``abort`` nothing runs and it may.
* ``POST /continue_generation`` (``tokenizer_manager.py:2282-2286``; ``scheduler.py:
  5934-5957``) lets the waiting requests in; it is accepted when nothing is paused too, so
  a run that starts sends one first (its predecessor may have been killed mid-push).

Owns the control calls (global rank 0 sends them, as the weight push); not when pushes
happen (:mod:`~megatron_rl.rollout.sglang.engine`) nor what a request cut short does next
(:mod:`~megatron_rl.rollout.sglang.partial`).
"""

from __future__ import annotations

from typing import Sequence

from megatron_rl.rollout.sglang.control import probe_servers
from megatron_rl.rollout.sglang.weight_transport import Limits, post_all
from megatron_rl.rollout.sglang.wire import PAUSE_MODES, continue_generation_body, pause_generation_body


class GenerationPause:
    """``/pause_generation`` and ``/continue_generation`` on every server (global rank 0).

    Args:
        urls: server base URLs.
        mode: ``abort``, ``retract`` or ``in_place`` (see the module docstring).
        limits: time limits of the calls.
        server_wait_s: how long a server that is down or restarting is waited for first.
    """

    def __init__(self, urls: Sequence[str], mode: str, limits: Limits, server_wait_s: float) -> None:
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode {mode!r} is not one of {PAUSE_MODES}")
        self.urls, self.mode, self.limits, self.server_wait_s = [u.rstrip("/") for u in urls], mode, limits, server_wait_s
        self.pauses = 0
        """Pauses sent (each followed by a continue)."""

    @property
    def flush_cache(self) -> bool:
        """Whether a push while paused may flush the servers' cache (not in place: SGLang refuses)."""
        return self.mode != "in_place"

    def pause(self) -> None:
        """Pause every server (a restarting one is waited for; it comes back unpaused)."""
        probe_servers(self.urls, timeout_s=self.limits.liveness_s, wait_s=self.server_wait_s)
        post_all(self.urls, "/pause_generation", pause_generation_body(self.mode), self.limits)
        self.pauses += 1

    def resume(self) -> None:
        """Let every server go on generating."""
        post_all(self.urls, "/continue_generation", continue_generation_body(), self.limits)
