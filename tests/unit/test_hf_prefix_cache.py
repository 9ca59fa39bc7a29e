"""The HF engine's prefix cache: a second turn served from the first turn's KV computes the
same log-probs as a full no-cache forward and returns, stitched with the first turn's, the
experts of every position of the trajectory (the acceptance "a prefix served from cache still
replays the right experts for every position").

The shipped demo checkpoint decodes a batch; each row's prompt is then extended by its
response and a few "environment" tokens, and the next turn is generated in one batch where
some rows hit the cache and one does not. Routes come back from ``routes_from`` (SGLang's
``routed_experts_start_len``): the first turn's ``[0, N1 - 1)`` and the second turn's
``[N1 - 1, N2 - 1)`` stitch into ``[N2 - 1, L, K]``, which must equal the top-K of a full
forward over the whole trajectory. A misaligned stitch (a row off by one, cached rows
missing) would show up as a length error or as wholesale route disagreement.

A decoding stopped between steps (``DecodeControl.stop``, the CPU SGLang stand-in's pauses)
keeps each live row's KV in the cache the same way, so a continuation in place starts from it.
"""

from pathlib import Path

import pytest
import torch

from megatron_rl.rollout.engine import SamplingParams
from megatron_rl.rollout.local.hf_generate import DecodeControl, generate
from megatron_rl.rollout.local.hf_prefix_cache import PrefixCache

ASSET = Path(__file__).resolve().parents[2] / "megatron_rl" / "assets" / "tiny_qwen3_moe"
ENV_TOKENS = [[198, 1, 88, 89], [198, 1, 90], [198, 1, 91, 92, 93]]


@pytest.fixture(scope="module")
def model():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(ASSET)).eval()


