"""Batched KV-cached generation with a transformers MoE causal LM, on one process.

Shape legend: B rows still decoding, P longest prompt, V vocabulary, L MoE layers,
K top-K, N prompt+response tokens of a sample.

One prefill forward over the left-padded prompts fills the KV cache; then each step
samples one token per row from the last position's logits with
:func:`~megatron_rl.rollout.sampling.sample_next_tokens` (the math every engine shares)
and forwards only those B new tokens. A row that produced a stop token, or its last
token, leaves the batch: its cache rows are dropped, so finished samples cost nothing.

Log-probs are of the distribution the token was drawn from, as SGLang reports them by
default and as the trainer scores them (``compute_logprobs`` at the sample's temperature):
``log_softmax(logits / T)`` of the model's fp32 logits at the sampled token, over the whole
vocabulary (top-k / top-p are not renormalized in; ``truncation_logratio`` says by how much
that differs per token); ``logprobs_after_temperature=False`` reports ``log_softmax(logits)``
(the T = 1 objective). Routes are the top-K experts
each MoE router chose for each forwarded position (by descending router probability,
transformers' ``torch.topk`` order), read from the router modules' outputs with forward
hooks keyed by layer number: the experts the block actually computed with, with the gate
weight each got (the router's top-K weights, normalized as the block uses them) and its
router probability (softmax over all E of the router logits). In SGLang's
layout a sample of N tokens has ``[N - 1, L, K]`` routes: the last token is never
forwarded. Inside decoding the three travel together as one fp32 ``[..., L, K, 3]`` tensor
(id, gate, probability; ids are exact in fp32), which is also what the prefix cache keeps.

Multi-turn: ``routes_from`` returns routes from a position on (SGLang's
``routed_experts_start_len``), and with a ``prefix_cache`` a prompt that extends a finished
response is served from that response's KV, so only the new positions are computed
(``hf_prefix_cache``).

Pauses (the hf engine's asynchronous rollouts, :class:`DecodeControl`): between a sampled
token and the next forward the decoding thread can park while the weights change; it then
goes on, each token tagged with the version of the pass that computed its logits. With
``recompute`` (SGLang's ``retract``) every live row's KV is computed again under the new
weights (the prompt and the tokens so far); otherwise (``in_place``) the old KV stays. Routes
of positions forwarded before the pause keep the pass that computed them. Or it can be
stopped there (the CPU SGLang stand-in's pauses, which SGLang's scheduler applies at its next
decode step): every live row is returned with the tokens it has (``Generation.cut``), its KV
kept in the prefix cache for a continuation in place.

Does not own the model or its weights (``hf_model``), data-parallel splitting or
versions (``hf_engine``).
"""

from __future__ import annotations

import re
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch

from megatron_rl.rollout.engine import SamplingParams, check_routes_from
from megatron_rl.rollout.local.hf_prefix_cache import (
    CachedPrefix,
    PrefixCache,
    batch_cache,
    take_rows,
)
from megatron_rl.rollout.sampling import (
    kept_log_mass,
    sample_next_tokens,
    sampled_logprobs,
)
from moe_routing.types import compact_id_dtype

_ROUTER_NAME = re.compile(r"(?:^|\.)layers\.(\d+)\.mlp\.(?:gate|router)$")


@dataclass
class Generation:
    """One prompt's response."""

    output_ids: list[int]
    """Generated ids (the stop token included when one was produced)."""
    logprobs: torch.Tensor
    """``[len(output_ids)]`` fp32 log-probs of those ids (full vocabulary, at T unless raw)."""
    stopped: bool
    """Ended on a stop token (else on ``max_new_tokens``)."""
    routes_NLK: torch.Tensor | None
    """``[N - 1, L, K]`` experts of every forwarded position (compact integer dtype), when asked."""
    gates_NLK: torch.Tensor | None = None
    """``[N - 1, L, K]`` fp32 gate weights of those experts, when routes are asked."""
    probs_NLK: torch.Tensor | None = None
    """``[N - 1, L, K]`` fp32 router probabilities of those experts, when routes are asked."""
    truncation_logratio: torch.Tensor | None = None
    """``[len(output_ids)]`` fp32 ``-log(mass kept)`` by top-k / top-p at each token (None: no truncation)."""
    versions: list[int] | None = None
    """The weights version that computed each token's logits (with a :class:`DecodeControl`)."""
    cut: bool = False
    """Decoding was stopped before the response ended (:meth:`DecodeControl.stop`)."""


