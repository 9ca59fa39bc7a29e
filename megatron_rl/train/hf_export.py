"""Hugging Face checkpoints out of a running trainer, in any TP/SP/EP/PP layout.

Owns: the collective export of the live policy as an HF checkpoint directory that
``transformers`` loads as is (safetensors shards, ``config.json``, the tokenizer and
generation files), written atomically: every parameter is gathered whole from its shards
onto global rank 0 one tensor at a time (the same gather the SGLang weight sync uses),
renamed with the architecture's HF table and streamed into size-bounded shards inside a
hidden staging directory that is renamed into place only when complete.

Where the side files come from: the starting checkpoint's own ``config.json``,
``generation_config.json`` and tokenizer files when the run started from one (dtype
updated to the trained weights'), else a ``config.json`` generated from the run's model;
a tokenizer loaded from elsewhere is saved with ``save_pretrained``. :class:`RunExports` is a
run's: every ``train.save_hf_every`` steps and at the last, into ``<run_dir>/hf/step_NNNNNN``,
and the export a resumed step still owes. Does not own the HF <-> Megatron tables
(``megatron_rl.checkpoint.mapping``).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import torch

from megatron_rl.checkpoint.hf_config import dequantized_config, hf_config_from_model
from megatron_rl.checkpoint.hf_io import (
    INDEX_NAME,
    SINGLE_NAME,
    ShardPlan,
    ShardWriter,
    atomic_output_dir,
    interrupted_staging_dirs,
    named_sizes,
    read_named,
    tensor_bytes,
)
from megatron_rl.checkpoint.mapping import ARCHITECTURES, all_weights, hf_name_map
from megatron_rl.parallel import comm
from megatron_rl.parallel.groups import ParallelGroups
from megatron_rl.rollout.sglang.weight_sync import gather_full_params
from megatron_rl.sections import ModelConfig
from megatron_rl.train.disk_space import as_no_space_left
from megatron_rl.train.engines import hf_architecture

if TYPE_CHECKING:
    from megatron_rl.checkpoint.init_source import InitSource
    from megatron_rl.config import RunConfig
    from megatron_rl.data.tokenizer import PromptTokenizer

DEFAULT_MAX_SHARD_BYTES = 5 * 2**30
"""transformers' default shard size for ``save_pretrained``."""


@dataclass(kw_only=True)
class HFExportSpec:
    """What an exported checkpoint is, beyond the weights."""

    architecture: str
    """HF model_type (key of ``mapping.ARCHITECTURES``)."""
    model: ModelConfig
    """The trained model."""
    side_files: list[Path] = field(default_factory=list)
    """Non-weight files to copy (config, generation config, tokenizer) from the starting checkpoint."""
    save_tokenizer: Callable[[Path], None] | None = None
    """Writes tokenizer files into a directory (a tokenizer that is not among ``side_files``)."""
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES
    """Largest safetensors shard."""
    passthrough: dict[str, str] = field(default_factory=dict)
    """Tensors the starting checkpoint kept aside (a vision tower, MTP layers; ``HFSource.passthrough``),
    written back unchanged."""


def _config_json(spec: HFExportSpec) -> dict:
    """The starting checkpoint's config with the written dtype, or one generated from the model."""
    carried = next((p for p in spec.side_files if p.name == "config.json"), None)
    if carried is None:
        return hf_config_from_model(spec.architecture, spec.model, spec.model.params_dtype)
    config = json.loads(carried.read_text())
    # A checkpoint read dequantized (GPT-OSS's MXFP4 experts) is exported unquantized.
    config = dequantized_config(config) or config
    # transformers 4 reads torch_dtype, 5 writes dtype; the weights are in the run's dtype.
    for key in ("torch_dtype", "dtype"):
        if key in config or key == "torch_dtype":
            config[key] = spec.model.params_dtype
    return config


def _write_side_files(spec: HFExportSpec, staging: Path) -> None:
    for path in spec.side_files:
        if path.name not in ("config.json", INDEX_NAME, SINGLE_NAME):
            shutil.copyfile(path, staging / path.name)
    (staging / "config.json").write_text(json.dumps(_config_json(spec), indent=2) + "\n")
    if spec.save_tokenizer is not None:
        spec.save_tokenizer(staging)


def _plan(spec: HFExportSpec) -> ShardPlan:
    dtype = getattr(torch, spec.model.params_dtype)
    weights = all_weights(ARCHITECTURES.get(spec.architecture), spec.model)
    sizes = {n: tensor_bytes(s, dtype) for w in weights for n, s in zip(w.hf, w.hf_shapes)}
    return ShardPlan.by_size({**sizes, **named_sizes(spec.passthrough)}, spec.max_shard_bytes)


