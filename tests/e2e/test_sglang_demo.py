"""End to end with the SGLang backend: weight sync in every layout, and the RL demo loop.

A protocol server (the HF engine behind SGLang's HTTP endpoints, in its own process:
transformers numerics, not the trainer's) plays the SGLang server; the trainer runs in a 2-process gloo world with
:func:`~megatron_rl.rollout.sglang.weight_sync.sglang_engine` in place of the embedded engine,
so generation goes over HTTP and weights go back, under HF names from the conversion table
(as a real SGLang server takes them) or layout-free Megatron names, through
``/update_weights_from_tensor`` or a gloo broadcast group.
"""

import sys
from pathlib import Path

import pytest
import torch

from megatron_rl.checkpoint.mapping import QWEN3_MOE, hf_name_map
from megatron_rl.config import RunConfig, load_config
from megatron_rl.config_loading import to_dict
from megatron_rl.parallel.world import free_port, run_world
from megatron_rl.rollout.sglang.control import request_json
from megatron_rl.rollout.sglang.server import ManagedServer

pytestmark = pytest.mark.parallel

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "demo_task.yaml"
SMALL = [
    "train.steps=2", "train.sft_steps=20", "train.save_every=2", "train.eval_every=2", "train.progress=false",
    "train.mini_batches=1", "train.routing_replay=R3", "rollout.prompts_per_step=4", "rollout.group_size=4",
    "rollout.max_new_tokens=3", "rollout.max_sampling_rounds=1", "eval.temperature=0.0",
    "data.task.num_train_prompts=24", "data.task.num_eval_prompts=12", "data.task.max_operand=5",
]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The launch path's server step in stand-in mode: it publishes its URL in a file once healthy."""
    port, root = free_port(), tmp_path_factory.mktemp("server")
    url_dir = root / "urls"
    command = [sys.executable, "-m", "megatron_rl.rollout.sglang.server", "--stand-in", str(CONFIG),
               "--host", "127.0.0.1", "--port", str(port), "--url-file", str(url_dir / "node0"),
               "--log-file", str(root / "server.log"), "--", "--threads", "1"]
    srv = ManagedServer(command, f"http://127.0.0.1:{port}", env={"PYTHONWARNINGS": "ignore"},
                        log_path=root / "launcher.log")
    srv.start()
    srv.wait_healthy(timeout_s=180, poll_s=0.2)
    srv.url_dir = url_dir
    yield srv
    srv.stop()
    assert not (url_dir / "node0").exists()  # the launcher withdraws its URL when stopped


def _compare(engine, model, groups, prompts) -> dict:
    """Greedy samples from the server against this rank's own log-prob pass of them."""
    from megatron_rl.parallel.logprobs import compute_logprobs
    from megatron_rl.rollout.engine import SamplingParams

    samples = engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=4), seed=0)
    ours = compute_logprobs(model, groups, [s.tokens for s in samples], [len(p) for p in prompts],
                            record_routing=True)
    served_lp = torch.cat([s.output_logprobs for s in samples])
    same_experts = [
        (ours.record.sample(i).expert_ids_TLK[:-1].long().sort(-1).values == s.routed_experts.long().sort(-1).values)
        .all(-1).float().mean() for i, s in enumerate(samples)
    ]
    return {"logprob_max_diff": float((ours.logprobs_T - served_lp).abs().max()),
            "route_agreement": float(torch.stack(same_experts).mean()),
            "versions": sorted({s.weight_version for s in samples})}


def _layouts_rank(url: str, cfg_dict: dict, layouts: list) -> list[dict]:
    """Per layout: a fresh model, a sync to the server, then served vs own log-probs and routes."""
    from megatron_rl.config_loading import from_dict
    from megatron_rl.parallel.cpu_platform import cpu_platform
    from megatron_rl.parallel.groups import model_parallel
    from megatron_rl.parallel.model import build_model
    from megatron_rl.rollout.sglang.client import SGLangClientConfig
    from megatron_rl.rollout.sglang.weight_sync import (
        WeightSyncConfig,
        megatron_names,
        sglang_engine,
    )
    from megatron_rl.sections import ParallelConfig

    cfg = from_dict(RunConfig, cfg_dict)
    results = []
    for version, (layout, mode, names) in enumerate(layouts, start=1):
        parallel = from_dict(ParallelConfig, layout)
        with cpu_platform(), model_parallel(parallel, seed=100 + version) as groups:
            model = build_model(cfg.model, parallel, moe_enable_routing_replay=True)
            sync = WeightSyncConfig(mode=mode, backend="gloo", master_address="127.0.0.1", bucket_bytes=64 << 10)
            client = SGLangClientConfig(urls=[url])
            failures = {}
            if version == 1:
                failures = _failures(model, groups, client, sync)
            name_map = hf_name_map(QWEN3_MOE, cfg.model) if names == "hf" else megatron_names
            engine = sglang_engine(model, groups, client, sync, name_map=name_map)
            engine.update_weights(version)
            prompts = [[3 + (groups.dp_rank * 7 + i) % 40, 12, 5 + i, 20] for i in range(6)]
            results.append({"layout": layout, "mode": mode, "names": names, **failures,
                            **_compare(engine, model, groups, prompts)})
            engine.close()
    return results


