"""End to end with the SGLang backend: weight sync in every layout and both transports, a
DeepSeek-V3-style model verified tensor by tensor, and the RL demo loop of configs/demo_sglang.yaml.

Two stand-ins (SGLang's endpoints and rules over a local engine, each in its own process,
launched with the wrapper's environment: log-probs at T) play the SGLang servers: the
launcher's server step (``--stand-in``, the HF engine: transformers numerics, not the
trainer's) serving the demo's Qwen3-MoE, and the tests' subclass serving a tiny
DeepSeek-V3 checkpoint (MLA with a query LoRA: ``q_a_proj`` and ``kv_a_proj_with_mqa`` load
together). The trainer runs in a 2-process gloo world with
:func:`~megatron_rl.rollout.sglang.weight_sync.sglang_engine`, so generation goes over HTTP and
weights go back under HF names, every push inside a weight-update session (the stand-ins
refuse any other, as SGLang 0.5.23 does), through ``/update_weights_from_tensor`` or a gloo
broadcast group.
"""

import hashlib
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from protocol_servers import protocol_server

from megatron_rl.config import load_config as run_config_from_checkpoint
from megatron_rl.config_loading import to_dict
from megatron_rl.parallel.world import run_world
from megatron_rl.rollout.sglang.control import request_json
from megatron_rl.rollout.sglang.server import SERVER_ENV, ManagedServer

pytestmark = pytest.mark.parallel

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "demo_sglang.yaml"
SMALL = [
    "train.steps=2", "train.save_every=2", "train.eval_every=2", "train.progress=false", "train.save_hf=false",
    "train.mini_batches=1", "rollout.prompts_per_step=4", "rollout.group_size=4", "rollout.max_new_tokens=6",
    "rollout.max_sampling_rounds=1", "objective.dynamic_sampling=false", "eval.max_prompts=4",
    "eval.num_samples=2", "eval.pass_k=[1,2]", "reward.num_workers=1",
]


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """The launcher's stand-in of the demo (it publishes its URL once healthy) and the tests'
    stand-in of a tiny DeepSeek-V3, started together."""
    root = tmp_path_factory.mktemp("servers")
    deepseek = root / "tiny_deepseek_v3"
    subprocess.run([sys.executable, str(ROOT / "tools" / "make_tiny_family_checkpoint.py"), "deepseek_v3",
                    str(deepseek)], check=True, capture_output=True, env={**SERVER_ENV, "PYTHONWARNINGS": "ignore"})
    url_dir = root / "urls"
    # The wrapper hands the socket bound here on to its stand-in.
    qwen = ManagedServer([sys.executable, "-m", "megatron_rl.rollout.sglang.server", "--stand-in", str(CONFIG),
                          "--host", "127.0.0.1", "--port", "0", "--url-file", str(url_dir / "node0"),
                          "--log-file", str(root / "qwen.log"), "--", "--threads", "1"],
                         "http://127.0.0.1:0", env={"PYTHONWARNINGS": "ignore"}, log_path=root / "launcher.log",
                         listen="127.0.0.1")
    ds = protocol_server(root / "deepseek", f"init_checkpoint={deepseek}", config=CONFIG, env=SERVER_ENV)
    qwen.start(), ds.start()
    qwen.wait_healthy(timeout_s=240, poll_s=0.2)
    ds.wait_healthy(timeout_s=240, poll_s=0.2)
    qwen.url_dir, ds.checkpoint = url_dir, deepseek
    yield {"qwen": qwen, "deepseek": ds}
    qwen.stop()
    ds.stop()
    assert not (url_dir / "node0").exists()  # the launcher withdraws its URL when stopped


def _compare(engine, model, groups, prompts, temperature: float) -> dict:
    """Samples from the server at ``temperature`` against this rank's own log-prob pass of them."""
    from megatron_rl.parallel.logprobs import compute_logprobs
    from megatron_rl.rollout.engine import SamplingParams

    samples = engine.generate(prompts, SamplingParams(temperature=temperature, max_new_tokens=4), seed=0)
    # The server reports log_softmax(logits / T) (SGLang's default); the trainer scores the same.
    ours = compute_logprobs(model, groups, [s.tokens for s in samples], [len(p) for p in prompts],
                            record_routing=True, temperature_T=torch.cat([s.temperatures() for s in samples]))
    served_lp = torch.cat([s.output_logprobs for s in samples])
    same_experts = [
        (ours.record.sample(i).expert_ids_TLK[:-1].long().sort(-1).values == s.routed_experts.long().sort(-1).values)
        .all(-1).float().mean() for i, s in enumerate(samples)
    ]
    return {f"logprob_max_diff@{temperature:g}": float((ours.logprobs_T - served_lp).abs().max()),
            f"route_agreement@{temperature:g}": float(torch.stack(same_experts).mean()),
            f"versions@{temperature:g}": sorted({s.weight_version for s in samples})}


