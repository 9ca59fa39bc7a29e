"""The command line's view of a config: ``--print-config`` (every value and its source, loading
back as the same run), ``--help``'s keys with their docs, and the closest key for a typo."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml

from megatron_rl.config import RunConfig
from megatron_rl.config_loading import ConfigError, attribute_docs, flatten, to_dict
from megatron_rl.train.config_report import config_help, resolved_config_yaml
from megatron_rl.train.main import main
from megatron_rl.config import load_config as load_run_config

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "configs" / "demo_cpu.yaml"
GSPO = ROOT / "configs" / "objectives" / "gspo.yaml"


def _comments(text: str) -> dict[str, str]:
    """Dotted key -> the comment after its value, read from the printed YAML's indentation."""
    comments, path = {}, []
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        depth = (len(line) - len(line.lstrip())) // 2
        key, _, rest = line.strip().partition(":")
        path = [*path[:depth], key]
        if "  # " in rest:
            comments[".".join(path)] = rest.split("  # ", 1)[1]
    return comments


def test_printed_config_loads_back_as_the_same_run(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)  # a relative path on the command line is relative to the cwd
    overrides = ["train.steps=3", "data.eval_files=[megatron_rl/assets/arithmetic/eval.jsonl]",
                 "objective.eps_high=0.3", "logging.wandb.tags=[a, b]"]
    cfg = load_run_config(GSPO, overrides)
    text = resolved_config_yaml(GSPO, overrides)
    assert set(flatten(yaml.safe_load(text))) == set(flatten(to_dict(cfg)))  # every default filled in
    printed = tmp_path / "elsewhere" / "printed.yaml"
    printed.parent.mkdir()
    printed.write_text(text)
    monkeypatch.chdir(tmp_path)
    reloaded = load_run_config(printed)
    # The same files: the override's relative path is printed absolute, so it holds from any directory.
    assert reloaded.data.eval_files == [str(ROOT / "megatron_rl/assets/arithmetic/eval.jsonl")]
    assert reloaded == dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, eval_files=reloaded.data.eval_files))


def test_a_printed_distillation_config_names_its_teachers_absolutely(tmp_path, monkeypatch):
    distill = ROOT / "configs" / "demo_distill.yaml"
    cfg = load_run_config(distill)
    printed = tmp_path / "printed.yaml"
    printed.write_text(resolved_config_yaml(distill))
    monkeypatch.chdir(tmp_path)
    # The preset's relative teacher path, printed absolute: the same teacher from any directory.
    assert load_run_config(printed).distill == cfg.distill
    assert cfg.distill.teachers[0].path == str(ROOT / "megatron_rl" / "assets" / "tiny_qwen3_moe_teacher")


def test_each_value_names_its_source():
    text = resolved_config_yaml(GSPO, ["train.steps=3", "optim.lr=2e-4"])
    comments = _comments(text)
    assert comments["train.steps"] == "override"
    assert comments["optim.lr"] == "override"
    assert comments["objective.preset"] == str(GSPO)  # the objective file sets it over its base
    assert comments["optim.clip_grad"] == str(DEMO)  # set by the base file only
    assert comments["train.epochs"] == str(DEMO)
    assert comments["model.num_experts"] == "init_checkpoint"
    assert comments["seed"] == str(DEMO)
    assert comments["eval.greedy"] == str(DEMO)
    assert comments["logging.wandb.mode"] == "default"
    assert comments["objective.eps_low"] == "default; gspo gives 0.0003"
    assert text.startswith(f"# megatron-rl-train resolved config: --config {GSPO}\n# overrides: train.steps=3")


def test_print_config_command_prints_and_exits(capsys):
    assert main(["--config", str(DEMO), "--print-config", "train.steps=7"]) == 0
    out = capsys.readouterr().out
    assert yaml.safe_load(out)["train"]["steps"] == 7
    assert main(["--config", str(DEMO), "--print-config", "train.stepz=7"]) == 2
    assert capsys.readouterr().err.startswith("megatron-rl-train: error: train.stepz: unknown key; did you mean "
                                              "train.steps? TrainerConfig accepts")


@pytest.mark.parametrize("override,key,suggestion", [
    ("train.stepz=3", "train.stepz", "train.steps"),
    ("trian.steps=3", "trian", "train"),
    ("model.num_expert=8", "model.num_expert", "model.num_experts"),  # checked against the starting checkpoint
    ("objective.eps_hihg=0.3", "objective.eps_hihg", "objective.eps_high"),
    ("logging.wandb.mod=offline", "logging.wandb.mod", "logging.wandb.mode"),
])
def test_an_unknown_key_names_the_closest_one(override, key, suggestion):
    with pytest.raises(ConfigError) as err:
        load_run_config(DEMO, [override])
    assert str(err.value).startswith(f"{key}: unknown key; did you mean {suggestion}? ")


