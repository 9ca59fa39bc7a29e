"""Log-prob and routing parity between HF transformers' model code and the Megatron model.

Shape legend: N tokens of one sequence, L MoE layers, K experts per token, E experts.

Owns: the HF reference pass (transformers' own forward, router logits per layer), the
Megatron pass (the project's forward-only log-prob pass with routing records, in any
layout), their comparison (per-token log-prob max / mean absolute difference, per-layer
top-K agreement, router-probability difference) and the tolerance check the parity tool
exits on. Every token of every sequence after the first is scored; routing is compared
at every position. Does not own conversion or prompt tokenization beyond reading a file.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import torch

from megatron_rl.checkpoint.errors import CheckpointMismatchError
from megatron_rl.checkpoint.inputs import read_json
from megatron_rl.sections import ParallelConfig

if TYPE_CHECKING:
    from megatron_rl.parallel.groups import ParallelGroups


@dataclass(kw_only=True)
class SequenceOutputs:
    """One side's outputs for one sequence of N tokens."""

    logprobs_N1: torch.Tensor
    """``[N - 1]`` log-probability of tokens 1..N-1 given their prefix."""
    expert_ids_NLK: torch.Tensor
    """``[N, L, K]`` top-K experts of every position and layer, by descending probability."""
    probs_NLK: torch.Tensor
    """``[N, L, K]`` router probability of those experts (softmax over all E, or the per-expert
    sigmoid score without the selection bias)."""
    router_probs_NLE: torch.Tensor | None = None
    """``[N, L, E]`` full router distribution (HF side only)."""


@dataclass(kw_only=True)
class ParityTolerances:
    """Limits beyond which the Megatron model does not compute what HF computes."""

    logprob_max_abs: float = 1e-4
    """Largest allowed per-token log-prob difference."""
    topk_agreement_min: float = 1.0
    """Smallest allowed fraction of positions, per layer, with the same top-K expert set."""
    router_prob_max_abs: float = 1e-5
    """Largest allowed router-probability difference at Megatron's chosen experts."""


@dataclass(kw_only=True)
class ParityReport:
    """How far the two sides are apart over all sequences."""

    num_scored_tokens: int
    """Tokens whose log-probs were compared."""
    num_positions: int
    """Positions whose routing was compared (per layer)."""
    logprob_max_abs_diff: float
    """Max over tokens of |log p_megatron - log p_hf|."""
    logprob_mean_abs_diff: float
    """Mean over tokens of |log p_megatron - log p_hf|."""
    topk_agreement_per_layer: list[float] = field(default_factory=list)
    """Per layer, the fraction of positions whose top-K expert sets are equal."""
    topk_ids_identical: bool = True
    """Every position's top-K ids are equal, in order."""
    router_prob_max_abs_diff: float = 0.0
    """Max |p_megatron - p_hf| of the experts Megatron chose (HF's full distribution)."""

    def violations(self, tolerances: ParityTolerances) -> list[str]:
        """Each tolerance the report breaks, in words (empty: parity holds)."""
        found = []
        # Written as "not <=" so that a NaN difference is a violation too.
        tol = tolerances
        if not self.logprob_max_abs_diff <= tol.logprob_max_abs:
            found.append(f"log-prob max abs diff {self.logprob_max_abs_diff:.3e} > {tol.logprob_max_abs:.1e}")
        for layer, agreement in enumerate(self.topk_agreement_per_layer):
            if not agreement >= tol.topk_agreement_min:
                found.append(f"layer {layer}: top-K agreement {agreement:.4f} < {tol.topk_agreement_min}")
        if not self.router_prob_max_abs_diff <= tol.router_prob_max_abs:
            diff = self.router_prob_max_abs_diff
            found.append(f"router prob max abs diff {diff:.3e} > {tol.router_prob_max_abs:.1e}")
        return found

    def to_dict(self) -> dict:
        """Plain dict (JSON output)."""
        return asdict(self)


