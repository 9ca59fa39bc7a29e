"""Start a run under torchrun on one node or many: validate, then one torchrun agent per node.

    python -m megatron_rl.launcher --config configs/qwen3_30b_a3b.yaml --nnodes 2 \\
        --rdzv-endpoint node001:29500 [--nproc-per-node 8] [key=value ...] [-- entry args]

Each node runs this once (``srun --ntasks-per-node=1`` does that under Slurm, see
``launch/slurm/``). It owns, in order:

1. the launch plan: node count, processes per node, rendezvous endpoint and id, and the
   node's log file, from the command line, else from Slurm's environment
   (``SLURM_NNODES``/``SLURM_NODEID``/``SLURM_JOB_ID``, rendezvous on the first node of the
   allocation), else single-node defaults;
2. validation of the run config against that plan before any worker exists
   (:func:`validate_launch`): world size = nodes x processes per node must fit the
   TP/CP/PP/EP layout (a multiple of TP x CP x PP and of ETP x EP x PP; the rest is data
   parallelism) and ``parallel.world_size``, the node count must divide the
   processes, TP groups must stay inside a node, a node cannot run more processes than
   it has GPUs, and FP8 must be runnable here (Transformer Engine, CUDA, GPU generation);
   on a GPU machine (or with ``--gpu-memory``) the memory planner (``megatron_rl.plan``)
   must find that every phase of an RL step fits the GPUs and the node's host memory;
3. the torchrun command (c10d rendezvous, no restarts by default: a failed run resumes
   from its last checkpoint when resubmitted) and the worker environment (threads per
   process);
4. running it: the agent's output goes to this process's stdout and to the per-node log,
   SIGTERM/SIGINT (Slurm's time limit, ``scancel``, Ctrl-C) are forwarded once, and the
   exit status is passed on: 0 only when every local worker succeeded, 2 for a rejected
   config, ``128 + signal`` for a stop. The agent and the server wrapper get SIGTERM from
   the kernel if this process dies outright, so a killed launcher leaves nothing running.

With ``--sglang ARGS`` each node also runs one SGLang server (``megatron_rl.rollout.sglang.
server ARGS``) for the run's rollouts beside its workers: the trainer is pointed at the
launch's URL directory and takes weights through ``/update_weights_from_tensor``; the server
is stopped when the agent exits. With ``rollout.placement: colocated`` the server starts with
``--enable-memory-saver`` and the two take turns on the GPUs (``megatron_rl.train.colocate``);
otherwise each keeps its memory (a static split, ``--mem-fraction-static``).

It does not own the training itself (the entry module, ``megatron_rl.train.main`` by
default, reads the same config under torchrun's environment) nor NCCL settings, which
live in ``launch/env.sh``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Sequence, TextIO

from megatron_rl.config import RunConfig, load_config
from megatron_rl.config_loading import ConfigError
from megatron_rl.fp8 import Fp8Environment, check_fp8
from megatron_rl.plan import Machine, make_plan, parse_bytes
from megatron_rl.plan.report import layout_from_config
from megatron_rl.rollout.sglang.server import FAILED_SUFFIX, parent_death_signal
from megatron_rl.sections import validate_layout
from megatron_rl.train.prepare import check_inputs

DEFAULT_ENTRY = "megatron_rl.train.main"
"""Module every worker runs unless ``--entry`` names another."""
SLURM_PORT_BASE = 20000
"""Under Slurm the rendezvous port is ``SLURM_PORT_BASE + job id % 10000``: distinct for
concurrent jobs, and below Linux's ephemeral range (32768+) so no client socket holds it."""
CONFIG_ERROR_EXIT = 2
"""Exit status for a config or launch plan rejected before any worker started."""