class DecodeControl:
    """Pauses a decoding thread between steps while the weights change (see the module docstring).

    Args:
        version: the version of the weights the model holds when decoding starts (None: tokens
            are not tagged; a control that only stops).
    """

    def __init__(self, version: int | None) -> None:
        self.version = version
        self.recompute = False
        self._pause, self._parked, self._resumed, self._done, self._stop = (threading.Event() for _ in range(5))

    def pause(self) -> None:
        """Ask the decoding thread to park at its next step; returns once it has (or has finished)."""
        self._resumed.clear()
        self._pause.set()
        while not (self._parked.wait(0.01) or self._done.is_set()):
            pass

    def resume(self, version: int, recompute: bool) -> None:
        """Go on under the weights of ``version``; ``recompute``: the KV again under them first."""
        self.version, self.recompute = version, recompute
        self._pause.clear()
        self._parked.clear()
        self._resumed.set()

    def stop(self) -> None:
        """Ask the decoding thread to end at its next step, every live row as it is (returns at once)."""
        self._stop.set()

    @property
    def stopping(self) -> bool:
        """:meth:`stop` was asked."""
        return self._stop.is_set()

    def finished(self) -> None:
        """The decoding ended (a pause asked later returns at once)."""
        self._done.set()

    def at_step(self) -> bool:
        """Called by the decoding thread between steps: parks while paused; True when the KV must
        be computed again (the weights changed and ``recompute``)."""
        if not self._pause.is_set():
            return False
        self._parked.set()
        self._resumed.wait()
        return self.recompute


def moe_routers(hf_model: torch.nn.Module) -> dict[int, torch.nn.Module]:
    """The router module of every MoE layer, keyed by 0-based layer number."""
    routers = {}
    for name, module in hf_model.named_modules():
        match = _ROUTER_NAME.search(name)
        if match is not None and type(module).__name__.endswith("TopKRouter"):
            routers[int(match[1])] = module
    return dict(sorted(routers.items()))


def _route_triples(out: tuple) -> torch.Tensor:
    """``[rows * positions, K, 3]`` fp32 (id, gate, router probability) from a transformers
    ``TopKRouter``'s output ``(router_logits, top-K weights, top-K indices)``."""
    logits_NE, gates_NK, ids_NK = out
    probs_NK = logits_NE.float().softmax(dim=-1).gather(1, ids_NK)
    return torch.stack([ids_NK.float(), gates_NK.float(), probs_NK], dim=-1)


@contextmanager
def _capture_routes(hf_model: torch.nn.Module, enabled: bool) -> Iterator[dict[int, list[torch.Tensor]]]:
    """Per layer, each forward's ``[rows * positions, K, 3]`` route triples, in call order."""
    captured: dict[int, list[torch.Tensor]] = {}
    handles = []
    if enabled:
        mine = threading.get_ident()  # another thread may decode with the same model (asynchronous rollouts)
        for layer, router in moe_routers(hf_model).items():
            calls = captured.setdefault(layer, [])
            # transformers' TopKRouter returns (router_logits, top-K weights, top-K indices).
            handles.append(router.register_forward_hook(
                lambda _m, _i, out, calls=calls: calls.append(_route_triples(out)) if threading.get_ident() == mine
                else None))
        if not handles:
            raise ValueError(f"{type(hf_model).__name__}: no MoE router (model.layers.N.mlp.gate or .router) to read "
                             "routes from")
    try:
        yield captured
    finally:
        for handle in handles:
            handle.remove()


def _pop_step_routes(captured: dict[int, list[torch.Tensor]], rows: int, positions: int) -> torch.Tensor | None:
    """The last forward's route triples as ``[rows, positions, L, K, 3]`` (and forget them)."""
    if not captured:
        return None
    per_layer = [captured[layer].pop().view(rows, positions, -1, 3) for layer in sorted(captured)]
    return torch.stack(per_layer, dim=2)


def check_lengths(prompts: Sequence[Sequence[int]], max_new_tokens: int, max_length: int) -> None:
    """Every prompt has a token and fits with ``max_new_tokens`` (error names the sample)."""
    for i, prompt in enumerate(prompts):
        if len(prompt) == 0:
            raise ValueError(f"sample {i}: empty prompt")
        if len(prompt) + max_new_tokens > max_length:
            raise ValueError(
                f"sample {i}: prompt of {len(prompt)} tokens + max_new_tokens {max_new_tokens} = "
                f"{len(prompt) + max_new_tokens} exceeds the model's maximum sequence length {max_length} "
                "(rollout.max_new_tokens or model.max_position_embeddings)"
            )


