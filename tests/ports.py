"""Ports for the tests' own servers and peers, none of which another process can take between
a pick and a bind: hand a bound socket over (``ManagedServer(listen=...)``, the servers here
read it with ``server.inherited_socket()``), hold a refusing port for as long as a test needs
one, or, for a consumer that takes only a port number, start again on a fresh port when the
one picked was taken first (:func:`on_a_fresh_port`)."""

from __future__ import annotations

import contextlib
import socket
import sys
from collections.abc import Callable, Iterator
from typing import TypeVar

T = TypeVar("T")

TAKEN = ("EADDRINUSE", "Address already in use", "address already in use", "is already in use")
"""How a port taken between its pick and its bind shows in an error or a log."""


class PortTaken(RuntimeError):
    """The port picked for a start was taken by another process before the start bound it."""


@contextlib.contextmanager
def refused_url() -> Iterator[str]:
    """A URL whose port refuses connections for as long as the block runs: bound here, never
    listened on, so no server of another process can answer there."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"


def free_port() -> int:
    """A TCP port free on localhost right now, which another process may take before its
    consumer binds it: only for consumers that take a port number, through :func:`on_a_fresh_port`."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def was_taken(text: str) -> bool:
    """Whether ``text`` (an error, a log) says a port was in use."""
    return any(mark in text for mark in TAKEN)


def on_a_fresh_port(start: Callable[[int], T], attempts: int = 3) -> T:
    """``start(port)`` on a port free now; when ``start`` raises :class:`PortTaken`, again on a
    fresh port, saying so in one line (at most ``attempts`` starts)."""
    for attempt in range(1, attempts + 1):
        port = free_port()
        try:
            return start(port)
        except PortTaken as err:
            if attempt == attempts:
                raise
            print(f"port {port} was taken before it was bound ({str(err).splitlines()[0][:200]}); "
                  f"starting again on a fresh port", file=sys.stderr, flush=True)
    raise AssertionError("unreachable")
