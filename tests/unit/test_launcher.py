"""The launcher: validation against the node layout before any worker, the plan from the
command line and from Slurm's environment, the torchrun command, exit-code propagation."""

import argparse
import dataclasses
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_rl import launcher
from megatron_rl.config_loading import ConfigError
from megatron_rl.fp8 import Fp8Environment
from megatron_rl.launcher import (
    LaunchPlan,
    default_nproc_per_node,
    resolve_plan,
    run_agent,
    torchrun_command,
    validate_launch,
    worker_environment,
)
from megatron_rl.config import load_config

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
DEMO = CONFIGS / "demo_cpu.yaml"
QWEN = CONFIGS / "qwen3_30b_a3b.yaml"
QWEN_LONG = CONFIGS / "qwen3_30b_a3b_long.yaml"
ASSET = CONFIGS.parent / "megatron_rl" / "assets" / "tiny_qwen3_moe"
TRAIN = CONFIGS.parent / "megatron_rl" / "assets" / "arithmetic" / "train.jsonl"
DEEPSEEK = CONFIGS / "deepseek_v3_style.yaml"
HOPPER = Fp8Environment(te_version="2.8.0", cuda_available=True, compute_capability=(9, 0), cuda_version="12.9")
NO_TE = Fp8Environment(te_version=None, cuda_available=True, compute_capability=(9, 0), cuda_version="12.9")


def _preset(path, *overrides, fp8=True):
    """A preset loaded on this CPU machine (FP8 off for loading), FP8 switched back on."""
    # The real presets name checkpoints on a cluster's file system; their layout is what is checked here.
    cfg = load_config(path, ["fp8.enabled=false", "init_checkpoint=null", *overrides])
    return dataclasses.replace(cfg, fp8=dataclasses.replace(cfg.fp8, enabled=fp8))


def _args(**kw):
    defaults = dict(config=str(DEMO), overrides=[], nnodes=None, nproc_per_node=None, rdzv_endpoint=None,
                    rdzv_id=None, node_rank=None, log_dir=None, max_restarts=0, entry=launcher.DEFAULT_ENTRY,
                    entry_args=[])
    defaults.update(kw)
    return argparse.Namespace(**defaults)


@pytest.mark.parametrize("path, nnodes", [(QWEN, 2), (DEEPSEEK, 4), (QWEN_LONG, 4)])
def test_presets_fit_their_intended_layouts(path, nnodes):
    validate_launch(_preset(path), nnodes, 8, gpus_per_node=8, fp8_env=HOPPER)


def test_demo_runs_on_one_node_or_two_loopback_nodes():
    cfg = load_config(DEMO)
    validate_launch(cfg, 1, 2)
    validate_launch(cfg, 2, 1)
    assert default_nproc_per_node(cfg, 1, gpus_per_node=0) == 2
    assert default_nproc_per_node(cfg, 2, gpus_per_node=0) == 1


