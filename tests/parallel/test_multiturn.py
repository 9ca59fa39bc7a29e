"""Multi-turn trajectories in EP2 on 2 gloo processes: routing replay across turns, and one
RL step of the agentic demo's road.

The shipped checkpoint answers the tool demo's prompts against the feedback environment
(up to 3 model turns: an answer, "Wrong, try again." rendered by the chat template when it
is wrong, another answer), with the two local engines; the calculator's tool turns take the
same path through the engines (the RL step below runs them). The ranks hold different
numbers of trajectories, so one of them runs out of live trajectories first and keeps step
with padding prompts.
For every trajectory, the routes stitched from each turn's engine pass (``routes_from``:
the positions no earlier pass covered) are compared with the R2 record, the old-policy
pass over the whole trajectory:

- ``rollout.engine=megatron``: equal bit for bit, every position and layer;
- ``rollout.engine=hf`` with its prefix cache (turns after the first are served from the
  previous turn's KV, so their prefix was computed, and routed, by an earlier pass): at
  least 99% of (position, layer) pairs agree and every disagreement is a near-tie of
  transformers' own router (the K-th and (K+1)-th probabilities within 1e-3), as for
  single-turn samples (``test_hf_engine.py``); a misaligned stitch would fail wholesale.

The rollout log-probs of the generated tokens are compared with the old-policy pass too.

In the same world, a 2-step run against the CPU SGLang stand-in serving the demo's model with
asynchronous rollouts (``rollout.max_staleness: 1``, the feedback environment): step 1's
trajectories are generated synchronously, step 2's in the background during step 1, so they
carry weight version 0 while the trainer holds version 1 (``rollout/staleness_max`` 1). For
both steps the trajectories' rollout log-probs of the generated tokens are the served
model's at the version they carry (Megatron's forward under that version's weights, within
the transformers-numerics tolerance of the hf engine above, and measurably not the next
version's), and the masking is the
synchronous one: the loss mask is exactly the generated tokens, and the environment's tokens
take the old policy's log-probs as their rollout log-probs (neutral corrections). That run
also uses per-turn credit (``objective.turn_credit: turn``, discount 0.9): the trainer's
advantages equal docs/agentic.md's formula written out here in plain floats.

In the same world, the trainer runs one RL step of ``configs/demo_tools.yaml`` (calculator
tool calls over several turns, hf engine with its prefix cache, R3 replaying the stitched
routes, RSPO over the generated tokens, multi-turn evaluation before and after), and the
metrics the issue asks for are logged and finite: turns and tool calls per trajectory, tool
errors, environment time, the masked token fraction, template mismatches, rollout-route
agreement per turn, correct tool use, the shares of end reasons.
"""

import math
import statistics
import time
from pathlib import Path

import pytest
import torch
from protocol_servers import protocol_server

from megatron_rl.parallel.world import run_world

pytestmark = pytest.mark.parallel

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "demo_tools.yaml"
PER_RANK = (3, 2)
NEAR_TIE = 1e-3
ONE_STEP = [
    "train.steps=1", "train.eval_every=1", "train.save_hf=false", "train.progress=false", "train.mini_batches=1",
    "rollout.prompts_per_step=4", "rollout.group_size=4", "eval.max_prompts=4", "eval.num_samples=2",
    "eval.pass_k=[1,2]", "eval.greedy=false", "reward.num_workers=0",
]
STEP_KEYS = ["env/turns", "env/tool_calls", "env/tool_errors", "env/time_s", "env/masked_token_frac",
             "env/template_mismatch_frac", "routing/rollout_agreement/turn1", "routing/replay_agreement",
             "gamma/mean", "reward/mean", "loss"]


def _one_rl_step(run_dir: str) -> list[dict]:
    """The trainer's metrics of one step of the agentic demo (every rank returns them)."""
    from megatron_rl.parallel.groups import model_parallel
    from megatron_rl.config import load_config as load_run_config
    from megatron_rl.train.trainer import Trainer

    cfg = load_run_config(str(CONFIG), [*ONE_STEP, f"train.run_dir={run_dir}"], world_size=2)
    with model_parallel(cfg.parallel, cfg.seed) as groups:
        return Trainer(cfg, groups).run()


