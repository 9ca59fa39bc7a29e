"""Sockets a server is handed instead of a port number to bind: the port is bound by whoever
starts the server (:class:`~megatron_rl.rollout.sglang.server.ManagedServer`), so no other
process can take it between a pick (or a check) and the server's bind, and the server listens
on it once it can serve. Standard library only, as the server wrapper.
"""

from __future__ import annotations

import os
import socket
from urllib.parse import urlsplit

LISTEN_FD_ENV = "MEGATRON_RL_LISTEN_FD"
"""Set in the environment of a server started with a socket handed over: the number of the
inherited socket, bound to the server's port, which the server listens on when it is ready
to serve (until then a connection is refused, as with no server) instead of binding its own."""


def bound_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` (port 0: one the kernel picks as it binds), not yet
    listening, that no other process can bind meanwhile.

    Raises:
        OSError: the port is taken (``EADDRINUSE``) or the host is not this machine's.
    """
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        # As servers bind: the connections of a server stopped a moment ago (TIME_WAIT) do not
        # count. Cleared once bound: a port bound without listening is another's to bind too
        # while both sockets allow reuse.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 0)
    except OSError:
        sock.close()
        raise
    return sock


def inherited_socket(serving: bool = True) -> socket.socket | None:
    """The bound socket this process was handed to serve on (:data:`LISTEN_FD_ENV`), or None;
    the variable is removed, so nothing this process starts believes it holds the socket too.

    ``serving``: this process listens on it next, so its address becomes reusable again (as
    servers bind theirs): the connections it accepts then leave nothing that keeps a restarted
    server off the port. False to hand it on unchanged.
    """
    fd = os.environ.pop(LISTEN_FD_ENV, None)
    if fd is None:
        return None
    sock = socket.socket(fileno=int(fd))
    if serving:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    return sock


def with_port(url: str, port: int) -> str:
    """``url`` with another port."""
    parts = urlsplit(url)
    return parts._replace(netloc=f"{parts.hostname}:{port}").geturl()


def port_in_use(url: str, timeout_s: float = 1.0) -> bool:
    """Whether something accepts TCP connections at ``url``'s host and port."""
    parts = urlsplit(url)
    try:
        with socket.create_connection((parts.hostname, parts.port), timeout=timeout_s):
            return True
    except OSError:
        return False