def _sha(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def _layouts_rank(urls: dict, cfg_dicts: dict, layouts: list) -> list[dict]:
    """Per layout: a fresh model, a push to its server, then served vs own log-probs and routes
    at T = 0.7 and 1.0; the DeepSeek-V3 push is also compared tensor by tensor."""
    from megatron_rl.config import RunConfig
    from megatron_rl.config_loading import from_dict
    from megatron_rl.parallel.cpu_platform import cpu_platform
    from megatron_rl.parallel.groups import model_parallel
    from megatron_rl.parallel.model import build_model
    from megatron_rl.rollout.sglang.client import SGLangClientConfig
    from megatron_rl.rollout.sglang.weight_sync import WeightSyncConfig, sglang_engine
    from megatron_rl.sections import ParallelConfig

    results = []
    for version, (family, layout, mode) in enumerate(layouts, start=1):
        cfg = from_dict(RunConfig, cfg_dicts[family])
        parallel = from_dict(ParallelConfig, layout)
        url = urls[family]
        with cpu_platform(), model_parallel(parallel, seed=100 + version) as groups:
            model = build_model(cfg.model, parallel, moe_enable_routing_replay=True)
            # Small buckets: without load groups DeepSeek's q_a/kv_a pairs would be split.
            sync = WeightSyncConfig(mode=mode, backend="gloo", master_address="127.0.0.1", bucket_bytes=16 << 10)
            client = SGLangClientConfig(urls=[url])
            architecture = "deepseek_v3" if family == "deepseek" else "qwen3_moe"
            failures = _failures(model, groups, client, sync, cfg.model, url) if version == 1 else {}
            engine = sglang_engine(model, groups, client, sync, architecture=architecture, model_config=cfg.model)
            engine.update_weights(version)
            row = {"family": family, "layout": layout, "mode": mode, **failures}
            if family == "deepseek":
                row.update(_tensor_by_tensor(engine, model, groups, url))
            if mode == "distributed":
                row.update(_distributed_refusals(engine, url, version))
            prompts = [[3 + (groups.dp_rank * 7 + i) % 40, 12, 5 + i, 20] for i in range(6)]
            for temperature in (0.7, 1.0):
                row.update(_compare(engine, model, groups, prompts, temperature))
            results.append(row)
            engine.close()
    return results


def _tensor_by_tensor(engine, model, groups, url) -> dict:
    """The server's tensors against the trainer's, by HF name (rank 0 reads, every rank gathers)."""
    import torch.distributed as dist

    from megatron_rl.rollout.sglang.weight_sync import gather_full_params

    ours = {}
    for name, full in gather_full_params(model, groups):
        ours.update({hf: _sha(t) for hf, t in engine.weight_sync.name_map(name, full)})
    if dist.get_rank() != 0:
        return {}
    served = request_json("GET", url + "/_test/weights")[1]
    session = request_json("GET", url + "/_test/stats")[1]["last_session"]
    return {"tensors": len(ours), "differ": sorted(n for n in served if served[n] != ours.get(n)),
            "not_pushed": sorted(set(served) - set(ours)), "session": session}


def _distributed_refusals(engine, url, version) -> dict:
    """Item 1: a server that refuses an announce (no session; its group gone) is an error naming
    it before any tensor is broadcast, not a broadcast that waits forever; then a reconnect heals."""
    import time

    import torch.distributed as dist

    from megatron_rl.parallel.comm import RankFailed
    from megatron_rl.rollout.sglang.weight_transport import WeightSyncError

    found = {}
    if dist.get_rank() == 0:
        started = time.monotonic()
        try:
            engine.weight_sync.transport.start()  # no session open: SGLang refuses before joining
        except WeightSyncError as err:
            found["no_session"] = (str(err), time.monotonic() - started)
        request_json("POST", url + "/destroy_weights_update_group", {"group_name": "megatron_rl_weight_sync"})
    dist.barrier()
    started = time.monotonic()
    try:
        engine.update_weights(version)
    except (WeightSyncError, RankFailed) as err:
        found["no_group"] = (str(err), time.monotonic() - started)
    engine.weight_sync.sync(version, reconnect=True)
    return found


def _failures(model, groups, client, sync, model_config, url) -> dict:
    """Refusals that end on every rank, clearly (rank 0 with its own error, its peers with
    :class:`RankFailed` carrying its message): a TP size the server does not have (item 4), a
    refused NCCL group, a refused request; and a session left open by a dead trainer is closed."""
    import dataclasses

    import torch.distributed as dist

    from megatron_rl.parallel.comm import RankFailed
    from megatron_rl.rollout.engine import SamplingParams
    from megatron_rl.rollout.sglang.client import RolloutRequestError
    from megatron_rl.rollout.sglang.weight_sync import WeightSyncError, sglang_engine

    messages = {}
    architecture = "qwen3_moe" if model_config.q_lora_rank is None else "deepseek_v3"
    for key, bad in (("tp_error", dataclasses.replace(sync, server_tp_size=2)),
                     ("nccl_error", dataclasses.replace(sync, mode="distributed", backend="nccl", timeout_s=120))):
        try:
            sglang_engine(model, groups, client, bad, architecture=architecture,
                          model_config=model_config).update_weights(98)
        except (WeightSyncError, RankFailed) as err:
            messages[key] = str(err)
    unsynced = sglang_engine(model, groups, client, None, architecture=architecture, model_config=model_config)
    try:
        unsynced.generate([[1] * 126], SamplingParams(max_new_tokens=4), seed=0)
    except RolloutRequestError as err:
        messages["generate_error"] = str(err)
    if dist.get_rank() == 0:  # a trainer that died mid-push left its session open
        request_json("POST", url + "/end_weight_update", {})  # (the refused NCCL group left one too)
        messages["stale_begin"] = request_json("POST", url + "/begin_weight_update", {})[0]
    dist.barrier()
    return messages


def test_weight_sync_in_every_layout_serves_the_trainers_model(servers, tmp_path):
    qwen_cfg = run_config_from_checkpoint(CONFIG, SMALL)
    deepseek_cfg = run_config_from_checkpoint(CONFIG, [*SMALL, f"init_checkpoint={servers['deepseek'].checkpoint}",
                                                       "rollout.sglang.hf_architecture=deepseek_v3"])
    layouts = [  # (model, layout, transport)
        ("qwen", {"tensor_model_parallel_size": 2}, "tensor"),
        # TP2 (SP) x EP2 over a broadcast group: each TP shard and expert reaches the server whole (issue 34).
        ("qwen", {"tensor_model_parallel_size": 2, "expert_model_parallel_size": 2}, "distributed"),
        ("qwen", {"pipeline_model_parallel_size": 2}, "tensor"),
        ("deepseek", {"expert_model_parallel_size": 2}, "tensor"),
    ]
    urls = {"qwen": servers["qwen"].url, "deepseek": servers["deepseek"].url}
    per_rank = run_world(_layouts_rank, 2, urls, {"qwen": to_dict(qwen_cfg), "deepseek": to_dict(deepseek_cfg)},
                         layouts, timeout_s=900)
    for rank_results in per_rank:
        first = rank_results[0]
        assert "server_tp_size is 2, but SGLang server" in first["tp_error"] and "tp_size 1" in first["tp_error"]
        assert "HTTP 400" in first["generate_error"] and "exceeds 128" in first["generate_error"]
        assert "only joins gloo groups" in first["nccl_error"]  # refused at once, not after a timeout
        for version, r in enumerate(rank_results, start=1):
            for temperature in ("0.7", "1"):
                assert r[f"versions@{temperature}"] == [version], r
                assert r[f"logprob_max_diff@{temperature}"] < 1e-4, r
                assert r[f"route_agreement@{temperature}"] > 0.97, r
    print("\nserved vs trainer log-probs, max |diff|: " + "; ".join(
        f"{r['family']} {r['mode']} {r['layout']}: T=0.7 {r['logprob_max_diff@0.7']:.1e}, "
        f"T=1 {r['logprob_max_diff@1']:.1e}" for r in per_rank[0]))
    first, distributed, deepseek = per_rank[0][0], per_rank[0][1], per_rank[0][3]
    assert first["stale_begin"] == 200  # and the push after it still landed (versions above)
    message, seconds = distributed["no_session"]
    assert "update_weights_from_distributed must run between begin_weight_update()" in message and seconds < 30
    message, seconds = distributed["no_group"]
    assert servers["qwen"].url in message and "init_weights_update_group" in message and seconds < 60
    assert deepseek["tensors"] > 0 and deepseek["differ"] == [] and deepseek["not_pushed"] == []
    assert deepseek["session"]["not_updated"] == [] and deepseek["session"]["dropped"] == []
    assert request_json("GET", servers["qwen"].url + "/model_info")[1]["weight_version"] == "3"


def _demo_rank(cfg_dict: dict, url: str) -> dict:
    """The RL loop of configs/demo_sglang.yaml with the SGLang engine, then greedy embedded-vs-SGLang samples."""
    import torch.distributed as dist

    from megatron_rl.config import RunConfig, validate
    from megatron_rl.config_loading import from_dict
    from megatron_rl.parallel.cpu_platform import cpu_platform
    from megatron_rl.parallel.groups import model_parallel
    from megatron_rl.rollout.engine import SamplingParams
    from megatron_rl.rollout.local.embedded import EmbeddedEngine
    from megatron_rl.rollout.sglang.engine import SGLangEngine
    from megatron_rl.train.trainer import Trainer

    cfg = from_dict(RunConfig, cfg_dict)
    validate(cfg, world_size=dist.get_world_size())
    with cpu_platform(), model_parallel(cfg.parallel, cfg.seed) as groups:
        trainer = Trainer(cfg, groups)
        assert isinstance(trainer.engine, SGLangEngine) and trainer.engine.cfg.urls == [url]
        history = trainer.run()
        prompts = [p.prompt_ids for p in trainer.rollouts.mine(trainer.eval_set.records)]
        greedy = SamplingParams(temperature=0.0, max_new_tokens=3, stop_token_ids=tuple(trainer.tokenizer.stop_token_ids))
        served = trainer.engine.generate(prompts, greedy, seed=0)
        local = EmbeddedEngine(trainer.ddp, groups, cfg.train.micro_batch_sequences).generate(prompts, greedy, seed=0)
        return {
            "history": history,
            "same_tokens": [a.output_ids == b.output_ids for a, b in zip(served, local)],
            "logprob_max_diff": max(float((a.output_logprobs - b.output_logprobs).abs().max())
                                    if a.output_ids == b.output_ids else float("inf") for a, b in zip(served, local)),
            "retries": dict(trainer.engine.stats.retries),
            "convention_checked": trainer.engine.convention_checked,
        }


def test_rl_demo_loop_with_the_sglang_backend(servers, tmp_path):
    """configs/demo_sglang.yaml: rollouts at T = 0.7 (the server's log-prob convention verified first),
    eval at T = 1, every push a session; the rollout log-probs are the trainer's to fp32 level."""
    server = servers["qwen"]
    cfg = run_config_from_checkpoint(CONFIG, [*SMALL, f"train.run_dir={tmp_path}", "rollout.sglang.urls=[]",
                                              f"rollout.sglang.url_dir={server.url_dir}",
                                              "rollout.sglang.server_wait_s=60"])
    assert cfg.rollout.temperature == 0.7 and cfg.eval.temperature == 1.0
    results = run_world(_demo_rank, 2, to_dict(cfg), server.url, timeout_s=900)
    rows = {row["step"]: row for row in results[0]["history"]}
    assert sorted(rows) == [0, 1, 2]
    assert "eval/accuracy" in rows[0] and "eval/accuracy" in rows[2]
    for step in (1, 2):
        row = rows[step]
        # Rollout log-probs come from the server; ~0 means it served this step's weights, at T.
        assert row["mismatch/train_rollout_abs_diff"] < 1e-4, (step, row["mismatch/train_rollout_abs_diff"])
        assert row["sglang/attempts"] > 0 and row["sglang/retries"] == row["sglang/resyncs"] == 0, row
        assert all(torch.isfinite(torch.tensor(v)) for v in row.values() if isinstance(v, float))
    for rank in results:
        assert all(rank["same_tokens"]) and rank["logprob_max_diff"] < 1e-4 and not rank["retries"], rank
    assert results[0]["convention_checked"]
    print("\ndemo_sglang.yaml at T = 0.7: mismatch/train_rollout_abs_diff "
          + ", ".join(f"step {s} {rows[s]['mismatch/train_rollout_abs_diff']:.1e}" for s in (1, 2)))
    assert request_json("GET", server.url + "/model_info")[1]["weight_version"] == "2"
