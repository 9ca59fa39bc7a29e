"""Damaged inputs and impossible layouts stop every checkpoint tool with one line, exit code 2.

Each case runs a command line's ``main(argv)`` in this process (TP1: a world of one, or no
world at all when the input is refused first) on a copy of the shipped tiny Qwen3-MoE
checkpoint, damaged one way: the tool must print exactly one line,
``<tool>: error: <message>``, naming the file, tensor or dimension, return 2, and leave
nothing at the output location (no directory, no staging directory, no created parents).
A vocabulary that TP does not divide is refused by name with the TP sizes that work and
the ``--vocab-padding-multiple`` that pads it to a size TP divides (the padded conversion
itself: ``tests/parallel/test_vocab_padding.py``), and such a vocabulary round-trips byte
for byte unpadded. Also:
the traceback on request, a failure inside one rank of a spawned world reported once by
that rank, and the helpers a resuming run uses on a damaged trainer checkpoint.
"""

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from megatron_rl.checkpoint.cli import (
    export_fp8_main,
    hf_to_megatron_main,
    megatron_to_hf_main,
    parity_main,
)
from megatron_rl.checkpoint.errors import CheckpointMismatchError
from megatron_rl.checkpoint.hf_io import staging_dir
from megatron_rl.parallel import mcore_compat as mc

ASSET = Path(__file__).resolve().parents[2] / "megatron_rl" / "assets" / "tiny_qwen3_moe"
TO_MEGATRON = "megatron-rl-convert-hf-to-megatron"
TO_HF = "megatron-rl-convert-megatron-to-hf"
ODD_VOCAB = 511


def _odd_vocab_copy(directory: Path) -> Path:
    """The tiny checkpoint with its vocabulary cut to 511 rows (odd: TP2 cannot split it)."""
    shutil.copytree(ASSET, directory)
    tensors = load_file(directory / "model.safetensors")
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        tensors[name] = tensors[name][:ODD_VOCAB].clone()
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((directory / "config.json").read_text())
    config["vocab_size"] = ODD_VOCAB
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    return directory


@pytest.fixture(scope="module")
def odd_vocab(tmp_path_factory):
    """(HF dir, its Megatron checkpoint converted at TP1)."""
    root = tmp_path_factory.mktemp("odd_vocab")
    hf = _odd_vocab_copy(root / "hf")
    assert hf_to_megatron_main([str(hf), str(root / "megatron"), "--no-progress"]) == 0
    return hf, root / "megatron"


def _fails_with_one_line(capsys, code: int, tool: str, *needles: str) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, err
    assert len(lines) == 1, err
    assert lines[0].startswith(f"{tool}: error: "), err
    for needle in needles:
        assert needle in lines[0], err
    return lines[0]


def _nothing_at(out: Path) -> None:
    assert not out.exists() and not staging_dir(out).exists()


def _truncate(path: Path, keep: float | int) -> None:
    size = path.stat().st_size
    os.truncate(path, int(size * keep) if isinstance(keep, float) else size - keep)


# ------------------------------------------------------------------ HF inputs


def test_truncated_safetensors(tmp_path, capsys):
    hf = shutil.copytree(ASSET, tmp_path / "hf")
    _truncate(hf / "model.safetensors", 0.5)
    out = tmp_path / "out"
    code = hf_to_megatron_main([str(hf), str(out), "--no-progress"])
    _fails_with_one_line(capsys, code, TO_MEGATRON, f"{hf / 'model.safetensors'}", "truncated or corrupt")
    _nothing_at(out)


def test_truncated_safetensors_fp8_export(tmp_path, capsys):
    hf = shutil.copytree(ASSET, tmp_path / "hf")
    _truncate(hf / "model.safetensors", 100)
    out = tmp_path / "out"
    code = export_fp8_main([str(hf), str(out), "--no-progress"])
    _fails_with_one_line(capsys, code, "megatron-rl-export-fp8", f"{hf / 'model.safetensors'}")
    _nothing_at(out)


