"""Fully asynchronous rollouts end to end: ``rollout.max_staleness: 2`` with partial rollouts,
per-token versions, and exactly once across kill -9 of the trainer at three points.

The stand-in (its own process, the megatron engine: the trained model's own numerics, so
routes and log-probs can be compared exactly) answers each request alone
(``--max-batch 1``, seeded) and models a GPU decode of ``LATENCY`` seconds per token; the
batches launched in step 1 decode at ``SLOW`` seconds per token, and step 1's weight push
waits until one of their responses is part-way, so it surely lands inside responses (more
pushes may, by timing): the push pauses the servers (mode ``abort``), the cut responses go on
as new requests from their tokens under the new weights. The trainer runs in
a 2-process gloo world (EP2), checkpointing after every step; four worlds run one after another:

* A: a fresh run, SIGKILLed (every rank kills itself) while it waits for step 4's batch to be
  generated (mid-generation: the join before checkpoint 2, whose step was trained); checkpoint 1
  holds steps 2 and 3's batches;
* B: resumes from 1, trains steps 2 and 3, SIGKILLed inside the push of version 3 with the
  servers paused and a weight-update session open (mid-push): step 3 is never checkpointed;
* C: resumes from 2 (the servers left paused and a session open), trains step 3 and is
  SIGKILLed in step 4's update (mid-train);
* D: resumes from 3 and runs to step 5.

Every rank writes what each step trained (tokens, per-token versions, the behaviour log-probs
and rollout routes the loss used) and the weights each version had, to disk as it goes, so
records of killed worlds survive. Checked: each token's version (several versions in one
response, at the boundary where it was cut), its behaviour log-prob against what that
version's weights compute (and not the next version's), the routes R3 replays per position
against that version's routing (exactly), the staleness bound, the ledger (the surviving
lineage A1, B2, C3, D4-5 trains every prompt of the order exactly once, none twice, none
skipped), and a step trained again after a kill is the killed run's, bit for bit: what the loss
got (A2 = B2, B3 = C3, C4 = D4: batches from a checkpoint, same weights) and the update's
metrics (A2 = B2, B3 = C3).
"""

import json
import os
import signal
import time
from pathlib import Path

import pytest
import torch
from protocol_servers import running_protocol_server

from megatron_rl.config import RunConfig, load_config
from megatron_rl.config_loading import to_dict
from megatron_rl.parallel.world import WorldError, run_world
from megatron_rl.rollout.sglang.control import request_json

pytestmark = pytest.mark.parallel

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "demo_task.yaml"
K, STEPS, PROMPTS = 2, 5, 4
LATENCY, SLOW = 0.05, 5.0
"""Seconds per generated token the stand-in models, and while step 1's batches ahead are computed:
a response seen part-way stays so for at least ``SLOW`` s, which the push must take to pause the
server (at 0.5 s a busy run once saw no push land inside a response: most likely its push
paused the server after the part-way responses had ended)."""
SMALL = [
    f"train.steps={STEPS}", "train.sft_steps=0", "train.save_every=1", "train.eval_every=100", "train.progress=false",
    "train.mini_batches=1", "train.routing_replay=R3", "optim.lr=3e-3", "optim.clip_grad=0",
    f"rollout.prompts_per_step={PROMPTS}", "rollout.group_size=2", "rollout.max_new_tokens=4",
    "rollout.max_sampling_rounds=1", "objective.dynamic_sampling=false", "objective.mismatch=tis",
    "objective.entropy_coef=0.01",  # every update changes the weights, even when a group's rewards are all equal
    "eval.temperature=0.0", "eval.max_prompts=4", "eval.greedy=false", "data.task.num_train_prompts=24",
    "data.task.num_eval_prompts=12", "data.task.max_operand=5", "rollout.engine=sglang",
    f"rollout.max_staleness={K}", "rollout.partial=true", "rollout.sglang.retry_backoff_max_s=1.0",
]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from running_protocol_server(tmp_path_factory.mktemp("server"), "--max-batch", "1", "--engine", "megatron",
                                       "--enable-deterministic-inference", "--token-latency-s", str(LATENCY))


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _arm(trainer, kill: str | None) -> None:
    """Make every rank SIGKILL itself at ``kill``: ``generation`` (waiting for step 4's batch),
    ``push`` (pushing version 3, the servers paused; rank 0 opens a weight-update session first)
    or ``train`` (step 4's update)."""
    import torch.distributed as dist

    if kill == "generation":
        join = trainer.ahead._join
        trainer.ahead._join = lambda batch, state: _die() if batch.step == 4 else join(batch, state)
    elif kill == "push":
        sync = trainer.engine.weight_sync.sync

        def sync_or_die(version, **kw):
            if version == 3:
                if dist.get_rank() == 0:
                    trainer.engine.weight_sync.sessions.begin()
                _die()
            return sync(version, **kw)

        trainer.engine.weight_sync.sync = sync_or_die
    elif kill == "train":
        update = trainer._update
        trainer._update = lambda batch, metrics, drift=None: (
            _die() if trainer.steps_seen[-1] == 4 else update(batch, metrics, drift))