def compare(hf: Sequence[SequenceOutputs], megatron: Sequence[SequenceOutputs]) -> ParityReport:
    """Compare the two sides sequence by sequence (same order, same tokens)."""
    if len(hf) != len(megatron):
        raise ValueError(f"{len(hf)} HF sequences but {len(megatron)} Megatron sequences")
    diffs, agree, identical, prob_err = [], [], True, 0.0
    for i, (ref, got) in enumerate(zip(hf, megatron)):
        if ref.expert_ids_NLK.shape != got.expert_ids_NLK.shape:
            raise ValueError(
                f"sequence {i}: routing shapes differ, HF {tuple(ref.expert_ids_NLK.shape)} "
                f"vs Megatron {tuple(got.expert_ids_NLK.shape)}"
            )
        diffs.append((got.logprobs_N1.double() - ref.logprobs_N1.double()).abs())
        ref_ids, got_ids = ref.expert_ids_NLK.long(), got.expert_ids_NLK.long()
        agree.append((ref_ids.sort(-1).values == got_ids.sort(-1).values).all(-1))
        identical &= bool(torch.equal(ref_ids, got_ids))
        at_megatron_choice = ref.router_probs_NLE.double().gather(-1, got_ids)
        prob_err = max(prob_err, float((got.probs_NLK.double() - at_megatron_choice).abs().max()))
    diff = torch.cat(diffs)
    agree_NL = torch.cat(agree)
    return ParityReport(
        num_scored_tokens=diff.numel(),
        num_positions=agree_NL.shape[0],
        logprob_max_abs_diff=float(diff.max()),
        logprob_mean_abs_diff=float(diff.mean()),
        topk_agreement_per_layer=agree_NL.double().mean(0).tolist(),
        topk_ids_identical=identical,
        router_prob_max_abs_diff=prob_err,
    )


def hf_reference(
    hf_dir: str | Path, sequences: Sequence[torch.Tensor], topk: int, score_function: str = "softmax"
) -> list[SequenceOutputs]:
    """transformers' forward of each sequence alone: log-probs and router decisions.

    The model is loaded in the checkpoint's own dtype. Each MoE layer's router module
    (``mlp.gate`` / ``block_sparse_moe.gate``, which returns logits, gate weights and ids)
    is hooked: the experts are the ones transformers itself selected (expert bias and
    group limits included), ordered by descending router probability, and the router
    probabilities are ``score_function`` of its float32 logits (softmax over all E, or
    the per-expert sigmoid, which is what a routing record holds).
    """
    from transformers import AutoModelForCausalLM

    from moe_routing.scores import router_log_scores

    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), config=_transformers_config(hf_dir), dtype="auto")
    model.eval()
    calls: list[tuple[torch.Tensor, torch.Tensor]] = []

    def hook(module, args, output):
        calls.append((output[0].float(), output[2]))

    routers = [m for name, m in model.named_modules() if name.endswith((".mlp.gate", ".block_sparse_moe.gate", ".mlp.router"))]
    handles = [m.register_forward_hook(hook) for m in routers]
    outputs = []
    try:
        with torch.no_grad():
            for seq in sequences:
                calls.clear()
                out = model(input_ids=seq[None].long(), use_cache=False)
                logp = torch.log_softmax(out.logits[0, :-1].float(), dim=-1)
                probs_NLE = torch.stack([router_log_scores(lg, score_function).exp() for lg, _ in calls], dim=1)
                ids_NLK = torch.stack([ids.long() for _, ids in calls], dim=1)
                if ids_NLK.shape[-1] != topk:
                    raise CheckpointMismatchError(f"HF routers chose {ids_NLK.shape[-1]} experts, expected {topk}")
                probs_NLK, order_NLK = probs_NLE.gather(-1, ids_NLK).sort(dim=-1, descending=True, stable=True)
                outputs.append(
                    SequenceOutputs(
                        logprobs_N1=logp.gather(1, seq[1:, None].long())[:, 0],
                        expert_ids_NLK=ids_NLK.gather(-1, order_NLK),
                        probs_NLK=probs_NLK,
                        router_probs_NLE=probs_NLE,
                    )
                )
    finally:
        for handle in handles:
            handle.remove()
    return outputs


def _transformers_config(hf_dir: str | Path):
    """The checkpoint's config as transformers builds it, for a family transformers knows under
    another ``model_type`` (Kimi-K2 as DeepSeek-V3); None: transformers reads config.json itself."""
    from transformers import AutoConfig

    from megatron_rl.checkpoint.hf_config import architecture_of, read_config

    config = read_config(hf_dir)
    as_type = architecture_of(config).transformers_model_type
    if as_type is None:
        return None
    # ``auto_map`` points at the checkpoint's own modelling code, which the parity check must not run.
    fields = {k: v for k, v in config.items() if k not in ("model_type", "auto_map")}
    return AutoConfig.for_model(as_type, **fields)