@pytest.mark.parametrize("text, detail", [('{"model_type": ', "line 2 column 1"), ("", "empty")])
def test_config_json_that_is_not_json(text, detail, tmp_path, capsys):
    hf = shutil.copytree(ASSET, tmp_path / "hf")
    (hf / "config.json").write_text(text + "\n")
    out = tmp_path / "out"
    code = hf_to_megatron_main([str(hf), str(out), "--no-progress"])
    _fails_with_one_line(capsys, code, TO_MEGATRON, f"{hf / 'config.json'}: not valid JSON", detail)
    _nothing_at(out)


# ------------------------------------------------------------------ distributed checkpoints


def test_missing_distcp_shard(odd_vocab, tmp_path, capsys):
    megatron = shutil.copytree(odd_vocab[1], tmp_path / "megatron")
    shard = sorted(megatron.glob("*.distcp"))[0]
    shard.unlink()
    out = tmp_path / "out"
    code = megatron_to_hf_main([str(megatron), str(out), "--no-progress"])
    _fails_with_one_line(capsys, code, TO_HF, f"{shard}: shard missing (it holds ")
    _nothing_at(out)


def test_truncated_distcp_shard(odd_vocab, tmp_path, capsys):
    megatron = shutil.copytree(odd_vocab[1], tmp_path / "megatron")
    shard = sorted(megatron.glob("*.distcp"))[-1]
    _truncate(shard, 10)
    out = tmp_path / "out"
    code = megatron_to_hf_main([str(megatron), str(out), "--no-progress"])
    _fails_with_one_line(capsys, code, TO_HF, f"{shard}: shard truncated")
    _nothing_at(out)


def test_truncated_distcp_metadata_for_parity(odd_vocab, tmp_path, capsys):
    megatron = shutil.copytree(odd_vocab[1], tmp_path / "megatron")
    _truncate(megatron / ".metadata", 0.5)
    code = parity_main(["--hf", str(odd_vocab[0]), "--megatron", str(megatron)])
    _fails_with_one_line(capsys, code, "megatron-rl-logprob-parity", f"{megatron / '.metadata'}: cannot be read")


# ------------------------------------------------------------------ output locations


def test_output_parent_is_a_file(tmp_path, capsys):
    (tmp_path / "a_file").write_text("not a directory\n")
    out = tmp_path / "a_file" / "deeper" / "out"
    code = hf_to_megatron_main([str(ASSET), str(out), "--no-progress"])
    _fails_with_one_line(capsys, code, TO_MEGATRON, f"its parent {tmp_path / 'a_file'} is a file")
    assert (tmp_path / "a_file").read_text() == "not a directory\n"


def test_output_parent_not_writable(tmp_path, capsys, monkeypatch):
    """The check, with the kernel's answer for a read-only directory stood in (root ignores modes)."""
    from megatron_rl.checkpoint import inputs

    locked = tmp_path / "locked"
    locked.mkdir()
    real_access = os.access
    monkeypatch.setattr(inputs.os, "access", lambda p, mode: False if Path(p) == locked else real_access(p, mode))
    out = locked / "new" / "out"
    code = hf_to_megatron_main([str(ASSET), str(out), "--no-progress"])
    _fails_with_one_line(capsys, code, TO_MEGATRON, f"cannot create it in {locked} (not writable")
    assert list(locked.iterdir()) == []


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into any mode; a read-only mount needs privileges")
def test_output_parent_really_not_writable(tmp_path, capsys):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o555)
    out = locked / "out"
    code = hf_to_megatron_main([str(ASSET), str(out), "--no-progress"])
    _fails_with_one_line(capsys, code, TO_MEGATRON, f"cannot create it in {locked}")
    _nothing_at(out)