def _floats(metrics: dict) -> dict:
    """A step's metrics that a rerun must repeat (not timings, nor whether rewards were scored
    ahead: a batch restored from a checkpoint is scored at the join)."""
    return {k: float(v) for k, v in metrics.items()
            if not k.startswith(("time/", "perf/", "rollout/rewards_scored_ahead"))}


def _slow_first_batches(trainer, url: str) -> None:
    """Steps 2 and 3's batches, launched in step 1, decode at ``SLOW`` per token until step 1's
    push, which waits until one of their responses is part-way."""
    import torch.distributed as dist

    from megatron_rl.rollout.sglang.control import request_json

    fill, changed = trainer.ahead.fill, trainer.ahead.weights_changed

    def set_latency(seconds: float) -> None:
        dist.barrier()
        if dist.get_rank() == 0:
            assert request_json("POST", url + "/_test/latency", {"token_latency_s": seconds})[0] == 200

    def slow_fill(step, state):
        if step == 1:
            set_latency(SLOW)
        fill(step, state)

    def part_way() -> bool:
        return any(0 < produced < total for produced, total in request_json("GET", url + "/_test/progress")[1])

    def push_then_speed_up(state):
        if state.weight_version == 1 and dist.get_rank() == 0:
            deadline = time.monotonic() + 120
            while not part_way():
                assert time.monotonic() < deadline, "no response of steps 2-3's batches went part-way in 120 s"
                time.sleep(0.02)
        changed(state)
        if state.weight_version == 1:
            set_latency(LATENCY)

    trainer.ahead.fill, trainer.ahead.weights_changed = slow_fill, push_then_speed_up


def _record(trainer, world: str, out: Path) -> None:
    """Write, as the run goes, each step's trained batch and the weights each version had."""
    import torch.distributed as dist

    rank = dist.get_rank()
    rl_step, batch, update = trainer.rl_step, trainer._batch, trainer._update
    trainer.steps_seen = []

    def recording_step(step, state):
        trainer.steps_seen.append(step)
        weights = out / f"weights_r{rank}_v{state.weight_version}.pt"
        if not weights.exists():
            torch.save([p.detach().clone() for p in trainer.ddp.parameters()], weights)
        return rl_step(step, state)

    def recording_batch(chosen, metrics, drift=None):
        made = batch(chosen, metrics, drift)
        samples = [s for group in chosen.samples for s in group]
        torch.save({"ids": [p.sample_id for p in chosen.problems], "sequences": made.sequences,
                    "prompt_lengths": made.prompt_lengths, "versions": [s.versions() for s in samples],
                    "rollout_lp": made.rollout_logprobs_T, "old_lp": made.old_logprobs_T,
                    "routes": made.rollout_routes, "trainer_version": drift.version},
                   out / f"{world}{trainer.steps_seen[-1]}_r{rank}.pt")
        return made

    def recording_update(made, metrics, drift=None):
        update(made, metrics, drift)
        (out / f"{world}{trainer.steps_seen[-1]}_r{rank}.json").write_text(json.dumps(_floats(metrics)))

    trainer.rl_step, trainer._batch, trainer._update = recording_step, recording_batch, recording_update


