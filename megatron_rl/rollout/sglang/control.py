"""Blocking HTTP control calls to SGLang servers: health probes before a run, JSON requests.

:func:`probe_servers` checks every server answers ``GET /health`` before any heavy work;
:func:`request_json` is the plain JSON request the weight sync and the launcher's control
calls use. Owns no ``/generate`` traffic (:mod:`~megatron_rl.rollout.sglang.client`).
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Sequence

from megatron_rl.rollout.sglang.ledger import RolloutRequestError


def probe_servers(urls: Sequence[str], timeout_s: float = 10.0, *, wait_s: float = 0.0,
                  poll_s: float = 1.0) -> None:
    """Fail unless every server answers ``GET /health`` with 200 (blocking; cheap).

    Meant for before any heavy work (building the model, the warm start), so a run whose
    servers are not there fails in seconds instead of after it.

    Args:
        urls: server base URLs.
        timeout_s: limit for each probe.
        wait_s: keep probing the servers that failed for this long (a restart in progress).
        poll_s: pause between rounds while waiting.

    Raises:
        RolloutRequestError: one line per server that did not answer 200, naming it.
    """
    pending = [u.rstrip("/") for u in urls]
    deadline = time.monotonic() + wait_s
    while True:
        with ThreadPoolExecutor(max_workers=max(1, min(len(pending), 32))) as pool:
            answers = list(pool.map(lambda u: (u, *request_json("GET", u + "/health", timeout_s=timeout_s)), pending))
        failed = [(u, status, body) for u, status, body in answers if status != 200]
        if not failed:
            return
        if time.monotonic() + poll_s > deadline:
            lines = [f"SGLang server {u} is not healthy: "
                     + (f"GET /health: {body}" if status == 0 else f"GET /health answered HTTP {status}")
                     for u, status, body in failed]
            waited = f" (waited {wait_s:g}s)" if wait_s > 0 else ""
            raise RolloutRequestError(f"{len(failed)} of {len(urls)} SGLang servers unreachable{waited}:\n"
                                      + "\n".join(lines))
        pending = [u for u, _, _ in failed]
        time.sleep(poll_s)


def request_json(method: str, url: str, payload: Any = None, *, timeout_s: float = 60.0) -> tuple[int, Any]:
    """Blocking JSON request for control calls (weight updates, health polling).

    Returns:
        ``(status, body)``: body parsed as JSON when it is, else the text; status 0 and the
        error text when the server could not be reached.
    """
    data = None if payload is None else json.dumps(payload).encode()
    request = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as resp:
            status, raw = resp.status, resp.read()
    except urllib.error.HTTPError as err:
        status, raw = err.code, err.read()
    except (urllib.error.URLError, OSError) as err:
        return 0, str(getattr(err, "reason", err))
    text = raw.decode(errors="replace")
    try:
        return status, json.loads(text)
    except ValueError:
        return status, text
