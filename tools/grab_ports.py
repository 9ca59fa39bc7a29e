"""Grab localhost ports in a loop, as a busy machine's other processes do: for checking that no
port we pick can be taken between its pick and its bind.

    unshare -rn sh -c 'ip link set lo up && python tools/grab_ports.py --seconds 3600 & pytest -q tests/...'

Each round binds a port the kernel picks (``bind(("127.0.0.1", 0))``, the same pick as a
"free port" helper's), listens on it, holds it among the last ``--hold`` ports taken and releases
the oldest, so a port picked free and bound a moment later is taken meanwhile with a
probability of about rate x gap / ports in the ephemeral range. Run it in a network namespace
of its own (``unshare -rn``, as above) so other users of the machine are not disturbed. Prints
the rounds per second when it ends (``--seconds``, or SIGTERM/SIGINT).
"""

from __future__ import annotations

import argparse
import collections
import signal
import socket
import sys
import time


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=600.0, help="stop after this long")
    parser.add_argument("--hold", type=int, default=2000, help="ports held at once")
    parser.add_argument("--pause-s", type=float, default=0.0, help="sleep between rounds")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    held: collections.deque[socket.socket] = collections.deque()
    rounds, started = 0, time.monotonic()
    try:
        while time.monotonic() - started < args.seconds:
            sock = socket.socket()
            try:
                sock.bind(("127.0.0.1", 0))
                sock.listen()
            except OSError:
                sock.close()
                time.sleep(0.01)
                continue
            held.append(sock)
            if len(held) > args.hold:
                held.popleft().close()
            rounds += 1
            if args.pause_s:
                time.sleep(args.pause_s)
    except KeyboardInterrupt:
        pass
    finally:
        elapsed = time.monotonic() - started
        print(f"grab_ports: {rounds} ports grabbed in {elapsed:.0f} s ({rounds / max(elapsed, 1e-9):.0f}/s), "
              f"{args.hold} held at once", file=sys.stderr, flush=True)
        for sock in held:
            sock.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