def _world(cfg_dict: dict, world: str, kill: str | None, out: str, check: bool) -> dict:
    from megatron_rl.config_loading import from_dict
    from megatron_rl.parallel.cpu_platform import cpu_platform
    from megatron_rl.parallel.groups import model_parallel
    from megatron_rl.train.trainer import Trainer

    cfg = from_dict(RunConfig, cfg_dict)
    with cpu_platform(), model_parallel(cfg.parallel, cfg.seed) as groups:
        trainer = Trainer(cfg, groups)
        _record(trainer, world, Path(out))
        _arm(trainer, kill)
        if world == "A":
            _slow_first_batches(trainer, cfg.rollout.sglang.urls[0])
        history = trainer.run()
        trainer.scorer.close()
        if not check:
            return {}
        order = [p.sample_id for p in trainer.rollouts.problems_at(0, STEPS * PROMPTS)]
        return {"checks": _checks(trainer, groups, Path(out)), "order": order}


def _checks(trainer, groups, out: Path) -> dict:
    """Every recorded step of every world, against the weights of the versions its tokens name."""
    import torch.distributed as dist

    from megatron_rl.parallel.logprobs import compute_logprobs

    rank = dist.get_rank()

    def under(version: int, record: dict):
        with torch.no_grad():
            for p, w in zip(trainer.ddp.parameters(), torch.load(out / f"weights_r{rank}_v{version}.pt")):
                p.copy_(w)
        result = compute_logprobs(trainer.ddp, groups, record["sequences"], record["prompt_lengths"],
                                  record_routing=True, **trainer._packing())
        return result.logprobs_T, result.record

    checks = {}
    for path in sorted(out.glob(f"*_r{rank}.pt")):
        record = torch.load(path, weights_only=False)
        versions_T = torch.cat(record["versions"])
        every = [None, None]  # the passes are collective: every rank runs those of every rank's versions
        dist.all_gather_object(every, sorted(set(versions_T.tolist())))
        passes = {v: under(v, record) for v in sorted(set(every[0]) | set(every[1]))}
        own = torch.stack([passes[int(v)][0][i] for i, v in enumerate(versions_T)])
        other = [(passes[v + 1][0] - record["rollout_lp"])[versions_T == v].abs().max()
                 for v in set(versions_T.tolist()) if v + 1 in passes]
        routes_equal, offset = True, 0
        for seq, prompt_len, versions, routes in zip(record["sequences"], record["prompt_lengths"],
                                                     record["versions"], record["routes"]):
            for p in range(routes.shape[0]):  # position p computed by the pass of the token it predicts
                v = int(versions[max(0, p - prompt_len + 1)])
                trainer_ids = passes[v][1].expert_ids_TLK[offset + p].long().sort(-1).values
                routes_equal &= torch.equal(routes[p].long().sort(-1).values, trainer_ids)
            offset += int(seq.numel())
        updated = path.with_suffix(".json")
        checks[path.stem.split("_")[0]] = {
            "update": json.loads(updated.read_text()) if updated.exists() else None,
            "ids": record["ids"], "versions": [v.tolist() for v in record["versions"]],
            "trainer_version": record["trainer_version"], "rollout_lp": record["rollout_lp"],
            "old_lp": record["old_lp"], "behaviour_diff_own": float((own - record["rollout_lp"]).abs().max()),
            "behaviour_diff_next": max((float(d) for d in other), default=None), "routes_equal": routes_equal,
        }
    return checks


def _rows(cfg: RunConfig) -> dict[int, dict]:
    from megatron_rl.train.metrics import read_metrics

    return {row["step"]: row for row in read_metrics(Path(cfg.train.run_dir) / "metrics.jsonl")}