def _failures(model, groups, client, sync) -> dict:
    """A refused weight update, a refused NCCL group and a refused request fail on every rank, clearly
    (rank 0 with its own error, its peers with :class:`RankFailed` carrying its message)."""
    from megatron_rl.parallel.comm import RankFailed
    from megatron_rl.rollout.engine import SamplingParams
    from megatron_rl.rollout.sglang.client import RolloutRequestError
    from megatron_rl.rollout.sglang.weight_sync import (
        WeightSyncConfig,
        WeightSyncError,
        sglang_engine,
    )

    messages = {}
    renamed = sglang_engine(model, groups, client, sync, name_map=lambda name, t: [("renamed." + name, t)])
    try:
        renamed.update_weights(99)
    except (WeightSyncError, RankFailed) as err:
        messages["sync_error"] = str(err)
    nccl = WeightSyncConfig(mode="distributed", backend="nccl", master_address="127.0.0.1", timeout_s=120)
    try:
        sglang_engine(model, groups, client, nccl).update_weights(98)
    except (WeightSyncError, RankFailed) as err:
        messages["nccl_error"] = str(err)
    unsynced = sglang_engine(model, groups, client, None)
    try:
        unsynced.generate([[1] * 62], SamplingParams(max_new_tokens=4), seed=0)
    except RolloutRequestError as err:
        messages["generate_error"] = str(err)
    return messages


def test_weight_sync_in_every_layout_serves_the_trainers_model(server):
    cfg = load_config(CONFIG, SMALL)
    layouts = [  # (layout, transport, server-side names)
        ({"tensor_model_parallel_size": 2}, "tensor", "hf"),
        ({"expert_model_parallel_size": 2}, "distributed", "megatron"),
        ({"pipeline_model_parallel_size": 2}, "tensor", "hf"),
    ]
    per_rank = run_world(_layouts_rank, 2, server.url, to_dict(cfg), layouts, timeout_s=600)
    for rank_results in per_rank:
        # Both ranks of the TP2 layout learn about rank 0's failures.
        assert "unknown parameter 'renamed.decoder." in rank_results[0]["sync_error"]
        assert "HTTP 400" in rank_results[0]["generate_error"] and "exceeds 64" in rank_results[0]["generate_error"]
        assert "only joins gloo groups" in rank_results[0]["nccl_error"]  # refused at once, not after a timeout
        for version, r in enumerate(rank_results, start=1):
            assert r["versions"] == [version], r
            assert r["logprob_max_diff"] < 1e-4, r
            assert r["route_agreement"] > 0.97, r
    assert request_json("GET", server.url + "/model_info")[1]["weight_version"] == "3"


def _demo_rank(cfg_dict: dict, url: str) -> dict:
    """The RL loop with the SGLang engine injected, then greedy embedded-vs-SGLang samples."""
    import torch.distributed as dist

    from megatron_rl.config import validate
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
            "same_routes": [a.routed_experts.shape == b.routed_experts.shape
                            and torch.equal(a.routed_experts.long(), b.routed_experts.long())
                            for a, b in zip(served, local)],
            "retries": dict(trainer.engine.stats.retries),
        }


def test_rl_demo_loop_with_the_sglang_backend(server, tmp_path):
    cfg = load_config(CONFIG, [*SMALL, f"train.run_dir={tmp_path}", "rollout.engine=sglang",
                               f"rollout.sglang.url_dir={server.url_dir}", "rollout.sglang.server_wait_s=60"])
    results = run_world(_demo_rank, 2, to_dict(cfg), server.url, timeout_s=900)
    rows = {row["step"]: row for row in results[0]["history"]}
    assert sorted(rows) == [0, 1, 2]
    assert "eval/accuracy" in rows[0] and "eval/accuracy" in rows[2]
    # Informative groups and non-zero gradients: the weights move every step, so a server
    # one version behind would give rollout log-probs off by ~1e-2 (measured), not ~1e-7.
    assert any(0 < rows[step]["reward/mean"] < 1 for step in (1, 2))
    for step in (1, 2):
        row = rows[step]
        assert row["optim/grad_norm"] > 0
        # Rollout log-probs come from the server; ~0 means it served this step's weights.
        assert row["mismatch/train_rollout_abs_diff"] < 1e-4, (step, row["mismatch/train_rollout_abs_diff"])
        assert row["routing/replay_agreement"] > 0.95 and row["routing/replayed_micro_batches"] > 0, row
        # Exactly-once is auditable from the metrics: every request answered at first try.
        assert row["sglang/attempts"] > 0 and row["sglang/retries"] == row["sglang/resyncs"] == 0, row
        assert all(torch.isfinite(torch.tensor(v)) for v in row.values() if isinstance(v, float))
    for rank in results:
        assert all(rank["same_tokens"]) and all(rank["same_routes"]), rank
        assert rank["logprob_max_diff"] < 1e-4 and not rank["retries"]
    assert request_json("GET", server.url + "/model_info")[1]["weight_version"] == "2"