def megatron_outputs(
    model: torch.nn.Module, groups: ParallelGroups, sequences: Sequence[torch.Tensor]
) -> list[SequenceOutputs]:
    """The Megatron model's outputs for every sequence (collective over the model's world).

    Every rank passes every sequence: data-parallel replicas repeat the work, which keeps
    the micro-batch counts equal across them and every rank's result complete.
    """
    from megatron_rl.parallel.logprobs import compute_logprobs

    result = compute_logprobs(model, groups, list(sequences), [1] * len(sequences), record_routing=True)
    outputs = []
    for j in range(len(sequences)):
        lo, hi = int(result.cu_seqlens_S1[j]), int(result.cu_seqlens_S1[j + 1])
        record = result.record.sample(j)
        outputs.append(
            SequenceOutputs(
                logprobs_N1=result.logprobs_T[lo:hi].clone(),
                expert_ids_NLK=record.expert_ids_TLK.clone(),
                probs_NLK=record.probs_TLK.float().clone(),
            )
        )
    return outputs


def _megatron_entry(megatron_dir: str, parallel: ParallelConfig, sequences: list[torch.Tensor]):
    from megatron_rl.checkpoint.convert import read_export_source
    from megatron_rl.checkpoint.megatron_io import load_megatron_model
    from megatron_rl.parallel.comm import rank
    from megatron_rl.parallel.cpu_platform import cpu_platform
    from megatron_rl.parallel.groups import model_parallel

    source = read_export_source(megatron_dir)
    enable = parallel.use_cpu_platform is not False
    with cpu_platform(enable=enable), model_parallel(parallel, seed=0) as groups:
        model = load_megatron_model(source.arch, source.model, parallel, megatron_dir)
        outputs = megatron_outputs(model, groups, sequences)
        first = rank(groups.world) == 0
    return outputs if first else None


def check_parity(
    hf_dir: str | Path,
    megatron_dir: str | Path,
    sequences: Sequence[torch.Tensor],
    parallel: ParallelConfig | None = None,
    world_size: int | None = None,
    timeout_s: float = 3600.0,
) -> ParityReport:
    """Run both sides on ``sequences`` (HF here, Megatron in a local gloo world) and compare."""
    from megatron_rl.checkpoint.convert import read_export_source
    from megatron_rl.checkpoint.hf_source import inspect_hf_checkpoint
    from megatron_rl.checkpoint.local_world import (
        check_layout,
        minimal_world_size,
        run_local,
    )

    parallel = parallel or ParallelConfig()
    source = read_export_source(megatron_dir)
    inspect_hf_checkpoint(hf_dir)
    world_size = world_size or minimal_world_size(parallel)
    check_layout(source.model, parallel, world_size)
    vocab = source.model.vocab_size
    for i, seq in enumerate(sequences):
        if len(seq) < 2 or int(seq.min()) < 0 or int(seq.max()) >= vocab:
            raise CheckpointMismatchError(
                f"prompt {i}: needs at least 2 token ids, each in [0, vocab_size={vocab}); got {len(seq)} "
                f"tokens in [{int(seq.min()) if len(seq) else '-'}, {int(seq.max()) if len(seq) else '-'}]"
            )
    reference = hf_reference(hf_dir, sequences, source.model.moe_router_topk, source.model.moe_router_score_function)
    args = (str(megatron_dir), parallel, list(sequences))
    megatron = run_local(_megatron_entry, world_size, *args, timeout_s=timeout_s)
    return compare(reference, megatron[0])


def random_prompts(count: int, length: int, vocab_size: int, seed: int) -> list[torch.Tensor]:
    """Reproducible random token sequences (checkpoints without a tokenizer)."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (length,), generator=gen) for _ in range(count)]


def load_prompts(path: str | Path, hf_dir: str | Path) -> list[torch.Tensor]:
    """Prompts from a JSON list: token-id lists as they are, strings through the HF tokenizer."""
    items = read_json(path)
    if not isinstance(items, list):
        raise CheckpointMismatchError(f"{path}: expected a JSON list of prompts, found {type(items).__name__}")
    tokenizer = None
    prompts = []
    for i, item in enumerate(items):
        if isinstance(item, str):
            if tokenizer is None:
                from transformers import AutoTokenizer

                tokenizer = AutoTokenizer.from_pretrained(str(hf_dir))
            item = tokenizer(item)["input_ids"]
        if len(item) < 2:
            raise CheckpointMismatchError(f"{path}: prompt {i} has {len(item)} tokens; parity needs at least 2")
        prompts.append(torch.tensor(item, dtype=torch.int64))
    return prompts