@torch.no_grad()
def generate(
    hf_model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams,
    *,
    generator: torch.Generator,
    return_routes: bool,
    max_length: int,
    pad_id: int = 0,
    routes_from: Sequence[int] | None = None,
    prefix_cache: PrefixCache | None = None,
    logprobs_after_temperature: bool = True,
    control: DecodeControl | None = None,
) -> list[Generation]:
    """One response per prompt, decoded together with a KV cache.

    Args:
        hf_model: a transformers MoE causal LM (eval mode).
        prompts: token ids of each prompt.
        params: sampling parameters (``max_new_tokens >= 1``).
        generator: draws the samples (same generator state and logits: same tokens).
        return_routes: also collect SGLang-layout routes per sample.
        max_length: the model's longest sequence; longer requests fail naming the sample.
        pad_id: id written in left-padding positions (masked out of attention).
        routes_from: per prompt, the first position whose routes are returned (default 0).
        prefix_cache: serve prompts that extend a finished response from its KV, and keep
            every finished response's KV in it (``hf_prefix_cache``).
        logprobs_after_temperature: report ``log_softmax(logits / T)``, the sampled
            distribution (SGLang's default); False: ``log_softmax(logits)``
            (:func:`~megatron_rl.rollout.sampling.sampled_logprobs`).
        control: pauses between steps while the weights change, and tags each token with the
            version that computed it (:class:`DecodeControl`).

    Length: one decoding loop, read top to bottom (prefill, then per step: sample, retire rows,
    pause, forward the new tokens).
    """
    if params.max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {params.max_new_tokens}")
    check_lengths(prompts, params.max_new_tokens, max_length)
    starts = check_routes_from(prompts, routes_from)
    device = next(hf_model.parameters()).device
    cached = [None if prefix_cache is None else prefix_cache.lookup(p, return_routes) for p in prompts]
    cache, input_BS, mask_BP, positions_BS, suffixes = _prefill_inputs(hf_model, prompts, cached, pad_id)
    B, S = input_BS.shape
    stops = set(params.stop_token_ids)
    responses = _Responses(B)
    with _capture_routes(hf_model, return_routes) as captured:
        out = hf_model(input_ids=input_BS, attention_mask=mask_BP, position_ids=positions_BS, cache=cache,
                       use_cache=True, logits_to_keep=1)
        step_routes = _pop_step_routes(captured, B, S)
        if step_routes is not None:
            for i, entry in enumerate(cached):
                if entry is not None:
                    responses.routes[i].append(entry.routes_CLK)
                responses.routes[i].append(step_routes[i, S - len(suffixes[i]):])
        rows = torch.arange(B, device=device)  # sample index of each batch row
        next_pos_B = torch.tensor([len(p) for p in prompts], device=device)
        out_version = None if control is None else control.version  # the weights that computed `out`
        for step in range(params.max_new_tokens):
            tokens_B, values_B2 = _sample_step(out.logits[:, -1].float(), params, generator, logprobs_after_temperature)
            keep = responses.append(rows.tolist(), tokens_B, values_B2, stops, step + 1 == params.max_new_tokens,
                                    out_version)
            if prefix_cache is not None:
                _keep_finished(prefix_cache, cache, rows, keep, mask_BP, prompts, responses)
            if not keep:
                break
            if len(keep) < len(rows):
                index = torch.tensor(keep, device=device)
                select_rows(cache, index)
                rows, tokens_B, mask_BP = rows[index], tokens_B[index], mask_BP[index]
                next_pos_B = next_pos_B[index]
            if control is not None and control.stopping:  # the live rows' KV kept for a continuation in place
                if prefix_cache is not None:
                    _keep_finished(prefix_cache, cache, rows, [], mask_BP, prompts, responses)
                responses.cut(rows.tolist())
                break
            if control is not None and control.at_step():
                # The weights changed: every live row's KV again, its last token forwarded with it.
                out_version = control.version
                live = [list(prompts[i]) + responses.output_ids[i] for i in rows.tolist()]
                cache, input_BS, mask_BP, positions_BS, _ = _prefill_inputs(hf_model, live, [None] * len(live), pad_id)
                out = hf_model(input_ids=input_BS, attention_mask=mask_BP, position_ids=positions_BS, cache=cache,
                               use_cache=True, logits_to_keep=1)
                next_pos_B = torch.tensor([len(seq) for seq in live], device=device)
                step_routes = _pop_step_routes(captured, len(rows), input_BS.shape[1])
                if step_routes is not None:  # only the new position's: the others keep their first pass's
                    for r, i in enumerate(rows.tolist()):
                        responses.routes[i].append(step_routes[r, -1:])
                continue
            out_version = None if control is None else control.version
            mask_BP = torch.cat([mask_BP, mask_BP.new_ones(len(rows), 1)], dim=1)
            out = hf_model(input_ids=tokens_B[:, None], attention_mask=mask_BP, position_ids=next_pos_B[:, None],
                           cache=cache, use_cache=True)
            next_pos_B = next_pos_B + 1
            step_routes = _pop_step_routes(captured, len(rows), 1)
            if step_routes is not None:
                for r, i in enumerate(rows.tolist()):
                    responses.routes[i].append(step_routes[r])
    if control is not None:
        control.finished()
    truncated = params.temperature > 0 and (params.top_p < 1 or params.top_k > 0)
    return responses.generations(compact_id_dtype(_num_experts(hf_model.config)), with_routes=return_routes,
                                 routes_from=starts, truncated=truncated)


