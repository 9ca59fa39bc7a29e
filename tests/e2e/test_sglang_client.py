"""The SGLang client over real HTTP: faults, restarts, load balancing, memory, and the launcher.

One protocol server (the HF engine behind SGLang's endpoints) serves the whole
module; a light fake server in a subprocess produces large route payloads quickly for the
memory test. Every batch is checked to hold each prompt's sample exactly once.
"""

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest
import torch
from ports import refused_url
from protocol_servers import running_protocol_server

from megatron_rl.rollout.engine import SamplingParams
from megatron_rl.rollout.sglang.client import (
    RolloutRequestError,
    RouteShape,
    SGLangClient,
    SGLangClientConfig,
    StaleWeightVersionError,
)
from megatron_rl.rollout.sglang.control import EncodedJSON, request_json
from megatron_rl.rollout.sglang.engine import SGLangEngine
from megatron_rl.rollout.sglang.scoring import ScoringClient, ScoringError
from megatron_rl.rollout.sglang.server import (
    ManagedServer,
    ServerStartError,
    SGLangServerConfig,
    build_command,
)

ROUTES = RouteShape(num_layers=4, topk=2, num_experts=8)
PARAMS = SamplingParams(temperature=1.0, max_new_tokens=3, stop_token_ids=(2,))
QUIET = {"PYTHONWARNINGS": "ignore"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from running_protocol_server(tmp_path_factory.mktemp("server"), "--weight-version", "0")


def _prompts(n: int) -> list[list[int]]:
    return [[10 + i % 9, 20, 11 + i % 5, 30] for i in range(n)]


def _generate(urls, prompts, *, expected="0", params=PARAMS, routes=True, **cfg):
    settings = dict(urls=urls, max_retries=3, backoff_s=0.05, backoff_max_s=0.5, request_timeout_s=60.0)
    client_cfg = SGLangClientConfig(**{**settings, **cfg})

    async def run():
        async with SGLangClient(client_cfg, ROUTES) as client:
            results = await client.generate(prompts, params, return_routed_experts=routes, expected_version=expected,
                                            seeds=list(range(len(prompts))))
            return results, client.stats

    return asyncio.run(run())


def _check_exactly_once(prompts, results):
    assert len(results) == len(prompts)
    batch = results[0].rid.split("-")[0]
    for i, (prompt, r) in enumerate(zip(prompts, results)):
        assert r.rid.startswith(f"{batch}-{i}.a"), (i, r.rid)  # the result answers sample i
        assert 1 <= len(r.output_ids) <= PARAMS.max_new_tokens
        assert r.output_logprobs.shape == (len(r.output_ids),) and bool((r.output_logprobs <= 0).all())
        assert (r.finish_reason == "stop") == (r.output_ids[-1] == 2)
        if r.routed_experts is not None:
            n = len(prompt) + len(r.output_ids) - 1
            assert r.routed_experts.shape == (n, 4, 2) and r.routed_experts.dtype == torch.uint8


def _arm(server, kind, times=1, **extra):
    status, body = request_json("POST", server.url + "/_test/fault", {"kind": kind, "times": times, **extra})
    assert status == 200, body


def test_prompt_scoring_gives_the_log_probs_generation_sampled_with(server):
    """A distillation teacher's requests (``ScoringClient``: prefill-only, prompt log-probs with the
    top-5): each response token's log-prob is the one generation at temperature 1 reported for it
    (the HF replica generated it, the served Megatron model scores it: within 1e-4); the top-5 come
    in decreasing order, the first at least the sampled token's, and a sampled token among them
    has its own log-prob there. A request SGLang refuses fails at once, naming the sample."""
    prompts = _prompts(4)
    results, _ = _generate([server.url], prompts, routes=False)
    client = ScoringClient([server.url], retry_budget_s=5.0)
    scored = client.score([p + r.output_ids for p, r in zip(prompts, results)], [len(p) for p in prompts], topk=5)
    for r, (logprobs, ids, top) in zip(results, scored):
        assert (logprobs - r.output_logprobs).abs().max() < 1e-4
        assert ids.shape == top.shape == (len(r.output_ids), 5)
        assert bool((top[:, :-1] >= top[:, 1:]).all()) and bool((top[:, 0] >= logprobs - 1e-6).all())
        for t, token in enumerate(r.output_ids):
            if token in ids[t].tolist():
                assert abs(float(top[t, ids[t].tolist().index(token)]) - float(logprobs[t])) < 1e-6
    with pytest.raises(ScoringError, match="teacher sample 0 .* HTTP 400"):
        client.score([[10, 20, 30]], [5], topk=0)  # logprob_start_len 4 is past the 3 input tokens


def test_health_model_info_and_a_batch(server):
    async def info():
        async with SGLangClient(SGLangClientConfig(urls=[server.url]), ROUTES) as client:
            return await client.check_servers(), await client.health(server.url, generate=True)

    infos, healthy = asyncio.run(info())
    assert healthy and infos[server.url]["weight_version"] == "0" and infos[server.url]["tp_size"] == 1
    prompts = _prompts(12)
    results, stats = _generate([server.url], prompts)
    _check_exactly_once(prompts, results)
    assert stats.attempts == 12 and not stats.retries and stats.max_in_flight <= 12
    greedy = SamplingParams(temperature=0.0, max_new_tokens=3)
    first, _ = _generate([server.url], prompts[:4], params=greedy)
    again, _ = _generate([server.url], prompts[:4], params=greedy)
    assert [r.output_ids for r in first] == [r.output_ids for r in again]
    assert all(torch.equal(a.routed_experts, b.routed_experts) for a, b in zip(first, again))


@pytest.mark.parametrize("kind,cause,extra,timeout_s", [
    ("http_500", "http_5xx", {}, 60.0),
    ("malformed_json", "malformed_json", {}, 60.0),
    ("delay", "timeout", {"delay_s": 10.0}, 4.0),
    ("wrong_route_length", "bad_payload", {}, 60.0),
    ("stale_version", "stale_version", {}, 60.0),
    ("abort", "aborted", {}, 60.0),
])
def test_a_fault_once_costs_one_retry_and_no_sample(server, kind, cause, extra, timeout_s):
    _arm(server, kind, **extra)
    prompts = _prompts(6)
    results, stats = _generate([server.url], prompts, request_timeout_s=timeout_s)
    _check_exactly_once(prompts, results)
    assert stats.retries == {cause: 1} and stats.attempts == 7
    assert sum(r.meta["attempts"] for r in results) == 7


def test_persistent_faults_end_in_clear_errors(server):
    _arm(server, "http_500", times=100)
    try:
        with pytest.raises(RolloutRequestError, match=r"gave up after 3 attempts; last failure \(http_5xx\).*HTTP 500"):
            _generate([server.url], _prompts(2), max_retries=2)
        _arm(server, "wrong_route_length", times=100)
        _arm(server, "http_500", times=0)
        with pytest.raises(RolloutRequestError, match=r"bad_payload.*expected \d+ = \d+ positions"):
            _generate([server.url], _prompts(1), max_retries=1)
    finally:
        _arm(server, "http_500", times=0)
        _arm(server, "wrong_route_length", times=0)
    _arm(server, "no_routes")
    with pytest.raises(RolloutRequestError, match=r"with --enable-return-routed-experts \(not retried\)"):
        _generate([server.url], _prompts(1))
    with pytest.raises(StaleWeightVersionError, match="generated with weight version '0', expected '7'"):
        _generate([server.url], _prompts(1), expected="7", max_retries=1)
    too_long = [list(range(2, 64))]  # 62 prompt tokens + 3 new > max_position_embeddings 64
    with pytest.raises(RolloutRequestError, match="HTTP 400 \\(request refused, not retried\\).*exceeds 64"):
        _generate([server.url], too_long)


def test_the_logprob_convention_is_the_runs_or_refused_before_any_sample_is_used(server):
    """Item 5: this server runs without SGLANG_RETURN_ORIGINAL_LOGPROB (SGLang's default, as the
    module's server is launched), so at T = 0.7 it reports log_softmax(logits / T), the distribution
    it samples: what a run of the sampled policy scores, so the probe lets it through; a run of the
    T = 1 objective (raw_logprobs) would read those as raw, and its probe refuses the server before
    the first such batch."""
    hot = SamplingParams(temperature=0.7, max_new_tokens=3)
    engine = SGLangEngine(SGLangClientConfig(urls=[server.url], max_retries=1), ROUTES)
    samples = engine.generate(_prompts(2), hot)
    assert len(samples) == 2 and engine.convention_checked and {s.temperature for s in samples} == {0.7}
    raw = SGLangEngine(SGLangClientConfig(urls=[server.url], max_retries=1, raw_logprobs=True), ROUTES)
    assert len(raw.generate(_prompts(2), PARAMS)) == 2  # T = 1: both conventions agree, no probe
    with pytest.raises(RolloutRequestError, match=rf"SGLang server {server.url} returns scaled log-probs.*"
                                                  r"train.policy_temperature=one.*SGLANG_RETURN_ORIGINAL_LOGPROB=1"):
        raw.generate(_prompts(2), hot)
    assert not raw.convention_checked


def test_seeds_are_honoured_only_with_deterministic_inference(server):
    """Item 7: SGLang ignores sampling_seed unless launched with --enable-deterministic-inference;
    so does the stand-in, and a run that asks for seeded sampling refuses such a server."""
    params = SamplingParams(temperature=1.0, max_new_tokens=8)
    prompts = _prompts(4)

    async def twice():
        async with SGLangClient(SGLangClientConfig(urls=[server.url]), ROUTES) as client:
            kw = dict(return_routed_experts=False, seeds=[5] * len(prompts))
            return await client.generate(prompts, params, **kw), await client.generate(prompts, params, **kw)

    first, again = asyncio.run(twice())
    assert [r.output_ids for r in first] != [r.output_ids for r in again]  # the same seeds, other samples

    async def seeded():
        async with SGLangClient(SGLangClientConfig(urls=[server.url], deterministic_inference=True), ROUTES) as c:
            return await c.check_servers()

    with pytest.raises(RolloutRequestError, match=rf"{server.url} run without --enable-deterministic-inference"):
        asyncio.run(seeded())
    assert "--enable-deterministic-inference" in build_command(SGLangServerConfig(model_path="/m",
                                                                                   deterministic_inference=True))


BUSY_SERVER = r"""
import asyncio, sys
from aiohttp import web
import torch
from megatron_rl.rollout.sglang.sockets import inherited_socket
from megatron_rl.rollout.sglang.wire import generate_response_payload
busy = [0]
async def generate(request):
    body = await request.json()
    busy[0] += 1
    await asyncio.sleep(4.0)  # a long generation: no byte until it is done
    busy[0] -= 1
    return web.json_response(generate_response_payload(
        rid=body["rid"], prompt_len=len(body["input_ids"]), output_ids=[5], output_logprobs=torch.tensor([-0.5]),
        finish_reason="length", weight_version="0", routed_experts=None))
async def health(request):
    if busy[0]:  # SGLang's /health waits for scheduler output, up to 20 s, then 503
        await asyncio.sleep(30.0)
        return web.Response(status=503)
    return web.Response()
app = web.Application()
app.add_routes([web.post("/generate", generate), web.get("/health", health),
                web.get("/ping", lambda r: web.Response()),
                web.get("/model_info", lambda r: web.json_response({"weight_version": "0"})),
                web.get("/server_info", lambda r: web.json_response({"tp_size": 1}))])
web.run_app(app, sock=inherited_socket(), print=None)
"""


def test_a_busy_server_is_not_called_hung(tmp_path):
    """Item 6: SGLang's /health is a one-token generation that a busy or paused scheduler answers
    only after up to 20 s; the hang detector asks /server_info (which a busy scheduler answers
    between two batches), so a request that takes longer than hang_check_after_s +
    health_timeout_s on a live server is waited for."""
    script = tmp_path / "busy_sglang.py"
    script.write_text(BUSY_SERVER)
    with ManagedServer([sys.executable, str(script)], "http://127.0.0.1:0", env=QUIET, listen="127.0.0.1") as busy:
        results, stats = _generate([busy.url], _prompts(2), expected=None, routes=False, hang_check_after_s=1.0,
                                   health_timeout_s=2.0)
    assert [r.output_ids for r in results] == [[5], [5]] and stats.timeouts == 0 and not stats.retries


def test_two_urls_share_the_load_and_a_dead_one_is_avoided(server):
    port = server.url.rsplit(":", 1)[1]
    prompts = _prompts(16)
    results, stats = _generate([server.url, f"http://localhost:{port}"], prompts)
    _check_exactly_once(prompts, results)
    assert len(stats.per_server) == 2 and min(stats.per_server.values()) >= 4
    with refused_url() as dead:
        results, stats = _generate([dead, server.url], prompts, server_cooldown_s=30.0)
    _check_exactly_once(prompts, results)
    # Only the first requests sent to the dead server fail; its cool-down keeps retries away.
    assert stats.per_server == {server.url: 16} and 1 <= stats.retries["connection"] <= 8
    assert stats.attempts == 16 + stats.retries["connection"]


def test_server_killed_mid_batch_and_restarted(server):
    _arm(server, "delay", times=1000, delay_s=2.0)  # keeps every request of the batch in flight
    prompts = _prompts(10)
    before = request_json("GET", server.url + "/_test/stats")[1]
    events = {}

    def crash_and_restart():
        # Killed once the whole batch is inside (each request held 2 s), not after a fixed sleep:
        # under load the batch took longer than 1 s to arrive.
        deadline = time.monotonic() + 120
        while (request_json("GET", server.url + "/_test/stats")[1]["generate_requests"] - before["generate_requests"]
               < len(prompts) and time.monotonic() < deadline):
            time.sleep(0.05)
        events["at_kill"] = request_json("GET", server.url + "/_test/stats")[1]
        os.killpg(server.process.pid, signal.SIGKILL)
        server.process.wait()
        server.start()
        server.wait_healthy(timeout_s=180, poll_s=0.2)

    restarter = threading.Thread(target=crash_and_restart)
    restarter.start()
    try:
        results, stats = _generate([server.url], prompts, max_retries=200, backoff_s=0.5, backoff_max_s=2.0)
    finally:
        restarter.join()
    _check_exactly_once(prompts, results)
    # The whole batch was inside the server when it died, and no first attempt was answered.
    assert events["at_kill"]["generate_requests"] - before["generate_requests"] == 10
    assert all(r.meta["attempts"] >= 2 for r in results)
    assert stats.retries.get("connection", 0) >= 10
    served = request_json("GET", server.url + "/_test/stats")[1]
    assert served["responses"] == 10 and served["weight_version"] == "0"


FAKE_SERVER = r"""
import sys
from aiohttp import web
import torch
from megatron_rl.rollout.sglang.sockets import inherited_socket
from megatron_rl.rollout.sglang.wire import generate_response_payload
prompt_len, output_len, layers, topk = map(int, sys.argv[1:5])
routes = torch.stack([torch.randperm(64)[:topk] for _ in range((prompt_len + output_len - 1) * layers)])
body = web.json_response(generate_response_payload(
    rid="@RID@", prompt_len=prompt_len, output_ids=list(range(3, 3 + output_len)),
    output_logprobs=torch.full((output_len,), -0.5), finish_reason="length", weight_version="0",
    routed_experts=routes.reshape(-1, layers, topk))).text
state = {"now": 0, "max": 0}
async def generate(request):
    rid = (await request.json())["rid"]
    state["now"] += 1
    state["max"] = max(state["max"], state["now"])
    try:
        return web.Response(text=body.replace("@RID@", rid), content_type="application/json")
    finally:
        state["now"] -= 1
async def stats(request):
    return web.json_response(state)
app = web.Application()
app.add_routes([web.post("/generate", generate), web.get("/health", lambda r: web.Response()),
                web.get("/_test/stats", stats)])
web.run_app(app, sock=inherited_socket(), print=None)
"""


def test_many_simultaneous_requests_keep_client_memory_bounded(tmp_path):
    prompt_len, output_len, layers, topk, count, concurrency = 200, 56, 24, 8, 1000, 64
    script = tmp_path / "fake_sglang.py"
    script.write_text(FAKE_SERVER)
    cmd = [sys.executable, str(script), str(prompt_len), str(output_len), str(layers), str(topk)]
    with ManagedServer(cmd, "http://127.0.0.1:0", env=QUIET, listen="127.0.0.1") as fake:
        shape = RouteShape(num_layers=layers, topk=topk, num_experts=64)
        # The fake has no /server_info: a reply slower than the hang check (15 s) under load was
        # called hung; this test is about memory, so the check waits as long as a request may.
        cfg = SGLangClientConfig(urls=[fake.url], max_concurrency=concurrency, request_timeout_s=120.0,
                                 hang_check_after_s=120.0)
        prompts = [[5] * prompt_len for _ in range(count)]
        params = SamplingParams(max_new_tokens=output_len)

        async def run(n):
            async with SGLangClient(cfg, shape) as client:
                results = await client.generate(prompts[:n], params, return_routed_experts=True)
                return results, client.stats

        asyncio.run(run(concurrency))  # warm up allocator and imports before the baseline
        process, peak, done = psutil.Process(), [0], threading.Event()

        def sample_rss():
            while not done.is_set():
                peak[0] = max(peak[0], process.memory_info().rss)
                time.sleep(0.005)

        baseline = process.memory_info().rss
        sampler = threading.Thread(target=sample_rss)
        sampler.start()
        started = time.perf_counter()
        try:
            results, stats = asyncio.run(run(count))
        finally:
            done.set()
            sampler.join()
        elapsed = time.perf_counter() - started
        server_max = request_json("GET", fake.url + "/_test/stats")[1]["max"]
    ids_per_sample = (prompt_len + output_len - 1) * layers * topk
    compact_total = sum(r.routed_experts.numel() * r.routed_experts.element_size() for r in results)
    wire_total = count * ids_per_sample * 4
    growth = peak[0] - baseline
    print(f"\n{count} requests x {ids_per_sample * 4 / 1e3:.0f} kB int32 routes in {elapsed:.1f}s, "
          f"concurrency {concurrency}: client RSS growth {growth / 2**20:.0f} MiB; compact results "
          f"{compact_total / 2**20:.0f} MiB; int32 payloads would be {wire_total / 2**20:.0f} MiB")
    assert len(results) == count and all(r.routed_experts.dtype == torch.uint8 for r in results)
    assert compact_total == count * ids_per_sample
    assert stats.max_in_flight == concurrency and server_max <= concurrency
    assert growth < compact_total + 64 * 2**20 < wire_total


def test_launcher_command_line_and_cli():
    cfg = SGLangServerConfig(model_path="/ckpt", port=31000, tp_size=4, mem_fraction_static=0.7, quantization="fp8",
                             kv_cache_dtype="fp8_e4m3", weight_version="0", extra_args=["--disable-radix-cache"])
    cmd = build_command(cfg)
    assert cmd[1:3] == ["-m", "sglang.launch_server"]
    pairs = {cmd[i]: cmd[i + 1] for i in range(3, len(cmd) - 1) if cmd[i].startswith("--")}
    assert pairs["--model-path"] == "/ckpt" and pairs["--tp-size"] == "4" and pairs["--port"] == "31000"
    assert pairs["--mem-fraction-static"] == "0.7" and pairs["--quantization"] == "fp8"
    assert pairs["--kv-cache-dtype"] == "fp8_e4m3" and pairs["--weight-version"] == "0"
    assert "--enable-return-routed-experts" in cmd and "--skip-tokenizer-init" in cmd
    assert cmd[-1] == "--disable-radix-cache" and cfg.url == "http://127.0.0.1:31000"
    plain = build_command(SGLangServerConfig(model_path="/m"))
    assert "--quantization" not in plain and "--mem-fraction-static" not in plain
    out = subprocess.run([sys.executable, "-m", "megatron_rl.rollout.sglang.server", "--model-path", "/m", "--fp8",
                          "--fp8-kv-cache", "--print-command", "--", "--disable-cuda-graph"],
                         capture_output=True, text=True, env={**os.environ, **QUIET}, check=True).stdout
    assert "--quantization fp8" in out and "--kv-cache-dtype fp8_e4m3" in out and out.strip().endswith(
        "--disable-cuda-graph")


HEALTH_IGNORING_SIGTERM = r"""
import http.server, signal, sys
from megatron_rl.rollout.sglang.sockets import inherited_socket
signal.signal(signal.SIGTERM, signal.SIG_IGN)
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


def test_launcher_wait_and_stop_logic(tmp_path):
    stubborn = ManagedServer([sys.executable, "-c", HEALTH_IGNORING_SIGTERM], "http://127.0.0.1:0", listen="127.0.0.1")
    stubborn.start().wait_healthy(timeout_s=30, poll_s=0.1)
    started = time.monotonic()
    assert stubborn.stop(grace_s=0.5) == -signal.SIGKILL and time.monotonic() - started < 10
    log = tmp_path / "crash.log"
    crashing = ManagedServer([sys.executable, "-c", "print('model not found'); raise SystemExit(3)"],
                             "http://127.0.0.1:0", log_path=log, listen="127.0.0.1")
    with pytest.raises(ServerStartError, match="exited with code 3(.|\n)*model not found"):
        crashing.start().wait_healthy(timeout_s=30, poll_s=0.1)
    silent = ManagedServer([sys.executable, "-c", "import time; time.sleep(60)"], "http://127.0.0.1:0",
                           listen="127.0.0.1")
    with pytest.raises(ServerStartError, match="not healthy after 1s"):
        silent.start().wait_healthy(timeout_s=1.0, poll_s=0.1)
    assert silent.process.poll() is not None  # stopped on the timeout


def test_a_bucket_sized_body_is_parsed_while_the_server_answers(server):
    """A 256 MiB weight update (the default bucket is 512 MB of tensors): parsed on the loop
    that answers /ping, it kept every other request waiting for the whole parse (seconds; a
    benchmark's healthy server was called hung); parsed off it, /ping answers throughout."""
    chunk = b"A" * (4 << 20)  # valid base64; the pieces are sent one after another, never joined
    body = EncodedJSON([b'{"serialized_named_tensors": ["', *[chunk] * 64, b'"], "load_format": null}'])
    latencies, sending = [], threading.Event()

    def ping() -> None:
        while sending.is_set():
            started = time.monotonic()
            assert request_json("GET", server.url + "/ping", timeout_s=60)[0] == 200
            latencies.append(time.monotonic() - started)
            time.sleep(0.02)

    sending.set()
    pinger = threading.Thread(target=ping)
    started = time.monotonic()
    pinger.start()
    try:
        status, answer = request_json("POST", server.url + "/update_weights_from_tensor", body, timeout_s=300)
    finally:
        sending.clear()
        pinger.join()
    took = time.monotonic() - started
    # Read and parsed (no session is open: refused after the parse, as SGLang refuses it).
    assert status == 400 and "begin_weight_update" in str(answer), answer
    print(f"\n256 MiB weight update answered in {took:.1f}s; /ping answered {len(latencies)} times meanwhile, "
          f"slowest in {max(latencies):.3f}s")
    assert len(latencies) >= 5 and max(latencies) < took / 4, (max(latencies), took)


def test_protocol_server_stops_cleanly_on_sigterm(server):
    assert server.stop(grace_s=30) == 0
