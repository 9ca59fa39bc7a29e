"""Request bodies of the CPU stand-in, parsed where its event loop does not wait for them.

The loop that parses a body is the loop that answers ``/ping`` and every other request; a
weight update's body is the size of a bucket (512 MB by default, as base64 text in JSON), and
``json.loads`` of it holds the GIL for its whole length (seconds; a thread would not free the
loop). A large body is therefore parsed by a child process (the interpreter alone, ``-I``:
``json`` and ``pickle``, started in ~30 ms) that hands the result back pickled, which this
process loads on a thread (a copy, a tenth of the parse). Small bodies (``/generate``'s) are
parsed inline.
"""

from __future__ import annotations

import asyncio
import json
import pickle
import sys
from typing import Any

from aiohttp import web

INLINE_BYTES = 1 << 20
"""Bodies up to this size are parsed on the loop (a millisecond or less)."""

_PARSER = ("import json, pickle, sys; "
           "pickle.dump(json.loads(sys.stdin.buffer.read()), sys.stdout.buffer, protocol=pickle.HIGHEST_PROTOCOL)")


async def json_body(request: web.Request) -> Any:
    """The request's JSON body (a large one parsed by a child process).

    Raises:
        ValueError: the body is not JSON (the parser's own message).
    """
    raw = await request.read()
    if len(raw) <= INLINE_BYTES:
        return json.loads(raw)
    parser = await asyncio.create_subprocess_exec(sys.executable, "-I", "-c", _PARSER, stdin=asyncio.subprocess.PIPE,
                                                  stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await parser.communicate(raw)
    del raw
    if parser.returncode != 0:
        lines = err.decode(errors="replace").strip().splitlines()
        raise ValueError(lines[-1] if lines else f"the body parser exited with code {parser.returncode}")
    return await asyncio.to_thread(pickle.loads, out)
