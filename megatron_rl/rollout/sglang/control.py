"""Blocking HTTP control calls to SGLang servers: liveness, server facts, watched JSON requests.

Liveness is ``GET /server_info``, because it must pass through the scheduler: SGLang's HTTP
process asks every scheduler for its internal state (``srt/entrypoints/http_server.py:863-894``
-> ``tokenizer_manager.get_internal_state``, ``srt/managers/tokenizer_control_mixin.py:
967-974``, one ``GetInternalStateReq`` over ZMQ), and a scheduler answers it where it takes in
requests, once per turn of its loop, between two batches and also while paused
(``srt/managers/scheduler.py:2026-2036``, dispatched at ``:1909``). What it costs the
scheduler: a dict of its resolved launch settings, topology and memory figures
(``scheduler_components/internal_state.py:45-62``), no GPU work; the caller gets it as JSON.
So a server whose scheduler hangs (a wedged forward, a collective that never completes, a
stopped process) leaves it unanswered, while ``GET /ping``, a flag check in the HTTP process
(``http_server.py:2190-2199``, ``tokenizer_manager.py:728-730``), still answers 200 and could not
tell. ``/health`` is not used either: a one-token generation that a busy scheduler, a long
weight update or a pause keeps from answering for 20 s, then 503 (``http_server.py:218``,
``:721-799``).

The bound this gives: a server is called hung when a liveness probe is unanswered within its
limit (``health_timeout_s``), so a scheduler that completes no turn of its loop (one batch,
one weight load, one bucket's broadcast) for that long is named, within ``hang_check_after_s
+ health_timeout_s`` of the hang; a healthy scheduler must therefore finish each turn within
``health_timeout_s`` (10 s at the defaults; a decode step takes milliseconds, a chunked
prefill or a bucket's load well under that). A server that refuses the connection or answers
503 is down or starting, not hung.

:func:`probe_servers` checks every server is live before heavy work (and waits for a
restarting one); :func:`watched_request` is a control request that probes the server's
liveness while it waits, so a server that hangs mid-call is named within a bound instead of
at the request's timeout; :func:`server_facts` reads ``/server_info``, where SGLang reports
its launch settings (``tp_size``, ``enable_deterministic_inference``, ...; ``http_server.py:
863-894``). Owns no ``/generate`` traffic (:mod:`~megatron_rl.rollout.sglang.client`).
"""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Sequence

from megatron_rl.rollout.sglang.ledger import RolloutRequestError, ServerHungError

LIVENESS_PATH = "/server_info"
"""The liveness request: one that must pass through the scheduler (see the module docstring)."""


@dataclass(frozen=True)
class EncodedJSON:
    """A JSON request body already encoded, in pieces sent one after another (never joined:
    a weight update's pieces are its bucket-sized payloads)."""

    pieces: Sequence[bytes]
    """The body's bytes, in order."""


def request_json(method: str, url: str, payload: Any = None, *, timeout_s: float = 60.0) -> tuple[int, Any]:
    """Blocking JSON request for control calls (``payload``: a JSON value, or :class:`EncodedJSON`).

    Returns:
        ``(status, body)``: body parsed as JSON when it is, else the text; status 0 and the
        error text when the server could not be reached, -1 and the text when it accepted the
        connection but did not answer within ``timeout_s``.
    """
    headers = {"Content-Type": "application/json"}
    if isinstance(payload, EncodedJSON):
        data = list(payload.pieces)
        headers["Content-Length"] = str(sum(len(p) for p in data))
    else:
        data = None if payload is None else json.dumps(payload).encode()
    request = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as resp:
            status, raw = resp.status, resp.read()
    except urllib.error.HTTPError as err:
        status, raw = err.code, err.read()
    except (TimeoutError, socket.timeout) as err:
        return -1, f"no answer within {timeout_s:g}s ({err})"
    except (urllib.error.URLError, OSError) as err:
        reason = getattr(err, "reason", err)
        if isinstance(reason, (TimeoutError, socket.timeout)):
            return -1, f"no answer within {timeout_s:g}s ({reason})"
        return 0, str(reason)
    text = raw.decode(errors="replace")
    try:
        return status, json.loads(text)
    except ValueError:
        return status, text


def hung_problem(url: str, timeout_s: float) -> str | None:
    """Why ``url`` is hung, or None (it answered :data:`LIVENESS_PATH`, or is down, which callers see anyway)."""
    status, _ = request_json("GET", url + LIVENESS_PATH, timeout_s=timeout_s)
    if status == -1:
        return f"SGLang server {url} is hung: GET {LIVENESS_PATH} unanswered within {timeout_s:g}s"
    return None


