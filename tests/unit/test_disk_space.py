"""A full disk is reported as such, naming the path: ``megatron_rl/train/disk_space.py``.

``/dev/full`` fails every write with ENOSPC, as a full file system does, without root or a
mount: a plain Python write keeps the errno, torch's zip writer (``torch.save``, the shards of
Megatron's distributed checkpoints) loses it (``unexpected pos``), so there the file system's
free space decides, measured here as an 8 MiB tmpfs that a checkpoint filled reports it.
(The trainer on a real 8 MiB tmpfs, checked by hand: docs/checkpoints.md.)
"""

import errno
import logging
import shutil
from collections import namedtuple
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.api import CheckpointException

from megatron_rl.train import disk_space
from megatron_rl.train.disk_space import (
    NoSpaceLeft,
    as_no_space_left,
    reporting_a_full_disk,
)
from megatron_rl.train.metrics import MetricsLogger

DEV_FULL = Path("/dev/full")
pytestmark = pytest.mark.skipif(not DEV_FULL.exists(), reason="needs /dev/full (Linux)")
Usage = namedtuple("Usage", "total used free")


def _torch_save_error() -> RuntimeError:
    with pytest.raises(RuntimeError) as caught:
        torch.save({"x": torch.zeros(1000)}, str(DEV_FULL))
    return caught.value


def test_a_plain_write_on_a_full_disk_names_the_path_and_the_cause(tmp_path):
    with pytest.raises(NoSpaceLeft) as caught:
        with reporting_a_full_disk(tmp_path / "run", "saving checkpoint step_000001"):
            with open(DEV_FULL, "w") as sink:
                sink.write("x" * 10_000)
    message = str(caught.value)
    assert message.startswith(f"saving checkpoint step_000001: no space left on the device holding {tmp_path}/run (")
    assert caught.value.errno == errno.ENOSPC and isinstance(caught.value.__cause__, OSError)


def test_torch_zip_writer_on_a_full_file_system(monkeypatch, tmp_path):
    """torch's message says nothing of the disk; the file system's free space does."""
    error = _torch_save_error()
    assert "No space left" not in str(error)
    # Free space as an 8 MiB tmpfs that the checkpoint filled reports it.
    monkeypatch.setattr(disk_space.shutil, "disk_usage", lambda path: Usage(8 << 20, (8 << 20) - 512, 512))
    explained = as_no_space_left(error, tmp_path / "ckpt", "saving checkpoint step_000002")
    assert str(explained) == (f"saving checkpoint step_000002: no space left on the device holding {tmp_path}/ckpt "
                              "(512 B free of 8.0 MiB)")
    # How Megatron's distributed checkpoint hands it to every rank: a BaseException.
    with pytest.raises(NoSpaceLeft, match="saving checkpoint step_000002: no space left"):
        with reporting_a_full_disk(tmp_path / "ckpt", "saving checkpoint step_000002"):
            raise CheckpointException("write", {0: (error, None)})


def test_other_failures_pass_through_unchanged(tmp_path):
    """With room on the disk, torch's error is not blamed on it."""
    assert shutil.disk_usage(tmp_path).free > disk_space.FULL_BELOW_BYTES
    error = _torch_save_error()
    assert as_no_space_left(error, tmp_path, "saving") is error
    with pytest.raises(KeyError):
        with reporting_a_full_disk(tmp_path, "saving"):
            raise KeyError("not a disk problem")


def test_metrics_logger_names_a_full_disk(tmp_path):
    logger = MetricsLogger(tmp_path, tensorboard=False)
    logger._file.close()
    logger._file = open(DEV_FULL, "w", buffering=1)  # the metrics file's disk fills up
    try:
        with pytest.raises(NoSpaceLeft, match=f"writing the metrics of step 3: no space left on the device "
                                              f"holding {tmp_path}"):
            logger.log(3, {"reward/mean": 0.5})
    finally:
        logger._file = None


def test_the_resumed_runs_rewrite_of_the_metrics_file_names_a_full_disk(monkeypatch, tmp_path):
    from megatron_rl.train import metrics

    (tmp_path / "metrics.jsonl").write_text('{"step": 0, "reward/mean": 0.5}\n')

    def full(path, lines):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(metrics, "_replace_lines", full)
    with pytest.raises(NoSpaceLeft, match=f"^rewriting the metrics file of the resumed run: no space left on the "
                                          f"device holding {tmp_path} "):
        MetricsLogger(tmp_path, tensorboard=False, resume_from_step=0)


class _NoModel:
    def sharded_state_dict(self):
        return {}


def test_a_checkpoint_save_on_a_full_disk_names_the_checkpoint_in_one_line_and_leaves_nothing(
        monkeypatch, tmp_path, caplog):
    """save_checkpoint's own write path, Megatron's writer failing as it does on a full disk
    (torch's zip writer on a full device, wrapped as Megatron hands it to every rank): its
    shards half written, its worker's error logged by Megatron before the save raises it."""
    import megatron_rl.train.checkpoint as checkpoint
    from megatron_rl.parallel import mcore_compat as mc
    from megatron_rl.parallel.world import world_of_one

    def full_disk_save(state, directory, **kwargs):
        (Path(directory) / "__0_0.distcp").write_bytes(b"half a shard")
        error = _torch_save_error()
        logging.getLogger(mc.ASYNC_WRITER_LOGGER).error(f"Local process 0 encountered an error: {error}")
        raise CheckpointException("write", {0: (error, None)})

    monkeypatch.setattr("megatron_rl.parallel.checkpoint.dist_checkpointing.save", full_disk_save)
    monkeypatch.setattr(disk_space.shutil, "disk_usage", lambda path: Usage(8 << 20, 8 << 20, 0))
    with world_of_one() as world, pytest.raises(NoSpaceLeft) as caught, caplog.at_level(logging.WARNING):
        checkpoint.save_checkpoint(tmp_path / "run", _NoModel(), None, checkpoint.TrainerState(1, 16, 1), {}, world)
    step = tmp_path / "run" / "checkpoints" / "step_000001"
    assert str(caught.value) == (f"saving checkpoint step_000001: no space left on the device holding {step} "
                                 "(0 B free of 8.0 MiB)")
    assert not (tmp_path / "run" / "checkpoints" / "latest").exists()
    # Nothing partial left, and no line of torch's before the run's own.
    assert list((tmp_path / "run" / "checkpoints").iterdir()) == [] and caplog.records == []


def test_a_published_checkpoint_is_kept_when_a_later_save_fails(monkeypatch, tmp_path):
    import megatron_rl.train.checkpoint as checkpoint
    from megatron_rl.parallel.world import world_of_one

    monkeypatch.setattr("megatron_rl.parallel.checkpoint.dist_checkpointing.save", lambda *args, **kwargs: None)
    with world_of_one() as world:
        checkpoint.save_checkpoint(tmp_path, _NoModel(), None, checkpoint.TrainerState(1, 16, 1), {}, world)
        monkeypatch.setattr(checkpoint, "json", None)  # trainer_state.json cannot be written: publishing fails
        with pytest.raises(AttributeError):
            checkpoint.save_checkpoint(tmp_path, _NoModel(), None, checkpoint.TrainerState(1, 16, 1), {}, world)
        with pytest.raises(AttributeError):
            checkpoint.save_checkpoint(tmp_path, _NoModel(), None, checkpoint.TrainerState(2, 32, 2), {}, world)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["latest", "step_000001"]
