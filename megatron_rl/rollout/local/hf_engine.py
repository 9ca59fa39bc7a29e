"""The HF rollout engine: KV-cached generation with transformers' model code, in every rank.

Shape legend: N prompt+response tokens of a sample, L MoE layers, K top-K.

The default engine for CPU and small GPU runs (``rollout.engine: hf``). Every rank holds
a transformers replica of the policy (``hf_model``) and generates with a KV cache
(``hf_generate``), so responses cost linear time in their length, and its numerics are
transformers' (SDPA attention, its MoE block, its RoPE), not the trainer's: the
train-versus-rollout log-prob gap, the routes R3 replays and the TIS/MIS/IcePop
corrections see a real, small mismatch, as against SGLang on GPUs. The exact
"train = rollout" mode (slime's and miles' true-on-policy) is ``rollout.engine: megatron``.

Weights: ``update_weights(version)`` (collective over the world) rebuilds each Megatron
parameter whole with the SGLang weight sync's gather (``gather_full_params``, here with
``everywhere=True``: the owner broadcasts each whole tensor to every rank), renames it
with the same HF table (``mapping.hf_name_map``) that names SGLang's tensors and the HF
export's, and copies it into the replica; every replica parameter must be written exactly
once, and all ranks must then hold bit-identical weights (an fp64 fingerprint is compared
over the world) under the same version, or the push fails. Works in every TP/SP/EP/PP
layout because the gather does.

Data parallelism: each data-parallel rank generates its own prompts. The ranks of one
model-parallel group (TP x PP) share a DP rank's prompts: each generates a contiguous
share with its own generator stream (seed, DP rank, MP rank) and the group all-gathers the
samples, so every rank of the group returns the same samples, and TP/PP ranks add
generation throughput instead of repeating it. No collective runs inside decoding, so
ranks finish independently.

Multi-turn rollouts (``prefix_cache=True``): each rank keeps the KV of the responses it
generated, and a later prompt that extends one (the next turn of a trajectory) prefills
only its new tokens; routes of the cached positions come from the pass that computed them
(``hf_prefix_cache``). A prompt another rank of the group generated last turn misses the
cache and is recomputed whole, which changes speed, never which positions' routes return.

Colocated runs (``rollout.placement: colocated``): the replica's memory is freed while the
trainer works (:meth:`HFEngine.release_memory`: its parameters' storages, and the prefix
cache's KV) and re-allocated before the next generation (:meth:`HFEngine.resume_memory`),
when the trainer pushes its weights into it again. Does not own sampling math
(``sampling``), the HF name table or when pushes happen (the trainer).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from megatron_rl.checkpoint.mapping import ARCHITECTURES, hf_name_map
from megatron_rl.parallel import comm
from megatron_rl.parallel.groups import ParallelGroups
from megatron_rl.parallel.offload import StorageSet
from megatron_rl.rollout.engine import RolloutSample, SamplingParams, check_routes_from
from megatron_rl.rollout.local.hf_generate import DecodeControl, Generation, check_lengths, generate
from megatron_rl.rollout.local.hf_model import (
    HFWeightLoader,
    build_hf_model,
    check_architecture,
)
from megatron_rl.rollout.local.hf_prefix_cache import PrefixCache
from megatron_rl.rollout.sglang.weight_sync import gather_full_params
from megatron_rl.sections import ModelConfig


@dataclass
class HFPending:
    """A batch :meth:`HFEngine.start_generate` began."""

    prompts: list
    """Token ids per sample (the whole batch of this data-parallel rank)."""
    control: DecodeControl
    """Pauses its decoding while the weights change."""
    temperature: float
    """The sampling temperature its samples are drawn at."""
    thread: threading.Thread | None = None
    mine: list[Generation] | None = None
    """This rank's share, once generated."""
    error: BaseException | None = None


