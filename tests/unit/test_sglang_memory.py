"""Colocated runs' memory protocol: the stand-in dies where SGLang 0.5.23 dies, and our client
refuses first (the rules and their SGLang lines: ``rollout/sglang/memory.py``,
``sglang_standin/memory.py``; the texts against SGLang's source:
``test_sglang_conformance.py``). The order of calls in a run: ``tests/e2e/test_colocated.py``."""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from megatron_rl.config import load_config
from megatron_rl.config_loading import ConfigError
from megatron_rl.rollout.engine import SamplingParams
from megatron_rl.rollout.sglang.memory import (
    TAGS,
    MemoryProtocolError,
    ServerMemory,
    release_servers,
)
from megatron_rl.sglang_standin.memory import TAGS as STANDIN_TAGS
from megatron_rl.sglang_standin.memory import MemoryOccupation, parse_tags
from megatron_rl.sglang_standin.weights import SchedulerCrash
from megatron_rl.rollout.sglang.weight_transport import Limits

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def test_the_stand_in_dies_where_sglang_dies():
    occupation = MemoryOccupation(memory_saver=True)
    with pytest.raises(SchedulerCrash, match="AssertionError: release_memory_occupation should be called only when"):
        occupation.release(None, idle=False)
    with pytest.raises(SchedulerCrash, match="KeyError: 'weights'"):
        occupation.resume(["weights"])
    assert occupation.release(["weights"], idle=True) == ["weights"]
    assert occupation.fault(["weights"]) and occupation.fault(["kv_cache"]) is None
    with pytest.raises(SchedulerCrash, match="Cannot pause allocation that is not active"):
        occupation.release(None, idle=True)  # [] / None mean all three, weights among them


def test_release_and_resume_by_tag_and_the_report():
    occupation = MemoryOccupation(memory_saver=True)
    assert occupation.release([], idle=True) == list(STANDIN_TAGS)
    assert occupation.resume(["weights"]) == ["weights"]
    report = occupation.report(paused=True)
    assert report["regions"] == {"kv_cache": "released", "weights": "resident", "cuda_graph": "released"}
    assert report["offload_tags"] == ["cuda_graph", "kv_cache"] and report["generation_paused"]
    assert occupation.resume(["kv_cache", "cuda_graph"]) == ["kv_cache", "cuda_graph"]
    assert occupation.report(paused=False)["regions"] == dict.fromkeys(STANDIN_TAGS, "resident")
    partly = MemoryOccupation(memory_saver=True)
    partly.release(None, idle=True)
    partly.resume(["weights"])
    with pytest.raises(SchedulerCrash, match="KeyError: 'weights'"):
        partly.resume(None)  # all three, weights resumed already


def test_without_the_memory_saver_only_the_tags_change():
    occupation = MemoryOccupation(memory_saver=False)
    assert occupation.release(None, idle=True) == [] and occupation.release(None, idle=True) == []
    assert occupation.fault(STANDIN_TAGS) is None
    assert occupation.resume(["weights"]) == []
    with pytest.raises(SchedulerCrash, match="KeyError"):
        occupation.resume(["weights"])


def test_tags_must_be_null_or_strings():
    assert parse_tags({}) is None and parse_tags({"tags": ["weights"]}) == ["weights"]
    with pytest.raises(ValueError, match="tags must be null or a list of strings"):
        parse_tags({"tags": "weights"})


def test_our_client_refuses_before_the_server_would_die():
    memory = ServerMemory(["http://127.0.0.1:1"], Limits(1.0, 1.0, 1.0), released=True)
    assert TAGS == STANDIN_TAGS
    with pytest.raises(MemoryProtocolError, match="generate while the SGLang servers' memory is released"):
        memory.check_generate()
    with pytest.raises(MemoryProtocolError, match="weight push while the SGLang servers' weights are released"):
        memory.check_push()
    with pytest.raises(MemoryProtocolError, match="released already"):
        memory.check_release(0)
    memory.mark_resumed(["weights"])
    memory.check_push()
    with pytest.raises(MemoryProtocolError, match=r"\['weights'\] not released .*KeyError"):
        memory.check_resume(["weights"])
    with pytest.raises(MemoryProtocolError, match="unknown tags"):
        memory.check_resume(["kv"])
    with pytest.raises(MemoryProtocolError, match="generation paused"):
        memory.check_generate()  # the KV cache is still released
    memory.mark_resumed(["kv_cache", "cuda_graph"])
    memory.check_generate()
    assert memory.describe() == "resident"
    with pytest.raises(MemoryProtocolError, match="with 2 generation.* in flight.*weight_updater.py:339-341"):
        memory.check_release(2)


