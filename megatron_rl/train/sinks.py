"""The run's Weights & Biases and MLflow runs (``logging.wandb``, ``logging.mlflow``), fed from
the logging rank.

Owns :class:`Trackers`, which starts each enabled tracker once per run and gives it the
run's resolved config and source commit (once, when the run starts), every step's metrics,
each HF checkpoint (an artifact that references its path; uploaded on request) and the
plots at the end. A resumed run continues the same W&B run and MLflow run: their ids are
kept in ``<run_dir>/tracker_ids.json``. W&B offline writes ``<run_dir>/wandb/offline-run-*``;
a resumed offline run writes a new directory under the same run id, which ``wandb sync``
appends to the same run.

Each tracker's calls run in order on a daemon thread of its own, so a slow or unreachable
server never holds up a step. A tracker that fails (not installed, no login, a server or
entity that refuses, a server that cannot be reached) costs one warning line and is off for
the rest of the run; W&B online then logs offline into ``<run_dir>/wandb`` instead, for a
later ``wandb sync``. A tracker that has not started within its timeout is given up the same
way, and closing waits at most ``logging.close_timeout_s``: no tracker stops or hangs the run.

MLflow metric names are :func:`mlflow_name`'s: ``eval/pass@4`` -> ``eval/pass_4``,
``perf/phase/update/seconds`` -> ``perf/phase.update.seconds``. Does not own the metrics themselves, nor
``metrics.jsonl`` and TensorBoard (``train.metrics``), nor which rank logs (the caller
creates the trackers enabled on one rank only).
"""

from __future__ import annotations

import functools
import importlib
import json
import os
import queue
import re
import secrets
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from megatron_rl.config import RunConfig
from megatron_rl.config_loading import flatten, to_dict

IDS_FILE = "tracker_ids.json"
"""Name of the file, in the run directory, that keeps the trackers' run ids for a resumed run."""

_MLFLOW_BATCH = 100
"""Params per MLflow ``log_batch`` call (the REST API's limit; metrics allow 1000)."""


def _warn(message: str) -> None:
    print(f"megatron-rl-train: warning: {message}", file=sys.stderr, flush=True)


def _reason(err: BaseException) -> str:
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: {lines[0] if lines else ''}".rstrip(": ")


def _import(module: str, extra: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError:
        raise ImportError(f"{module.split('.')[0]} is not installed (pip install -e \".[{extra}]\")") from None


@functools.cache
def source_commit() -> str | None:
    """The git commit of this package's checkout, ``+dirty`` when tracked files differ from it;
    None when the package is not a git checkout of its own (an installed copy)."""
    root = Path(__file__).resolve().parents[2]

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=30,
                              check=True).stdout.strip()

    try:
        if Path(git("rev-parse", "--show-toplevel")).resolve() != root:
            return None
        commit, dirty = git("rev-parse", "HEAD"), git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return None
    return commit + ("+dirty" if dirty else "")


class _Worker:
    """One tracker's calls, in order, on a daemon thread; off for good after its first failure."""

    def __init__(self, name: str, start: Callable[[], None], start_timeout_s: float) -> None:
        self.name = name
        self.off = False
        self._lock = threading.Lock()
        self._started = threading.Event()
        self._start_timeout_s = start_timeout_s
        self._deadline = time.monotonic() + start_timeout_s
        self._calls: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()

        def first() -> None:
            start()
            self._started.set()

        self._calls.put(first)
        self._thread = threading.Thread(target=self._loop, name=f"{name} tracker", daemon=True)
        self._thread.start()

    def submit(self, call: Callable[[], None]) -> None:
        """Queue ``call``; dropped once the tracker is off, or not started in time."""
        if not self._started.is_set() and time.monotonic() > self._deadline:
            self.give_up(f"not started within {self._start_timeout_s:g} s (can its server be reached?)")
        if not self.off:
            self._calls.put(call)

    def give_up(self, reason: str) -> None:
        """Turn the tracker off with one warning line (the first reason only)."""
        with self._lock:
            if self.off:
                return
            self.off = True
        _warn(f"{self.name}: {reason}; the run goes on without it")

    def close(self, finish: Callable[[], None], timeout_s: float) -> None:
        """Run ``finish`` after the queued calls; wait at most ``timeout_s`` for all of them."""
        self.submit(finish)
        self._calls.put(None)
        if self.off:
            return  # what its thread is still stuck in has been given up already
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            self.give_up(f"still busy after logging.close_timeout_s={timeout_s:g} s; what it holds is dropped")

    def _loop(self) -> None:
        while (call := self._calls.get()) is not None:
            if self.off:
                continue
            try:
                call()
            except Exception as err:  # noqa: BLE001 - a tracker's failure must never reach the run
                self.give_up(_reason(err))