def _full_forward(model, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(``[N, V]`` log-softmax of the logits, ``[N - 1, L, K]`` sorted top-K routes) of one unpadded pass."""
    with torch.no_grad():
        out = model(input_ids=torch.tensor([ids]), output_router_logits=True)
    routes = torch.stack([r.float().topk(2, dim=-1).indices for r in out.router_logits], dim=1)[:-1]
    return out.logits[0].float().log_softmax(-1), routes.sort(-1).values


def test_second_turn_from_the_cache_equals_a_full_forward_and_stitches_every_position(model):
    cache = PrefixCache()
    prompts = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [20, 21, 22, 23, 24]]
    params = SamplingParams(temperature=1.0, max_new_tokens=8, stop_token_ids=(2,))
    first = generate(model, prompts, params, generator=torch.Generator().manual_seed(0), return_routes=True,
                     max_length=128, prefix_cache=cache)
    assert len(cache) == 3 and cache.hits == 0
    second_prompts = [p + g.output_ids + env for p, g, env in zip(prompts, first, ENV_TOKENS)]
    second_prompts.append([30, 31, 32, 33])  # a row with nothing cached, in the same batch
    starts = [len(p) + len(g.output_ids) - 1 for p, g in zip(prompts, first)] + [0]
    second = generate(model, second_prompts, params, generator=torch.Generator().manual_seed(1),
                      return_routes=True, max_length=128, routes_from=starts, prefix_cache=cache)
    assert cache.hits == 3
    for i, (prompt, g) in enumerate(zip(second_prompts, second)):
        ids = prompt + g.output_ids
        logp, routes = _full_forward(model, ids)
        expected = logp[len(prompt) - 1: -1].gather(-1, torch.tensor(g.output_ids)[:, None])[:, 0]
        assert (g.logprobs - expected).abs().max() <= 1e-5, i
        stitched = g.routes_NLK if i == 3 else torch.cat([first[i].routes_NLK, g.routes_NLK])
        assert stitched.shape == (len(ids) - 1, 4, 2), i
        assert torch.equal(stitched.long().sort(-1).values, routes), i


def test_cached_positions_keep_the_routes_of_the_pass_that_computed_them(model):
    """A request asking for routes of cached positions gets them from the cache, not recomputed."""
    cache = PrefixCache()
    prompt = [5, 6, 7, 8, 9]
    params = SamplingParams(temperature=0.0, max_new_tokens=4)
    first = generate(model, [prompt], params, generator=torch.Generator(), return_routes=True, max_length=128,
                     prefix_cache=cache)[0]
    (entry_ids,) = [tuple(prompt + first.output_ids[:-1])]
    marked = cache.lookup(list(entry_ids) + [1], need_routes=True)
    marked.routes_CLK = torch.full_like(marked.routes_CLK, 7)  # a stand-in for "what that pass recorded"
    cache.store(marked)
    again = generate(model, [list(entry_ids) + [1]], params, generator=torch.Generator(), return_routes=True,
                     max_length=128, routes_from=[2], prefix_cache=cache)[0]
    cached_rows = len(entry_ids) - 2
    assert again.routes_NLK.shape[0] == len(entry_ids) + 1 + len(again.output_ids) - 1 - 2
    assert bool((again.routes_NLK[:cached_rows] == 7).all())
    assert not bool((again.routes_NLK[cached_rows:] == 7).all())


def test_a_stopped_decode_ends_at_the_next_step_with_every_live_row_as_it_is_and_its_kv_kept(model):
    """A stop asked while the third forward runs (the prefill and two decode steps) ends the
    decoding right after it: every row has 3 tokens, equal to an unstopped decode's first 3
    (same generator), with their log-probs and the routes of every position it forwarded; each
    is marked cut, and its KV is kept: a continuation from the cache computes what a full
    forward computes."""
    prompts = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [20, 21, 22, 23, 24]]
    params = SamplingParams(temperature=1.0, max_new_tokens=24)  # no stop token: every row would run 24 steps
    whole = generate(model, prompts, params, generator=torch.Generator().manual_seed(0), return_routes=True,
                     max_length=128)
    control, forwards, cache = DecodeControl(None), [], PrefixCache()

    def count(*_):
        forwards.append(1)
        if len(forwards) == 3:
            control.stop()

    handle = model.register_forward_hook(count)
    try:
        cut = generate(model, prompts, params, generator=torch.Generator().manual_seed(0), return_routes=True,
                       max_length=128, prefix_cache=cache, control=control)
    finally:
        handle.remove()
    assert len(forwards) == 3 and len(cache) == 3
    for prompt, w, c in zip(prompts, whole, cut):
        assert c.cut and not w.cut and not c.stopped and c.versions is None
        assert c.output_ids == w.output_ids[:3] and torch.equal(c.logprobs, w.logprobs[:3])
        assert torch.equal(c.routes_NLK, w.routes_NLK[:len(prompt) + 2])
    again = [p + c.output_ids for p, c in zip(prompts, cut)]
    more = generate(model, again, SamplingParams(temperature=1.0, max_new_tokens=1),
                    generator=torch.Generator().manual_seed(1), return_routes=False, max_length=128,
                    prefix_cache=cache)
    assert cache.hits == 3
    for ids, g in zip(again, more):
        logp, _ = _full_forward(model, ids + g.output_ids)
        assert abs(float(g.logprobs[0] - logp[len(ids) - 1, g.output_ids[0]])) <= 1e-5


def test_routes_from_outside_the_prompt_names_the_sample(model):
    with pytest.raises(ValueError, match=r"^sample 1: routes_from 3 is outside \[0, 2\]"):
        generate(model, [[5, 6, 7], [8, 9]], SamplingParams(max_new_tokens=2), generator=torch.Generator(),
                 return_routes=True, max_length=128, routes_from=[0, 3])


def test_logprobs_are_of_the_untruncated_t_scaled_distribution_with_gates_and_truncation(model):
    """What the hf engine (and the stand-in over it) reports at T = 0.7, top-p 0.9, as SGLang does
    by default: ``log_softmax(logits / T)`` over the whole vocabulary; the truncation log-ratio
    ``-log(mass top-p kept)``; per position the router's gate weights and softmax probabilities
    of its top-K. ``logprobs_after_temperature=False`` reports ``log_softmax(logits)``."""
    prompts = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14]]
    params = SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=6)
    got = generate(model, prompts, params, generator=torch.Generator().manual_seed(3), return_routes=True,
                   max_length=128)
    raw = generate(model, prompts, params, generator=torch.Generator().manual_seed(3), return_routes=False,
                   max_length=128, logprobs_after_temperature=False)
    for prompt, g, r in zip(prompts, got, raw):
        ids = prompt + g.output_ids
        assert r.output_ids == g.output_ids
        with torch.no_grad():
            out = model(input_ids=torch.tensor([ids]), output_router_logits=True)
        logits = out.logits[0, len(prompt) - 1: -1].float()
        targets = torch.tensor(g.output_ids)[:, None]
        scaled = (logits / 0.7).log_softmax(-1)
        assert (g.logprobs - scaled.gather(-1, targets)[:, 0]).abs().max() <= 1e-5
        assert (r.logprobs - logits.log_softmax(-1).gather(-1, targets)[:, 0]).abs().max() <= 1e-5
        # Mass top-p keeps: the most likely tokens while the mass before each is below 0.9.
        sorted_p = scaled.exp().sort(-1, descending=True).values
        kept = (sorted_p * ((sorted_p.cumsum(-1) - sorted_p) < 0.9)).sum(-1)
        assert (g.truncation_logratio + kept.log()).abs().max() <= 1e-5 and float(g.truncation_logratio.max()) > 0
        assert r.truncation_logratio is not None and g.routes_NLK.shape == g.gates_NLK.shape == g.probs_NLK.shape
        probs_NLE = torch.stack([x.float().softmax(-1) for x in out.router_logits], dim=1)[:-1]
        top = probs_NLE.gather(-1, g.routes_NLK.long())
        assert (g.probs_NLK - top).abs().max() <= 1e-5
        assert (g.gates_NLK - top / top.sum(-1, keepdim=True)).abs().max() <= 1e-5  # Qwen3 norm_topk_prob