@dataclass(kw_only=True)
class LaunchPlan:
    """Everything one node's torchrun agent is started with."""

    config: str
    """Run config (YAML) handed to every worker."""
    overrides: list[str] = field(default_factory=list)
    """``key.path=value`` overrides, applied by the launcher and by every worker."""
    nnodes: int
    """Nodes taking part; one torchrun agent each."""
    nproc_per_node: int
    """Workers each agent starts (one per GPU on GPU nodes)."""
    rdzv_endpoint: str
    """``host:port`` of the c10d rendezvous store (hosted by the agent on that host)."""
    rdzv_id: str
    """Rendezvous id shared by every agent of this run."""
    node_name: str
    """This node in log names: ``node<rank>`` when the rank is known, else the hostname."""
    log_file: Path
    """This node's log: the agent's and its workers' output."""
    max_restarts: int = 0
    """Worker-group restarts torchrun attempts before failing."""
    entry: str = DEFAULT_ENTRY
    """Module (or ``.py`` script) every worker runs."""
    entry_args: list[str] = field(default_factory=list)
    """Extra arguments for the entry after the config and overrides."""
    threads_per_process: int = 1
    """OMP_NUM_THREADS for each worker unless the environment sets it."""

    @property
    def world_size(self) -> int:
        """Workers over all nodes."""
        return self.nnodes * self.nproc_per_node


# --------------------------------------------------------------------------- validation


def _require(ok: bool, key: str, rule: str) -> None:
    if not ok:
        raise ConfigError(f"{key}: {rule}")


def default_nproc_per_node(cfg: RunConfig, nnodes: int, gpus_per_node: int) -> int:
    """Workers per node when not given: one per GPU, else ``parallel.world_size / nnodes``.

    Raises:
        ConfigError: the node count does not divide ``parallel.world_size``.
    """
    if gpus_per_node > 0:
        return gpus_per_node
    world = cfg.parallel.world_size
    if world is None:
        return 1
    _require(
        world % nnodes == 0,
        "parallel.world_size",
        f"{world} processes cannot be spread evenly over {nnodes} nodes; "
        "choose a node count that divides the world size",
    )
    return world // nnodes


def validate_launch(
    cfg: RunConfig,
    nnodes: int,
    nproc_per_node: int,
    *,
    gpus_per_node: int = 0,
    fp8_env: Fp8Environment | None = None,
) -> None:
    """Check a run config against a launch plan; nothing is started here.

    Args:
        cfg: the loaded run config.
        nnodes: nodes taking part.
        nproc_per_node: workers per node.
        gpus_per_node: GPUs this node has (0 on a CPU node).
        fp8_env: the machine FP8 is checked against; None probes this one when FP8 is on.

    Raises:
        ConfigError: naming the key and the rule that the plan breaks.
    """
    _require(nnodes >= 1, "launch.nnodes", f"must be >= 1, got {nnodes}")
    _require(nproc_per_node >= 1, "launch.nproc_per_node", f"must be >= 1, got {nproc_per_node}")
    world = nnodes * nproc_per_node
    p = cfg.parallel
    if p.world_size is not None:
        _require(p.world_size % nnodes == 0, "parallel.world_size",
                 f"{p.world_size} processes cannot be spread evenly over {nnodes} nodes")
        _require(p.world_size == world, "parallel.world_size",
                 f"config expects {p.world_size} processes, but {nnodes} nodes x {nproc_per_node} "
                 f"processes per node start {world}")
    _require(gpus_per_node == 0 or nproc_per_node <= gpus_per_node, "launch.nproc_per_node",
             f"{nproc_per_node} processes per node but only {gpus_per_node} GPUs are visible")
    validate_layout(cfg.model, p, world_size=world)
    tp = p.tensor_model_parallel_size
    _require(nproc_per_node % tp == 0, "parallel.tensor_model_parallel_size",
             f"TP ({tp}) must divide the processes per node ({nproc_per_node}) so that each "
             "tensor-parallel group stays inside one node")
    check_fp8(cfg.fp8, fp8_env)


