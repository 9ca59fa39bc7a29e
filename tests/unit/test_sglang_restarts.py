"""A server restarted between two weight pushes (no rollout in between to see it) is counted
(``sglang/restarts``) and the push rebuilds what the server lost (its session, its group)."""

from megatron_rl.rollout.sglang import weight_sync
from megatron_rl.rollout.sglang.weight_sync import WeightSync, WeightSyncConfig, restarted_servers


class _Transport:
    def __init__(self) -> None:
        self.calls = []

    def reset(self) -> None:
        self.calls.append("reset")

    def start(self) -> None:
        self.calls.append("start")


def test_a_push_that_finds_a_restarted_server_counts_it_and_reconnects(monkeypatch, capsys):
    answers = iter([{"http://a": {"startup_time": {"t": 1.0}}, "http://b": {"startup_time": {"t": 2.0}}},
                    {"http://a": {"startup_time": {"t": 1.0}}, "http://b": {"startup_time": {"t": 2.0}}},
                    {"http://a": {"startup_time": {"t": 9.0}}, "http://b": {"startup_time": {"t": 2.0}}}])
    monkeypatch.setattr(weight_sync, "probe_servers", lambda urls, **limits: next(answers))
    sync = object.__new__(WeightSync)  # what opening a push needs of rank 0's sync
    sync.cfg, sync.urls, sync.started_at, sync.restarts = WeightSyncConfig(), ["http://a", "http://b"], {}, 0
    sync.servers_checked, sync.transport = False, _Transport()
    sync.sessions = type("Sessions", (), {"begin": lambda self: None})()
    checked = []
    monkeypatch.setattr(sync, "_check_servers", lambda: checked.append(True), raising=False)
    for _ in range(3):
        sync._open(reconnect=False)
    assert sync.take_restarts() == 1 and sync.take_restarts() == 0
    assert checked == [True, True] and sync.transport.calls == ["start", "start", "reset", "start"]
    assert capsys.readouterr().out == "SGLang servers restarted since the last push: http://a\n"


def test_restarted_servers_compares_startup_times():
    started_at = {}
    assert restarted_servers(started_at, {"http://a": {"startup_time": 1}}) == []  # first seen
    assert restarted_servers(started_at, {"http://a": {"startup_time": 1}}) == []
    assert restarted_servers(started_at, {"http://a": {"startup_time": 2}}) == ["http://a"]
    assert started_at == {"http://a": 2}