@pytest.mark.parametrize(
    "path, overrides, nnodes, nproc, gpus, env, key, rule",
    [
        # world size does not match TP x PP x DP
        (QWEN, ["parallel.world_size=null"], 1, 12, 0, HOPPER, "parallel.world_size",
         "not divisible by TP x PP x CP = 8"),
        (QWEN, [], 2, 4, 0, HOPPER, "parallel.world_size", "expects 16 processes, but 2 nodes x 4"),
        (DEMO, ["parallel.world_size=null"], 1, 3, 0, HOPPER, "parallel.expert_model_parallel_size",
         "not divisible by ETP x EP x PP = 2"),
        (QWEN_LONG, ["parallel.world_size=null"], 3, 8, 8, HOPPER, "parallel.world_size",
         "not divisible by TP x PP x CP = 16"),
        # a node count that does not divide the processes
        (QWEN, [], 3, 5, 0, HOPPER, "parallel.world_size", "16 processes cannot be spread evenly over 3 nodes"),
        # TP groups would straddle nodes; more workers than GPUs
        (QWEN, [], 8, 2, 0, HOPPER, "parallel.tensor_model_parallel_size",
         "TP (4) must divide the processes per node (2)"),
        (QWEN, [], 2, 8, 4, HOPPER, "launch.nproc_per_node", "only 4 GPUs are visible"),
        # FP8 without Transformer Engine, or on a GPU without FP8 tensor cores
        (QWEN, [], 2, 8, 8, NO_TE, "fp8.enabled", "Transformer Engine does not import here"),
        (DEEPSEEK, [], 4, 8, 8, dataclasses.replace(HOPPER, compute_capability=(8, 0)), "fp8.enabled",
         "compute capability >= 8.9"),
        (QWEN, [], 0, 8, 0, HOPPER, "launch.nnodes", "must be >= 1"),
    ],
)
def test_invalid_launch_is_rejected(path, overrides, nnodes, nproc, gpus, env, key, rule):
    with pytest.raises(ConfigError) as err:
        validate_launch(_preset(path, *overrides), nnodes, nproc, gpus_per_node=gpus, fp8_env=env)
    assert str(err.value).startswith(f"{key}: ") and rule in str(err.value), str(err.value)


def test_default_processes_per_node_need_a_dividing_node_count():
    with pytest.raises(ConfigError, match=r"^parallel.world_size: 16 processes cannot be spread evenly over 3 nodes"):
        default_nproc_per_node(_preset(QWEN, fp8=False), 3, gpus_per_node=0)
    assert default_nproc_per_node(_preset(QWEN, fp8=False), 3, gpus_per_node=8) == 8


@pytest.fixture
def no_processes(monkeypatch):
    """Fails the test if the launcher starts any process; clears Slurm's environment."""
    started = []

    def popen(*args, **kwargs):
        started.append(args)
        raise AssertionError(f"a process was started: {args}")

    monkeypatch.setattr(launcher.subprocess, "Popen", popen)
    for name in ("SLURM_JOB_ID", "SLURM_NNODES", "SLURM_NODEID", "SLURM_JOB_NODELIST", "SLURM_STEP_NODELIST"):
        monkeypatch.delenv(name, raising=False)
    return started


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--config", str(QWEN)], "init_checkpoint: /data/models/Qwen3-30B-A3B does not exist"),
        (["--config", str(QWEN), "init_checkpoint=null", "fp8.enabled=false", "data.train_files=[/nowhere/train.parquet]"],
         "data.train_files[0]: /nowhere/train.parquet"),
        (["--config", str(QWEN), "init_checkpoint=null", f"data.train_files=[{TRAIN}]", f"data.eval_files=[{TRAIN}]",
          f"tokenizer.path={ASSET}"], "fp8.enabled: FP8 training needs Transformer Engine and a CUDA GPU"),
        (["--config", str(QWEN), "init_checkpoint=null", f"data.train_files=[{TRAIN}]", f"data.eval_files=[{TRAIN}]",
          f"tokenizer.path={ASSET}", "fp8.enabled=false", "--nnodes", "3", "--rdzv-endpoint", "127.0.0.1:9"],
         "parallel.world_size: 16 processes cannot be spread evenly over 3 nodes"),
        (["--config", str(DEMO), "--nproc-per-node", "3"], "parallel.world_size: config expects 2 processes"),
        (["--config", str(DEMO), "--nnodes", "2"], "launch.rdzv_endpoint: 2 nodes need --rdzv-endpoint"),
        (["--config", str(DEMO), "train.steps=-1"], "train.steps: must be >= 0"),
        (["--config", str(DEMO), "data.train_files=[a"], "data.train_files: override value '[a' is not valid YAML"),
    ],
)
def test_main_rejects_before_starting_any_process(argv, message, no_processes, capsys):
    assert launcher.main(argv) == launcher.CONFIG_ERROR_EXIT
    assert message in capsys.readouterr().err
    assert no_processes == []


