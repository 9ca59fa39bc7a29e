"""End to end: the agentic demo's road (``configs/demo_tools.yaml``) for one RL step on CPU.

A real 2-process gloo world through ``megatron-rl-train``: the shipped checkpoint answers the
tool prompts against the calculator over several turns (hf engine with its prefix cache),
the trajectories are scored, trained with R3 replaying their stitched routes and RSPO over
the generated tokens, and evaluated multi-turn. The metrics the issue asks for are logged
and finite: turns and tool calls per trajectory, tool errors, environment time, the masked
token fraction, template mismatches, rollout-route agreement per turn, correct tool use.
"""

import math
from pathlib import Path

import pytest

from megatron_rl.rollout.trajectory import END_REASONS
from megatron_rl.train.main import main
from megatron_rl.train.metrics import read_metrics

pytestmark = pytest.mark.parallel

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "demo_tools.yaml"
SMALL = [
    "train.steps=1", "train.save_every=1", "train.eval_every=1", "train.save_hf=false", "train.progress=false",
    "train.mini_batches=1", "rollout.prompts_per_step=4", "rollout.group_size=4", "eval.max_prompts=4",
    "eval.num_samples=2", "eval.pass_k=[1,2]", "eval.greedy=false",
]
STEP_KEYS = ["env/turns", "env/tool_calls", "env/tool_errors", "env/time_s", "env/masked_token_frac",
             "env/template_mismatch_frac", "routing/rollout_agreement/turn1", "routing/replay_agreement",
             "gamma/mean", "reward/mean", "loss"]


def test_a_multi_turn_rl_step(tmp_path):
    assert main(["--config", str(CONFIG), *SMALL, f"train.run_dir={tmp_path}"]) == 0
    rows = {row["step"]: row for row in read_metrics(Path(tmp_path) / "metrics.jsonl")}
    assert sorted(rows) == [0, 1]
    for key in STEP_KEYS:
        assert key in rows[1] and math.isfinite(rows[1][key]), key
    assert 0 < rows[1]["env/masked_token_frac"] < 1 and rows[1]["env/turns"] > 1
    assert sum(rows[1][f"env/end/{reason}"] for reason in END_REASONS) == 1.0
    for step in (0, 1):
        for key in ("eval/accuracy", "eval/correct_tool_use", "eval/turns"):
            assert key in rows[step] and 0 <= rows[step][key] <= 3, (step, key)