@pytest.mark.parametrize("overrides, culprit", [
    (["rollout.engine=megatron"], "rollout.engine=megatron"),
    (["rollout.engine=sglang", "rollout.sglang.urls=[http://h:1]", "rollout.max_staleness=1"],
     "rollout.max_staleness=1"),
    (["rollout.engine=sglang", "rollout.sglang.urls=[http://h:1]", "rollout.sglang.weight_sync=none"],
     "rollout.sglang.weight_sync=none"),
])
def test_colocated_placement_refuses_what_cannot_take_turns(overrides, culprit):
    with pytest.raises(ConfigError, match=f"rollout.placement: colocated with {culprit}"):
        load_config(CONFIGS / "demo_cpu.yaml", ["rollout.placement=colocated", *overrides])


def test_colocated_placement_with_the_hf_engine_is_accepted():
    cfg = load_config(CONFIGS / "demo_cpu.yaml", ["rollout.placement=colocated", "rollout.engine=hf"])
    assert cfg.rollout.placement == "colocated"


class _Recorder(BaseHTTPRequestHandler):
    """A server that answers ``/server_info`` with ``saver`` and records every POST."""

    saver = False
    posts: list = []

    def log_message(self, *args) -> None:
        pass

    def _answer(self, body) -> None:
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        self._answer({"enable_memory_saver": type(self).saver} if self.path == "/server_info" else {})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"null")
        type(self).posts.append([self.path, body])
        self._answer(None)


def test_servers_without_the_memory_saver_are_refused_and_the_others_paused_then_released():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    limits = Limits(10.0, 10.0, 10.0)
    _Recorder.saver, _Recorder.posts = False, []
    try:
        with pytest.raises(MemoryProtocolError, match=f"{url} run without --enable-memory-saver"):
            release_servers([url], limits)
        assert _Recorder.posts == []
        _Recorder.saver = True
        release_servers([url], limits)
        assert _Recorder.posts == [["/pause_generation", {"mode": "abort"}],
                                   ["/release_memory_occupation", {"tags": ["kv_cache", "weights", "cuda_graph"]}]]
    finally:
        server.shutdown()


def test_the_engine_sends_nothing_the_rules_refuse():
    from megatron_rl.rollout.sglang.client import RouteShape, SGLangClientConfig
    from megatron_rl.rollout.sglang.engine import SGLangEngine

    _Recorder.saver, _Recorder.posts = True, []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    memory = ServerMemory([url], Limits(10.0, 10.0, 10.0), released=True)
    engine = SGLangEngine(SGLangClientConfig(urls=[url]), RouteShape(num_layers=2, topk=2, num_experts=4),
                          memory=memory)
    try:
        with pytest.raises(MemoryProtocolError, match="generate while"):
            engine.generate([[1, 2]], SamplingParams(max_new_tokens=1), seed=0)
        with pytest.raises(MemoryProtocolError, match="generate while"):
            engine.start_generate([[1, 2]], SamplingParams(max_new_tokens=1), seed=0)
        engine.resume_memory(["weights"])
        with pytest.raises(MemoryProtocolError, match="not released"):
            engine.resume_memory(["weights"])
        engine.resume_memory(["kv_cache", "cuda_graph"])
        engine.pending.add(0)  # a batch start_generate began and finish_generate has not ended
        with pytest.raises(MemoryProtocolError, match="in flight"):
            engine.release_memory()
        engine.pending.clear()
        engine.release_memory()
    finally:
        server.shutdown()
    assert _Recorder.posts == [["/resume_memory_occupation", {"tags": ["weights"]}],
                               ["/resume_memory_occupation", {"tags": ["kv_cache", "cuda_graph"]}],
                               ["/continue_generation", {}], ["/pause_generation", {"mode": "abort"}],
                               ["/release_memory_occupation", {"tags": ["kv_cache", "weights", "cuda_graph"]}]]
    assert memory.describe().startswith("released")