def test_dry_run_prints_the_command_and_starts_nothing(no_processes, capsys, tmp_path):
    argv = ["--config", str(DEMO), "train.steps=3", f"train.run_dir={tmp_path}", "--dry-run", "--", "--extra"]
    assert launcher.main(argv) == 0
    out = capsys.readouterr().out
    assert "1 node(s) x 2 process(es) = world 2" in out
    assert "--rdzv-backend=c10d" in out and f"--config {DEMO} train.steps=3" in out and out.rstrip().endswith("--extra")
    assert not (tmp_path / "logs").exists()


def test_plan_comes_from_the_slurm_environment(monkeypatch, tmp_path):
    calls = []

    def fake_run(cmd, **kwargs):
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, 0, stdout="gpu007\ngpu008\n", stderr="")

    monkeypatch.setattr(launcher.subprocess, "run", fake_run)
    env = {"SLURM_JOB_ID": "4242", "SLURM_NNODES": "2", "SLURM_NODEID": "1",
           "SLURM_JOB_NODELIST": "gpu[007-008]", "SLURM_CPUS_ON_NODE": "64"}
    cfg = _preset(QWEN, f"train.run_dir={tmp_path}", fp8=False)
    plan = resolve_plan(_args(config=str(QWEN)), cfg, env, gpus_per_node=8)
    assert calls == [["scontrol", "show", "hostnames", "gpu[007-008]"]]
    assert (plan.nnodes, plan.nproc_per_node, plan.world_size) == (2, 8, 16)
    assert plan.rdzv_endpoint == "gpu007:24242" and plan.rdzv_id == "4242"
    assert plan.node_name == "node1" and plan.log_file == tmp_path / "logs" / "node1.log"
    assert plan.threads_per_process == 8
    env["MEGATRON_RL_RDZV_PORT"] = "31000"
    explicit = _args(config=str(QWEN), nnodes=2, rdzv_id="mine", node_rank=0)
    plan = resolve_plan(explicit, cfg, env, gpus_per_node=8)
    assert plan.rdzv_endpoint == "gpu007:31000" and plan.rdzv_id == "mine" and plan.node_name == "node0"


def test_single_node_defaults_outside_slurm(tmp_path):
    cfg = load_config(DEMO, [f"train.run_dir={tmp_path}"])
    plan = resolve_plan(_args(), cfg, {}, gpus_per_node=0)
    assert (plan.nnodes, plan.nproc_per_node, plan.rdzv_endpoint, plan.node_name) == (1, 2, "127.0.0.1:0", "node0")


def test_torchrun_command_and_environment(tmp_path):
    plan = LaunchPlan(config="c.yaml", overrides=["a.b=1"], nnodes=2, nproc_per_node=4, rdzv_endpoint="h:1",
                      rdzv_id="r", node_name="node0", log_file=tmp_path / "n.log", entry_args=["--x"],
                      threads_per_process=3)
    assert torchrun_command(plan, python="py") == [
        "py", "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=4", "--rdzv-backend=c10d",
        "--rdzv-endpoint=h:1", "--rdzv-id=r", "--max-restarts=0",
        "-m", "megatron_rl.train.main", "--config", "c.yaml", "a.b=1", "--x",
    ]
    script = dataclasses.replace(plan, entry="tools/convert.py", entry_args=[])
    assert torchrun_command(script, python="py")[-4:] == ["tools/convert.py", "--config", "c.yaml", "a.b=1"]
    env = worker_environment(plan, {"PATH": "/bin"})
    assert env["OMP_NUM_THREADS"] == "3" and env["PYTHONUNBUFFERED"] == "1" and env["PATH"] == "/bin"
    assert worker_environment(plan, {"OMP_NUM_THREADS": "7"})["OMP_NUM_THREADS"] == "7"


@pytest.mark.parametrize(
    "code, expected",
    [("print('hello from the agent'); raise SystemExit(7)", 7),
     ("print('hello from the agent', flush=True); import os, signal; os.kill(os.getpid(), signal.SIGTERM)",
      128 + signal.SIGTERM),
     ("print('hello from the agent')", 0)],
)
def test_run_agent_tees_output_and_passes_the_exit_status_on(code, expected, tmp_path, capsys):
    log = tmp_path / "logs" / "node0.log"
    assert run_agent([sys.executable, "-c", code], {}, log) == expected
    assert "hello from the agent" in log.read_text()
    assert "hello from the agent" in capsys.readouterr().out


