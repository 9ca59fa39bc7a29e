"""Bad inputs to ``megatron-rl-train`` are rejected before any worker or model exists.

Each case runs the real entry point (``main``) on the demo config with one input broken
and checks: exit code 2, one line on stderr naming the culprit (key, file, row), and that
no process world was started (``run_world`` is replaced by a function that fails the test).
"""

import json
import shutil
from pathlib import Path

import pytest

import megatron_rl.train.main as train_main
from megatron_rl.train.main import main

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "configs" / "demo_cpu.yaml"
DISTILL = REPO / "configs" / "demo_distill.yaml"
ASSET = REPO / "megatron_rl" / "assets" / "tiny_qwen3_moe"
TRAIN = REPO / "megatron_rl" / "assets" / "arithmetic" / "train.jsonl"


@pytest.fixture(scope="module")
def bad_inputs(tmp_path_factory):
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("bad")
    llama = root / "llama"
    shutil.copytree(ASSET, llama)
    config = json.loads((llama / "config.json").read_text())
    config["model_type"] = "llama"
    (llama / "config.json").write_text(json.dumps(config))
    (root / "not_a_checkpoint").mkdir()
    (root / "a_file").write_text("x")
    tokenizer = AutoTokenizer.from_pretrained(str(ASSET), local_files_only=True)
    tokenizer.add_tokens([f"<extra_{i}>" for i in range(600)])
    tokenizer.save_pretrained(root / "big_tokenizer")
    plain = AutoTokenizer.from_pretrained(str(ASSET), local_files_only=True)
    plain.chat_template = None
    plain.save_pretrained(root / "no_template")
    for name in ("chat_template.jinja",):
        (root / "no_template" / name).unlink(missing_ok=True)
    rows = TRAIN.read_text().splitlines()[:5]
    broken = json.loads(rows[3])
    del broken["answer"]
    rows[3] = json.dumps(broken)
    (root / "missing_answer.jsonl").write_text("\n".join(rows) + "\n")
    (root / "latin1.jsonl").write_bytes("\n".join(rows).replace("What", "Qu\u00e9").encode("latin-1"))
    (root / "my_rewards.py").write_text(
        "def two_args(prompt, response):\n    return 0.0\n"
    )
    (root / "my_envs.py").write_text("class NoStep:\n    def reset(self, row):\n        return None\n")
    (root / "broken_envs.py").write_text("raise RuntimeError('no sandbox credentials')\n")
    shutil.copytree(ASSET, root / "swapped_tokens")  # a teacher whose tokenizer gives 'a' and 'b' each other's ids
    tokenizer_json = json.loads((ASSET / "tokenizer.json").read_text())
    vocab = tokenizer_json["model"]["vocab"]
    vocab["a"], vocab["b"] = vocab["b"], vocab["a"]
    (root / "swapped_tokens" / "tokenizer.json").write_text(json.dumps(tokenizer_json))
    (root / "sourced.jsonl").write_text("".join(json.dumps({**json.loads(row), "source": "chat"}) + "\n"
                                                for row in TRAIN.read_text().splitlines()[:5]))
    from megatron_rl.config_loading import to_dict
    from megatron_rl.config import load_config as load_run_config

    stored = to_dict(load_run_config(DEMO, world_size=2))
    for name, change in (("other_seed", {"seed": 7}), ("other_model", {"model": {**stored["model"], "num_layers": 2}}),
                         ("truncated_state", None)):
        step = root / name / "checkpoints" / "step_000002"
        step.mkdir(parents=True)
        (root / name / "checkpoints" / "latest").write_text("step_000002\n")
        text = json.dumps({"step": 2, "config": {**stored, **(change or {})}})
        (step / "trainer_state.json").write_text(text if change else text[: len(text) // 2])
    for name, saved in SAVED_LAYOUTS.items():
        step = root / name / "checkpoints" / "step_000002"
        step.mkdir(parents=True)
        (root / name / "checkpoints" / "latest").write_text("step_000002\n")
        (step / "trainer_state.json").write_text(json.dumps({"step": 2, "config": stored, **saved}))
    return root


def _layout(tp=1, ep=1, world=2):
    return {"tensor_model_parallel_size": tp, "pipeline_model_parallel_size": 1, "expert_model_parallel_size": ep,
            "expert_tensor_parallel_size": 1, "data_parallel_size": world // tp, "world_size": world}


SAVED_LAYOUTS = {
    "ep2_plain": {"layout": _layout(ep=2), "optimizer": {"distributed": False, "sharding": None}},
    "ep2_distributed": {"layout": _layout(ep=2), "optimizer": {"distributed": True, "sharding": "fully_reshardable"}},
    "ep2_dp_reshardable": {"layout": _layout(ep=2, world=4),
                           "optimizer": {"distributed": True, "sharding": "dp_reshardable"}},
}
"""Checkpoints as ``trainer_state.json`` describes them (the optimizer-layout check reads nothing else)."""


CASES = {
    "missing init dir": (["init_checkpoint={root}/nowhere"], "init_checkpoint: {root}/nowhere does not exist"),
    "init is a file": (["init_checkpoint={root}/a_file"], "is not a directory"),
    "not a checkpoint": (["init_checkpoint={root}/not_a_checkpoint"], "is neither an HF checkpoint"),
    "unsupported architecture": (["init_checkpoint={root}/llama"], "model_type"),
    "dimensions contradict": (["model.hidden_size=128"], "model.hidden_size: the config sets 128 but the checkpoint"),
    "tokenizer too large": (["tokenizer.path={root}/big_tokenizer"], "model.vocab_size"),
    "no chat template": (["tokenizer.path={root}/no_template"], "tokenizer.chat_template"),
    "override not YAML": (["data.train_files=[a"], "data.train_files: override value '[a' is not valid YAML"),
    "missing data file": (["data.train_files=[{root}/none.jsonl]"], "data.train_files[0]"),
    "row without answer": (["data.train_files=[{root}/missing_answer.jsonl]"], "row 3 of {root}/missing_answer.jsonl"),
    "prompt file not UTF-8": (["data.train_files=[{root}/latin1.jsonl]"],
                              "data.train_files[0]: cannot read {root}/latin1.jsonl: line 1: not UTF-8"),
    "run dir is a file": (["train.run_dir={root}/a_file/run"], "train.run_dir: {root}/a_file is a file"),
    "resume with another seed": (["train.run_dir={root}/other_seed"], "seed: the run directory's checkpoint"),
    "resume with another model": (["train.run_dir={root}/other_model"], "model.num_layers: the run directory's"),
    "truncated trainer state": (["train.run_dir={root}/truncated_state"],
                                "{root}/truncated_state/checkpoints/step_000002/trainer_state.json is unreadable"),
    "resume EP2 at TP2 EP1 (issue 27.1)": (
        ["train.run_dir={root}/ep2_distributed", "optim.distributed=true", "parallel.expert_model_parallel_size=1",
         "parallel.tensor_model_parallel_size=2"],
        "parallel.expert_model_parallel_size: the run directory's checkpoint step_000002 was saved at "
        "TP1 PP1 EP2 ETP1 DP2 (2 processes), this config asks for TP2 PP1 EP1 ETP1 DP1 (2 processes)"),
    "resume plain state with the distributed optimizer": (
        ["train.run_dir={root}/ep2_plain", "optim.distributed=true"],
        "optim.distributed: the run directory's checkpoint step_000002 holds the plain optimizer's state, this "
        "config asks for the distributed one; resume with optim.distributed=false"),
    "resume distributed state with the plain optimizer": (
        ["train.run_dir={root}/ep2_distributed", "optim.distributed=false"],
        "holds the distributed optimizer's state, this config asks for the plain one"),
    "resume dp_reshardable state at another TP": (
        ["train.run_dir={root}/ep2_dp_reshardable", "optim.distributed=true", "optim.checkpoint_sharding=dp_reshardable",
         "parallel.world_size=4", "parallel.tensor_model_parallel_size=2"],
        "parallel: the run directory's checkpoint step_000002 was saved at TP1 PP1 EP2 ETP1 DP4 (4 processes), this "
        "config asks for TP2 PP1 EP2 ETP1 DP2 (4 processes); its optimizer state is dp_reshardable"),
    "reward does not import": (["reward.function=no_such_module:score"], "reward.function"),
    "reward wrong signature": (["reward.function=my_rewards:two_args"], "reward.function"),
    "staleness with the hf engine's multi-turn rollouts": (["rollout.max_staleness=1", "rollout.env.name=calculator"],
                                                           "rollout.max_staleness: 1 with rollout.engine=hf and "
                                                           "rollout.env"),
    "staleness without weight sync": (["rollout.max_staleness=1", "rollout.engine=sglang",
                                       "rollout.sglang.urls=[http://127.0.0.1:9]", "rollout.sglang.weight_sync=none"],
                                      "rollout.max_staleness: 1 with rollout.sglang.weight_sync=none"),
    "staleness deeper than offered": (["rollout.max_staleness=65"], "rollout.max_staleness: 65 is outside [0, 64]"),
    "staleness below zero": (["rollout.max_staleness=-1"], "rollout.max_staleness: -1 is outside [0, 64]"),
    "staleness with the megatron engine": (["rollout.max_staleness=2", "rollout.engine=megatron"],
                                           "rollout.max_staleness: 2 with rollout.engine=megatron: the embedded "
                                           "engine generates with the trainer's own model"),
    "partial rollouts of the synchronous loop": (["rollout.partial=true"],
                                                 "rollout.partial: true with rollout.max_staleness=0"),
    "partial rollouts with an engine that cannot pause": (["rollout.partial=true", "rollout.max_staleness=2",
                                                           "rollout.engine=megatron"],
                                                          "rollout.partial: true with rollout.engine=megatron"),
    "pause mode without partial rollouts": (["rollout.partial_mode=retract"],
                                            "rollout.partial_mode: retract without rollout.partial=true"),
    "staleness colocated": (["rollout.max_staleness=2", "rollout.engine=sglang", "rollout.placement=colocated",
                             "rollout.sglang.urls=[http://127.0.0.1:9]"],
                            "rollout.placement: colocated with rollout.max_staleness=2"),
    "environment does not import": (["rollout.env.name=no_such_module:Env"],
                                    "rollout.env.name: cannot import 'no_such_module'"),
    "environment without step": (["rollout.env.name=my_envs:NoStep"], "rollout.env.name: my_envs:NoStep has no step"),
    "environment arguments": (["rollout.env.name=calculator", "rollout.env.args.digits=3"],
                              "rollout.env.args: calculator does not accept"),
    "http environment without url": (["rollout.env.name=http"], "rollout.env.http.url: '' is not an http://"),
    "no turn allowed": (["rollout.env.name=calculator", "rollout.env.max_turns=0"], "rollout.env.max_turns"),
    "trajectory longer than the model": (["rollout.env.name=calculator", "rollout.env.max_total_tokens=4096"],
                                         "rollout.env.max_total_tokens: 4096 exceeds"),
    "unknown environment": (["rollout.env.name=calculater"],
                            "rollout.env.name: 'calculater' is neither a built-in environment (calculator, feedback, "
                            "http) nor an import path 'package.module:Class'"),
    "environment module raises on import": (["rollout.env.name=broken_envs:Env"],
                                            "rollout.env.name: cannot import 'broken_envs': RuntimeError: no sandbox "
                                            "credentials"),
    "environment class missing": (["rollout.env.name=my_envs:Nope"],
                                  "rollout.env.name: module 'my_envs' has no attribute 'Nope'"),
    "no room for a turn": (["rollout.env.name=calculator", "rollout.env.max_total_tokens=16"],
                           "rollout.env.max_total_tokens: 16 leaves no room for a prompt"),
    "environment step never times out": (["rollout.env.name=calculator", "rollout.env.step_timeout_s=inf"],
                                         "rollout.env.step_timeout_s: must be a finite number > 0"),
    "http retries forever": (["rollout.env.name=http", "rollout.env.http.url=http://127.0.0.1:9",
                              "rollout.env.http.backoff_s=inf"], "rollout.env.http.backoff_s: must be a finite"),
    "environment limit without environment": (["rollout.env.max_turns=0"],
                                              "rollout.env.max_turns: 0 is set, but rollout.env.name is null"),
    "greedy rollouts, sampled policy": (["rollout.temperature=0"],
                                        "rollout.temperature: 0 (greedy) draws from no distribution"),
    "R3w over SGLang": (["train.routing_replay=R3w", "rollout.engine=sglang", "rollout.sglang.urls=[http://127.0.0.1:9]"],
                        "train.routing_replay: R3w replays the engine's gate weights, and SGLang 0.5.23 returns"),
    "breakdown with multi-turn": (["train.mismatch.breakdown=true", "rollout.env.name=calculator"],
                                  "train.mismatch.breakdown: multi-turn trajectories do not carry"),
    "environment without chat template": (["rollout.env.name=calculator", "tokenizer.chat_template=false"],
                                          "rollout.env.name: multi-turn rollouts render"),
    "responses the model leaves no prompt room for": (
        ["rollout.max_new_tokens=121"],
        "rollout.max_new_tokens (121, of model.max_position_embeddings 128): leaves 7 tokens for a prompt, fewer than "
        "the 8 the tokenizer's chat template takes around an empty one"),
    "responses the model leaves too little prompt room for": (
        ["rollout.max_new_tokens=120"],
        "rollout.max_new_tokens (120, of model.max_position_embeddings 128): all 2300 train prompts are longer than "
        "8 tokens"),
    "a prompt limit below the chat template": (["data.max_prompt_tokens=4"],
                                               "data.max_prompt_tokens: leaves 4 tokens for a prompt, fewer than the"),
}


def _teacher(path: str, sources: str = "[]") -> str:
    return f"distill.teachers=[{{path: {path}, sources: {sources}}}]"


DISTILL_CASES = {
    "teacher path missing": ([_teacher("{root}/nowhere")], "distill.teachers[0].path: {root}/nowhere does not exist"),
    "teacher tokenizer differs": ([_teacher("{root}/swapped_tokens")],
                                  "distill.teachers[0].path: the teacher's tokenizer ({root}/swapped_tokens) is not the "
                                  f"run's ({ASSET}): token 'a' is id"),
    "routing column not read": (["distill.teacher_key=source"],
                                "distill.teacher_key: 'source' is not a prompt-file column the trainer reads"),
    "routing column not in the files": (["distill.teacher_key=source", "data.metadata_keys=[source]"],
                                        f"data.metadata_keys[0]: {TRAIN} has no column 'source'"),
    "a source no teacher takes": (["distill.teacher_key=source", "data.metadata_keys=[source]",
                                   "data.train_files=[{root}/sourced.jsonl]", "data.eval_files=[{root}/sourced.jsonl]",
                                   _teacher(str(ASSET), "[math]")], "has source 'chat', which no teacher takes"),
}
"""Bad distillation configs (``configs/demo_distill.yaml`` with one thing broken)."""


@pytest.mark.parametrize("case", [*CASES, *(f"distill: {c}" for c in DISTILL_CASES)])
def test_bad_input_is_one_line_exit_2_and_no_world(case, bad_inputs, capsys, monkeypatch):
    config = DISTILL if case.startswith("distill: ") else DEMO
    overrides, expected = DISTILL_CASES[case[len("distill: "):]] if config == DISTILL else CASES[case]
    root = str(bad_inputs)
    monkeypatch.syspath_prepend(root)

    def no_world(*args, **kwargs):
        raise AssertionError("a process world was started for a bad input")

    monkeypatch.setattr(train_main, "run_world", no_world)
    code = main(["--config", str(config), *(o.replace("{root}", root) for o in overrides)])
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert len(err.splitlines()) == 1 and err.startswith("megatron-rl-train: error: "), err
    assert expected.replace("{root}", root) in err, err


def test_the_world_guard_is_live_and_the_ranks_get_the_checked_prompts(monkeypatch, tmp_path):
    """Control: with valid inputs the guarded ``run_world`` is what main calls. And the prompt
    files are read and tokenized once per run: the ranks are handed what the input check loaded
    (pickled, as the ranks' forkserver gets it), with the tokenizer that encoded it."""
    import pickle

    import megatron_rl.train.prepare as prepare
    from megatron_rl.data.prompts import load_prompts
    from megatron_rl.train.prepare import RunPrompts

    started, loaded = [], {}

    def no_world(*args, **kwargs):
        started.append(args)
        raise AssertionError("world started")

    def recorded(cfg, split, *args):
        assert split not in loaded, f"{split} prompts read twice"
        loaded[split] = load_prompts(cfg, split, *args)
        return loaded[split]

    monkeypatch.setattr(train_main, "run_world", no_world)
    monkeypatch.setattr(prepare, "load_prompts", recorded)
    with pytest.raises(AssertionError, match="world started"):
        main(["--config", str(DEMO), f"train.run_dir={tmp_path}"])
    (fn, nproc, cfg_dict, handed), = started
    assert fn is train_main.run_rank and sorted(loaded) == ["eval", "train"]
    handed = pickle.loads(pickle.dumps(handed))
    assert isinstance(handed, RunPrompts)
    assert handed.train.records == loaded["train"].records and len(handed.train) == 2300
    assert handed.eval.records == loaded["eval"].records and len(handed.eval) == 200
    assert all(handed.tokenizer.encode_prompt(r.prompt) == list(r.prompt_ids) for r in handed.eval.records)


@pytest.mark.parametrize("saved, overrides", [
    ("ep2_distributed", ["optim.distributed=true", "parallel.world_size=4"]),  # DP2 -> DP4
    ("ep2_distributed", ["optim.distributed=true", "parallel.world_size=4", "parallel.tensor_model_parallel_size=2"]),
    ("ep2_dp_reshardable", ["optim.distributed=true", "optim.checkpoint_sharding=dp_reshardable"]),  # DP4 -> DP1
    ("ep2_plain", ["optim.distributed=false", "parallel.world_size=4", "parallel.tensor_model_parallel_size=2"]),
])
def test_layout_changes_the_checkpoint_reshards_are_let_through(bad_inputs, saved, overrides):
    from megatron_rl.config import load_config as load_run_config
    from megatron_rl.train.prepare import check_resume_layout

    cfg = load_run_config(DEMO, [f"train.run_dir={bad_inputs}/{saved}", *overrides])
    stored = json.loads((bad_inputs / saved / "checkpoints" / "step_000002" / "trainer_state.json").read_text())
    check_resume_layout(cfg, stored, "step_000002")