ASYNC = [
    "train.steps=2", "train.eval_every=100", "train.save_hf=false", "train.progress=false", "train.mini_batches=1",
    "rollout.prompts_per_step=2", "rollout.group_size=4", "rollout.max_sampling_rounds=1", "eval.max_prompts=2",
    "eval.num_samples=1", "eval.pass_k=[1]", "eval.greedy=false", "reward.num_workers=0",
    "objective.dynamic_sampling=false", "rollout.env.name=feedback", "rollout.env.max_turns=2",
    "rollout.engine=sglang", "rollout.sglang.weight_sync=tensor", "rollout.max_staleness=1",
    "objective.entropy_coef=0.01",  # every update changes the weights, even when a group's rewards are all equal
    "objective.turn_credit=turn", "objective.turn_discount=0.9",
    # The length penalty makes trajectory rewards differ when the tiny model answers none right.
    "objective.overlong_penalty_max_len=100", "objective.overlong_penalty_cache_len=96",
]


def _async_run(run_dir: str, url: str) -> dict:
    """Two steps with asynchronous multi-turn rollouts; per step, the trainer's weight version,
    the trajectories' versions and turns, and the masking and log-prob checks."""
    from megatron_rl.parallel.groups import model_parallel
    from megatron_rl.parallel.logprobs import compute_logprobs
    from megatron_rl.rollout.sglang.server import health_status
    from megatron_rl.config import load_config as load_run_config
    from megatron_rl.train.trainer import Trainer

    deadline = time.monotonic() + 300
    while health_status(url) != 200:
        assert time.monotonic() < deadline, f"the stand-in at {url} is not healthy after 300 s"
        time.sleep(0.2)
    cfg = load_run_config(str(CONFIG), [*ASYNC, f"train.run_dir={run_dir}", f"rollout.sglang.urls=[{url}]"],
                          world_size=2)
    with model_parallel(cfg.parallel, cfg.seed) as groups:
        trainer = Trainer(cfg, groups)
        snapshots, steps, rl_step, make_batch = {}, {}, trainer.rl_step, trainer._batch

        def recording_step(step, state):
            snapshots[state.weight_version] = [p.detach().clone() for p in trainer.ddp.parameters()]
            steps[step] = {"trainer_version": state.weight_version}
            return rl_step(step, state)

        def recording_batch(chosen, metrics, *rest):
            out = make_batch(chosen, metrics, *rest)
            step = max(steps)
            steps[step].update(samples=[s for group in chosen.samples for s in group], batch=out,
                               rewards=torch.cat(chosen.rewards).tolist())
            return out

        trainer.rl_step, trainer._batch = recording_step, recording_batch
        history = trainer.run()
        trainer.scorer.close()
        checks = {}
        for step, rec in steps.items():
            samples, batch = rec["samples"], rec["batch"]
            generated_T = torch.cat([s.loss_mask() for s in samples])

            def behaviour_diff(version):
                with torch.no_grad():
                    for p, w in zip(trainer.ddp.parameters(), snapshots[version]):
                        p.copy_(w)
                served_T = compute_logprobs(trainer.ddp, groups, batch.sequences, batch.prompt_lengths,
                                            **trainer._packing()).logprobs_T
                return float((batch.rollout_logprobs_T - served_T)[generated_T].abs().max())

            version = samples[0].weight_version
            env_T = ~batch.loss_mask_T
            checks[step] = {
                "trainer_version": rec["trainer_version"], "versions": [s.weight_version for s in samples],
                "turns": [len(s.turns) for s in samples],
                "mask_is_generated": torch.equal(batch.loss_mask_T, generated_T),
                "env_tokens": int(env_T.sum()),
                "env_rollout_lp_is_old": torch.equal(batch.rollout_logprobs_T[env_T], batch.old_logprobs_T[env_T]),
                "behaviour_diff": behaviour_diff(version),
                "behaviour_diff_next": behaviour_diff(version + 1) if version + 1 in snapshots else None,
                "rewards": rec["rewards"], "advantages": batch.advantages_T.tolist(),
                "turn_spans": [s.turns for s in samples], "turn_rewards": [s.turn_rewards for s in samples],
                "lengths": [len(s.output_ids) for s in samples],
            }
    return {"history": history, "checks": checks}


