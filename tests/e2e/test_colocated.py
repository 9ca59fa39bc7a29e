"""Colocated runs on CPU: the trainer and the rollout engine take turns, and nothing else changes.

One stand-in (SGLang's endpoints and rules, ``--enable-memory-saver``; deterministic inference,
so that a sample does not depend on the batch it was generated in; the tests' subclass logs
the calls it receives) serves configs/demo_sglang.yaml's model. In one world of two processes (EP2,
the demo's layout) the same two-step run (an evaluation at steps 0 and 2) runs four times: SGLang
disaggregated, SGLang colocated, the HF engine disaggregated (its replica beside the
trainer), the HF engine colocated. Every metric of each colocated run equals its
disaggregated twin's exactly (timings and memory peaks aside): the offload restores every
byte and the engine gets the same weights, so the same seeds give the same samples and the
same updates. The stand-in's log shows SGLang's protocol (``docs/sglang.md``,
``rollout/sglang/memory.py``): released before the model is built; each turn resumes the
weights, pushes them inside one session, resumes the KV cache and CUDA graphs, continues,
generates, pauses and releases everything. The HF engine's replica holds no storage between
turns. Our client refuses, on its own side, a generation into released memory.
"""

from pathlib import Path

import pytest
from protocol_servers import protocol_server

from megatron_rl.config import load_config as run_config_from_checkpoint
from megatron_rl.config_loading import to_dict
from megatron_rl.parallel.world import run_world
from megatron_rl.rollout.sglang.control import request_json
from megatron_rl.rollout.sglang.server import SERVER_ENV

pytestmark = pytest.mark.parallel

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "demo_sglang.yaml"

SMALL = [
    "train.steps=2", "train.save_every=2", "train.eval_every=2", "train.progress=false", "train.save_hf=false",
    "train.mini_batches=1", "rollout.prompts_per_step=4", "rollout.group_size=2", "rollout.max_new_tokens=4",
    "rollout.max_sampling_rounds=1", "objective.dynamic_sampling=false", "eval.max_prompts=2",
    "eval.num_samples=2", "eval.pass_k=[1]", "reward.num_workers=1",
]
RELEASE_ALL = [["/pause_generation", None], ["/release_memory_occupation", ["kv_cache", "weights", "cuda_graph"]]]
TURN = [["/resume_memory_occupation", ["weights"]], ["/begin_weight_update", None],
        ["/update_weights_from_tensor", None], ["/end_weight_update", None],
        ["/resume_memory_occupation", ["kv_cache", "cuda_graph"]], ["/continue_generation", None]]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = protocol_server(tmp_path_factory.mktemp("colocated"), "--enable-memory-saver",
                          "--enable-deterministic-inference", config=CONFIG,
                          env=SERVER_ENV)
    srv.start()
    srv.wait_healthy(timeout_s=240, poll_s=0.2)
    yield srv
    srv.stop()


def _runs(cfg_dicts: dict, url: str) -> dict:
    """Each config's history; the engine's refusals and memory between turns of the colocated runs."""
    import torch.distributed as dist

    from megatron_rl.config import RunConfig, validate
    from megatron_rl.config_loading import from_dict
    from megatron_rl.parallel.cpu_platform import cpu_platform
    from megatron_rl.parallel.groups import model_parallel
    from megatron_rl.rollout.engine import SamplingParams
    from megatron_rl.rollout.sglang.memory import MemoryProtocolError
    from megatron_rl.train.trainer import Trainer

    out = {}
    for name, cfg_dict in cfg_dicts.items():
        cfg = from_dict(RunConfig, cfg_dict)
        validate(cfg, world_size=dist.get_world_size())
        with cpu_platform(), model_parallel(cfg.parallel, cfg.seed) as groups:
            trainer = Trainer(cfg, groups)
            out[name] = {"history": trainer.run()}
            if name == "sglang colocated":
                out[name]["log"] = request_json("GET", url + "/_test/calls")[1]
                try:
                    trainer.engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=2), seed=0)
                except MemoryProtocolError as err:
                    out[name]["refused"] = str(err)
            if name == "hf colocated":
                released = trainer.engine.released  # the replica's storages, released after the last turn
                out[name]["replica_bytes"] = (released.nbytes, sum(s.storage.nbytes() for s in released.items))
    return out


def _same(row: dict) -> dict:
    return {k: v for k, v in row.items() if not k.startswith(("time/", "perf/", "memory/"))}


def test_colocated_runs_follow_sglangs_protocol_and_equal_the_disaggregated_runs(server, tmp_path):
    cfgs = {}
    for engine in ("sglang", "hf"):
        for placement in ("disaggregated", "colocated"):
            name = f"{engine} {placement}"
            cfgs[name] = to_dict(run_config_from_checkpoint(CONFIG, [
                *SMALL, f"train.run_dir={tmp_path / name.replace(' ', '_')}", f"rollout.engine={engine}",
                f"rollout.sglang.urls=[{server.url}]", "rollout.sglang.deterministic_inference=true",
                f"rollout.placement={placement}"]))
    runs, other_rank = run_world(_runs, 2, cfgs, server.url, timeout_s=900)
    for rank in (runs, other_rank):
        resident, now = rank["hf colocated"]["replica_bytes"]
        assert resident > 0 and now == 0
    assert "refused" in other_rank["sglang colocated"]
    for engine in ("sglang", "hf"):
        apart, together = runs[f"{engine} disaggregated"]["history"], runs[f"{engine} colocated"]["history"]
        assert [r["step"] for r in together] == [0, 1, 2]
        for a, b in zip(apart, together, strict=True):
            a, b = _same(a), _same(b)
            assert a == b, (engine, {k: (a.get(k), b.get(k)) for k in {*a, *b} if a.get(k) != b.get(k)})
    colocated = runs["sglang colocated"]
    log = colocated["log"]
    start = log.index(RELEASE_ALL[0])  # the disaggregated run before it never released
    assert "/release_memory_occupation" not in [path for path, _ in log[:start]]
    assert all(n > 0 for path, n in log[start:] if path == "/generate")
    calls = [[path, None if path == "/generate" else tags] for path, tags in log[start:]]
    # eval (step 0), rollouts (steps 1, 2), eval (step 2): four turns, each TURN, generation, release
    assert calls == [*RELEASE_ALL, *[call for _ in range(4) for call in [*TURN, ["/generate", None], *RELEASE_ALL]]]
    assert "generate while the SGLang servers' memory is released" in colocated["refused"]