def _sample_step(logits_BV: torch.Tensor, params: SamplingParams, generator: torch.Generator,
                 after_temperature: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(tokens_B, values_B2)``: the drawn tokens, and per row their log-prob (at T unless
    raw) and the truncation log-ratio ``-log(mass kept)`` by top-k / top-p."""
    tokens_B = sample_next_tokens(logits_BV, temperature=params.temperature, top_p=params.top_p,
                                  top_k=params.top_k, generator=generator)
    token_lp_B = sampled_logprobs(logits_BV, tokens_B, temperature=params.temperature,
                                  after_temperature=after_temperature)
    kept_B = kept_log_mass(logits_BV, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k)
    return tokens_B, torch.stack([token_lp_B, -kept_B], dim=1)


def select_rows(cache, index: torch.Tensor) -> None:
    """Keep the cache rows ``index`` of every layer.

    transformers 5.24's linear-attention cache layers (Gated DeltaNet: a convolution window and
    a recurrent state per row, ``cache_utils.LinearAttentionCacheLayerMixin``) have no ``batch_select_indices``:
    their states are selected here.
    """
    for layer in cache.layers:
        if hasattr(layer, "batch_select_indices"):
            layer.batch_select_indices(index)
            continue
        for states in (layer.conv_states, layer.recurrent_states):
            for i, state in states.items():
                if state is not None:
                    states[i] = state[index]


def _prefill_inputs(hf_model: torch.nn.Module, prompts: Sequence[Sequence[int]],
                    cached: list[CachedPrefix | None], pad_id: int) -> tuple:
    """``(cache, input_BS, mask_BP, positions_BS, suffixes)`` of the prefill: each prompt's
    positions not served from ``cached``, left-padded, after the cached ones (``batch_cache``);
    with nothing cached, exactly the left-padded prompts over an empty cache."""
    from transformers import DynamicCache

    device = next(hf_model.parameters()).device
    done_B = [0 if c is None else len(c.ids) for c in cached]  # positions served from the cache
    suffixes = [list(p)[n:] for p, n in zip(prompts, done_B)]
    input_BS, mask_BP, positions_BS = _left_padded(suffixes, torch.tensor([len(s) for s in suffixes], device=device),
                                                   pad_id)
    positions_BS = positions_BS + torch.tensor(done_B, device=device)[:, None] * mask_BP
    cache = DynamicCache(config=hf_model.config)
    if any(done_B):
        _, mask_BC = batch_cache(cache, cached, next(hf_model.parameters()).dtype, device)
        mask_BP = torch.cat([mask_BC, mask_BP], dim=1)
    return cache, input_BS, mask_BP, positions_BS, suffixes


def _keep_finished(prefix_cache: PrefixCache, cache, rows: torch.Tensor, keep: list[int], mask_BP: torch.Tensor,
                   prompts: Sequence[Sequence[int]], responses: _Responses) -> None:
    """Store the KV (and routes) of the rows that just finished, for a continuation of their sample."""
    kept = set(keep)
    finished = [r for r in range(len(rows)) if r not in kept]
    for r, (keys, values) in zip(finished, take_rows(cache, finished, mask_BP)):
        i = int(rows[r])
        ids = (*prompts[i], *responses.output_ids[i][:-1])
        if keys[0].shape[1] != len(ids):
            raise RuntimeError(f"prefix cache: sample {i} holds {keys[0].shape[1]} cached positions for {len(ids)} ids")
        routes = torch.cat(responses.routes[i]) if responses.routes[i] else None
        prefix_cache.store(CachedPrefix(ids, keys, values, routes))


def _left_padded(
    prompts: Sequence[Sequence[int]], lengths_B: torch.Tensor, pad_id: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``[B, P]`` ids, attention mask and positions of the prompts, padded on the left."""
    device = lengths_B.device
    B, P = len(prompts), int(lengths_B.max())
    input_BP = torch.full((B, P), pad_id, dtype=torch.long, device=device)
    for i, prompt in enumerate(prompts):
        input_BP[i, P - len(prompt):] = torch.tensor(list(prompt), dtype=torch.long)
    mask_BP = (torch.arange(P, device=device) >= (P - lengths_B)[:, None]).long()
    # Left padding: positions count real tokens only, so RoPE sees what an unpadded pass sees.
    positions_BP = (mask_BP.cumsum(-1) - 1).clamp(min=0)
    return input_BP, mask_BP, positions_BP


