"""The worker of ``megatron-rl-smoke``: one checkpoint, any layout, the same logits and gradients.

``layout_worker`` runs on every rank of a world: it builds the model for its layout,
saves (reference run) or loads (every other run) the weights through Megatron's
distributed checkpoint, runs one forward + backward over the same packed batch through
Megatron's schedules and returns, from the ranks that own them, the full-vocabulary
logits of every sample (gathered over TP, only for comparison) and the reduced gradients
of the router weights and of the output layer. ``compare`` states how far two such
results are apart. Its steps (:func:`layout_groups`, :func:`load_layout_model`,
:func:`forward_backward`) are separate so that a caller can check more in the same world
(the layout-invariance tests add the log-prob pass). Owns no command line
(:mod:`megatron_rl.smoke`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch
import torch.distributed as dist
from megatron.core import tensor_parallel

from megatron_rl.parallel.checkpoint import load_model, save_model
from megatron_rl.parallel.comm import all_gather_cat
from megatron_rl.parallel.cpu_platform import cpu_platform
from megatron_rl.parallel.groups import ParallelGroups, model_parallel
from megatron_rl.parallel.model import build_model
from megatron_rl.parallel.packing import (
    PackedMicroBatch,
    next_token_targets,
    pack_sequences,
)
from megatron_rl.parallel.schedule import run_schedule, unwrap, wrap_for_training
from megatron_rl.parallel.vocab_parallel import vocab_parallel_logprobs_entropy
from megatron_rl.sections import (
    ModelConfig,
    ParallelConfig,
    validate_layout,
    validate_model,
)


@dataclass
class LayoutRun:
    """Everything one layout world needs (picklable)."""

    model: ModelConfig
    """Architecture (identical across the runs being compared)."""
    parallel: ParallelConfig
    """Layout of this run."""
    checkpoint_dir: str
    """Distributed checkpoint: written by the reference run, read by the others."""
    sequences: list[torch.Tensor]
    """Token ids of every sample of the batch, ``[len_s]`` each."""
    save_checkpoint: bool = False
    """True for the reference run, which initializes the weights and saves them."""
    micro_batch_sequences: int = 2
    """Sequences packed into one micro-batch."""
    seed: int = 1234
    """Seed for the weights of the reference run."""


def micro_batches_for_rank(
    sequences: list[torch.Tensor], groups: ParallelGroups, per_micro_batch: int
) -> list[PackedMicroBatch]:
    """This DP rank's share of the batch (sample i goes to DP rank i mod DP), packed.

    Every DP rank gets the same number of micro-batches, all padded to one common length:
    expert-parallel dispatch is a collective over ranks that hold different data, and the
    allgather dispatcher needs equal token counts on each of them.
    """
    shares = [list(range(r, len(sequences), groups.dp_size)) for r in range(groups.dp_size)]
    chunks = [
        [share[i : i + per_micro_batch] for i in range(0, len(share), per_micro_batch)]
        for share in shares
    ]
    counts = {len(c) for c in chunks}
    if len(counts) != 1:
        raise ValueError(
            f"{len(sequences)} sequences in micro-batches of {per_micro_batch} give data-parallel "
            f"ranks unequal micro-batch counts {sorted(counts)}; make the batch divisible"
        )
    longest = max(sum(sequences[i].numel() for i in chunk) for c in chunks for chunk in c)
    return [
        pack_sequences(
            [sequences[i] for i in chunk],
            sample_ids=chunk,
            pad_multiple=groups.tp_size if groups.sequence_parallel else 1,
            pad_to=longest,
        )
        for chunk in chunks[groups.dp_rank]
    ]


def _cross_entropy_loss(groups: ParallelGroups, vocab_size: int):
    def loss_fn(mb: PackedMicroBatch, logits_1TV: torch.Tensor):
        targets_T, mask_T = next_token_targets(mb)
        logits_TV = logits_1TV[0].float()
        logprobs_T, _ = vocab_parallel_logprobs_entropy(
            logits_TV, targets_T, groups.tp, compute_entropy=False, vocab_size=vocab_size
        )
        per_token_T = -logprobs_T
        loss_sum = (per_token_T * mask_T).sum()
        num_tokens = mask_T.sum().to(torch.int)
        # Gathering the vocabulary is for the comparison only; the RL path never does it.
        full_TV = tensor_parallel.gather_from_tensor_model_parallel_region(
            logits_TV.detach(), group=groups.tp
        )[:, :vocab_size]
        samples = {
            int(sid): full_TV[mb.cu_seqlens[i] : mb.cu_seqlens[i + 1]].clone()
            for i, sid in enumerate(mb.sample_ids)
        }
        return loss_sum, num_tokens, {"samples": samples, "loss_sum": loss_sum.detach()}

    return loss_fn


def _gathered_grads(model: torch.nn.Module, groups: ParallelGroups) -> dict[str, torch.Tensor]:
    """Router grads by global layer number and the full output-layer grad (last stage)."""
    gpt = unwrap(model)
    grads: dict[str, torch.Tensor] = {}
    for layer in gpt.decoder.layers:
        router = layer.mlp.router
        grads[f"router.{layer.layer_number}"] = router.weight.main_grad.detach().clone()
    if groups.is_last_stage:
        grads["output_layer"] = all_gather_cat(gpt.output_layer.weight.main_grad.detach(), groups.tp, dim=0)
    return grads


@contextlib.contextmanager
def layout_groups(run: LayoutRun) -> Iterator[ParallelGroups]:
    """This rank's groups for ``run``'s layout (checked first), on the CPU platform unless
    the layout turns it off."""
    validate_model(run.model)
    validate_layout(run.model, run.parallel, dist.get_world_size())
    with cpu_platform(enable=run.parallel.use_cpu_platform is not False):
        with model_parallel(run.parallel, run.seed) as groups:
            yield groups


def load_layout_model(run: LayoutRun) -> torch.nn.Module:
    """The model in this rank's layout, with freshly initialized weights saved (reference
    run) or the reference weights loaded."""
    model = build_model(run.model, run.parallel)
    if run.save_checkpoint:
        save_model(model, Path(run.checkpoint_dir))
    else:
        load_model(model, Path(run.checkpoint_dir))
    return model


def forward_backward(model: torch.nn.Module, groups: ParallelGroups, run: LayoutRun) -> dict:
    """One forward + backward of the batch; the logits and gradients this rank owns."""
    ddp = wrap_for_training(model)
    micro_batches = micro_batches_for_rank(run.sequences, groups, run.micro_batch_sequences)
    outputs = run_schedule(ddp, micro_batches, _cross_entropy_loss(groups, run.model.vocab_size), forward_only=False)
    samples: dict[int, torch.Tensor] = {}
    for out in outputs:
        samples.update(out["samples"])
    grads = _gathered_grads(ddp, groups)  # a collective: every rank must enter
    return {
        "rank": dist.get_rank(),
        "tp_rank": groups.tp_rank,
        "pp_rank": groups.pp_rank,
        "dp_rank": groups.dp_rank,
        "ep_rank": groups.ep_rank,
        "is_last_stage": groups.is_last_stage,
        "samples": samples if groups.tp_rank == 0 else {},
        "grads": grads if groups.tp_rank == 0 else {},
    }


def layout_worker(run: LayoutRun) -> dict:
    """Per-rank body of a layout world (call through ``run_world``)."""
    with layout_groups(run) as groups:
        return forward_backward(load_layout_model(run), groups, run)


def merge_rank_results(results: list[dict]) -> dict:
    """Combine per-rank results: every sample's logits and each gradient, once."""
    samples: dict[int, torch.Tensor] = {}
    grads: dict[str, torch.Tensor] = {}
    for res in results:
        samples.update(res["samples"])
        for name, grad in res["grads"].items():
            grads.setdefault(name, grad)
    return {"samples": samples, "grads": grads}


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """``||actual - expected|| / ||expected||`` (absolute when expected is zero)."""
    diff = (actual.double() - expected.double()).norm()
    scale = expected.double().norm()
    return float(diff / scale) if scale > 0 else float(diff)


def compare(actual: dict, expected: dict) -> dict[str, float]:
    """Max abs logit difference over all samples and relative error of each gradient.

    Raises:
        KeyError: a sample or gradient present in ``expected`` is missing in ``actual``.
    """
    missing = sorted(set(expected["samples"]) - set(actual["samples"]))
    if missing:
        raise KeyError(f"samples missing from the layout run: {missing}")
    logits_max_abs = max(
        float((actual["samples"][i] - ref).abs().max()) for i, ref in expected["samples"].items()
    )
    report = {"logits_max_abs_diff": logits_max_abs}
    for name, ref in expected["grads"].items():
        if name not in actual["grads"]:
            raise KeyError(f"gradient {name} missing from the layout run")
        report[f"grad_rel_err.{name}"] = relative_error(actual["grads"][name], ref)
    return report


def random_sequences(
    num_sequences: int, vocab_size: int, min_len: int, max_len: int, seed: int
) -> list[torch.Tensor]:
    """Reproducible variable-length token sequences for checks."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (num_sequences,), generator=gen)
    return [torch.randint(0, vocab_size, (int(n),), generator=gen) for n in lengths]
