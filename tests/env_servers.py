"""A test-only HTTP environment server that misbehaves on request, for the ``http`` environment.

It speaks the protocol of ``megatron_rl.rollout.envs.http`` (``/reset``, ``/step``,
``/close``) and decides its behaviour from the prompt row's ``sample_id``: ``ok`` answers a
tool call with its result and ends at the first turn without one; ``5xx`` answers every
step with HTTP 503; ``drop`` closes the connection without answering; ``slow`` answers
after ``slow_s``; ``notjson`` answers a body that is not JSON. Every request is counted by
(path, sample id). Runs in a daemon thread with its own event loop.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
from collections import Counter

from aiohttp import web


class MisbehavingEnvServer:
    """Start with ``with MisbehavingEnvServer() as server:``; ``server.url`` is its base URL."""

    def __init__(self, slow_s: float = 2.0) -> None:
        self.slow_s = slow_s
        self.requests: Counter = Counter()
        self.sessions: dict[str, str] = {}
        self._ids = itertools.count()
        self._loop = asyncio.new_event_loop()
        self._runner: web.AppRunner | None = None
        self.url = ""

    def __enter__(self) -> "MisbehavingEnvServer":
        started = threading.Event()

        def serve() -> None:
            asyncio.set_event_loop(self._loop)
            app = web.Application()
            app.add_routes([web.post("/reset", self.reset), web.post("/step", self.step),
                            web.post("/close", self.close)])
            self._runner = web.AppRunner(app)
            self._loop.run_until_complete(self._runner.setup())
            site = web.TCPSite(self._runner, "127.0.0.1", 0)
            self._loop.run_until_complete(site.start())
            self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
            started.set()
            self._loop.run_forever()

        threading.Thread(target=serve, daemon=True, name="env-server").start()
        started.wait(10)
        return self

    def __exit__(self, *exc_info) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)

    async def reset(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.requests["reset", body["sample_id"]] += 1
        session = f"s{next(self._ids)}"
        self.sessions[session] = body["sample_id"]
        return web.json_response({"session": session, "messages": None})

    async def step(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        kind = self.sessions[body["session"]]
        self.requests["step", kind] += 1
        if kind == "5xx":
            return web.Response(status=503, text="overloaded")
        if kind == "drop":
            request.transport.close()
            return web.Response()
        if kind == "slow":
            await asyncio.sleep(self.slow_s)
        if kind == "notjson":
            return web.Response(text="<html>oops</html>")
        calls = body["tool_calls"]
        if not calls:
            return web.json_response({"observation": None, "reward": 0.5, "done": True})
        return web.json_response({"observation": [{"role": "tool", "content": "71"} for _ in calls], "reward": 0.0,
                                  "done": False, "metrics": {"tool_calls": len(calls)}})

    async def close(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.requests["close", self.sessions.get(body["session"], "?")] += 1
        return web.json_response({})