class _Responses:
    """What each sample has generated so far (indexed by sample, not by batch row)."""

    def __init__(self, num_samples: int) -> None:
        self.output_ids: list[list[int]] = [[] for _ in range(num_samples)]
        self.logprobs: list[list[torch.Tensor]] = [[] for _ in range(num_samples)]
        self.routes: list[list[torch.Tensor]] = [[] for _ in range(num_samples)]
        self.versions: list[list[int]] = [[] for _ in range(num_samples)]
        self.stopped = [False] * num_samples
        self.cut_rows: set[int] = set()

    def append(self, samples: list[int], tokens_B: torch.Tensor, token_lp_B2: torch.Tensor,
               stops: set[int], last_step: bool, version: int | None = None) -> list[int]:
        """Adds each row's token (computed by weights ``version``; its log-prob and truncation
        log-ratio, ``[B, 2]``) to its sample; returns the rows that go on decoding."""
        keep = []
        for r, (i, token) in enumerate(zip(samples, tokens_B.tolist())):
            self.output_ids[i].append(token)
            self.logprobs[i].append(token_lp_B2[r])
            self.versions[i].append(version)
            self.stopped[i] = token in stops
            if not self.stopped[i] and not last_step:
                keep.append(r)
        return keep

    def cut(self, samples: list[int]) -> None:
        """These samples were stopped before their response ended."""
        self.cut_rows.update(samples)

    def generations(self, id_dtype: torch.dtype, *, with_routes: bool, routes_from: list[int],
                    truncated: bool) -> list[Generation]:
        """One :class:`Generation` per sample; routes (when collected) from ``routes_from`` on, as
        ``id_dtype`` ids, gates and probabilities; the truncation log-ratios when top-k / top-p cut."""
        out = []
        for i, (ids, values, routes, stopped, start, versions) in enumerate(zip(
                self.output_ids, self.logprobs, self.routes, self.stopped, routes_from, self.versions)):
            values_O2 = torch.stack(values).float().cpu()
            triples = torch.cat(routes)[start:].cpu() if with_routes else None
            out.append(Generation(
                output_ids=ids, logprobs=values_O2[:, 0].contiguous(), stopped=stopped,
                routes_NLK=None if triples is None else triples[..., 0].to(id_dtype),
                gates_NLK=None if triples is None else triples[..., 1].contiguous(),
                probs_NLK=None if triples is None else triples[..., 2].contiguous(),
                truncation_logratio=values_O2[:, 1].contiguous() if truncated else None,
                versions=None if None in versions else versions, cut=i in self.cut_rows,
            ))
        return out


def _num_experts(config) -> int:
    """E from a transformers MoE config (Qwen3-MoE: num_experts; Mixtral: num_local_experts)."""
    for key in ("num_experts", "num_local_experts"):
        value = getattr(config, key, None)
        if value:
            return int(value)
    raise ValueError(f"{type(config).__name__}: no expert count (num_experts / num_local_experts)")