def test_failure_after_creating_parents_removes_them(tmp_path, capsys, monkeypatch):
    from megatron_rl.checkpoint import fp8

    def disk_full(weight):
        raise OSError(28, "No space left on device", str(out / "model.safetensors"))

    monkeypatch.setattr(fp8, "quantize_blockwise", disk_full)
    out = tmp_path / "new" / "deeper" / "out"
    code = export_fp8_main([str(ASSET), str(out), "--no-progress"])
    _fails_with_one_line(capsys, code, "megatron-rl-export-fp8", f"{out / 'model.safetensors'}: No space left")
    assert not (tmp_path / "new").exists()


# ------------------------------------------------------------------ layouts and the vocabulary


@pytest.mark.parametrize(
    "flag, needle",
    [
        (["--ep", "3"], "--ep 3 (expert_model_parallel_size) does not divide model.num_experts=8; "
                        "EP sizes that work: 1, 2, 4, 8"),
        (["--pp", "3"], "--pp 3 (pipeline_model_parallel_size) does not divide model.num_layers=4; "
                        "PP sizes that work: 1, 2, 4"),
        (["--tp", "3"], "--tp 3 (tensor_model_parallel_size) does not divide model.num_attention_heads=4"),
        (["--tp", "0"], "--tp 0: must be >= 1"),
    ],
    ids=["ep", "pp", "tp", "zero"],
)
def test_layout_that_does_not_divide_the_model(flag, needle, tmp_path, capsys):
    out = tmp_path / "out"
    code = hf_to_megatron_main([str(ASSET), str(out), "--no-progress", *flag])
    _fails_with_one_line(capsys, code, TO_MEGATRON, needle)
    _nothing_at(out)


def test_vocab_not_divisible_by_tp_is_refused_with_the_padding_that_fits(odd_vocab, tmp_path, capsys):
    out = tmp_path / "out"
    code = hf_to_megatron_main([str(odd_vocab[0]), str(out), "--tp", "2", "--no-progress"])
    line = _fails_with_one_line(
        capsys, code, TO_MEGATRON, f"model.vocab_size={ODD_VOCAB}", "model.vocab_padding_multiple=1",
        "set model.vocab_padding_multiple=128 (pads to 512), converting with --vocab-padding-multiple",
    )
    assert line.split("padded_vocab_size=511: ")[1].startswith("1;")
    _nothing_at(out)
    # The TP1 checkpoint stores 511 rows: padding it takes a new conversion, which the message names.
    code = parity_main(["--hf", str(odd_vocab[0]), "--megatron", str(odd_vocab[1]), "--tp", "2"])
    _fails_with_one_line(capsys, code, "megatron-rl-logprob-parity", f"model.vocab_size={ODD_VOCAB}",
                         "--vocab-padding-multiple")
    code = hf_to_megatron_main([str(odd_vocab[0]), str(out), "--vocab-padding-multiple", "0", "--no-progress"])
    _fails_with_one_line(capsys, code, TO_MEGATRON, "--vocab-padding-multiple 0: must be an integer >= 1")
    _nothing_at(out)


def test_odd_vocab_round_trips_byte_for_byte_at_tp1(odd_vocab, tmp_path):
    hf, megatron = odd_vocab
    out = tmp_path / "back"
    assert megatron_to_hf_main([str(megatron), str(out), "--no-progress"]) == 0
    for path in sorted(hf.iterdir()):
        assert (out / path.name).read_bytes() == path.read_bytes(), path.name
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in hf.iterdir())


# ------------------------------------------------------------------ the convention


def test_traceback_on_request(tmp_path, monkeypatch):
    hf = shutil.copytree(ASSET, tmp_path / "hf")
    (hf / "config.json").write_text("{")
    with pytest.raises(CheckpointMismatchError, match="not valid JSON"):
        hf_to_megatron_main([str(hf), str(tmp_path / "a"), "--traceback"])
    monkeypatch.setenv("MEGATRON_RL_TRACEBACK", "1")
    with pytest.raises(CheckpointMismatchError, match="not valid JSON"):
        hf_to_megatron_main([str(hf), str(tmp_path / "b")])


