"""Safetensors reading, planned shard writing and all-or-nothing output directories."""

import json

import pytest
import torch
from safetensors.torch import save_file

from megatron_rl.checkpoint.errors import CheckpointMismatchError
from megatron_rl.checkpoint.hf_io import (
    INCOMPLETE_MARKER,
    INDEX_NAME,
    HFCheckpoint,
    ShardPlan,
    ShardWriter,
    atomic_output_dir,
    staging_dir,
)

TENSORS = {f"t{i}": torch.full((4, i + 1), float(i)) for i in range(5)}


def _write(directory, plan: ShardPlan, tensors=TENSORS, order=None):
    directory.mkdir(exist_ok=True)
    writer = ShardWriter(directory, plan)
    for name in order or list(tensors):
        writer.add(name, tensors[name])
    writer.finish()


def test_by_size_plan_fills_shards_in_order():
    sizes = {name: t.numel() * 4 for name, t in TENSORS.items()}  # 16, 32, 48, 64, 80 bytes
    plan = ShardPlan.by_size(sizes, max_shard_bytes=100)
    files = list(dict.fromkeys(plan.weight_map.values()))
    assert plan.sharded and files == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert [n for n, f in plan.weight_map.items() if f == files[0]] == ["t0", "t1", "t2"]
    assert not ShardPlan.by_size(sizes, max_shard_bytes=10**6).sharded


def test_written_shards_read_back_with_index(tmp_path):
    plan = ShardPlan.by_size({n: t.numel() * 4 for n, t in TENSORS.items()}, max_shard_bytes=100)
    # Tensors arrive out of file order: a shard is written once its last tensor is in.
    _write(tmp_path / "ckpt", plan, order=["t4", "t0", "t3", "t1", "t2"])
    index = json.loads((tmp_path / "ckpt" / INDEX_NAME).read_text())
    assert index["weight_map"] == plan.weight_map
    assert index["metadata"] == {"total_size": sum(t.numel() * 4 for t in TENSORS.values()),
                                 "total_parameters": sum(t.numel() for t in TENSORS.values())}
    checkpoint = HFCheckpoint(tmp_path / "ckpt")
    assert checkpoint.names() == list(plan.weight_map)
    assert checkpoint.shape("t2") == (4, 3) and checkpoint.dtype("t2") == torch.float32
    assert all(torch.equal(checkpoint.get(n), t) for n, t in TENSORS.items())


def test_writer_rejects_unknown_duplicate_and_missing_tensors(tmp_path):
    plan = ShardPlan.by_size({"a": 16, "b": 16}, max_shard_bytes=16)
    writer = ShardWriter(tmp_path, plan)
    with pytest.raises(CheckpointMismatchError, match="tensor c is not part"):
        writer.add("c", torch.zeros(4))
    writer.add("a", torch.zeros(4))
    with pytest.raises(CheckpointMismatchError, match="tensor a was produced twice"):
        writer.add("a", torch.zeros(4))
    with pytest.raises(CheckpointMismatchError, match="never produced: b"):
        writer.finish()


def test_index_and_shards_must_agree(tmp_path):
    plan = ShardPlan.by_size({n: t.numel() * 4 for n, t in TENSORS.items()}, max_shard_bytes=100)
    _write(tmp_path / "ckpt", plan)
    index_path = tmp_path / "ckpt" / INDEX_NAME
    index = json.loads(index_path.read_text())
    del index["weight_map"]["t1"]
    index_path.write_text(json.dumps(index))
    with pytest.raises(CheckpointMismatchError, match="in shards but not the index: \\[t1\\]"):
        HFCheckpoint(tmp_path / "ckpt")
    index["weight_map"]["t1"] = "model-00009-of-00009.safetensors"
    index_path.write_text(json.dumps(index))
    with pytest.raises(CheckpointMismatchError, match="model-00009-of-00009.safetensors is missing \\(it holds t1\\)"):
        HFCheckpoint(tmp_path / "ckpt")


def test_single_file_checkpoint(tmp_path):
    save_file({"x": torch.ones(2, 2, dtype=torch.bfloat16)}, str(tmp_path / "model.safetensors"))
    checkpoint = HFCheckpoint(tmp_path)
    assert checkpoint.index is None and checkpoint.dtype("x") == torch.bfloat16
    with pytest.raises(CheckpointMismatchError, match="neither"):
        HFCheckpoint(tmp_path / "nothing-here")


def test_atomic_output_dir_appears_only_on_success(tmp_path):
    final = tmp_path / "out"
    with atomic_output_dir(final) as staging:
        assert staging == staging_dir(final) and (staging / INCOMPLETE_MARKER).exists()
        assert not final.exists()
        (staging / "weights").write_text("w")
    assert (final / "weights").exists() and not (final / INCOMPLETE_MARKER).exists()
    assert not staging_dir(final).exists()
    with pytest.raises(FileExistsError, match="already exists"):
        with atomic_output_dir(final):
            pass


def test_atomic_output_dir_leaves_nothing_after_a_failure(tmp_path):
    final = tmp_path / "out"
    with pytest.raises(RuntimeError, match="mid-write"):
        with atomic_output_dir(final) as staging:
            (staging / "half-written").write_text("w")
            raise RuntimeError("mid-write")
    assert not final.exists() and not staging_dir(final).exists()
    staging_dir(final).mkdir()  # what a killed run leaves behind
    with pytest.raises(FileExistsError, match="interrupted"):
        with atomic_output_dir(final):
            pass


def test_written_shards_are_as_readable_as_other_new_files(tmp_path):
    plan = ShardPlan.by_size({n: t.numel() * 4 for n, t in TENSORS.items()}, max_shard_bytes=100)
    _write(tmp_path / "out", plan)
    reference = tmp_path / "plain.txt"
    reference.write_text("x")
    modes = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "out").glob("*.safetensors")}
    assert len(modes) == 3 and set(modes.values()) == {reference.stat().st_mode & 0o777}, modes
