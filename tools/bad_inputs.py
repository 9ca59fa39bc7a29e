"""Run the command-line tools on bad inputs and tabulate how each one fails.

Every case runs one console script of this venv (``megatron-rl-train``, ``megatron-rl-launch``,
``megatron-rl-smoke``, the checkpoint tools) as a subprocess on one broken input, built in a temporary directory
from the shipped tiny checkpoint (``megatron_rl/assets/tiny_qwen3_moe``), the arithmetic
prompt files and ``configs/demo_cpu.yaml``. The convention each should meet: exit code 2,
within 10 s, one line on stderr ``<tool>: error: <message>`` that names the culprit (the
case's ``expect`` text). The table gives, per case, the exit code, the seconds to fail,
the CPU seconds its processes used (user + system: what it costs whatever the machine's load;
on a quiet machine the seconds to fail come close to it), the stderr line count (argparse's
usage lines not counted) and the first line of the message
(the ``error:`` line when there is one); the verdict column says which part of the convention a case misses. A case that
runs past ``--timeout`` is killed with its process group.

Usage (from a checkout, with the venv active)::

    python tools/bad_inputs.py                 # table on stdout
    python tools/bad_inputs.py --only ckpt     # cases whose name contains "ckpt"
    python tools/bad_inputs.py --markdown out.md
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from make_tiny_family_checkpoint import COMMON, FAMILIES, TOKENIZER_FILES, build, save

REPO = Path(__file__).resolve().parents[1]
ASSET = REPO / "megatron_rl" / "assets" / "tiny_qwen3_moe"
TRAIN_ROWS = REPO / "megatron_rl" / "assets" / "arithmetic" / "train.jsonl"
DEMO = REPO / "configs" / "demo_cpu.yaml"
DISTILL = REPO / "configs" / "demo_distill.yaml"
QWEN = REPO / "configs" / "qwen3_30b_a3b.yaml"
TASK = REPO / "configs" / "demo_task.yaml"
BIN = Path(sys.executable).parent
LIMIT_S = 10.0


@dataclass
class Case:
    """One bad input: the command (script name first) and the text its message must contain."""

    name: str
    argv: list[str]
    expect: str
    import_from: str | None = None
    """A directory put first on PYTHONPATH (a user's module the case imports)."""


def _truncate(path: Path, keep: float) -> None:
    os.truncate(path, int(path.stat().st_size * keep))


def _copy(root: Path, name: str) -> Path:
    return Path(shutil.copytree(ASSET, root / name))


def build_inputs(root: Path) -> dict[str, Path]:
    """The broken files and directories the cases point at."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoTokenizer

    paths: dict[str, Path] = {}
    paths["trunc_st"] = _copy(root, "trunc_st")
    _truncate(paths["trunc_st"] / "model.safetensors", 0.5)
    paths["bad_json"] = _copy(root, "bad_json")
    (paths["bad_json"] / "config.json").write_text('{"model_type": "qwen3_moe",\n')
    paths["no_config"] = _copy(root, "no_config")
    (paths["no_config"] / "config.json").unlink()
    paths["llama"] = _copy(root, "llama")
    config = json.loads((ASSET / "config.json").read_text())
    (paths["llama"] / "config.json").write_text(json.dumps({**config, "model_type": "llama"}))
    paths["n_group"] = _copy(root, "n_group")
    family_config = {**COMMON, **FAMILIES["deepseek_v3"][2], "n_group": 3, "model_type": "deepseek_v3"}
    (paths["n_group"] / "config.json").write_text(json.dumps(family_config))
    paths["n_group_0"] = _copy(root, "n_group_0")
    (paths["n_group_0"] / "config.json").write_text(json.dumps({**family_config, "n_group": 0}))
    paths["swiglu"] = _copy(root, "swiglu")
    oss_config = {**config, "model_type": "gpt_oss", "swiglu_alpha": 1.5, "attention_bias": True, "num_local_experts": 8}
    (paths["swiglu"] / "config.json").write_text(json.dumps(oss_config))
    paths["qwen3_next"] = root / "qwen3_next"
    save(build("qwen3_next"), "qwen3_next", paths["qwen3_next"])
    for name in TOKENIZER_FILES:
        shutil.copy(ASSET / name, paths["qwen3_next"] / name)
    paths["odd_vocab"] = _copy(root, "odd_vocab")
    tensors = load_file(ASSET / "model.safetensors")
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        tensors[name] = tensors[name][:511].clone()
    save_file(tensors, str(paths["odd_vocab"] / "model.safetensors"), metadata={"format": "pt"})
    (paths["odd_vocab"] / "config.json").write_text(json.dumps({**config, "vocab_size": 511}))
    (root / "empty_dir").mkdir()
    (root / "a_file").write_text("x\n")
    (root / "exists").mkdir()
    (root / "bad.yaml").write_text("train:\n  steps: [1, 2\n")
    (root / "prompts_bad.json").write_text("[[1, 2, 3], [4, 5")
    (root / "broken_envs.py").write_text("raise RuntimeError('no sandbox credentials')\n")

    tokenizer = AutoTokenizer.from_pretrained(str(ASSET), local_files_only=True)
    tokenizer.add_tokens([f"<extra_{i}>" for i in range(600)])
    tokenizer.save_pretrained(root / "big_tokenizer")
    plain = AutoTokenizer.from_pretrained(str(ASSET), local_files_only=True)
    plain.chat_template = None
    plain.save_pretrained(root / "no_template")
    (root / "no_template" / "chat_template.jinja").unlink(missing_ok=True)
    rows = TRAIN_ROWS.read_text().splitlines()[:5]
    broken = json.loads(rows[3])
    del broken["answer"]
    rows[3] = json.dumps(broken)
    (root / "missing_answer.jsonl").write_text("\n".join(rows) + "\n")
    (root / "bad_line.jsonl").write_text("\n".join([*rows[:2], rows[2][:-5], *rows[3:]]) + "\n")
    (root / "latin1.jsonl").write_bytes("\n".join([*rows[:2], rows[2].replace("What", "Qu\u00e9"), *rows[3:]])
                                        .encode("latin-1") + b"\n")
    paths["swapped_tokens"] = _copy(root, "swapped_tokens")
    tokenizer_json = json.loads((ASSET / "tokenizer.json").read_text())
    vocab = tokenizer_json["model"]["vocab"]
    vocab["a"], vocab["b"] = vocab["b"], vocab["a"]
    (paths["swapped_tokens"] / "tokenizer.json").write_text(json.dumps(tokenizer_json))
    (root / "sourced.jsonl").write_text("".join(json.dumps({**json.loads(row), "source": "chat"}) + "\n"
                                                for row in TRAIN_ROWS.read_text().splitlines()[:5]))
    state = root / "truncated_state" / "checkpoints" / "step_000002"
    state.mkdir(parents=True)
    (root / "truncated_state" / "checkpoints" / "latest").write_text("step_000002\n")
    (state / "trainer_state.json").write_text('{"step": 2, "config": {"seed": 12')

    megatron = root / "megatron"
    done = subprocess.run(
        [str(BIN / "megatron-rl-convert-hf-to-megatron"), str(ASSET), str(megatron), "--no-progress"],
        capture_output=True, text=True,
    )
    if done.returncode != 0:
        raise SystemExit(f"setup: converting {ASSET} failed:\n{done.stderr}")
    for name in ("meg_missing", "meg_trunc", "meg_meta"):
        paths[name] = Path(shutil.copytree(megatron, root / name))
    shards = sorted(megatron.glob("*.distcp"))
    (paths["meg_missing"] / shards[0].name).unlink()
    _truncate(paths["meg_trunc"] / shards[-1].name, 0.9)
    _truncate(paths["meg_meta"] / ".metadata", 0.5)
    paths["megatron"] = megatron
    paths["resume_shard"] = _trainer_run_dir(root / "resume_shard", megatron)
    paths["resume_layout"] = _trainer_run_dir(root / "resume_layout", megatron)
    _truncate(paths["resume_shard"] / "checkpoints" / "step_000002" / shards[-1].name, 0.9)
    return paths


def _trainer_run_dir(run_dir: Path, megatron: Path) -> Path:
    """A run directory whose latest checkpoint holds the demo's config, the converted model and RNG files.

    It has no optimizer state, so only damage found before the optimizer loads is a fair case
    (a truncated shard: the model and optimizer are read in one pass).
    """
    import torch

    from megatron_rl.config import load_config
    from megatron_rl.config_loading import to_dict

    step = Path(shutil.copytree(megatron, run_dir / "checkpoints" / "step_000002"))
    (run_dir / "checkpoints" / "latest").write_text("step_000002\n")
    config = to_dict(load_config(DEMO, world_size=2))
    state = {"step": 2, "data_position": 32, "weight_version": 2, "optimizer_state": False, "config": config}
    (step / "trainer_state.json").write_text(json.dumps(state, indent=1))
    (step / "rng").mkdir()
    for rank in range(2):
        torch.save({"torch": torch.get_rng_state()}, step / "rng" / f"rank_{rank:05d}.pt")
    return run_dir


def _teacher(path, sources: str = "[]") -> str:
    """The override of ``configs/demo_distill.yaml``'s teacher list: one teacher at ``path``."""
    return f"distill.teachers=[{{path: {path}, sources: {sources}, parallel: {{tensor_model_parallel_size: 2}}}}]"


def cases(root: Path, p: dict[str, Path]) -> list[Case]:
    """Every case; ``{run}`` in a train argument becomes a fresh run directory under ``root``."""
    train = ["megatron-rl-train", "--config", str(DEMO)]
    distill = ["megatron-rl-train", "--config", str(DISTILL)]
    launch = ["megatron-rl-launch", "--config", str(DEMO)]
    to_meg = "megatron-rl-convert-hf-to-megatron"
    to_hf = "megatron-rl-convert-megatron-to-hf"
    parity = "megatron-rl-logprob-parity"
    fp8 = "megatron-rl-export-fp8"
    out = str(root / "out" / "new")
    qwen_local = ["init_checkpoint=null", f"data.train_files=[{TRAIN_ROWS}]", f"data.eval_files=[{TRAIN_ROWS}]",
                  f"tokenizer.path={ASSET}"]
    return [
        Case("train: missing init dir", [*train, f"init_checkpoint={root}/nowhere"], f"{root}/nowhere does not exist"),
        Case("train: init is a file", [*train, f"init_checkpoint={root}/a_file"], "is not a directory"),
        Case("train: init not a checkpoint", [*train, f"init_checkpoint={root}/empty_dir"], "is neither an HF"),
        Case("train: unsupported architecture", [*train, f"init_checkpoint={p['llama']}"], "model_type"),
        Case("train: init truncated safetensors", [*train, f"init_checkpoint={p['trunc_st']}"], "model.safetensors"),
        Case("train: init config.json n_group=3", [*train, f"init_checkpoint={p['n_group']}"],
             "config.json n_group=3: must divide n_routed_experts (8)"),
        Case("train: init config.json n_group=0", [*train, f"init_checkpoint={p['n_group_0']}"],
             "config.json n_group=0: must be an integer >= 1"),
        Case("train: init config.json not JSON", [*train, f"init_checkpoint={p['bad_json']}"], "config.json"),
        Case("train: no prompt fits beside the responses", [*train, "rollout.max_new_tokens=121"],
             "rollout.max_new_tokens (121, of model.max_position_embeddings 128): leaves 7 tokens for a prompt"),
        Case("train: task num_eval_prompts=0", ["megatron-rl-train", "--config", str(TASK),
                                                "data.task.num_eval_prompts=0"], "data.task.num_eval_prompts"),
        Case("train: Gated DeltaNet init, CP2", [*train, f"init_checkpoint={p['qwen3_next']}",
                                                "parallel.expert_model_parallel_size=1",
                                                "parallel.context_parallel_size=2"],
             "parallel.context_parallel_size: must be 1 with Gated DeltaNet layers"),
        Case("train: missing YAML file", ["megatron-rl-train", "--config", f"{root}/none.yaml"], "none.yaml"),
        Case("train: bad YAML file", ["megatron-rl-train", "--config", f"{root}/bad.yaml"], "bad.yaml"),
        Case("train: unknown key", [*train, "objective.no_such_key=1"], "objective.no_such_key"),
        Case("train: override not YAML", [*train, "data.train_files=[a"], "data.train_files: override value"),
        Case("train: wrong type eps_low=abc", [*train, "objective.eps_low=abc"], "objective.eps_low"),
        Case("train: dynamic_sampling=maybe", [*train, "objective.dynamic_sampling=maybe"],
             "objective.dynamic_sampling"),
        Case("train: model key contradicts init", [*train, "model.hidden_size=128"], "model.hidden_size"),
        Case("train: tokenizer too large", [*train, f"tokenizer.path={root}/big_tokenizer"], "vocab_size"),
        Case("train: no chat template", [*train, f"tokenizer.path={root}/no_template"], "tokenizer.chat_template"),
        Case("train: missing data file", [*train, f"data.train_files=[{root}/none.jsonl]"], "data.train_files[0]"),
        Case("train: row without answer", [*train, f"data.train_files=[{root}/missing_answer.jsonl]"], "row 3"),
        Case("train: malformed JSONL line", [*train, f"data.train_files=[{root}/bad_line.jsonl]"],
             "bad_line.jsonl: line 3"),
        Case("train: prompt file not UTF-8", [*train, f"data.train_files=[{root}/latin1.jsonl]"],
             "latin1.jsonl: line 3: not UTF-8"),
        Case("train: reward does not import", [*train, "reward.function=no_such_module:score"], "reward.function"),
        Case("train: EP does not divide experts", [*train, "parallel.expert_model_parallel_size=3"],
             "expert_model_parallel_size"),
        Case("train: TP does not divide heads", [*train, "parallel.tensor_model_parallel_size=3"],
             "tensor_model_parallel_size"),
        Case("train: run_dir is a file", [*train, f"train.run_dir={root}/a_file/run"], "a_file"),
        Case("train: truncated trainer_state.json", [*train, f"train.run_dir={root}/truncated_state"],
             "trainer_state.json"),
        Case("train: resume, truncated .distcp shard", [*train, f"train.run_dir={p['resume_shard']}"], ".distcp"),
        Case("train: resume EP2 checkpoint at TP2 (EP1)", [*train, f"train.run_dir={p['resume_layout']}",
                                                          "parallel.expert_model_parallel_size=1",
                                                          "parallel.tensor_model_parallel_size=2"],
             "saved at TP1 PP1 EP2 ETP1 DP2 (2 processes), this config asks for TP2 PP1 EP1 ETP1 DP1"),
        Case("train: init Megatron ckpt, truncated shard", [*train, f"init_checkpoint={p['meg_trunc']}"], ".distcp"),
        Case("train: max_staleness=1, hf engine with rollout.env", [*train, "rollout.max_staleness=1",
                                                                    "rollout.env.name=calculator"],
             "rollout.max_staleness: 1 with rollout.engine=hf and rollout.env"),
        Case("train: max_staleness=1, no weight sync", [*train, "rollout.max_staleness=1", "rollout.engine=sglang",
                                                        "rollout.sglang.urls=[http://127.0.0.1:9]",
                                                        "rollout.sglang.weight_sync=none"], "weight_sync=none"),
        Case("train: max_staleness=65 (beyond the bound)", [*train, "rollout.max_staleness=65"],
             "rollout.max_staleness: 65 is outside [0, 64]"),
        Case("train: max_staleness=2, megatron engine", [*train, "rollout.max_staleness=2", "rollout.engine=megatron"],
             "rollout.engine=megatron: the embedded engine"),
        Case("train: partial rollouts, max_staleness=0", [*train, "rollout.partial=true"],
             "rollout.partial: true with rollout.max_staleness=0"),
        Case("train: partial rollouts, megatron engine (cannot pause)", [*train, "rollout.partial=true",
                                                                         "rollout.max_staleness=2",
                                                                         "rollout.engine=megatron"],
             "rollout.partial: true with rollout.engine=megatron"),
        Case("train: max_staleness=2, colocated", [*train, "rollout.max_staleness=2", "rollout.engine=sglang",
                                                   "rollout.placement=colocated",
                                                   "rollout.sglang.urls=[http://127.0.0.1:9]"],
             "rollout.placement: colocated with rollout.max_staleness=2"),
        Case("train: unknown rollout.env", [*train, "rollout.env.name=calculater"],
             "rollout.env.name: 'calculater' is neither a built-in environment"),
        Case("train: greedy rollouts, sampled policy", [*train, "rollout.temperature=0"],
             "rollout.temperature: 0 (greedy) draws from no distribution"),
        Case("train: R3w over SGLang (no gates)", [*train, "train.routing_replay=R3w", "rollout.engine=sglang",
                                                   "rollout.sglang.urls=[http://127.0.0.1:9]"],
             "train.routing_replay: R3w replays the engine's gate weights"),
        Case("train: R3w without routes", [*train, "train.routing_replay=R3w", "rollout.return_routed_experts=false"],
             "train.routing_replay: R3w replays the rollout engine's routes"),
        Case("train: breakdown with multi-turn", [*train, "train.mismatch.breakdown=true", "rollout.env.name=calculator"],
             "train.mismatch.breakdown: multi-turn trajectories do not carry"),
        Case("train: policy_temperature=two", [*train, "train.policy_temperature=two"], "train.policy_temperature"),
        Case("mismatch: no such run", ["megatron-rl-mismatch", f"{root}/nowhere"], f"{root}/nowhere: no such run"),
        Case("mismatch: nothing saved", ["megatron-rl-mismatch", f"{root}/empty_dir"],
             "holds no saved rollouts (run with train.mismatch.save_rollouts=true)"),
        Case("train: env module does not import", [*train, "rollout.env.name=no_such_module:Env"],
             "rollout.env.name: cannot import 'no_such_module'"),
        Case("train: env module raises on import", [*train, "rollout.env.name=broken_envs:Env"],
             "rollout.env.name: cannot import 'broken_envs': RuntimeError", import_from=str(root)),
        Case("train: env class missing", [*train, "rollout.env.name=megatron_rl.rollout.envs.builtin:Nope"],
             "has no attribute 'Nope'"),
        Case("train: env args not accepted", [*train, "rollout.env.name=calculator", "rollout.env.args.digits=3"],
             "rollout.env.args: calculator does not accept"),
        Case("train: env max_turns=0", [*train, "rollout.env.name=calculator", "rollout.env.max_turns=0"],
             "rollout.env.max_turns: must be >= 1"),
        Case("train: env max_total_tokens over the model", [*train, "rollout.env.name=calculator",
                                                            "rollout.env.max_total_tokens=4096"],
             "rollout.env.max_total_tokens: 4096 exceeds"),
        Case("train: env step_timeout_s=inf", [*train, "rollout.env.name=calculator", "rollout.env.step_timeout_s=inf"],
             "rollout.env.step_timeout_s: must be a finite number > 0"),
        Case("train: env limit, no rollout.env.name", [*train, "rollout.env.max_turns=0"],
             "rollout.env.max_turns: 0 is set, but rollout.env.name is null"),
        Case("train: distill teacher path missing", [*distill, _teacher(f"{root}/nowhere")],
             f"distill.teachers[0].path: {root}/nowhere does not exist"),
        Case("train: distill tokenizer mismatch", [*distill, _teacher(p["swapped_tokens"])],
             "distill.teachers[0].path: the teacher's tokenizer"),
        Case("train: distill teacher_key not read", [*distill, "distill.teacher_key=source"],
             "distill.teacher_key: 'source' is not a prompt-file column"),
        Case("train: distill data column unknown", [*distill, "distill.teacher_key=source", "data.metadata_keys=[source]"],
             "has no column 'source'"),
        Case("train: distill source no teacher takes", [*distill, "distill.teacher_key=source",
                                                        "data.metadata_keys=[source]", f"data.train_files=[{root}/sourced.jsonl]",
                                                        f"data.eval_files=[{root}/sourced.jsonl]", _teacher(ASSET, "[math]")],
             "has source 'chat', which no teacher takes"),
        Case("train: distill with a sampling temperature", [*distill, "rollout.temperature=0.7"],
             "train.policy_temperature: distillation compares the untempered distributions"),
        Case("launch: missing YAML file", ["megatron-rl-launch", "--config", f"{root}/none.yaml"], "none.yaml"),
        Case("launch: bad YAML file", ["megatron-rl-launch", "--config", f"{root}/bad.yaml"], "bad.yaml"),
        Case("launch: nproc does not match world", [*launch, "--nproc-per-node", "3"], "parallel.world_size"),
        Case("launch: 2 nodes, no rendezvous", [*launch, "--nnodes", "2"], "rdzv"),
        Case("launch: train.steps=-1", [*launch, "train.steps=-1"], "train.steps"),
        Case("launch: FP8 without TE", ["megatron-rl-launch", "--config", str(QWEN), *qwen_local], "fp8.enabled"),
        Case("launch: override not YAML", [*launch, "data.train_files=[a"], "data.train_files: override value"),
        Case("launch: wrong type eps_low=abc", [*launch, "objective.eps_low=abc"], "objective.eps_low"),
        Case("smoke: override not YAML", ["megatron-rl-smoke", "model.num_experts=[a"], "model.num_experts"),
        Case("smoke: EP2 layout, 5 experts", ["megatron-rl-smoke", "model.num_experts=5"],
             "must divide model.num_experts (5)"),
        Case("ckpt hf2meg: truncated safetensors", [to_meg, str(p["trunc_st"]), out], "model.safetensors"),
        Case("ckpt hf2meg: config.json not JSON", [to_meg, str(p["bad_json"]), out], "config.json"),
        Case("ckpt hf2meg: config.json n_group=3", [to_meg, str(p["n_group"]), out],
             "config.json n_group=3: must divide n_routed_experts (8)"),
        Case("ckpt hf2meg: no config.json", [to_meg, str(p["no_config"]), out], "config.json"),
        Case("ckpt hf2meg: GPT-OSS swiglu_alpha=1.5", [to_meg, str(p["swiglu"]), out], "config.json swiglu_alpha=1.5"),
        Case("ckpt hf2meg: unsupported architecture", [to_meg, str(p["llama"]), out], "model_type"),
        Case("ckpt hf2meg: output parent is a file", [to_meg, str(ASSET), f"{root}/a_file/out"], "a_file"),
        Case("ckpt hf2meg: output exists", [to_meg, str(ASSET), f"{root}/exists"], f"{root}/exists"),
        Case("ckpt hf2meg: --ep 3 (8 experts)", [to_meg, str(ASSET), out, "--ep", "3"], "num_experts"),
        Case("ckpt hf2meg: --pp 3 (4 layers)", [to_meg, str(ASSET), out, "--pp", "3"], "num_layers"),
        Case("ckpt hf2meg: --tp 2, vocab 511", [to_meg, str(p["odd_vocab"]), out, "--tp", "2"], "vocab_size=511"),
        Case("ckpt hf2meg: --tp abc (usage)", [to_meg, str(ASSET), out, "--tp", "abc"], "--tp"),
        Case("ckpt meg2hf: missing .distcp shard", [to_hf, str(p["meg_missing"]), out], ".distcp"),
        Case("ckpt meg2hf: truncated .distcp shard", [to_hf, str(p["meg_trunc"]), out], ".distcp"),
        Case("ckpt meg2hf: truncated .metadata", [to_hf, str(p["meg_meta"]), out], ".metadata"),
        Case("ckpt meg2hf: HF dir given", [to_hf, str(ASSET), out], ".metadata"),
        Case("ckpt meg2hf: output parent is a file", [to_hf, str(p["megatron"]), f"{root}/a_file/out"], "a_file"),
        Case("ckpt meg2hf: --max-shard-size abc", [to_hf, str(p["megatron"]), out, "--max-shard-size", "abc"],
             "not a size"),
        Case("ckpt parity: --tp 3", [parity, "--hf", str(ASSET), "--megatron", str(p["megatron"]), "--tp", "3"],
             "num_attention_heads"),
        Case("ckpt parity: truncated .distcp shard", [parity, "--hf", str(ASSET), "--megatron", str(p["meg_trunc"])],
             ".distcp"),
        Case("ckpt parity: prompts not JSON", [parity, "--hf", str(ASSET), "--megatron", str(p["megatron"]),
                                               "--prompts", f"{root}/prompts_bad.json"], "prompts_bad.json"),
        Case("ckpt fp8: truncated safetensors", [fp8, str(p["trunc_st"]), out], "model.safetensors"),
        Case("ckpt fp8: output parent is a file", [fp8, str(ASSET), f"{root}/a_file/out"], "a_file"),
    ]


def run_case(case: Case, run_dir: Path, timeout_s: float) -> dict:
    """Run one case in its own process group; what it printed and how long it took."""
    argv = [str(BIN / case.argv[0]), *case.argv[1:]]
    if case.argv[0] == "megatron-rl-train" and not any(a.startswith("train.run_dir=") for a in argv):
        argv.append(f"train.run_dir={run_dir}")
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    env.pop("MEGATRON_RL_TRACEBACK", None)
    if case.import_from is not None:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (case.import_from, env.get("PYTHONPATH")) if p)
    start, used = time.monotonic(), _children_cpu_s()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env=env, cwd=REPO)
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
        code: int | str = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        code = "timeout"
    seconds, cpu_s = time.monotonic() - start, _children_cpu_s() - used
    # argparse's usage lines ("usage: ..." and its indented continuation) come before its one error line.
    lines = [line for line in stderr.splitlines() if line.strip() and not line.startswith(("usage:", " "))]
    errors = [line for line in lines if "error:" in line]
    first = (errors or lines or [line for line in stdout.splitlines() if line.strip()] or [""])[0]
    return {"code": code, "seconds": seconds, "cpu_s": cpu_s, "lines": len(lines), "first": first.strip()}