def export_hf(model: torch.nn.Module, groups: ParallelGroups, out_dir: str | Path, spec: HFExportSpec) -> Path:
    """Collective: write the policy as an HF checkpoint at ``out_dir`` (replacing one of the same step).

    Every rank of the world calls this; only global rank 0 writes. A failure on rank 0
    leaves no directory behind and is raised on every rank after the gather finishes, so
    no rank waits in a collective for a peer that gave up. Staging directories that killed
    exports left next to ``out_dir`` are removed first: the trainer holds the run
    directory's lock, so nothing else writes there.

    Args:
        model: this rank's model stage (bare or DDP-wrapped).
        groups: this rank's parallel groups.
        out_dir: the final directory, e.g. ``<run_dir>/hf/step_000100``.
        spec: architecture, model config and side files.
    """
    out_dir = Path(out_dir)
    rank0 = comm.rank(groups.world) == 0
    error: BaseException | None = None
    output = None
    writer = None
    if rank0:
        try:
            # A run resumed before its step-N checkpoint exports step N again: same weights.
            if out_dir.exists():
                shutil.rmtree(out_dir)
            for stale in interrupted_staging_dirs(out_dir.parent):
                shutil.rmtree(stale)
            output = atomic_output_dir(out_dir)
            staging = output.__enter__()
            _write_side_files(spec, staging)
            writer = ShardWriter(staging, _plan(spec))
        except Exception as err:  # noqa: BLE001 - reported on every rank below
            error = err
    name_map = hf_name_map(ARCHITECTURES.get(spec.architecture), spec.model)
    for name, full in gather_full_params(model, groups):
        if error is None and writer is not None:
            try:
                for hf_name, tensor in name_map(name, full):
                    writer.add(hf_name, tensor.cpu())
            except Exception as err:  # noqa: BLE001 - keep gathering: peers are in collectives
                error = err
    if rank0 and error is None:
        try:
            for name, tensor in read_named(spec.passthrough):
                writer.add(name, tensor)
            writer.finish()
        except Exception as err:  # noqa: BLE001
            error = err
    if rank0 and error is not None:
        # Before the staging directory is removed: a full disk is recognised by what it holds.
        error = as_no_space_left(error, out_dir, f"writing the HF checkpoint {out_dir.name}")
    if rank0 and output is not None:
        if error is None:
            output.__exit__(None, None, None)
        else:
            output.__exit__(type(error), error, error.__traceback__)
    comm.raise_first_failure(error, groups.world, f"exporting the HF checkpoint {out_dir}")
    return out_dir


class RunExports:
    """A run's HF checkpoints (construct and call on every rank together).

    Args:
        cfg: the run config (``train.save_hf*``, ``train.run_dir``, the model, the tokenizer's source).
        groups: this rank's parallel groups.
        ddp: the DDP-wrapped policy stage.
        init: the starting checkpoint (its side files are carried over), or None.
        tokenizer: the run's tokenizer (saved when it does not come from the starting checkpoint).
    """

    def __init__(self, cfg: RunConfig, groups: ParallelGroups, ddp: torch.nn.Module, init: InitSource | None,
                 tokenizer: PromptTokenizer) -> None:
        self.cfg, self.groups, self.ddp, self.init, self.tokenizer = cfg, groups, ddp, init, tokenizer
        self.rank0 = comm.rank(groups.world) == 0

    def due(self, step: int) -> bool:
        """Whether step ``step`` writes an HF checkpoint."""
        t = self.cfg.train
        return bool(t.save_hf and (step == t.steps or (t.save_hf_every and step % t.save_hf_every == 0)))

    def __call__(self, step: int) -> Path:
        """Collective: the current policy as an HF checkpoint in ``<run_dir>/hf/step_NNNNNN``."""
        cfg = self.cfg
        side_files = [Path(f) for f in self.init.hf.files] if self.init is not None else []
        own_tokenizer = cfg.data.source == "files" and cfg.tokenizer.path is not None
        spec = HFExportSpec(
            architecture=hf_architecture(cfg, self.init),
            model=cfg.model, side_files=side_files,
            save_tokenizer=self.tokenizer.hf_tokenizer.save_pretrained if own_tokenizer else None,
            passthrough=self.init.hf.passthrough if self.init is not None else {},
        )
        out = export_hf(self.ddp, self.groups, Path(cfg.train.run_dir) / "hf" / f"step_{step:06d}", spec)
        if self.rank0:
            print(f"HF checkpoint: {out}", flush=True)
        return out

    def finish_owed(self, step: int, resumed: bool) -> None:
        """Collective: the HF checkpoint a resumed step owes, when it is missing. A step
        publishes its training checkpoint after its export, so a run stopped during the export
        resumes at the step before; this covers the rest (a run directory written before that
        order, ``train.save_hf`` turned on for the resume): the weights loaded are that step's,
        so the export is made now. Staging left by a stopped export is removed either way."""
        if not resumed or step == 0 or not self.due(step):
            return
        out = Path(self.cfg.train.run_dir) / "hf" / f"step_{step:06d}"
        # Rank 0 alone writes the export: on nodes without a shared file system only it can tell.
        if comm.broadcast_object(self.rank0 and not out.is_dir(), 0, self.groups.world):
            if self.rank0:
                print(f"the HF export of step {step} did not finish before the run stopped: writing it now",
                      flush=True)
            self(step)
