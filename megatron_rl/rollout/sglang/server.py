"""Start, watch and stop a real SGLang server (``python -m sglang.launch_server``) on a GPU node.

    python -m megatron_rl.rollout.sglang.server --model-path /ckpt/hf --port 30000 --tp-size 4 \\
        [--mem-fraction-static 0.7] [--fp8] [--fp8-kv-cache] [--deterministic-inference] \\
        [--url-file runs/x/sglang/$(hostname)] [-- extra sglang args]
    python -m megatron_rl.rollout.sglang.server --stand-in configs/demo_cpu.yaml --port 30000 \
        --url-file runs/x/sglang/$(hostname)        # CPU dry run: the protocol server instead

Owns: the command line from a typed :class:`SGLangServerConfig` (routed experts on, no
tokenizer since requests carry token ids, TP size, memory fraction, FP8 weights
``--quantization fp8`` and KV cache ``--kv-cache-dtype fp8_e4m3``, initial
``--weight-version``, ``--enable-deterministic-inference`` for seeded sampling,
``--enable-memory-saver`` for a colocated run, whose servers release and resume their memory
around the trainer's turns and take the weights again after each resume, so without
``--enable-weights-cpu-backup``), in an environment with ``SGLANG_RETURN_ORIGINAL_LOGPROB=0``
(:func:`server_env`: SGLang's default, ``log_softmax(logits / T)`` of the distribution it samples,
which the trainer scores; ``--original-logprobs`` sets 1 for ``train.policy_temperature: one``; read
once at start, ``srt/layers/sampler.py:82``); starting it in its own process group (so a stop reaches every
worker it forks, and dying with this process if it is killed outright); refusing to start
on a port something already answers on (its health would be mistaken for ours); waiting
until ``GET /health`` answers 200 (failing early, with the log tail, when the process exits
first; SGLang's ``/health`` is a one-token generation that answers within its 20 s check, so
each probe waits that long); stopping with SIGTERM, then SIGKILL after a grace period. :class:`ManagedServer`
does this for any command with a health URL, which is how the tests exercise it against
the protocol server. Run as a module, SIGTERM/SIGINT stop the server at any point, startup
included, and the wrapper exits with ``128 + signal``.

Launch paths: under torchrun, rank 0 (or one rank per node) can hold a
:class:`SGLangServer` as a context manager; under SLURM, run this module as a step
(``srun --overlap --ntasks-per-node=1 python -m megatron_rl.rollout.sglang.server ...
--url-file DIR/$SLURMD_NODENAME &``): it writes the URL once healthy, stays in the
foreground, and stops the server cleanly on SIGTERM/SIGINT (``scancel``, the job's time
limit), so the trainer reads the URLs from the files. Does not own the client or weights.
Standard library only: it also runs from SGLang's own environment, which pins another torch.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Literal, Mapping, Sequence
from urllib.parse import urlsplit

from megatron_rl.rollout.sglang.sockets import (
    LISTEN_FD_ENV,
    bound_socket,
    inherited_socket,
    port_in_use,
    with_port,
)


@dataclass(kw_only=True)
class SGLangServerConfig:
    """One SGLang server (``sglang.launch_server`` flags of SGLang 0.5.23)."""

    model_path: str
    """HF checkpoint directory (the trainer's weights replace it after the first sync)."""
    host: str = "0.0.0.0"
    """Interface to listen on."""
    port: int = 30000
    """HTTP port."""
    tp_size: int = 1
    """Tensor-parallel GPUs of this server (``--tp-size``)."""
    mem_fraction_static: float | None = None
    """GPU memory fraction for weights and KV cache (None: SGLang's default)."""
    enable_return_routed_experts: bool = True
    """``--enable-return-routed-experts``: R3 needs the routes."""
    skip_tokenizer_init: bool = True
    """Requests carry token ids; no tokenizer is loaded."""
    quantization: Literal["fp8"] | None = None
    """``--quantization fp8``: FP8 weights quantized from the checkpoint at load."""
    kv_cache_dtype: Literal["auto", "fp8_e4m3", "fp8_e5m2"] = "auto"
    """``--kv-cache-dtype``."""
    dtype: str = "auto"
    """``--dtype`` of the weights (auto: the checkpoint's)."""
    weight_version: str = "default"
    """``--weight-version`` reported until the first weight sync."""
    base_gpu_id: int = 0
    """First GPU index this server uses (``--base-gpu-id``)."""
    random_seed: int | None = None
    """``--random-seed``."""
    deterministic_inference: bool = False
    """``--enable-deterministic-inference``: each request's ``sampling_seed`` decides its
    sample (SGLang ignores the seed otherwise); costs throughput."""
    enable_memory_saver: bool = False
    """``--enable-memory-saver``: ``/release_memory_occupation`` frees the GPU memory (colocated runs)."""
    original_logprobs: bool = False
    """``SGLANG_RETURN_ORIGINAL_LOGPROB=1``: raw log-probs at every T (``train.policy_temperature: one``)."""
    extra_args: list[str] = field(default_factory=list)
    """Further ``sglang.launch_server`` flags, appended verbatim."""
    python: str = sys.executable
    """Interpreter that has SGLang installed (it may live in its own environment)."""

    @property
    def url(self) -> str:
        """Base URL for clients on this node."""
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::") else self.host
        return f"http://{host}:{self.port}"


def build_command(cfg: SGLangServerConfig) -> list[str]:
    """The ``sglang.launch_server`` command line for ``cfg``."""
    cmd = [cfg.python, "-m", "sglang.launch_server", "--model-path", cfg.model_path, "--host", cfg.host,
           "--port", str(cfg.port), "--tp-size", str(cfg.tp_size), "--dtype", cfg.dtype,
           "--kv-cache-dtype", cfg.kv_cache_dtype, "--weight-version", cfg.weight_version,
           "--base-gpu-id", str(cfg.base_gpu_id)]
    if cfg.mem_fraction_static is not None:
        cmd += ["--mem-fraction-static", str(cfg.mem_fraction_static)]
    if cfg.enable_return_routed_experts:
        cmd.append("--enable-return-routed-experts")
    if cfg.skip_tokenizer_init:
        cmd.append("--skip-tokenizer-init")
    if cfg.quantization is not None:
        cmd += ["--quantization", cfg.quantization]
    if cfg.random_seed is not None:
        cmd += ["--random-seed", str(cfg.random_seed)]
    if cfg.deterministic_inference:
        cmd.append("--enable-deterministic-inference")
    if cfg.enable_memory_saver:
        cmd.append("--enable-memory-saver")
    return cmd + list(cfg.extra_args)


SERVER_ENV = {"SGLANG_RETURN_ORIGINAL_LOGPROB": "0"}
"""The servers' default environment: ``log_softmax(logits / T)``, sampled and scored (``srt/layers/sampler.py:275``,
``:312-316``); set lest an inherited value make them raw (``:82``, ``:231-237``, ``:319-323``)."""


def server_env(cfg: SGLangServerConfig) -> dict[str, str]:
    """The server's environment: :data:`SERVER_ENV`, or raw log-probs with ``original_logprobs``."""
    return {"SGLANG_RETURN_ORIGINAL_LOGPROB": "1"} if cfg.original_logprobs else dict(SERVER_ENV)


HEALTH_PROBE_S = 25.0
"""Limit of one ``GET /health`` while waiting for a server: SGLang's answers within its
``SGLANG_HEALTH_CHECK_TIMEOUT`` (20 s, ``srt/entrypoints/http_server.py:218``), at least 1 s."""


def health_status(url: str, timeout_s: float = 2.0) -> int:
    """HTTP status of ``GET url/health`` (0 when nothing answers)."""
    try:
        with urllib.request.urlopen(url + "/health", timeout=timeout_s) as resp:
            return resp.status
    except urllib.error.HTTPError as err:
        return err.code
    except (urllib.error.URLError, OSError):
        return 0


class ServerStartError(RuntimeError):
    """The server exited or stayed unhealthy, or its port was taken; the message says which."""


_PR_SET_PDEATHSIG = 1  # <sys/prctl.h>


def parent_death_signal(sig: int) -> Callable[[], None] | None:
    """A ``preexec_fn`` after which the kernel sends ``sig`` to the child when this process
    dies, however it dies (Linux; None elsewhere, and off the main thread, because the
    kernel ties the signal to the thread that started the child, not to the process)."""
    if not sys.platform.startswith("linux") or threading.current_thread() is not threading.main_thread():
        return None
    # Resolved here: between fork and exec the child should only make the system call.
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    parent = os.getpid()

    def arm() -> None:
        prctl(_PR_SET_PDEATHSIG, sig)
        if os.getppid() != parent:  # the parent died before the signal was armed
            os.kill(os.getpid(), sig)

    return arm


class ManagedServer:
    """A server process with a health URL: start, wait until healthy, stop.

    Args:
        command: the command line.
        url: base URL; ``GET url/health`` must return 200 once it is ready.
        env: extra environment variables.
        log_path: file for the server's stdout and stderr (None: inherit this process's).
        listen: for a server that serves on a socket it is handed (:data:`LISTEN_FD_ENV`: the
            stand-in, the wrapper of one): the interface to bind ``url``'s port on at each start,
            port 0 meaning the kernel's pick (``url`` then names it), or a bound socket the
            caller holds. None: the server binds its port itself, after a check that nothing
            answers there.
    """

    def __init__(self, command: Sequence[str], url: str, *, env: Mapping[str, str] | None = None,
                 log_path: str | Path | None = None, listen: str | socket.socket | None = None) -> None:
        self.command, self.url = list(command), url.rstrip("/")
        self.env = {**os.environ, **(env or {})}
        self.log_path = Path(log_path) if log_path is not None else None
        self.listen = listen
        self.process: subprocess.Popen | None = None

    def start(self) -> "ManagedServer":
        """Start the process in a new session (its own process group).

        Raises:
            ServerStartError: something already answers on the port (an orphaned server, another
                job): its ``/health`` would pass for this server's.
        """
        if self.process is not None and self.process.poll() is None:
            raise RuntimeError(f"server for {self.url} is already running (pid {self.process.pid})")
        port = urlsplit(self.url).port
        taken = (f"port {port} is already in use ({self.url} accepts connections), not by a server this process "
                 f"started; stop whatever listens there (ss -ltnp 'sport = :{port}') or choose another port")
        sock = self.listen if isinstance(self.listen, socket.socket) else None
        if isinstance(self.listen, str):
            try:
                sock = bound_socket(self.listen, port)
            except OSError as err:
                raise ServerStartError(taken.replace("accepts connections", err.strerror or str(err))) from None
        elif sock is None and port_in_use(self.url):
            raise ServerStartError(taken)
        if sock is not None:
            self.url = with_port(self.url, sock.getsockname()[1])
        env = self.env if sock is None else {**self.env, LISTEN_FD_ENV: str(sock.fileno())}
        out = None
        if self.log_path is not None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            out = open(self.log_path, "ab")
        try:
            # SIGKILL on our death: the server leads its own session, so nothing else would
            # stop it, and SGLang's own workers already die with it.
            self.process = subprocess.Popen(self.command, env=env, stdout=out,
                                            stderr=subprocess.STDOUT if out else None, start_new_session=True,
                                            preexec_fn=parent_death_signal(signal.SIGKILL),
                                            pass_fds=() if sock is None else (sock.fileno(),))
        finally:
            if out is not None:
                out.close()
            if isinstance(self.listen, str) and sock is not None:
                sock.close()  # the server's now: a dead server's port refuses, as it should
        return self

    def wait_healthy(self, timeout_s: float = 900.0, poll_s: float = 0.5) -> None:
        """Block until ``/health`` is 200.

        Raises:
            ServerStartError: the process exited first, or ``timeout_s`` passed (the
                process is then stopped).
        """
        deadline = time.monotonic() + timeout_s
        while True:
            code = self.process.poll()
            if code is not None:
                raise ServerStartError(f"server for {self.url} exited with code {code} before it was healthy"
                                       + self._log_tail())
            if health_status(self.url, timeout_s=max(1.0, min(HEALTH_PROBE_S, deadline - time.monotonic()))) == 200:
                return
            if time.monotonic() > deadline:
                self.stop()
                raise ServerStartError(f"server for {self.url} not healthy after {timeout_s:g}s" + self._log_tail())
            time.sleep(poll_s)

    def stop(self, grace_s: float = 30.0) -> int | None:
        """SIGTERM to the process group, SIGKILL after ``grace_s``; returns the exit code."""
        if self.process is None:
            return None
        if self.process.poll() is None:
            self._signal_group(signal.SIGTERM)
            try:
                self.process.wait(grace_s)
            except subprocess.TimeoutExpired:
                self._signal_group(signal.SIGKILL)
                self.process.wait()
        # Workers the server forked may outlive it; the group kill reaches them too.
        self._signal_group(signal.SIGKILL)
        return self.process.returncode

    def kill(self) -> None:
        """SIGKILL the server's whole process group now."""
        if self.process is not None:
            self._signal_group(signal.SIGKILL)

    def _signal_group(self, sig: int) -> None:
        try:
            os.killpg(self.process.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def _log_tail(self, lines: int = 40) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        tail = self.log_path.read_text(errors="replace").splitlines()[-lines:]
        return f"\n--- last {len(tail)} lines of {self.log_path} ---\n" + "\n".join(tail)

    def __enter__(self) -> "ManagedServer":
        self.start()
        try:
            self.wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


class SGLangServer(ManagedServer):
    """A real SGLang server from :class:`SGLangServerConfig`.

    Args:
        cfg: server settings.
        env: extra environment (e.g. ``CUDA_VISIBLE_DEVICES``).
        log_path: server log file.
    """

    def __init__(self, cfg: SGLangServerConfig, *, env: Mapping[str, str] | None = None,
                 log_path: str | Path | None = None) -> None:
        super().__init__(build_command(cfg), cfg.url, env={**server_env(cfg), **(env or {})}, log_path=log_path)
        self.cfg = cfg


FAILED_SUFFIX = ".failed"
"""A launcher that could not start its server writes ``<url file>.failed`` with the reason."""


def write_url_file(path: str | Path, url: str) -> None:
    """Publish ``url`` atomically, so a reader never sees half a line."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(url + "\n")
    os.replace(tmp, path)


def read_url_files(directory: str | Path, count: int, timeout_s: float, poll_s: float = 1.0) -> list[str]:
    """The URLs ``count`` servers wrote to ``directory`` (sorted by file name).

    Raises:
        RuntimeError: a launcher reported that its server failed to start.
        TimeoutError: fewer than ``count`` files appeared within ``timeout_s``; names the
            ones that did.
        ValueError: more than ``count`` files, or a file that holds no http(s) URL.
    """
    directory = Path(directory)
    deadline = time.monotonic() + timeout_s
    while True:
        failed = sorted(directory.glob(f"*{FAILED_SUFFIX}"))
        if failed:
            raise RuntimeError("SGLang server(s) failed to start: " + "; ".join(
                f"{f.name[:-len(FAILED_SUFFIX)]}: {f.read_text().strip()}" for f in failed))
        files = sorted(p for p in directory.glob("*")
                       if p.is_file() and not p.name.startswith(".") and not p.name.endswith(FAILED_SUFFIX))
        if len(files) >= count or time.monotonic() > deadline:
            break
        time.sleep(poll_s)
    if len(files) < count:
        raise TimeoutError(f"{directory}: {len(files)} of {count} SGLang servers published a URL within "
                           f"{timeout_s:g}s ({[f.name for f in files]}); see the servers' logs")
    if len(files) > count:
        raise ValueError(f"{directory}: {len(files)} URL files but {count} servers expected: "
                         f"{[f.name for f in files]} (stale files from an earlier job?)")
    urls = [f.read_text().strip() for f in files]
    for f, url in zip(files, urls):
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"{f}: {url!r} is not an http(s) URL")
    return urls


def _parse(argv: Sequence[str] | None) -> tuple[argparse.Namespace, SGLangServerConfig]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-path", default=None, help="HF checkpoint to serve (required unless --stand-in)")
    parser.add_argument("--stand-in", metavar="CONFIG", default=None,
                        help="serve CONFIG's model with the HF engine behind SGLang's protocol "
                             "(megatron_rl.sglang_standin.server) instead of SGLang: a CPU dry run of "
                             "the launch path")
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--tp-size", type=int, default=1)
    parser.add_argument("--mem-fraction-static", type=float, default=None)
    parser.add_argument("--fp8", action="store_true", help="--quantization fp8")
    parser.add_argument("--fp8-kv-cache", action="store_true", help="--kv-cache-dtype fp8_e4m3")
    parser.add_argument("--weight-version", default="default")
    parser.add_argument("--deterministic-inference", action="store_true",
                        help="--enable-deterministic-inference: sampling_seed decides each sample")
    parser.add_argument("--enable-memory-saver", action="store_true",
                        help="release and resume GPU memory around a colocated trainer's turns")
    parser.add_argument("--original-logprobs", action="store_true", help="raw log-probs (policy_temperature=one)")
    parser.add_argument("--base-gpu-id", type=int, default=0)
    parser.add_argument("--python", default=sys.executable, help="interpreter with SGLang installed")
    parser.add_argument("--log-file", default=None)
    parser.add_argument("--url-file", default=None, help="write the URL here once the server is healthy")
    parser.add_argument("--startup-timeout", type=float, default=900.0)
    parser.add_argument("--print-command", action="store_true", help="print the command and exit")
    parser.add_argument("extra", nargs="*", help="extra server flags (after --)")
    args = parser.parse_args(argv)
    if args.model_path is None and args.stand_in is None:
        parser.error("--model-path is required (or --stand-in CONFIG for a CPU dry run)")
    cfg = SGLangServerConfig(
        model_path=args.model_path or args.stand_in, host=args.host, port=args.port, tp_size=args.tp_size,
        mem_fraction_static=args.mem_fraction_static, quantization="fp8" if args.fp8 else None,
        kv_cache_dtype="fp8_e4m3" if args.fp8_kv_cache else "auto", weight_version=args.weight_version,
        base_gpu_id=args.base_gpu_id, python=args.python, extra_args=list(args.extra),
        deterministic_inference=args.deterministic_inference, enable_memory_saver=args.enable_memory_saver,
        original_logprobs=args.original_logprobs,
    )
    return args, cfg


def stand_in_command(cfg: SGLangServerConfig) -> list[str]:
    """The protocol server's command line for ``--stand-in`` (``model_path`` is the run config)."""
    return [cfg.python, "-m", "megatron_rl.sglang_standin.server", "--config", cfg.model_path,
            "--host", cfg.host, "--port", str(cfg.port), "--weight-version", cfg.weight_version,
            "--tp-size", str(cfg.tp_size),
            *(["--enable-deterministic-inference"] if cfg.deterministic_inference else []),
            *(["--enable-memory-saver"] if cfg.enable_memory_saver else []), *cfg.extra_args]


class _Stopped(BaseException):
    """SIGTERM or SIGINT reached the wrapper (a BaseException: nothing on the way out catches it)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def main(argv: Sequence[str] | None = None) -> int:
    args, cfg = _parse(argv)
    command = stand_in_command(cfg) if args.stand_in else build_command(cfg)
    if args.print_command:
        print(" ".join(command))
        return 0
    # The stand-in serves on a socket the wrapper binds (or was handed), so its port cannot be
    # taken between a check and the bind, and --port 0 means the kernel's pick.
    listen = (inherited_socket(serving=False) or cfg.host) if args.stand_in else None
    server = ManagedServer(command, cfg.url, env=server_env(cfg), log_path=args.log_file, listen=listen)

    def stop_now(signum: int, _frame: object) -> None:
        # Raised, not flagged: the startup wait (up to --startup-timeout) must end too.
        raise _Stopped(signum)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, stop_now)
    stopped_by = None
    try:
        return _serve(server, args, cfg)
    except _Stopped as stop:
        stopped_by = stop.signum
        return 128 + stop.signum
    except ServerStartError as err:
        print(f"sglang_server: error: {err}", file=sys.stderr, flush=True)
        return 1
    finally:
        # From here on a signal must not cut the stop short, only skip the server's grace.
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: server.kill())
        server.stop()
        if args.url_file:
            Path(args.url_file).unlink(missing_ok=True)
        if stopped_by is not None:
            code = server.process.returncode if server.process is not None else "none: not started"
            print(f"sglang_server: stopped by {signal.Signals(stopped_by).name}; server stopped (its exit code "
                  f"{code})", file=sys.stderr, flush=True)


def _serve(server: ManagedServer, args: argparse.Namespace, cfg: SGLangServerConfig) -> int:
    """Start, wait until healthy, publish the URL, then watch the server until it exits."""
    try:
        server.start()
        server.wait_healthy(args.startup_timeout)
    except ServerStartError as err:
        if args.url_file:
            # The trainer waits for this file: tell it at once instead of at its timeout.
            first = str(err).splitlines()[0]
            write_url_file(args.url_file + FAILED_SUFFIX, f"{first} (log: {args.log_file or 'stdout'})")
        raise
    url = server.url
    if args.url_file:
        if cfg.host in ("0.0.0.0", "::"):
            # Other nodes reach this server by the node's name, not by loopback.
            url = f"http://{os.uname().nodename}:{urlsplit(server.url).port}"
        write_url_file(args.url_file, url)
    print(f"{'stand-in' if args.stand_in else 'SGLang'} server healthy at {url} (pid {server.process.pid})",
          flush=True)
    while server.process.poll() is None:
        time.sleep(1.0)
    print(f"server exited with code {server.process.returncode}", file=sys.stderr, flush=True)
    return 1


if __name__ == "__main__":
    sys.exit(main())