def test_an_unknown_key_far_from_every_key_gets_no_suggestion():
    with pytest.raises(ConfigError) as err:
        load_run_config(DEMO, ["xyzzy=1"])
    assert str(err.value).startswith("xyzzy: unknown key; RunConfig accepts [")


def test_help_lists_every_section_and_key_with_its_doc(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    listing = config_help(width=10_000)
    lines = listing.splitlines()
    for f in dataclasses.fields(RunConfig):
        doc = attribute_docs(RunConfig)[f.name]
        assert any(line.strip().startswith(f"{f.name}: {doc}") or line.strip().startswith(f"{f.name} (default")
                   for line in lines), f.name
    assert "    train.steps (default 30): RL steps (each: rollouts, old-policy pass, updates)." in lines
    # The objective's options are documented once, on ObjectiveConfig's fields.
    from megatron_rl.algos.config import ObjectiveConfig

    eps_low = attribute_docs(ObjectiveConfig)["eps_low"]
    assert f"    objective.eps_low (default 'preset'): {eps_low}" in lines
    assert "      logging.wandb.mode (default 'disabled'): " in listing
    assert "config keys (override any with key=value" in out and "train.steps (default 30)" in out


def test_a_large_checkpoint_with_the_demos_sizes_is_warned_once_naming_its_preset(tmp_path, capsys, monkeypatch):
    """Issue 34: unset keys fall back to the tiny demo's sizes (8-token answers, the hf engine,
    30 steps, one process), which a 30B checkpoint cannot use. One warning line names them and
    the matching preset; a file that sets them (or a small checkpoint) gets none."""
    import megatron_rl.train.config_report as report
    import megatron_rl.train.main as train_main
    from megatron_rl.train.config_report import demo_sized_warning, matching_presets

    monkeypatch.chdir(ROOT)  # the presets are named relative to the cwd
    qwen = load_run_config(ROOT / "configs" / "qwen3_30b_a3b.yaml", ["init_checkpoint=null", "fp8.enabled=false"])
    bare = dataclasses.replace(RunConfig(), init_checkpoint="/ckpt/Qwen3-30B-A3B", model=qwen.model)
    assert [p.name for p in matching_presets(bare)] == [
        "qwen3_30b_a3b.yaml", "qwen3_30b_a3b_1node.yaml", "qwen3_30b_a3b_long.yaml"]
    line = demo_sized_warning(None, ["train.steps=30"], bare, launched=False)
    assert line == (
        "megatron-rl-train: warning: /ckpt/Qwen3-30B-A3B has 30.5B parameters but keeps the tiny demo's defaults "
        "rollout.max_new_tokens=8, rollout.engine=hf, parallel.world_size=1; start your file from "
        "configs/qwen3_30b_a3b.yaml or configs/qwen3_30b_a3b_1node.yaml or configs/qwen3_30b_a3b_long.yaml "
        "(base: <preset>)")
    assert "parallel.world_size" not in demo_sized_warning(None, [], bare, launched=True)
    assert demo_sized_warning(ROOT / "configs" / "qwen3_30b_a3b.yaml", [], dataclasses.replace(
        qwen, init_checkpoint="/ckpt/Qwen3-30B-A3B"), launched=False) is None
    assert demo_sized_warning(None, [], dataclasses.replace(bare, init_checkpoint=None), launched=False) is None

    # The entry point prints it once, before the input checks (a tiny checkpoint counted as large).
    monkeypatch.setattr(report, "LARGE_MODEL_PARAMS", 0)
    monkeypatch.setattr(train_main, "check_inputs", lambda cfg: (_ for _ in ()).throw(ConfigError("stop here")))
    mine = tmp_path / "my_run.yaml"
    mine.write_text(yaml.safe_dump({"init_checkpoint": str(ROOT / "megatron_rl" / "assets" / "tiny_qwen3_moe"),
                                    "data": {"source": "files", "train_files": ["p.jsonl"]}}))
    assert main(["--config", str(mine), f"train.run_dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and err[0].startswith("megatron-rl-train: warning: ")
    assert err[0].endswith("start your file from the preset in configs/ nearest your model and machines (base: <preset>)")
    assert err[1] == "megatron-rl-train: error: stop here"
    assert main(["--config", str(DEMO), "rollout.engine=hf", f"train.run_dir={tmp_path / 'run'}"]) == 2
    assert capsys.readouterr().err.splitlines() == ["megatron-rl-train: error: stop here"]  # every size set
