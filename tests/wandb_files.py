"""Test support: a W&B offline run file read back with wandb's own reader.

``wandb.sdk.internal.datastore.DataStore`` reads the LevelDB-style log that an offline run
writes (``run-<id>.wandb``), and ``wandb.proto.wandb_internal_pb2.Record`` parses each record;
wandb 0.30 dropped the reader, hence the bound in setup.py's ``test`` extra.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class OfflineRun:
    """What the tests look at in one offline run file."""

    run_id: str | None = None
    """The run record's id."""
    history: list[dict] = field(default_factory=list)
    """One dict per history record (a logged step): metric name -> value, ``_step`` included."""
    artifacts: list = field(default_factory=list)
    """The ``ArtifactRecord`` protobufs of logged artifacts."""


def read_offline_run(path: str | Path) -> OfflineRun:
    """Every record of the ``.wandb`` file ``path``."""
    from wandb.proto import wandb_internal_pb2
    from wandb.sdk.internal.datastore import DataStore

    store = DataStore()
    store.open_for_scan(str(path))
    run = OfflineRun()
    while (data := store.scan_data()) is not None:
        record = wandb_internal_pb2.Record()
        record.ParseFromString(data)
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run.run_id = record.run.run_id
        elif kind == "history":
            # A flat name is stored as its key, or as a one-element nested key (wandb-core).
            run.history.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                                for item in record.history.item})
        elif kind == "artifact":
            run.artifacts.append(record.artifact)
    return run