def _worker(run_dir: str, url: str) -> dict:
    import torch.distributed as dist

    from megatron_rl.checkpoint.init_source import inspect_init_checkpoint
    from megatron_rl.data.prompts import load_prompts
    from megatron_rl.parallel.cpu_platform import cpu_platform
    from megatron_rl.parallel.groups import model_parallel
    from megatron_rl.parallel.logprobs import compute_logprobs
    from megatron_rl.parallel.model import build_model
    from megatron_rl.rollout.engine import SamplingParams
    from megatron_rl.rollout.envs.load import env_factory
    from megatron_rl.rollout.local.embedded import EmbeddedEngine
    from megatron_rl.rollout.local.hf_engine import HFEngine
    from megatron_rl.rollout.multiturn import GroupPeers, MultiTurnRollout
    from megatron_rl.train.init_weights import load_initial_weights
    from megatron_rl.config import load_config as load_run_config
    from megatron_rl.train.prepare import (
        max_prompt_tokens,
        run_tokenizer,
    )

    out = {}
    with cpu_platform():
        cfg = load_run_config(str(CONFIG), ["rollout.env.name=feedback"], world_size=2)
        with model_parallel(cfg.parallel, cfg.seed) as groups:
            gpt = build_model(cfg.model, cfg.parallel, moe_enable_routing_replay=True)
            load_initial_weights(gpt, inspect_init_checkpoint(cfg.init_checkpoint), cfg.model, groups)
            tokenizer = run_tokenizer(cfg)
            records = load_prompts(cfg.data, "train", tokenizer, max_prompt_tokens(cfg)).records
            rank = dist.get_rank()
            mine = records[rank * 8: rank * 8 + PER_RANK[rank]]
            params = SamplingParams(temperature=1.0, max_new_tokens=cfg.rollout.max_new_tokens,
                                    stop_token_ids=tokenizer.stop_token_ids)
            engines = {"megatron": EmbeddedEngine(gpt, groups),
                       "hf": HFEngine(gpt, groups, architecture="qwen3_moe", model_config=cfg.model, prefix_cache=True)}
            for name, engine in engines.items():
                rollout = MultiTurnRollout(engine, tokenizer, cfg.rollout.env, env_factory(cfg.rollout.env),
                                           GroupPeers(groups), cfg.model.max_position_embeddings)
                samples = rollout.run(mine, params, seed=7, return_routes=True)
                old = compute_logprobs(gpt, groups, [s.tokens for s in samples], [len(s.prompt_ids) for s in samples],
                                       record_routing=True)
                out[name] = {
                    "samples": samples,
                    "r2": [old.record.sample(i).expert_ids_TLK[:-1] for i in range(len(samples))],
                    "old_logprobs": [old.logprobs_T[old.cu_seqlens_S1[i]:old.cu_seqlens_S1[i + 1]]
                                     for i in range(len(samples))],
                    "cache_hits": getattr(getattr(engine, "prefix_cache", None), "hits", None),
                }
        out["history"] = _one_rl_step(run_dir)
        out["async"] = _async_run(run_dir + "_async", url)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    # The server loads while the world runs the engines' part; the async run waits for it.
    server = protocol_server(tmp_path_factory.mktemp("server"), config=CONFIG).start()
    try:
        return run_world(_worker, 2, str(tmp_path_factory.mktemp("agentic")), server.url, timeout_s=900)
    finally:
        server.stop()


def test_trajectories_have_several_turns_and_ranks_differ_in_count(results):
    for rank, got in enumerate(results):
        for name in ("megatron", "hf"):
            samples = got[name]["samples"]
            assert len(samples) == PER_RANK[rank]
            assert any(len(s.turns) > 1 for s in samples), (rank, name, [s.end_reason for s in samples])
    assert any(r["hf"]["cache_hits"] for r in results)


def test_megatron_engine_routes_equal_the_r2_record_bit_for_bit(results):
    for got in results:
        for s, r2 in zip(got["megatron"]["samples"], got["megatron"]["r2"]):
            assert s.routed_experts.shape == r2.shape == (len(s.prompt_ids) + len(s.output_ids) - 1, 4, 2)
            assert torch.equal(s.routed_experts.long(), r2.long())


def test_megatron_engine_logprobs_of_generated_tokens_match_the_old_policy(results):
    for got in results:
        for s, old in zip(got["megatron"]["samples"], got["megatron"]["old_logprobs"]):
            mask = s.loss_mask()
            diff = (s.output_logprobs[mask] - old[mask]).abs().max()
            assert diff <= 1e-5, float(diff)


def test_hf_engine_routes_agree_with_r2_except_near_ties(results):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(ROOT / "megatron_rl" / "assets" / "tiny_qwen3_moe")).eval()
    agree = total = 0
    widest = 0.0
    for got in results:
        for s, r2, old in zip(got["hf"]["samples"], got["hf"]["r2"], got["hf"]["old_logprobs"]):
            mask = s.loss_mask()
            assert (s.output_logprobs[mask] - old[mask]).abs().max() <= 1e-4
            same_NL = (s.routed_experts.long().sort(-1).values == r2.long().sort(-1).values).all(-1)
            agree, total = agree + int(same_NL.sum()), total + same_NL.numel()
            if not same_NL.all():
                with torch.no_grad():
                    logits = model(input_ids=s.tokens[None], output_router_logits=True).router_logits
                probs_NLE = torch.stack([x.float().softmax(-1) for x in logits], dim=1)[:-1]
                top3 = probs_NLE.topk(3, dim=-1).values
                widest = max(widest, float((top3[..., 1] - top3[..., 2])[~same_NL].max()))
    print(f"hf multi-turn routes agree {agree / total:.4f} with R2; widest near-tie gap {widest:.1e}")
    assert agree / total >= 0.99 and widest <= NEAR_TIE