def probe_servers(urls: Sequence[str], timeout_s: float = 10.0, *, wait_s: float = 0.0,
                  poll_s: float = 1.0) -> dict[str, Any]:
    """Fail unless every server answers :data:`LIVENESS_PATH` with 200 (blocking; cheap); returns
    each server's answer (its ``/server_info``) by URL.

    Meant for before any heavy work (building the model, a weight push), so a run whose
    servers are not there fails in seconds instead of after it.

    Args:
        urls: server base URLs.
        timeout_s: limit for each probe; a server that accepts the connection and stays
            silent this long is hung, and fails the probe at once, waiting or not.
        wait_s: keep probing servers that are down or starting for this long (a restart).
        poll_s: pause between rounds while waiting.

    Raises:
        ServerHungError: a server is hung (named).
        RolloutRequestError: one line per server that did not answer 200, naming it.
    """
    pending = [u.rstrip("/") for u in urls]
    deadline = time.monotonic() + wait_s
    live: dict[str, Any] = {}
    while True:
        with ThreadPoolExecutor(max_workers=max(1, min(len(pending), 32))) as pool:
            answers = list(pool.map(lambda u: (u, *request_json("GET", u + LIVENESS_PATH, timeout_s=timeout_s)),
                                    pending))
        hung = [u for u, status, _ in answers if status == -1]
        if hung:
            raise ServerHungError("; ".join(f"SGLang server {u} is hung: GET {LIVENESS_PATH} unanswered within "
                                            f"{timeout_s:g}s" for u in hung))
        live.update((u, body) for u, status, body in answers if status == 200)
        failed = [(u, status, body) for u, status, body in answers if status != 200]
        if not failed:
            return live
        if time.monotonic() + poll_s > deadline:
            lines = [f"SGLang server {u} is not live: " + (f"GET {LIVENESS_PATH}: {body}" if status == 0
                                                           else f"GET {LIVENESS_PATH} answered HTTP {status}")
                     for u, status, body in failed]
            waited = f" (waited {wait_s:g}s)" if wait_s > 0 else ""
            raise RolloutRequestError(f"{len(failed)} of {len(urls)} SGLang servers unreachable{waited}:\n"
                                      + "\n".join(lines))
        pending = [u for u, _, _ in failed]
        time.sleep(poll_s)


def watched_request(method: str, url: str, path: str, payload: Any = None, *, timeout_s: float,
                    hang_check_after_s: float, liveness_timeout_s: float) -> tuple[int, Any]:
    """:func:`request_json` to ``url + path`` that probes :data:`LIVENESS_PATH` every
    ``hang_check_after_s`` while it waits; a server that stays silent there too is reported hung.

    Raises:
        ServerHungError: naming the server and the call, within ``hang_check_after_s +
            liveness_timeout_s`` of the hang (the request itself may still be pending).
    """
    box: dict = {}
    done = threading.Event()

    def run() -> None:
        box["answer"] = request_json(method, url + path, payload, timeout_s=timeout_s)
        done.set()

    threading.Thread(target=run, daemon=True, name=f"sglang-control{path}").start()
    waited = 0.0
    while not done.wait(hang_check_after_s):
        waited += hang_check_after_s
        problem = hung_problem(url, liveness_timeout_s)
        if problem is not None:
            raise ServerHungError(f"{problem}, while {method} {path} was unanswered for {waited:g}s")
    return box["answer"]


def server_facts(urls: Sequence[str], *, timeout_s: float, hang_check_after_s: float) -> dict[str, dict]:
    """``GET /server_info`` of every server (SGLang's resolved launch settings), by URL.

    Raises:
        RolloutRequestError: a server answered anything but a JSON object (named).
        ServerHungError: a server hung.
    """
    def one(url: str) -> tuple[str, int, Any]:
        return url, *watched_request("GET", url, "/server_info", timeout_s=max(timeout_s, 60.0),
                                     hang_check_after_s=hang_check_after_s, liveness_timeout_s=timeout_s)

    with ThreadPoolExecutor(max_workers=max(1, min(len(urls), 32))) as pool:
        answers = list(pool.map(one, urls))
    bad = [f"{u}/server_info: HTTP {status}: {str(body)[:200]}" for u, status, body in answers
           if status != 200 or not isinstance(body, dict)]
    if bad:
        raise RolloutRequestError("; ".join(bad))
    return {u: body for u, _, body in answers}
