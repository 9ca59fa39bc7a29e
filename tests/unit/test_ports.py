"""Ports we pick are bound before anyone is told them: a port another process takes between a
pick and its bind (``EADDRINUSE``) cannot fail a run. Each test hands the old way of picking a
port that is already taken, so it fails where the pick is still made and bound later."""

import socket
import sys
import threading
from datetime import timedelta
from urllib.parse import urlsplit

import pytest
import torch

from megatron_rl.rollout.sglang import weight_transport
from megatron_rl.rollout.sglang.server import ManagedServer, ServerStartError, health_status
from megatron_rl.rollout.sglang.weight_payload import init_group_body


@pytest.fixture
def taken_port():
    """A port another process holds (listening), as a racing process would."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def test_the_weight_update_group_binds_its_rendezvous_before_telling_the_servers(monkeypatch, taken_port):
    monkeypatch.setattr(weight_transport, "free_port", lambda: taken_port, raising=False)
    told = {}

    def server_joins(urls, path, body_of, limits):
        # What a server does with /init_weights_update_group: join at the address and port it is told.
        # A raw gloo group (this process registers the trainer's side under the same name) under the
        # keys torch's _new_process_group_helper gives a group's gloo backend: "<name>" "<name>/" "cpu/".
        body = told["body"] = body_of(urls[0])
        store = torch.distributed.TCPStore(body["master_address"], body["master_port"], body["world_size"],
                                           is_master=False, timeout=timedelta(seconds=30))
        name = body["group_name"]
        keys = torch.distributed.PrefixStore("cpu/", torch.distributed.PrefixStore(
            f"{name}/", torch.distributed.PrefixStore(name, store)))
        told["group"] = torch.distributed.ProcessGroupGloo(keys, body["rank_offset"], body["world_size"],
                                                           timedelta(seconds=30))
        return [(urls[0], 200, {"success": True, "message": "joined"})]

    monkeypatch.setattr(weight_transport, "call_all", server_joins)
    limits = weight_transport.Limits(request_s=30.0, hang_check_after_s=30.0, liveness_s=10.0)
    transport = weight_transport.DistributedTransport(["http://server"], 1, "gloo", "127.0.0.1", 0, "ports_test",
                                                      limits)
    joining = threading.Thread(target=transport._open)
    joining.start()
    joining.join(90)
    assert transport.group is not None and told["body"]["master_port"] != taken_port
    assert told["body"] == init_group_body(address="127.0.0.1", port=told["body"]["master_port"], rank_offset=1,
                                           world_size=2, group_name="ports_test", backend="gloo")
    flat = torch.arange(4.0)
    received = torch.zeros(4)
    peer = threading.Thread(target=lambda: told["group"].broadcast(received, 0).wait())
    peer.start()
    torch.distributed.broadcast(flat, 0, group=transport.group)
    peer.join(60)
    assert torch.equal(received, flat)
    torch.distributed.destroy_process_group(transport.group)


HANDED_SERVER = """
import http.server, sys, time
from megatron_rl.rollout.sglang.sockets import inherited_socket
time.sleep(float(sys.argv[1]))  # starting up
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers()
    def log_message(self, *a):
        pass
server = http.server.HTTPServer(("127.0.0.1", 0), H, bind_and_activate=False)
server.socket = inherited_socket()
server.server_activate()  # listens: ready to serve
server.serve_forever()
"""


def test_a_server_serves_on_the_socket_bound_as_it_starts_and_keeps_its_port_on_restart(taken_port):
    server = ManagedServer([sys.executable, "-c", HANDED_SERVER, "1.0"], "http://127.0.0.1:0", listen="127.0.0.1")
    try:
        server.start()
        port = urlsplit(server.url).port
        # Starting: the port is the server's, but refuses connections (none wait in a queue
        # for a server that may never answer), and nobody else can bind it, reuse or not.
        assert port not in (0, taken_port) and health_status(server.url) == 0
        with socket.socket() as thief, pytest.raises(OSError, match="Address already in use"):
            thief.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            thief.bind(("127.0.0.1", port))
        server.wait_healthy(timeout_s=60, poll_s=0.05)
        server.kill()
        server.process.wait()
        assert health_status(server.url) == 0  # a dead server's port refuses: nothing of ours holds it
        server.start().wait_healthy(timeout_s=60, poll_s=0.05)
        assert urlsplit(server.url).port == port
    finally:
        server.stop()
    taken = ManagedServer([sys.executable, "-c", HANDED_SERVER, "0"], f"http://127.0.0.1:{taken_port}",
                          listen="127.0.0.1")
    with pytest.raises(ServerStartError, match=f"port {taken_port} is already in use"):
        taken.start()
    assert taken.process is None