class _Ids:
    """The trackers' run ids in ``<run_dir>/tracker_ids.json``, written as soon as each is known."""

    def __init__(self, run_dir: Path, resumed: bool) -> None:
        self.path = run_dir / IDS_FILE
        self._lock = threading.Lock()
        self.ids: dict[str, str] = {}
        if resumed and self.path.is_file():
            try:
                self.ids = json.loads(self.path.read_text())
            except (OSError, ValueError) as err:
                _warn(f"{self.path} is unreadable ({_reason(err)}); the trackers start new runs")
        if not self.ids:
            self._write()

    def set(self, name: str, run_id: str) -> None:
        with self._lock:
            self.ids[name] = run_id
            self._write()

    def _write(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(self.ids, indent=1) + "\n")
        os.replace(tmp, self.path)


class _Wandb:
    """The W&B run; every method runs on the W&B worker thread."""

    def __init__(self, cfg: RunConfig, ids: _Ids, resumed: bool) -> None:
        self.cfg, self.c, self.run_dir = cfg, cfg.logging.wandb, Path(cfg.train.run_dir)
        self.config = None if resumed else to_dict(cfg)
        self.run_id = ids.ids.get("wandb") or secrets.token_hex(4)
        ids.set("wandb", self.run_id)
        self.run = None
        self.last_step: int | None = None

    def start(self) -> None:
        wandb = _import("wandb", "wandb")
        # Errors reach the caller as exceptions; wandb's own console lines would repeat them.
        quiet = functools.partial(wandb.setup, settings=wandb.Settings(silent=True))
        quiet()
        c = self.c
        self.run_dir.mkdir(parents=True, exist_ok=True)
        init = functools.partial(
            wandb.init, project=c.project, entity=c.entity, name=c.name or self.run_dir.resolve().name,
            group=c.group, tags=c.tags or None, dir=str(self.run_dir), id=self.run_id,
            config=None if self.config is None else {**self.config, "git_commit": source_commit()},
            settings=wandb.Settings(console="off", silent=True, init_timeout=c.init_timeout_s))
        if c.mode == "online":
            try:
                self.run = init(mode="online", resume="allow")
                print(f"W&B run: {self.run.url}", flush=True)
                return
            except Exception as err:  # noqa: BLE001 - the offline files are the fallback
                # The service keeps the failed run's id; a fresh service lets the offline run reuse it.
                wandb.teardown()
                quiet()
                _warn(f"W&B: cannot start the online run ({_reason(err)}); logging offline to "
                      f"{self.run_dir / 'wandb'} instead (upload with: wandb sync {self.run_dir / 'wandb'})")
        self.run = init(mode="offline")
        if c.mode == "offline":
            print(f"W&B: offline run {self.run_id} in {self.run_dir / 'wandb'} (upload with: wandb sync "
                  f"{self.run_dir / 'wandb'})", flush=True)

    def log(self, step: int, values: Mapping[str, float]) -> None:
        self.run.log(dict(values), step=step)
        self.last_step = step

    def checkpoint(self, step: int, path: Path) -> None:
        import wandb

        artifact = wandb.Artifact(f"{self.run_id}-hf", type="model", metadata={"step": step})
        if self.c.upload_checkpoints:
            artifact.add_dir(str(path))
        else:
            artifact.add_reference(path.resolve().as_uri(), checksum=False)
        self.run.log_artifact(artifact, aliases=[f"step_{step:06d}", "latest"])

    def plots(self, paths: Sequence[Path]) -> None:
        import wandb

        images = {f"plots/{p.stem}": wandb.Image(str(p)) for p in paths}
        self.run.log(images, step=self.last_step)

    def finish(self, failed: bool) -> None:
        self.run.finish(exit_code=1 if failed else 0)
        # finish() returns once the service has the run's last record, not once its writer has
        # flushed the offline file (wandb 0.29: seen 7 bytes, then whole, under load); the
        # teardown waits for the service process to exit, so the file is whole when we return.
        _import("wandb", "wandb").teardown()


def mlflow_name(name: str) -> str:
    """``name`` as an MLflow metric name: every character MLflow refuses becomes ``_``, and every
    ``/`` after the first becomes ``.``: MLflow's UI groups charts by the part before the first
    ``/``, and its file store keeps a name's later parts as directories, where ``routing/flip_rate``
    and ``routing/flip_rate/layer1`` could not both exist."""
    head, slash, tail = re.sub(r"[^A-Za-z0-9_\-. :/]", "_", name).partition("/")
    return head + slash + tail.replace("/", ".")


def _probe_server(uri: str, timeout_s: float) -> None:
    """Raise ``ConnectionError`` unless an ``http(s)`` tracking server answers within ``timeout_s``
    (any HTTP status counts: the server is there). MLflow's own client would retry a refused
    connection for minutes, printing a line per retry."""
    if not uri.startswith(("http://", "https://")):
        return
    try:
        urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=timeout_s).close()
    except urllib.error.HTTPError:
        return
    except (urllib.error.URLError, OSError) as err:
        raise ConnectionError(f"{uri} did not answer within {timeout_s:g} s "
                              f"({getattr(err, 'reason', err)})") from None