def test_staleness_two_partial_rollouts_per_token_versions_and_exactly_once_across_kills(server, tmp_path):
    cfg = load_config(CONFIG, [*SMALL, f"train.run_dir={tmp_path / 'run'}", f"rollout.sglang.urls=[{server.url}]"])
    out = tmp_path / "records"
    out.mkdir()
    rows = {}
    for world, kill in (("A", "generation"), ("B", "push"), ("C", "train")):
        started = time.monotonic()
        with pytest.raises(WorldError) as died:
            run_world(_world, 2, to_dict(cfg), world, kill, str(out), False, timeout_s=900)
        assert died.value.lost, f"world {world}: no rank was killed: {died.value}"
        rows[world] = _rows(cfg)
        print(f"world {world}: killed ({kill}) after {time.monotonic() - started:.1f}s")
    # The stand-in's Megatron engine runs its fusions eager without CUDA, as the ranks do.
    assert request_json("GET", server.url + "/_test/stats")[1]["megatron_compiles"] == torch.cuda.is_available()
    started = time.monotonic()
    final = run_world(_world, 2, to_dict(cfg), "D", None, str(out), True, timeout_s=900)
    rows["D"] = _rows(cfg)
    print(f"world D: {time.monotonic() - started:.1f}s")
    # Each killed run logged the steps before its kill; the final history has every step once.
    assert [sorted(rows[w]) for w in "ABCD"] == [[0, 1], [0, 1, 2], [0, 1, 2, 3], list(range(STEPS + 1))]
    mixed, next_diffs = 0, []
    for rank in final:
        checks = rank["checks"]
        assert sorted(checks) == ["A1", "A2", "B2", "B3", "C3", "C4", "D4", "D5"]
        print(f"\nbehaviour log-probs vs their version: max {max(c['behaviour_diff_own'] for c in checks.values()):.1e}; "
              f"vs the next version {[c['behaviour_diff_next'] for c in checks.values()]}")
        for name, check in checks.items():
            assert check["behaviour_diff_own"] < 1e-5, (name, check["behaviour_diff_own"])
            assert check["routes_equal"], name
            v = check["trainer_version"]
            for versions in check["versions"]:
                assert v - K <= min(versions) and max(versions) <= v, (name, versions)
                assert versions == sorted(versions), (name, versions)  # versions only grow along a response
                mixed += len(set(versions)) > 1
        next_diffs += [c["behaviour_diff_next"] for c in checks.values() if c["behaviour_diff_next"] is not None]
        # The lineage that survived trains each prompt of the training order once.
        trained = [i for name in ("A1", "B2", "C3", "D4", "D5") for i in checks[name]["ids"]]
        assert len(trained) == len(set(trained)) and sorted(trained) == sorted(rank["order"])
        # A step trained again after a kill is the killed run's, bit for bit.
        for first, again in (("A2", "B2"), ("B3", "C3"), ("C4", "D4")):
            a, b = checks[first], checks[again]
            assert a["ids"] == b["ids"] and a["versions"] == b["versions"], (first, again)
            assert torch.equal(a["rollout_lp"], b["rollout_lp"]) and torch.equal(a["old_lp"], b["old_lp"]), first
        for first, again in (("A2", "B2"), ("B3", "C3")):
            assert checks[first]["update"] == checks[again]["update"], (first, again)
    assert mixed > 0, "no push landed inside a response"
    # The next version computes other log-probs for some token (of either rank: which rank's responses a
    # push cuts is timing; one rank's alone had none once, at load 40).
    assert any(d > 1e-3 for d in next_diffs), next_diffs
    history = rows["D"]
    staleness = [history[s]["rollout/staleness_max"] for s in range(1, STEPS + 1)]
    print(f"staleness_max per step {staleness}; responses continued after a pause "
          f"{[history[s]['sglang/continued'] for s in range(1, STEPS + 1)]}; mixed-version responses {mixed}")
    assert max(staleness) == K
    # The drift is logged for the version lags step 5's tokens have, and only those (no 0 for a lag without tokens).
    last = [rank["checks"][f"D{STEPS}"] for rank in final]
    lags = {c["trainer_version"] - v for c in last for versions in c["versions"] for v in versions}
    assert {f"drift/{m}/lag{d}" for m in ("flip_rate", "router_shift", "gamma", "train_rollout_abs_diff")
            for d in lags} == {k for k in history[STEPS] if k.startswith("drift/")}
