"""Prompt scoring on SGLang servers: a distillation teacher's log-probs of the student's samples.

Owns :class:`ScoringClient`: one prefill-only ``POST /generate`` per sample (``input_ids``:
prompt + response, ``max_new_tokens`` 0, ``return_logprob`` with ``logprob_start_len`` =
prompt length - 1, so the answer holds every response token's log-prob, and
``top_logprobs_num`` for the top-k; the body and its decoding are
:func:`~megatron_rl.rollout.sglang.score_wire.score_payload` and
:func:`~megatron_rl.rollout.sglang.score_wire.decode_score_response`), spread over the servers
round-robin with a bound on requests in flight, each retried with backoff on a connection
error, a timeout or a 5xx within a time budget (a 4xx, a bad request, fails at once, naming
the sample and the server). Does not own generation (:mod:`~megatron_rl.rollout.sglang.client`)
or which samples a teacher scores (``megatron_rl.train.teachers``).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Sequence

import aiohttp
import torch

from megatron_rl.rollout.sglang.score_wire import decode_score_response, score_payload
from megatron_rl.rollout.sglang.wire import WireFormatError


class ScoringError(RuntimeError):
    """A sample could not be scored (names it, the server and why)."""


class ScoringClient:
    """Scores samples on SGLang servers (blocking calls; one event loop per call).

    Args:
        urls: the teacher's servers.
        max_concurrency: requests in flight at once.
        request_timeout_s: limit for one attempt.
        retry_budget_s: how long a sample keeps retrying after its first failure.
    """

    def __init__(self, urls: Sequence[str], *, max_concurrency: int = 64,
                 request_timeout_s: float = 120.0, retry_budget_s: float = 120.0) -> None:
        if not urls:
            raise ValueError("a scoring client needs at least one server URL")
        self.urls = [u.rstrip("/") for u in urls]
        self.max_concurrency = max_concurrency
        self.request_timeout_s, self.retry_budget_s = request_timeout_s, retry_budget_s
        self.batch = uuid.uuid4().hex[:8]
        self.calls = 0

    def score(self, sequences: Sequence[Sequence[int]], prompt_lengths: Sequence[int],
              topk: int) -> list[tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]]:
        """Per sample, its response tokens' ``[n]`` log-probs (and ``[n, K]`` top-k ids and
        log-probs with ``topk``) under the served model."""
        if not sequences:
            return []
        self.calls += 1
        return asyncio.run(self._score_all(sequences, prompt_lengths, topk))

    async def _score_all(self, sequences, prompt_lengths, topk):
        limit = asyncio.Semaphore(self.max_concurrency)
        timeout = aiohttp.ClientTimeout(total=self.request_timeout_s)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            async def one(i: int):
                async with limit:
                    return await self._score_one(session, i, list(sequences[i]), int(prompt_lengths[i]), topk)

            return await asyncio.gather(*(one(i) for i in range(len(sequences))))

    async def _score_one(self, session: aiohttp.ClientSession, index: int, ids: list[int], prompt_length: int,
                         topk: int):
        start = prompt_length - 1
        deadline, attempt, delay = None, 0, 0.5
        while True:
            url = self.urls[(index + attempt) % len(self.urls)]
            rid = f"score-{self.batch}-{self.calls}-{index}.a{attempt}"
            source = f"teacher sample {index} (rid {rid}) from {url}"
            try:
                async with session.post(f"{url}/generate", json=score_payload(
                        rid=rid, input_ids=ids, logprob_start_len=start, top_logprobs_num=topk)) as response:
                    raw = await response.read()
                    status = response.status
            except (aiohttp.ClientError, asyncio.TimeoutError) as err:
                status, raw = None, f"{type(err).__name__}: {err}".encode()
            if status == 200:
                try:
                    return decode_score_response(json.loads(raw), rid=rid, input_ids=ids, start=start, topk=topk,
                                                 source=source)
                except (ValueError, WireFormatError) as err:
                    raise ScoringError(f"{source}: {err}") from None
            if status is not None and 400 <= status < 500:
                raise ScoringError(f"{source}: HTTP {status}: {raw.decode(errors='replace')[:300]}")
            deadline = deadline or time.monotonic() + self.retry_budget_s
            if time.monotonic() > deadline:
                raise ScoringError(f"{source}: no answer within {self.retry_budget_s:g} s of retries "
                                   f"(last: {status or raw.decode(errors='replace')[:200]})")
            attempt += 1
            await asyncio.sleep(delay)
            delay = min(delay * 2, 8.0)