def test_one_agentic_rl_step_logs_the_multi_turn_metrics(results):
    from megatron_rl.rollout.trajectory import END_REASONS

    rows = {row["step"]: row for row in results[0]["history"]}
    assert sorted(rows) == [0, 1]
    for key in STEP_KEYS:
        assert key in rows[1] and math.isfinite(rows[1][key]), key
    assert 0 < rows[1]["env/masked_token_frac"] < 1 and rows[1]["env/turns"] > 1
    assert sum(rows[1][f"env/end/{reason}"] for reason in END_REASONS) == pytest.approx(1.0)
    for step in (0, 1):
        for key in ("eval/accuracy", "eval/correct_tool_use", "eval/turns"):
            assert key in rows[step] and 0 <= rows[step][key] <= 3, (step, key)


def test_staleness_one_multi_turn_trajectories_carry_their_version_and_mask_like_synchronous_ones(results):
    for got in results:
        checks, rows = got["async"]["checks"], {row["step"]: row for row in got["async"]["history"]}
        print(f"\nasync multi-turn: {checks}")
        assert sorted(checks) == [1, 2]
        # Step 1 is generated synchronously at version 0; step 2's batch was generated during
        # step 1, under version 0, and is trained by weights at version 1.
        assert checks[1]["trainer_version"] == 0 and set(checks[1]["versions"]) == {0}
        assert checks[2]["trainer_version"] == 1 and set(checks[2]["versions"]) == {0}
        assert rows[2]["rollout/staleness_max"] == 1
        assert any(n > 1 for check in checks.values() for n in check["turns"]), checks
        for step, check in checks.items():
            assert check["mask_is_generated"] and check["env_rollout_lp_is_old"], (step, check)
            # The served model's log-probs at the version the trajectory carries (transformers
            # numerics), measurably not the next version's.
            assert check["behaviour_diff"] <= 1e-4, (step, check)
            assert check["behaviour_diff_next"] >= 1e-2, (step, check)
    assert any(check["env_tokens"] > 0 for got in results for check in got["async"]["checks"].values())


def _per_turn_grpo(check: dict, group_size: int, discount: float, eps: float) -> list[float]:
    """docs/agentic.md's per-turn credit written out: turn rewards (the last takes what the
    trajectory reward leaves), discounted returns term by term, GRPO within (prompt, turn)."""
    returns = []
    for spans, env, total in zip(check["turn_spans"], check["turn_rewards"], check["rewards"]):
        env = (list(env) + [0.0] * len(spans))[:len(spans)]
        r = env[:-1] + [total - sum(env[:-1])]
        returns.append([sum(discount ** (j - k) * r[j] for j in range(k, len(r))) for k in range(len(r))])
    peers: dict = {}
    for i, g in enumerate(returns):
        for k, value in enumerate(g):
            peers.setdefault((i // group_size, k), []).append(value)
    expected = []
    for i, (g, spans, n) in enumerate(zip(returns, check["turn_spans"], check["lengths"])):
        ends = [start for start, _ in spans[1:]] + [n]
        for k, ((start, _), end) in enumerate(zip(spans, ends)):
            others = peers[(i // group_size, k)]
            std = statistics.stdev(others) if len(others) > 1 else 0.0
            value = 0.0 if std == 0 else (g[k] - statistics.fmean(others)) / (std + eps)
            expected += [value] * (end - start)
    return expected


def test_per_turn_credit_in_the_trainer_follows_the_documented_formula(results):
    from megatron_rl.algos import get_preset

    eps, informative = get_preset("grpo").adv_std_eps, 0
    for got in results:
        for step, check in got["async"]["checks"].items():
            expected = _per_turn_grpo(check, group_size=4, discount=0.9, eps=eps)
            assert check["advantages"] == pytest.approx(expected, rel=1e-5, abs=1e-6), step
            informative += sum(abs(a) > 0.1 for a in check["advantages"])
    assert informative > 0  # not all advantages zero: the check above compared numbers