def test_sglang_option_adds_a_server_per_node_and_points_the_trainer_at_it(no_processes, capsys, tmp_path):
    # rollout.max_staleness=1 needs the SGLang engine: the launch is planned without it, then checked with it.
    argv = ["--config", str(DEMO), f"train.run_dir={tmp_path}", "--rdzv-id", "job7", "--dry-run",
            "--sglang", "--model-path /ckpt/hf --tp-size 2 --mem-fraction-static 0.4", "rollout.max_staleness=1"]
    assert launcher.main(argv) == 0
    out = capsys.readouterr().out
    server = next(line for line in out.splitlines() if line.startswith("launch: SGLang server:"))
    url_dir = tmp_path / "sglang_urls" / "job7"
    assert "-m megatron_rl.rollout.sglang.server" in server and f"--url-file {url_dir / 'node0'}" in server
    assert server.rstrip().endswith("--model-path /ckpt/hf --tp-size 2 --mem-fraction-static 0.4")
    for override in ("rollout.engine=sglang", f"rollout.sglang.url_dir={url_dir}", "rollout.sglang.num_servers=1",
                     "rollout.sglang.weight_sync=tensor", "rollout.sglang.server_tp_size=2"):
        assert override in out
    assert no_processes == []


def test_sglang_option_is_validated_with_the_run(no_processes, capsys):
    # The model routes with sigmoid here: no HF architecture SGLang serves can hold it.
    argv = ["--config", str(CONFIGS / "demo_task.yaml"), "model.moe_router_score_function=sigmoid", "--dry-run",
            "--sglang", "--model-path /ckpt/hf"]
    assert launcher.main(argv) == launcher.CONFIG_ERROR_EXIT
    err = capsys.readouterr().err
    assert "rollout.sglang.hf_architecture: the model cannot be exported as qwen3_moe" in err
    assert "qwen3_moe routes with softmax scores" in err


def test_a_colocated_config_starts_its_servers_with_the_memory_saver(no_processes, capsys, tmp_path):
    argv = ["--config", str(DEMO), f"train.run_dir={tmp_path}", "--rdzv-id", "job8", "--dry-run",
            "--sglang", "--model-path /ckpt/hf", "rollout.placement=colocated"]
    assert launcher.main(argv) == 0
    out = capsys.readouterr().out
    server = next(line for line in out.splitlines() if line.startswith("launch: SGLang server:"))
    assert "-m megatron_rl.rollout.sglang.server --enable-memory-saver --url-file" in server
    assert "--enable-weights-cpu-backup" not in server  # the trainer pushes the weights after every resume
    argv[argv.index("rollout.placement=colocated")] = "rollout.placement=disaggregated"
    assert launcher.main(argv) == 0
    assert "--enable-memory-saver" not in capsys.readouterr().out


@pytest.mark.parametrize("main,prog", [("megatron_rl.launcher:main", "megatron-rl-launch"),
                                       ("megatron_rl.checkpoint.cli:parity_main", "megatron-rl-logprob-parity")])
def test_help_names_the_installed_command_and_says_what_every_option_does(main, prog, capsys):
    import importlib
    import re

    module, name = main.split(":")
    with pytest.raises(SystemExit) as done:
        getattr(importlib.import_module(module), name)(["--help"])
    assert done.value.code == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(f"usage: {prog} ")
    # An option without help is a bare "  --name VALUE" line followed by the next option's.
    options = [i for i, line in enumerate(lines) if re.match(r"^  -", line)]
    bare = [lines[i].strip() for i in options if not re.search(r"\S {2,}\S", lines[i].strip())
            and not (i + 1 < len(lines) and re.match(r"^ {10,}\S", lines[i + 1]))]
    assert options and not bare, bare