class _Mlflow:
    """The MLflow run; every method runs on the MLflow worker thread."""

    def __init__(self, cfg: RunConfig, ids: _Ids) -> None:
        self.cfg, self.c, self.ids = cfg, cfg.logging.mlflow, ids
        self.run_id = ids.ids.get("mlflow")
        self.client = None

    def start(self) -> None:
        c = self.c
        self.client = _import("mlflow.tracking", "mlflow").MlflowClient(tracking_uri=c.tracking_uri)
        _probe_server(self.client.tracking_uri, c.start_timeout_s)
        if self.run_id is not None:
            self.client.update_run(self.run_id, status="RUNNING")
            return
        experiment = self.client.get_experiment_by_name(c.experiment)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(c.experiment)
        commit = source_commit()
        run = self.client.create_run(experiment_id, run_name=c.run_name or Path(self.cfg.train.run_dir).resolve().name,
                                     tags={"mlflow.source.git.commit": commit} if commit else None)
        self.run_id = run.info.run_id
        self.ids.set("mlflow", self.run_id)
        self._log_config()
        print(f"MLflow run {self.run_id} in experiment {c.experiment!r} at {self.client.tracking_uri}", flush=True)

    def _log_config(self) -> None:
        from mlflow.entities import Param

        config = to_dict(self.cfg)
        params = [Param(key, json.dumps(value) if isinstance(value, (list, dict)) else str(value))
                  for key, value in flatten(config).items()]
        for i in range(0, len(params), _MLFLOW_BATCH):
            self.client.log_batch(self.run_id, params=params[i : i + _MLFLOW_BATCH])
        self.client.log_text(self.run_id, yaml.safe_dump(config, sort_keys=False), "config.yaml")

    def log(self, step: int, values: Mapping[str, float]) -> None:
        from mlflow.entities import Metric

        now_ms = int(time.time() * 1000)
        metrics = [Metric(mlflow_name(k), float(v), now_ms, step) for k, v in values.items()]
        self.client.log_batch(self.run_id, metrics=metrics)

    def checkpoint(self, step: int, path: Path) -> None:
        if self.c.upload_checkpoints:
            self.client.log_artifacts(self.run_id, str(path), f"hf/step_{step:06d}")
        else:
            self.client.set_tag(self.run_id, f"hf_checkpoint.step_{step:06d}", str(path.resolve()))

    def plots(self, paths: Sequence[Path]) -> None:
        for path in paths:
            self.client.log_artifact(self.run_id, str(path), "plots")

    def finish(self, failed: bool) -> None:
        self.client.set_terminated(self.run_id, "FAILED" if failed else "FINISHED")


class Trackers:
    """The run's W&B and MLflow runs (those ``cfg.logging`` enables); inert when not ``enabled``.

    Args:
        cfg: the run's resolved config.
        enabled: True on the one rank that logs.
        resumed: the run continues from its run directory's checkpoint: continue the trackers'
            runs recorded there (a run without a record starts a new one).
    """

    def __init__(self, cfg: RunConfig, *, enabled: bool, resumed: bool) -> None:
        self.close_timeout_s = cfg.logging.close_timeout_s
        self._backends: list[tuple[_Worker, _Wandb | _Mlflow]] = []
        w, m = cfg.logging.wandb, cfg.logging.mlflow
        if not enabled or (w.mode == "disabled" and not m.enabled):
            return
        ids = _Ids(Path(cfg.train.run_dir), resumed)
        if w.mode != "disabled":
            wandb_run = _Wandb(cfg, ids, resumed)
            self._backends.append((_Worker("W&B", wandb_run.start, w.init_timeout_s + 30), wandb_run))
        if m.enabled:
            mlflow_run = _Mlflow(cfg, ids)
            self._backends.append((_Worker("MLflow", mlflow_run.start, m.start_timeout_s + 30), mlflow_run))

    def log(self, step: int, values: Mapping[str, float]) -> None:
        """One step's metrics (Python floats)."""
        values = dict(values)
        for worker, backend in self._backends:
            worker.submit(functools.partial(backend.log, step, values))

    def log_checkpoint(self, step: int, path: str | Path) -> None:
        """The HF checkpoint of ``step`` in directory ``path``."""
        for worker, backend in self._backends:
            worker.submit(functools.partial(backend.checkpoint, step, Path(path)))

    def log_plots(self, paths: Sequence[Path]) -> None:
        """The run's PNG plots (after its last step)."""
        for worker, backend in self._backends:
            worker.submit(functools.partial(backend.plots, list(paths)))

    def close(self, failed: bool = False) -> None:
        """Finish every tracker's run (marked failed when the run raised), each waited for at
        most ``logging.close_timeout_s``."""
        backends, self._backends = self._backends, []
        for worker, backend in backends:
            worker.close(functools.partial(backend.finish, failed), self.close_timeout_s)

    def __enter__(self) -> Trackers:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc_info: object) -> None:
        self.close(failed=exc_type is not None)