def test_bad_usage_names_the_tool(capsys):
    with pytest.raises(SystemExit) as exit_info:
        hf_to_megatron_main(["only-one-argument"])
    assert exit_info.value.code == 2
    assert f"{TO_MEGATRON}: error: " in capsys.readouterr().err


def fail_on_rank_one() -> None:
    """Rank 1 meets a damaged file; rank 0 waits in a collective that never completes."""
    if dist.get_rank() == 1:
        raise CheckpointMismatchError("/ckpt/__1_0.distcp: shard truncated")
    dist.barrier()


def test_a_rank_failure_is_reported_once_by_that_rank():
    from megatron_rl.checkpoint.local_world import run_local

    with pytest.raises(CheckpointMismatchError) as info:
        run_local(fail_on_rank_one, 2, timeout_s=120)
    assert str(info.value) == "rank 1: /ckpt/__1_0.distcp: shard truncated"


# ------------------------------------------------------------------ helpers for a resuming run


def test_resume_helpers_name_the_damaged_file(odd_vocab, tmp_path):
    from megatron_rl.checkpoint.inputs import (
        check_dist_checkpoint,
        load_torch_file,
        read_json,
    )

    state = tmp_path / "trainer_state.json"
    state.write_text('{"step": 3, "data_pos')
    with pytest.raises(CheckpointMismatchError, match=f"{state}: not valid JSON"):
        read_json(state)
    state.write_text('{"step": 3}')
    with pytest.raises(CheckpointMismatchError, match="key.*data_position.*missing"):
        read_json(state, required=("step", "data_position"))
    rng = tmp_path / "rank_00000.pt"
    torch.save({"torch": torch.get_rng_state()}, rng)
    _truncate(rng, 0.5)
    with pytest.raises(CheckpointMismatchError, match=f"{rng}: not a readable torch file"):
        load_torch_file(rng)
    rng.write_bytes(b"garbage")
    with pytest.raises(CheckpointMismatchError, match=f"{rng}: not a readable torch file"):
        load_torch_file(rng)
    megatron = shutil.copytree(odd_vocab[1], tmp_path / "megatron")
    check_dist_checkpoint(megatron)
    common = megatron / mc.MEGATRON_COMMON_NAME
    assert common.exists() == mc.WRITES_COMMON_FILE  # 0.19 keeps it in the DCP shards, checked by size
    if mc.WRITES_COMMON_FILE:
        _truncate(common, 0.5)
        with pytest.raises(CheckpointMismatchError, match="common.pt: not a readable torch file"):
            check_dist_checkpoint(megatron)


def test_a_damaged_trainer_checkpoint_is_found_before_resuming(odd_vocab, tmp_path):
    from megatron_rl.checkpoint.trainer_source import check_trainer_checkpoint

    step = shutil.copytree(odd_vocab[1], tmp_path / "step_000002")
    state = {"step": 2, "data_position": 32, "weight_version": 2, "config": {}}
    (step / "trainer_state.json").write_text(json.dumps(state))
    (step / "rng").mkdir()
    for rank in range(2):
        torch.save({"torch": torch.get_rng_state()}, step / "rng" / f"rank_{rank:05d}.pt")
    assert check_trainer_checkpoint(step) == state
    damage = [
        (lambda: _truncate(step / "rng" / "rank_00001.pt", 0.5), "rank_00001.pt: not a readable torch file"),
        (lambda: sorted(step.glob("*.distcp"))[0].unlink(), "__0_0.distcp: shard missing"),
        (lambda: _truncate(step / "trainer_state.json", 0.5), "trainer_state.json: not valid JSON"),
    ]
    for harm, message in damage:
        harm()
        with pytest.raises(CheckpointMismatchError, match=message):
            check_trainer_checkpoint(step)