def check_memory(cfg: RunConfig, plan: LaunchPlan, gpu_memory: int, host_memory: int | None,
                 gpus_per_node: int, shares_gpus: bool) -> None:
    """Refuse a layout the memory planner says cannot fit (``megatron_rl.plan``).

    Args:
        cfg: the loaded run config.
        plan: this launch (world size, processes per node).
        gpu_memory: bytes per GPU.
        host_memory: bytes of host memory per node (None: not checked).
        gpus_per_node: GPUs per node.
        shares_gpus: ``--sglang`` runs a server on the trainer's GPUs beside it, both resident
            (a ``rollout.placement: colocated`` run is planned with its offload instead).

    Raises:
        ConfigError: ``memory: <phase, its need, the biggest term>``.
    """
    machine = Machine(gpus=plan.world_size, gpu_memory=gpu_memory, host_memory=host_memory,
                      gpus_per_node=gpus_per_node)
    layout = dataclasses.replace(layout_from_config(cfg, machine), world=plan.world_size)
    if shares_gpus:
        layout = dataclasses.replace(layout, placement="colocated", offload=False, server_gpus=0)
    # The servers of a disaggregated run have GPUs of their own, outside this launch.
    memory_plan = make_plan(cfg, dataclasses.replace(machine, gpus=plan.world_size + layout.server_gpus), layout)
    if not memory_plan.fits:
        raise ConfigError(f"memory: {memory_plan.refusal()} (megatron-rl-plan prints the whole plan)")


# --------------------------------------------------------------------------- the plan


