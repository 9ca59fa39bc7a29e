"""A remote environment or sandbox behind HTTP (``rollout.env.name: http``).

The protocol (JSON bodies, one session per trajectory; docs/agentic.md has examples):

* ``POST /reset`` ``{"sample_id", "prompt", "ground_truth", "metadata"}`` ->
  ``{"session": str, "messages": [...] | null}``;
* ``POST /step`` ``{"session", "turn", "text", "token_ids", "tool_calls": [{"name", "arguments"}]}``
  -> ``{"observation": [...] | null, "reward": float, "done": bool, "metrics": {name: number}}``;
  ``turn`` (1, 2, ...) lets a server answer a retried step without applying it twice;
* ``POST /close`` ``{"session"}``, best effort.

Each request has its own timeout; a connection error, a dropped connection, a timeout or
a 5xx answer is retried (``retries`` times, with doubling backoff), a 4xx answer or a
body that is not the expected JSON is not. What still fails raises
:class:`~megatron_rl.rollout.envs.base.EnvError` naming the URL and the cause, which ends
that trajectory (the driver also bounds the whole call by ``rollout.env.step_timeout_s``).
Each call runs its own event loop with aiohttp, in the driver's thread for that call.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp

from megatron_rl.data.prompts import PromptRecord
from megatron_rl.rollout.envs.base import (
    EnvError,
    Environment,
    EnvStep,
    Messages,
    ModelTurn,
    check_messages,
)
from megatron_rl.rollout.envs.config import HttpEnvConfig


class HttpEnvironment(Environment):
    """One trajectory's session with a remote environment server (see the module docstring)."""

    def __init__(self, cfg: HttpEnvConfig) -> None:
        self.cfg = cfg
        self.session: str | None = None

    def reset(self, row: PromptRecord) -> Messages | None:
        body = self._request("/reset", {"sample_id": row.sample_id, "prompt": row.prompt,
                                        "ground_truth": row.ground_truth, "metadata": row.metadata})
        session = body.get("session")
        if not isinstance(session, str):
            raise EnvError(f"{self.cfg.url}/reset answered no string 'session': {_short(body)}")
        self.session = session
        messages = body.get("messages")
        if messages is not None:
            check_messages(messages, f"{self.cfg.url}/reset answered")
        return messages

    def step(self, turn: ModelTurn) -> EnvStep:
        body = self._request("/step", {
            "session": self.session, "turn": turn.index, "text": turn.text, "token_ids": list(turn.token_ids),
            "tool_calls": [{"name": c.name, "arguments": c.arguments} for c in turn.tool_calls],
        })
        try:
            return EnvStep(observation=body.get("observation"), reward=body.get("reward", 0.0),
                           done=bool(body.get("done", False)), metrics=body.get("metrics") or {})
        except (TypeError, ValueError) as err:
            raise EnvError(f"{self.cfg.url}/step answered {_short(body)}: {err}") from None

    def close(self) -> None:
        if self.session is not None:
            self._request("/close", {"session": self.session}, retries=0)

    def _request(self, path: str, payload: dict, retries: int | None = None) -> dict[str, Any]:
        return asyncio.run(self._post(path, payload, self.cfg.retries if retries is None else retries))

    async def _post(self, path: str, payload: dict, retries: int) -> dict[str, Any]:
        url = self.cfg.url.rstrip("/") + path
        timeout = aiohttp.ClientTimeout(total=self.cfg.request_timeout_s)
        cause = ""
        async with aiohttp.ClientSession(timeout=timeout) as session:
            for attempt in range(retries + 1):
                if attempt:
                    await asyncio.sleep(self.cfg.backoff_s * 2 ** (attempt - 1))
                try:
                    async with session.post(url, json=payload) as resp:
                        text = await resp.text()
                        if resp.status >= 500:
                            cause = f"HTTP {resp.status}"
                            continue
                        if resp.status >= 400:
                            raise EnvError(f"{url}: HTTP {resp.status}: {text[:200]!r}")
                except (aiohttp.ClientError, asyncio.TimeoutError) as err:
                    cause = f"{type(err).__name__}: {err}" if str(err) else type(err).__name__
                    continue
                try:
                    body = json.loads(text)
                except json.JSONDecodeError:
                    raise EnvError(f"{url}: the answer is not JSON: {text[:200]!r}") from None
                if not isinstance(body, dict):
                    raise EnvError(f"{url}: the answer is not a JSON object: {_short(body)}")
                return body
        raise EnvError(f"{url}: {cause} after {retries + 1} attempt{'s' if retries else ''}")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 200 else text[:197] + "..."