class HFEngine:
    """Generate with a transformers replica of the Megatron policy on every rank.

    Construction is collective (it pushes the model's current weights as version 0).

    Args:
        model: this rank's Megatron model stage (bare or DDP-wrapped); its weights are pushed.
        groups: this rank's parallel groups.
        architecture: HF ``model_type`` the replica is built as (``qwen3_moe`` or ``mixtral``).
        model_config: the Megatron model's config.
        device: where the replica lives (default: the current CUDA device, else CPU).
        dtype: the replica's dtype (default: the model's ``params_dtype``).
        prefix_cache: keep each finished response's KV and serve a prompt that extends it
            from there (multi-turn rollouts; emptied at every weight push).
        logprobs_after_temperature: report ``log_softmax(logits / T)``, the distribution each
            token is drawn from (SGLang's default); False: ``log_softmax(logits)`` (the T = 1
            objective, ``objective.policy_temperature=one``).
        pause_mode: partial rollouts: a push with generations running pauses them and goes on
            (``in_place`` over the old KV, else computing it again); None: a push waits for none.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        groups: ParallelGroups,
        *,
        architecture: str,
        model_config: ModelConfig,
        device: torch.device | str | None = None,
        dtype: str | None = None,
        prefix_cache: bool = False,
        logprobs_after_temperature: bool = True,
        pause_mode: str | None = None,
    ) -> None:
        check_architecture(architecture)
        self.logprobs_after_temperature = logprobs_after_temperature
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
        self.model, self.groups = model, groups
        self.architecture = architecture
        self.max_length = model_config.max_position_embeddings
        self.hf_model = build_hf_model(architecture, model_config, device, dtype)
        self._name_map = hf_name_map(ARCHITECTURES.get(architecture), model_config)
        self._loader = HFWeightLoader(self.hf_model, architecture)
        # A sliding window keeps only its last keys and a Gated DeltaNet layer a recurrent state,
        # neither of which the prefix cache's per-position KV can restore: such a model's next
        # turn is computed whole (a cache miss, which changes speed, never the routes returned).
        self.prefix_cache = PrefixCache() if prefix_cache and model_config.mixer_types == (
            ("full_attention",) * model_config.num_layers) else None
        self.weight_version = -1
        self.released: StorageSet | None = None
        """The replica's storages while its memory is released (None: resident)."""
        self.pause_mode = pause_mode
        self._running: list[HFPending] = []
        """Batches :meth:`start_generate` began and :meth:`finish_generate` has not ended."""
        self.update_weights(0)

    # ------------------------------------------------------------------ weights

    @torch.no_grad()
    def update_weights(self, version: int) -> None:
        """Collective over the world: load the Megatron model's weights into every replica as ``version``."""
        if self.released is not None:
            raise RuntimeError("HF engine: weights pushed while its memory is released (resume_memory first)")
        running = [p for p in self._running if p.thread.is_alive()]
        if running and self.pause_mode is None:
            raise RuntimeError("HF engine: weights pushed while a generation runs (without partial rollouts a push "
                               "waits for the batches in flight: finish them first)")
        for pending in running:  # parked between decoding steps while the replica changes
            pending.control.pause()
        for name, full in gather_full_params(self.model, self.groups, everywhere=True):
            for hf_name, tensor in self._name_map(name, full):
                self._loader.load(hf_name, tensor)
        self._loader.finish()
        if self.prefix_cache is not None:
            self.prefix_cache.clear()  # KV of the old weights must not serve the new ones
        self._check_replicas(version)
        self.weight_version = version
        for pending in running:
            pending.control.resume(version, recompute=self.pause_mode != "in_place")

    def fingerprint(self) -> float:
        """fp64 sum over every replica parameter (equal bytes give equal sums)."""
        return float(sum(p.detach().double().sum() for p in self.hf_model.parameters()))

    def _check_replicas(self, version: int) -> None:
        """Every rank holds the same bytes under the same version, or the push fails."""
        mine = torch.tensor([[self.fingerprint(), float(version)]], dtype=torch.float64)
        everyone = comm.all_gather_cat(mine, self.groups.world)
        differ = [r for r, theirs in enumerate(everyone) if not torch.equal(theirs, everyone[0])]
        if differ:
            raise RuntimeError(
                f"HF engine weight push to version {version}: rank {differ[0]} holds fingerprint/version "
                f"{everyone[differ[0]].tolist()}, rank 0 {everyone[0].tolist()}"
            )

    def close(self) -> None:
        """Release the replica."""
        self.hf_model = None

    # ------------------------------------------------------------------ colocated runs

    def release_memory(self) -> None:
        """Free the replica's parameters and the prefix cache's KV (nothing is copied: the
        next :meth:`resume_memory` is followed by a push of the trainer's weights)."""
        if self.released is not None:
            raise RuntimeError("HF engine: its memory is released already")
        if self.prefix_cache is not None:
            self.prefix_cache.clear()
        device = next(self.hf_model.parameters()).device
        self.released = StorageSet((p, False) for p in self.hf_model.parameters())
        self.released.offload()
        if device.type == "cuda":
            torch.cuda.empty_cache()

    def resume_memory(self, tags: Sequence[str] = ("weights", "kv_cache")) -> None:
        """Re-allocate the replica's parameters (zeroed, and stale until :meth:`update_weights`)
        when ``tags`` name ``weights``; its KV cache is allocated per generation anyway."""
        if "weights" not in tags:
            return
        if self.released is None:
            raise RuntimeError("HF engine: resume_memory without release_memory")
        self.released.restore()
        self.released = None

    # ------------------------------------------------------------------ generation

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams, *,
                 return_routed_experts: bool = True, seed: int = 0,
                 routes_from: Sequence[int] | None = None, kv: PrefixCache | None = None,
                 control: DecodeControl | None = None) -> list[RolloutSample]:
        """``RolloutEngine.generate`` for this DP rank (collective over the model-parallel group);
        ``kv``: a cache to use instead of the engine's own (prompts that extend an entry are
        served from it, every computed row's KV is kept in it: the CPU SGLang stand-in's
        pauses in place); ``control``: stops the decoding between steps (the stand-in's pauses;
        a sample it cut has ``finish_reason`` abort)."""
        mine = self._share(prompts, params, return_routed_experts=return_routed_experts, seed=seed,
                           routes_from=routes_from, kv=kv, control=control)
        return self._samples(prompts, self._gathered(mine), params.temperature)

    def _share(self, prompts: Sequence[Sequence[int]], params: SamplingParams, *, return_routed_experts: bool,
               seed: int, routes_from: Sequence[int] | None = None, kv: PrefixCache | None = None,
               control: DecodeControl | None = None) -> list[Generation]:
        """This rank's share of the prompts, generated (nothing collective)."""
        if self.released is not None:
            raise RuntimeError("HF engine: generate while its memory is released (resume_memory first)")
        check_lengths(prompts, params.max_new_tokens, self.max_length)
        starts = check_routes_from(prompts, routes_from)
        share = self._share_of(len(prompts))
        mp = self.groups.mp
        generator = torch.Generator(device=next(self.hf_model.parameters()).device)
        generator.manual_seed(seed * 1_000_003 + self.groups.dp_rank * comm.size(mp) + comm.rank(mp))
        if not len(share):
            return []
        return generate(self.hf_model, [prompts[i] for i in share], params, generator=generator,
                        return_routes=return_routed_experts, max_length=self.max_length,
                        routes_from=[starts[i] for i in share], prefix_cache=self.prefix_cache if kv is None else kv,
                        logprobs_after_temperature=self.logprobs_after_temperature, control=control)

    def _share_of(self, count: int) -> range:
        """The indices this rank of its model-parallel group generates (contiguous, balanced)."""
        mp = self.groups.mp
        per, extra = divmod(count, comm.size(mp))
        rank = comm.rank(mp)
        start = rank * per + min(rank, extra)
        return range(start, start + per + (rank < extra))

    def _gathered(self, mine: list[Generation]) -> list[Generation]:
        """Every share of the model-parallel group, in order (collective over it)."""
        if comm.size(self.groups.mp) > 1:
            return [g for part in comm.all_gather_objects(mine, self.groups.mp) for g in part]
        return mine

    def _samples(self, prompts: Sequence[Sequence[int]], generations: list[Generation],
                 temperature: float) -> list[RolloutSample]:
        out = []
        for prompt, g in zip(prompts, generations):
            versions = torch.tensor(g.versions) if g.versions is not None else None
            mixed = versions is not None and len(set(g.versions)) > 1
            out.append(RolloutSample(
                prompt_ids=list(prompt), output_ids=g.output_ids, output_logprobs=g.logprobs,
                finish_reason="abort" if g.cut else "stop" if g.stopped else "length", routed_experts=g.routes_NLK,
                weight_version=self.weight_version if versions is None else int(versions.min()),
                token_versions=versions if mixed else None, temperature=temperature, routed_gates=g.gates_NLK,
                routed_probs=g.probs_NLK, truncation_logratio=g.truncation_logratio,
            ))
        return out

    # ------------------------------------------------------------------ asynchronous rollouts

    def start_generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams, *,
                       return_routed_experts: bool = True, seed: int = 0,
                       on_samples: Callable[[dict[int, RolloutSample]], None] | None = None) -> HFPending:
        """Begin :meth:`generate` of this rank's share in a thread of its own (nothing collective
        there); :meth:`finish_generate` gathers the shares. While it runs, :meth:`update_weights`
        pauses it between decoding steps, the SGLang servers' ``/pause_generation`` here: with
        ``pause_mode`` ``in_place`` it goes on over the old KV, else (``abort``, ``retract``) its
        KV is computed again under the new weights first; each token carries the version that
        computed it. ``on_samples`` (model-parallel rank 0) gets its share's samples, by index."""
        control = DecodeControl(self.weight_version)
        pending = HFPending(list(prompts), control, params.temperature)
        first = self._share_of(len(prompts)).start

        def run() -> None:
            try:
                pending.mine = self._share(prompts, params, return_routed_experts=return_routed_experts, seed=seed,
                                           control=control)
                if on_samples is not None and comm.rank(self.groups.mp) == 0:
                    on_samples({first + j: s for j, s in enumerate(self._samples(
                        [prompts[first + j] for j in range(len(pending.mine))], pending.mine, params.temperature))})
            except BaseException as err:  # noqa: BLE001 - raised by finish_generate
                pending.error = err
            finally:
                control.finished()

        pending.thread = threading.Thread(target=run, daemon=True, name="megatron-rl-hf-rollouts")
        pending.thread.start()
        self._running.append(pending)
        return pending

    def finish_generate(self, pending: HFPending, version: int) -> list[RolloutSample]:
        """Collective over the model-parallel group: the batch :meth:`start_generate` began."""
        pending.thread.join()
        self._running = [p for p in self._running if p is not pending]
        comm.raise_first_failure(pending.error, self.groups.mp, "a background hf generation")
        return self._samples(pending.prompts, self._gathered(pending.mine), pending.temperature)