def slurm_head_node(env: Mapping[str, str]) -> str | None:
    """First host of this Slurm step's (or job's) node list, expanded by ``scontrol``."""
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
    if not nodelist:
        return None
    try:
        out = subprocess.run(
            ["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, check=True
        ).stdout.split()
    except (OSError, subprocess.CalledProcessError) as err:
        raise ConfigError(f"launch.rdzv_endpoint: cannot expand SLURM node list {nodelist!r}: {err}") from err
    return out[0] if out else None


def _cpus_on_node(env: Mapping[str, str]) -> int:
    if env.get("SLURM_CPUS_ON_NODE", "").isdigit():
        return int(env["SLURM_CPUS_ON_NODE"])
    return len(os.sched_getaffinity(0))


def resolve_plan(
    args: argparse.Namespace,
    cfg: RunConfig,
    env: Mapping[str, str],
    gpus_per_node: int,
) -> LaunchPlan:
    """The launch plan from the command line, then Slurm's environment, then defaults."""
    in_slurm = "SLURM_JOB_ID" in env
    nnodes = args.nnodes
    if nnodes is None:
        nnodes = int(env.get("SLURM_STEP_NUM_NODES") or env.get("SLURM_NNODES") or 1) if in_slurm else 1
    node_rank = args.node_rank
    if node_rank is None and env.get("SLURM_NODEID", "").isdigit():
        node_rank = int(env["SLURM_NODEID"])
    if node_rank is None and nnodes == 1:
        node_rank = 0
    nproc = args.nproc_per_node or default_nproc_per_node(cfg, nnodes, gpus_per_node)
    endpoint = args.rdzv_endpoint
    if endpoint is None and in_slurm:
        port = env.get("MEGATRON_RL_RDZV_PORT") or str(SLURM_PORT_BASE + int(env["SLURM_JOB_ID"]) % 10000)
        endpoint = f"{slurm_head_node(env) or socket.gethostname()}:{port}"
    if endpoint is None:
        _require(
            nnodes == 1,
            "launch.rdzv_endpoint",
            f"{nnodes} nodes need --rdzv-endpoint HOST:PORT on the first node (or run under Slurm)",
        )
        # Port 0: the single agent hosts the store on a free port (torchrun --standalone).
        endpoint = "127.0.0.1:0"
    rdzv_id = args.rdzv_id or env.get("SLURM_JOB_ID") or "megatron-rl"
    node_name = f"node{node_rank}" if node_rank is not None else f"node-{socket.gethostname()}"
    log_dir = Path(args.log_dir) if args.log_dir else Path(cfg.train.run_dir) / "logs"
    return LaunchPlan(
        config=args.config,
        overrides=list(args.overrides),
        nnodes=nnodes,
        nproc_per_node=nproc,
        rdzv_endpoint=endpoint,
        rdzv_id=rdzv_id,
        node_name=node_name,
        log_file=log_dir / f"{node_name}.log",
        max_restarts=args.max_restarts,
        entry=args.entry,
        entry_args=list(args.entry_args),
        threads_per_process=max(1, _cpus_on_node(env) // nproc),
    )


def torchrun_command(plan: LaunchPlan, python: str = sys.executable) -> list[str]:
    """The torchrun (``python -m torch.distributed.run``) command line of one node."""
    cmd = [
        python, "-m", "torch.distributed.run",
        f"--nnodes={plan.nnodes}",
        f"--nproc-per-node={plan.nproc_per_node}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={plan.rdzv_endpoint}",
        f"--rdzv-id={plan.rdzv_id}",
        f"--max-restarts={plan.max_restarts}",
    ]
    cmd += [plan.entry] if plan.entry.endswith(".py") else ["-m", plan.entry]
    return cmd + ["--config", plan.config, *plan.overrides, *plan.entry_args]


def worker_environment(plan: LaunchPlan, env: Mapping[str, str]) -> dict[str, str]:
    """The agent's environment: ``env`` plus per-process threads, unbuffered output and the
    warning filter of a plain run; values already in ``env`` win."""
    out = dict(env)
    # Without this, torchrun sets 1 thread per worker; a CPU run wants its share of cores.
    out.setdefault("OMP_NUM_THREADS", str(plan.threads_per_process))
    out["PYTHONUNBUFFERED"] = "1"
    # The same filter as a plain megatron-rl-train world: Megatron's deprecation noise
    # would otherwise bury the progress lines in every node log.
    out.setdefault("PYTHONWARNINGS", "ignore::UserWarning,ignore::FutureWarning")
    return out


# --------------------------------------------------------------------------- running


def run_agent(cmd: Sequence[str], env: Mapping[str, str], log_file: Path, stdout: TextIO | None = None) -> int:
    """Run the torchrun agent, teeing its output to ``stdout`` and ``log_file``.

    SIGTERM and SIGINT are forwarded to the agent, which stops its workers. Returns the
    agent's exit status, ``128 + signal`` when a signal ended it or was forwarded to it.
    """
    stdout = sys.stdout if stdout is None else stdout
    log_file.parent.mkdir(parents=True, exist_ok=True)
    # Its own session: the terminal's Ctrl-C reaches only this process, which forwards it
    # once (a second SIGINT would cut short torchrun's own shutdown of its workers).
    proc = subprocess.Popen(list(cmd), env=dict(env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True, preexec_fn=parent_death_signal(signal.SIGTERM))
    received: list[int] = []

    def forward(signum: int, _frame: object) -> None:
        received.append(signum)
        proc.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        with log_file.open("ab") as log:
            assert proc.stdout is not None
            for line in iter(proc.stdout.readline, b""):
                log.write(line)
                log.flush()
                stdout.write(line.decode(errors="replace"))
                stdout.flush()
        rc = proc.wait()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    if received and rc != 0:
        # torchrun exits 1 after stopping its workers on a signal; the stop is the news.
        return 128 + received[0]
    return 128 - rc if rc < 0 else rc


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="megatron-rl-launch",
        description="Validate a run config against the node layout, then start torchrun on this node.",
    )
    parser.add_argument("--config", required=True, help="run config (YAML); every worker gets the same path")
    parser.add_argument("--nnodes", type=int, help="nodes (default: SLURM_NNODES, else 1)")
    parser.add_argument("--nproc-per-node", type=int, help="workers per node (default: GPUs, else world_size / nnodes)")
    parser.add_argument("--rdzv-endpoint", help="HOST:PORT of the rendezvous (default: first Slurm node, else local)")
    parser.add_argument("--rdzv-id", help="rendezvous id shared by all nodes (default: SLURM_JOB_ID)")
    parser.add_argument("--node-rank", type=int, help="this node's index, for its log name (default: SLURM_NODEID)")
    parser.add_argument("--log-dir", help="per-node logs go here (default: <train.run_dir>/logs)")
    parser.add_argument("--max-restarts", type=int, default=0, help="worker-group restarts before failing")
    parser.add_argument("--entry", default=DEFAULT_ENTRY, help="module or .py script each worker runs")
    parser.add_argument("--sglang", metavar="ARGS", default=None,
                        help="also run an SGLang server on this node for the rollouts (colocated, weights "
                             "through /update_weights_from_tensor); ARGS are megatron_rl.rollout.sglang.server's "
                             "options, e.g. --sglang='--model-path /ckpt/hf --tp-size 8 --mem-fraction-static 0.4'")
    parser.add_argument("--gpu-memory", help="memory per GPU for the memory plan, e.g. 80GiB (default on a GPU "
                                             "machine: the first GPU's; on a CPU machine the plan runs only with it)")
    parser.add_argument("--host-memory", help="host memory per node for the memory plan (default on a GPU machine: "
                                              "this node's)")
    parser.add_argument("--dry-run", action="store_true", help="validate and print the command; start nothing")
    parser.add_argument("overrides", nargs="*", help="key.path=value overrides; arguments after -- go to the entry")
    return parser


def _gpus_on_node() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _memory_sizes(args: argparse.Namespace, gpus: int) -> tuple[int, int | None]:
    """GPU memory per GPU and host memory per node: the arguments, else this machine's."""
    if args.gpu_memory:
        gpu_memory = parse_bytes(args.gpu_memory, "--gpu-memory")
    else:
        import torch

        gpu_memory = torch.cuda.get_device_properties(0).total_memory
    if args.host_memory:
        return gpu_memory, parse_bytes(args.host_memory, "--host-memory")
    host_memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") if gpus > 0 else None
    return gpu_memory, host_memory


def main(argv: Sequence[str] | None = None) -> int:
    """Validate, then run this node's torchrun agent; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    entry_args: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, entry_args = argv[:cut], argv[cut + 1 :]
    args = _parser().parse_intermixed_args(argv)
    args.entry_args = entry_args
    env = dict(os.environ)
    try:
        # With --sglang the engine is SGLang whatever the config says: plan the launch without
        # another engine's checks, then validate the run with the SGLang section below.
        planning = args.overrides + (["rollout.engine=megatron", "rollout.max_staleness=0",
                                      "rollout.placement=disaggregated"] if args.sglang is not None else [])
        cfg = load_config(args.config, planning)
        check_inputs(cfg)
        gpus = _gpus_on_node()
        plan = resolve_plan(args, cfg, env, gpus)
        server_cmd = None
        if args.sglang is not None:
            server_cmd, extra = colocated_sglang(plan, cfg, args.sglang)
            plan.overrides += extra
            cfg = load_config(args.config, plan.overrides)  # validates the SGLang section too
            if cfg.rollout.placement == "colocated":  # the servers release their memory between turns
                server_cmd.insert(server_cmd.index("--url-file"), "--enable-memory-saver")
        validate_launch(cfg, plan.nnodes, plan.nproc_per_node, gpus_per_node=gpus)
        if gpus > 0 or args.gpu_memory:
            gpu_memory, host_memory = _memory_sizes(args, gpus)
            check_memory(cfg, plan, gpu_memory, host_memory, gpus or plan.nproc_per_node,
                         args.sglang is not None and cfg.rollout.placement != "colocated")
    except ConfigError as err:
        print(f"megatron-rl-launch: error: {err}", file=sys.stderr, flush=True)
        return CONFIG_ERROR_EXIT
    cmd = torchrun_command(plan)
    worker_env = worker_environment(plan, env)
    summary = (
        f"launch: {plan.node_name} on {socket.gethostname()}: {plan.nnodes} node(s) x "
        f"{plan.nproc_per_node} process(es) = world {plan.world_size}, c10d rendezvous "
        f"{plan.rdzv_endpoint} id {plan.rdzv_id}, OMP_NUM_THREADS={worker_env['OMP_NUM_THREADS']}, "
        f"log {plan.log_file}"
    )
    if server_cmd is not None:
        summary += f"\nlaunch: SGLang server: {shlex.join(server_cmd)}"
    if args.dry_run:
        print(f"{summary}\nlaunch: {shlex.join(cmd)}", flush=True)
        return 0
    _announce(plan.log_file, f"==== {time.strftime('%Y-%m-%d %H:%M:%S')}\n{summary}\nlaunch: {shlex.join(cmd)}")
    server = None
    if server_cmd is not None:
        # A URL (or failure note) left by an earlier launch with the same id is not this server's.
        url_file = Path(server_cmd[server_cmd.index("--url-file") + 1])
        for stale in (url_file, url_file.with_name(url_file.name + FAILED_SUFFIX)):
            stale.unlink(missing_ok=True)
        # SIGTERM if this launcher is killed: the wrapper then stops its server and withdraws its URL.
        server = subprocess.Popen(server_cmd, start_new_session=True, preexec_fn=parent_death_signal(signal.SIGTERM))
    try:
        rc = run_agent(cmd, worker_env, plan.log_file)
    finally:
        if server is not None:
            _stop_server(server, server_cmd)
    _announce(plan.log_file, f"launch: {plan.node_name} finished with exit code {rc}")
    return rc


def colocated_sglang(plan: LaunchPlan, cfg: RunConfig, server_args: str) -> tuple[list[str], list[str]]:
    """This node's SGLang server command and the overrides that point the trainer at it.

    Every node's launcher starts one server that publishes its URL in a directory unique to
    this launch (the rendezvous id), so the trainer waits for all ``nnodes`` of them and
    never picks up a URL left by an earlier run.
    """
    url_dir = Path(cfg.train.run_dir) / "sglang_urls" / plan.rdzv_id
    own = ["--url-file", str(url_dir / plan.node_name),
           "--log-file", str(plan.log_file.parent / f"sglang-{plan.node_name}.log")]
    words = shlex.split(server_args)
    command = [sys.executable, "-m", "megatron_rl.rollout.sglang.server", *own, *words]
    # The push lays its payloads out for the servers' TP size, which they report and it checks.
    tp_size = words[words.index("--tp-size") + 1] if "--tp-size" in words[:-1] else "1"
    overrides = ["rollout.engine=sglang", "rollout.sglang.urls=[]", f"rollout.sglang.url_dir={url_dir}",
                 f"rollout.sglang.num_servers={plan.nnodes}", "rollout.sglang.weight_sync=tensor",
                 f"rollout.sglang.server_tp_size={tp_size}"]
    return command, overrides


def _stop_server(server: subprocess.Popen, command: Sequence[str], grace_s: float = 60.0) -> None:
    """SIGTERM the server launcher (it stops SGLang and withdraws its URL); SIGKILL if it hangs."""
    if server.poll() is None:
        server.terminate()
        try:
            server.wait(grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
            # A killed launcher could not withdraw its URL itself.
            url_file = Path(command[command.index("--url-file") + 1])
            url_file.unlink(missing_ok=True)


def _announce(log_file: Path, message: str) -> None:
    """Print a launcher line and append it to the node log (the log keeps every attempt)."""
    print(message, flush=True)
    log_file.parent.mkdir(parents=True, exist_ok=True)
    with log_file.open("a") as log:
        log.write(message + "\n")


if __name__ == "__main__":
    sys.exit(main())