def _children_cpu_s() -> float:
    """CPU seconds (user + system) of this process's ended children: a case's cost whatever the load."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def verdict(case: Case, result: dict) -> str:
    """``ok``, or the parts of the convention the case misses."""
    misses = []
    if result["code"] != 2:
        misses.append(f"exit {result['code']}")
    if result["seconds"] > LIMIT_S:
        misses.append(f"{result['seconds']:.0f}s > {LIMIT_S:.0f}s")
    if result["lines"] != 1:
        misses.append(f"{result['lines']} stderr lines")
    if not result["first"].startswith(f"{case.argv[0]}: error: "):
        misses.append(f"not '{case.argv[0]}: error: ...'")
    if case.expect not in result["first"]:
        misses.append("culprit not named")
    return "ok" if not misses else "; ".join(misses)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="run the cases whose name contains this text")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds before a case is killed")
    parser.add_argument("--markdown", default=None, help="also write the table here")
    parser.add_argument("--keep", action="store_true", help="keep the temporary directory")
    args = parser.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="bad-inputs-"))
    try:
        paths = build_inputs(root)
        rows = ["| case | exit | seconds | CPU s | stderr lines | verdict | first line of the message |",
                "|---|---|---|---|---|---|---|"]
        failed = 0
        selected = [c for c in cases(root, paths) if args.only in c.name]
        for i, case in enumerate(selected):
            result = run_case(case, root / "runs" / f"case_{i:02d}", args.timeout)
            judged = verdict(case, result)
            failed += judged != "ok"
            first = result["first"].replace(str(root), "$TMP").replace("|", "\\|")
            rows.append(f"| {case.name} | {result['code']} | {result['seconds']:.1f} | {result['cpu_s']:.1f} | "
                        f"{result['lines']} | "
                        f"{judged} | {first[:220]} |")
            print(rows[-1] if i else "\n".join(rows), flush=True)
        summary = f"\n{len(selected) - failed} of {len(selected)} cases meet the convention"
        print(summary)
        if args.markdown:
            Path(args.markdown).write_text("\n".join(rows) + "\n" + summary + "\n")
        return 0 if failed == 0 else 1
    finally:
        if args.keep:
            print(f"inputs kept in {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
