"""vocab_parallel_logprobs_entropy on one process (no group) against a plain reference.

The reference is torch.log_softmax over the whole vocabulary in float64, the target's
entry gathered, and the entropy -sum p log p; its gradients come from autograd.
"""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from megatron_rl.parallel.vocab_parallel import (
    VocabParallelLogProbMath,
    vocab_parallel_logprobs_entropy,
)


def reference(logits_TV, targets_T):
    """Plain full-vocabulary log-prob of the target and entropy, in float64."""
    logp_TV = torch.log_softmax(logits_TV.double(), dim=-1)
    logprobs_T = logp_TV.gather(1, targets_T[:, None].long()).squeeze(1)
    entropy_T = -(logp_TV.exp() * logp_TV).sum(dim=-1)
    return logprobs_T, entropy_T


def make_problem(num_tokens=29, vocab=53, scale=3.0, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    logits_TV = (torch.randn(num_tokens, vocab, generator=gen, dtype=torch.float64) * scale).to(
        dtype
    )
    targets_T = torch.randint(0, vocab, (num_tokens,), generator=gen)
    weights_T = torch.randn(num_tokens, generator=gen, dtype=torch.float64)
    return logits_TV, targets_T, weights_T


def reference_grad(logits_TV, targets_T, lp_weights_T, entropy_weights_T=None):
    """Autograd gradient of sum(w * logprobs) (+ sum(u * entropy)) w.r.t. the logits."""
    logits = logits_TV.detach().double().requires_grad_(True)
    logprobs_T, entropy_T = reference(logits, targets_T)
    loss = (lp_weights_T * logprobs_T).sum()
    if entropy_weights_T is not None:
        loss = loss + (entropy_weights_T * entropy_T).sum()
    loss.backward()
    return logits.grad


def library_grad(logits_TV, targets_T, lp_weights_T, entropy_weights_T=None, **kwargs):
    logits = logits_TV.detach().clone().requires_grad_(True)
    logprobs_T, entropy_T = vocab_parallel_logprobs_entropy(
        logits, targets_T, entropy_requires_grad=entropy_weights_T is not None, **kwargs
    )
    loss = (lp_weights_T * logprobs_T.double()).sum()
    if entropy_weights_T is not None:
        loss = loss + (entropy_weights_T * entropy_T.double()).sum()
    loss.backward()
    return logits.grad


@pytest.mark.parametrize(
    "dtype, tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)], ids=["fp64", "fp32"]
)
def test_forward_matches_full_log_softmax(dtype, tol):
    logits_TV, targets_T, _ = make_problem(dtype=dtype)
    logprobs_T, entropy_T = vocab_parallel_logprobs_entropy(logits_TV, targets_T, chunk_tokens=8)
    ref_logprobs_T, ref_entropy_T = reference(logits_TV, targets_T)
    assert logprobs_T.dtype == entropy_T.dtype == dtype
    assert (logprobs_T.double() - ref_logprobs_T).abs().max() <= tol
    assert (entropy_T.double() - ref_entropy_T).abs().max() <= tol
    assert ref_entropy_T.std() > 0.1, "degenerate problem"


def test_logprob_gradient_matches_full_vocabulary_gradient():
    logits_TV, targets_T, weights_T = make_problem()
    grad = library_grad(logits_TV, targets_T, weights_T, chunk_tokens=8)
    expected = reference_grad(logits_TV, targets_T, weights_T)
    assert grad.dtype == torch.float64
    assert (grad - expected).abs().max() <= 1e-6
    assert expected.abs().max() > 0.1


def test_entropy_gradient_matches_when_requested():
    logits_TV, targets_T, weights_T = make_problem()
    entropy_weights_T = torch.linspace(-1.0, 2.0, logits_TV.shape[0], dtype=torch.float64)
    grad = library_grad(logits_TV, targets_T, weights_T, entropy_weights_T, chunk_tokens=8)
    expected = reference_grad(logits_TV, targets_T, weights_T, entropy_weights_T)
    assert (grad - expected).abs().max() <= 1e-6
    # The entropy term is really in there: dropping it changes the gradient.
    assert (expected - reference_grad(logits_TV, targets_T, weights_T)).abs().max() > 1e-2


def test_entropy_alone_has_a_gradient():
    logits_TV, targets_T, _ = make_problem()
    zeros_T = torch.zeros(logits_TV.shape[0], dtype=torch.float64)
    entropy_weights_T = torch.ones_like(zeros_T)
    logits = logits_TV.clone().requires_grad_(True)
    _, entropy_T = vocab_parallel_logprobs_entropy(
        logits, targets_T, chunk_tokens=5, entropy_requires_grad=True
    )
    entropy_T.sum().backward()
    expected = reference_grad(logits_TV, targets_T, zeros_T, entropy_weights_T)
    assert (logits.grad - expected).abs().max() <= 1e-6


def test_entropy_has_no_grad_path_unless_requested():
    logits_TV, targets_T, weights_T = make_problem()
    logits = logits_TV.clone().requires_grad_(True)
    logprobs_T, entropy_T = vocab_parallel_logprobs_entropy(logits, targets_T)
    assert logprobs_T.requires_grad
    assert not entropy_T.requires_grad and entropy_T.grad_fn is None
    # Adding the (detached) entropy to the loss leaves the gradient that of the log-probs.
    ((weights_T * logprobs_T).sum() + entropy_T.sum()).backward()
    assert (logits.grad - reference_grad(logits_TV, targets_T, weights_T)).abs().max() <= 1e-6


def test_compute_entropy_false_returns_none():
    logits_TV, targets_T, _ = make_problem()
    logprobs_T, entropy_T = vocab_parallel_logprobs_entropy(
        logits_TV, targets_T, compute_entropy=False
    )
    assert entropy_T is None
    assert (logprobs_T - reference(logits_TV, targets_T)[0]).abs().max() <= 1e-12


@pytest.mark.parametrize("entropy_grad", [False, True], ids=["logprob", "logprob+entropy"])
def test_gradcheck_tiny_double(entropy_grad):
    logits_TV, targets_T, _ = make_problem(num_tokens=5, vocab=7)
    logits_TV.requires_grad_(True)

    def fn(logits):
        logprobs_T, entropy_T = vocab_parallel_logprobs_entropy(
            logits, targets_T, chunk_tokens=2, entropy_requires_grad=entropy_grad
        )
        return (logprobs_T, entropy_T) if entropy_grad else logprobs_T

    assert torch.autograd.gradcheck(fn, (logits_TV,), eps=1e-6, atol=1e-8)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_low_precision_input_gives_fp32_outputs_and_grad_in_input_dtype(dtype):
    logits_TV, targets_T, weights_T = make_problem(dtype=dtype)
    entropy_weights_T = torch.full_like(weights_T, 0.5)
    logits = logits_TV.clone().requires_grad_(True)
    logprobs_T, entropy_T = vocab_parallel_logprobs_entropy(
        logits, targets_T, chunk_tokens=6, entropy_requires_grad=True
    )
    assert logprobs_T.dtype == entropy_T.dtype == torch.float32
    # The math runs in fp32 on the exact low-precision values, so it matches the reference
    # on those values as tightly as fp32 input does.
    ref_logprobs_T, ref_entropy_T = reference(logits_TV, targets_T)
    assert (logprobs_T.double() - ref_logprobs_T).abs().max() <= 1e-5
    assert (entropy_T.double() - ref_entropy_T).abs().max() <= 1e-5
    ((weights_T * logprobs_T).sum() + (entropy_weights_T * entropy_T).sum()).backward()
    assert logits.grad.dtype == dtype
    expected = reference_grad(logits_TV, targets_T, weights_T, entropy_weights_T)
    # Only the final cast to the input dtype rounds: within half a unit in the last place
    # (relative eps / 2; below the smallest normal number the spacing is fixed).
    info = torch.finfo(dtype)
    bound = info.eps / 2 * (expected.abs() * 1.001 + info.smallest_normal)
    assert ((logits.grad.double() - expected).abs() <= bound).all()


def test_chunk_size_does_not_change_results():
    logits_TV, targets_T, weights_T = make_problem(num_tokens=23)
    entropy_weights_T = torch.linspace(0.5, 1.5, 23, dtype=torch.float64)
    results = {}
    for chunk in (1, 2, 5, 7, 22, 23, 24, 1000):
        logits = logits_TV.clone().requires_grad_(True)
        logprobs_T, entropy_T = vocab_parallel_logprobs_entropy(
            logits, targets_T, chunk_tokens=chunk, entropy_requires_grad=True
        )
        ((weights_T * logprobs_T).sum() + (entropy_weights_T * entropy_T).sum()).backward()
        results[chunk] = (logprobs_T.detach(), entropy_T.detach(), logits.grad)
    # Equal up to summation order only: torch may split a one-row reduction across threads.
    for chunk, outputs in results.items():
        for name, got, want in zip(("logprobs", "entropy", "grad"), outputs, results[1000]):
            assert (got - want).abs().max() <= 1e-12, (chunk, name)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
def test_extreme_logits_stay_finite_and_exact(dtype):
    gen = torch.Generator().manual_seed(3)
    logits_TV = ((torch.rand(16, 40, generator=gen, dtype=torch.float64) * 2 - 1) * 1e4).to(dtype)
    targets_T = torch.randint(0, 40, (16,), generator=gen)
    targets_T[0] = int(logits_TV[0].argmax())  # the one token whose log-prob is ~0
    logits = logits_TV.clone().requires_grad_(True)
    logprobs_T, entropy_T = vocab_parallel_logprobs_entropy(
        logits, targets_T, chunk_tokens=3, entropy_requires_grad=True
    )
    (logprobs_T.sum() + entropy_T.sum()).backward()
    for tensor in (logprobs_T, entropy_T, logits.grad):
        assert torch.isfinite(tensor).all()
    ref_logprobs_T, ref_entropy_T = reference(logits_TV, targets_T)
    # Log-probs reach -2e4, where an fp32 ulp is ~2e-3: compare relative to the magnitude.
    rtol = 1e-12 if dtype == torch.float64 else 1e-6
    assert ((logprobs_T.double() - ref_logprobs_T).abs() <= rtol * (1 + ref_logprobs_T.abs())).all()
    assert (entropy_T.double() - ref_entropy_T).abs().max() <= 1e-5
    ones_T = torch.ones(16, dtype=torch.float64)
    expected = reference_grad(logits_TV, targets_T, ones_T, ones_T)
    assert (logits.grad.double() - expected).abs().max() <= 1e-6


def test_logits_at_minus_infinity_are_zero_probability_not_nan():
    """Padded or masked vocabulary entries at -inf must not turn anything into nan."""
    logits_TV, targets_T, weights_T = make_problem()
    targets_T = targets_T.clamp(max=49)
    padded_TV = torch.cat([logits_TV[:, :50], torch.full((29, 3), float("-inf"))], dim=1)
    logits = padded_TV.clone().requires_grad_(True)
    logprobs_T, entropy_T = vocab_parallel_logprobs_entropy(
        logits, targets_T, chunk_tokens=4, entropy_requires_grad=True
    )
    ((weights_T * logprobs_T).sum() + entropy_T.sum()).backward()
    ref_logprobs_T, ref_entropy_T = reference(logits_TV[:, :50], targets_T)
    assert (logprobs_T - ref_logprobs_T).abs().max() <= 1e-12
    assert (entropy_T - ref_entropy_T).abs().max() <= 1e-12
    ones_T = torch.ones(29, dtype=torch.float64)
    expected = reference_grad(logits_TV[:, :50], targets_T, weights_T, ones_T)
    assert (logits.grad[:, :50] - expected).abs().max() <= 1e-6
    assert torch.equal(logits.grad[:, 50:], torch.zeros(29, 3, dtype=torch.float64))


def test_non_contiguous_logits_view():
    """A column slice of a wider tensor (a shard view) works, and its gradient flows back."""
    logits_TV, targets_T, weights_T = make_problem()
    wide = torch.cat([logits_TV, torch.zeros(29, 4, dtype=torch.float64)], dim=1)
    wide.requires_grad_(True)
    view_TV = wide[:, :53]
    assert not view_TV.is_contiguous()
    logprobs_T, _ = vocab_parallel_logprobs_entropy(view_TV, targets_T, chunk_tokens=6)
    (weights_T * logprobs_T).sum().backward()
    expected = reference_grad(logits_TV, targets_T, weights_T)
    assert (wide.grad[:, :53] - expected).abs().max() <= 1e-6
    assert torch.equal(wide.grad[:, 53:], torch.zeros(29, 4, dtype=torch.float64))


def test_integer_targets_of_any_width_are_accepted():
    logits_TV, targets_T, _ = make_problem()
    as_int64, _ = vocab_parallel_logprobs_entropy(logits_TV, targets_T)
    as_int32, _ = vocab_parallel_logprobs_entropy(logits_TV, targets_T.int())
    assert torch.equal(as_int64, as_int32)


def test_empty_token_axis():
    logprobs_T, entropy_T = vocab_parallel_logprobs_entropy(
        torch.zeros(0, 11), torch.zeros(0, dtype=torch.long)
    )
    assert logprobs_T.shape == entropy_T.shape == (0,)


def test_static_math_composes_over_three_shards_without_collectives():
    """The local math alone, combined by hand (max, then sum) over 3 shards, is exact."""
    math = VocabParallelLogProbMath
    logits_TV, targets_T, weights_T = make_problem(vocab=54)
    entropy_weights_T = torch.linspace(-1.0, 1.0, logits_TV.shape[0], dtype=torch.float64)
    shards = logits_TV.chunk(3, dim=1)
    targets = [math.local_targets(targets_T, rank * 18, 18) for rank in range(3)]
    max_C = torch.stack([math.chunk_max(shard, torch.float64) for shard in shards]).amax(dim=0)
    stats_3C = sum(
        math.chunk_partial_stats(shard, max_C, *ids, shard.clone(), shard.clone())
        for shard, ids in zip(shards, targets)
    )
    logprobs_C, entropy_C, lse_C = math.finalize(max_C, stats_3C)
    ref_logprobs_T, ref_entropy_T = reference(logits_TV, targets_T)
    assert (logprobs_C - ref_logprobs_T).abs().max() <= 1e-12
    assert (entropy_C - ref_entropy_T).abs().max() <= 1e-12
    assert (lse_C - torch.logsumexp(logits_TV, dim=-1)).abs().max() <= 1e-12
    grads = [
        math.chunk_grad(
            shard, lse_C, *ids, weights_T, shard.clone(),
            entropy_C, entropy_weights_T, shard.clone(),
        )
        for shard, ids in zip(shards, targets)
    ]
    expected = reference_grad(logits_TV, targets_T, weights_T, entropy_weights_T)
    assert (torch.cat(grads, dim=1) - expected).abs().max() <= 1e-6


class _FloatOutputSizes(TorchDispatchMode):
    """Records the element count of every floating-point tensor any aten op returns."""

    def __init__(self):
        super().__init__()
        self.numels = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for value in tree_flatten(out)[0]:
            if isinstance(value, torch.Tensor) and value.dtype in (torch.float32, torch.float64):
                self.numels.append(value.numel())
        return out


def test_no_fp32_tensor_larger_than_one_chunk_forward_and_backward():
    num_tokens, v_local, chunk = 64, 50, 8
    logits_TV, targets_T, weights_T = make_problem(num_tokens, v_local, dtype=torch.bfloat16)
    logits = logits_TV.clone().requires_grad_(True)
    sizes = _FloatOutputSizes()
    with sizes:
        logprobs_T, entropy_T = vocab_parallel_logprobs_entropy(
            logits, targets_T, chunk_tokens=chunk, entropy_requires_grad=True
        )
        ((weights_T * logprobs_T).sum() + entropy_T.sum()).backward()
    assert logits.grad.dtype == torch.bfloat16
    assert max(sizes.numels) == chunk * v_local
    # The monitor does see a whole-input upcast, as the gather-then-log-softmax approach does.
    with sizes:
        reference(logits_TV, targets_T)
    assert max(sizes.numels) == num_tokens * v_local


def test_saved_for_backward_is_the_input_and_two_token_vectors():
    logits_TV, targets_T, _ = make_problem(num_tokens=12, vocab=30, dtype=torch.float32)
    logits = logits_TV.clone().requires_grad_(True)
    for entropy_grad, expected_vectors in ((False, 1), (True, 2)):
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            vocab_parallel_logprobs_entropy(
                logits, targets_T, chunk_tokens=4, entropy_requires_grad=entropy_grad
            )
        big = [t for t in saved if t.dim() == 2]
        assert len(big) == 1 and big[0].data_ptr() == logits.data_ptr()  # a reference, no copy
        vectors = [t for t in saved if t.dim() == 1 and t.is_floating_point()]
        assert [tuple(t.shape) for t in vectors] == [(12,)] * expected_vectors
        assert [t for t in saved if t.dim() == 1 and not t.is_floating_point()] == [targets_T]


@pytest.mark.parametrize(
    "logits, targets, kwargs, error, match",
    [
        (torch.zeros(4, 5, 6), torch.zeros(4, dtype=torch.long), {}, ValueError,
         r"logits_TV .*2-D"),
        (torch.zeros(4), torch.zeros(4, dtype=torch.long), {}, ValueError, r"logits_TV .*2-D"),
        (torch.zeros(4, 5, dtype=torch.long), torch.zeros(4, dtype=torch.long), {}, TypeError,
         r"logits_TV must be floating point"),
        (torch.zeros(4, 5), torch.zeros(4, 1, dtype=torch.long), {}, ValueError,
         r"targets_T must be a 1-D"),
        (torch.zeros(4, 5), torch.zeros(3, dtype=torch.long), {}, ValueError,
         r"targets_T has 3 tokens but logits_TV has 4"),
        (torch.zeros(4, 5), torch.zeros(4), {}, TypeError, r"targets_T must hold integer"),
        (torch.zeros(4, 5), torch.zeros(4, dtype=torch.bool), {}, TypeError,
         r"targets_T must hold integer"),
        (torch.zeros(4, 5), torch.tensor([0, 4, 5, 1]), {}, ValueError,
         r"targets_T\[2\] = 5 is outside the vocabulary \[0, 5\)"),
        (torch.zeros(4, 5), torch.tensor([0, 1, 2, -1]), {}, ValueError,
         r"targets_T\[3\] = -1 is outside"),
        (torch.zeros(4, 5), torch.zeros(4, dtype=torch.long), {"chunk_tokens": 0}, ValueError,
         r"chunk_tokens must be a positive int; got 0"),
        (torch.zeros(4, 5), torch.zeros(4, dtype=torch.long), {"chunk_tokens": -3}, ValueError,
         r"chunk_tokens must be a positive int"),
        (torch.zeros(4, 5), torch.zeros(4, dtype=torch.long), {"chunk_tokens": 2.0}, ValueError,
         r"chunk_tokens must be a positive int"),
    ],
)
def test_bad_inputs_raise_naming_the_culprit(logits, targets, kwargs, error, match):
    with pytest.raises(error, match=match):
        vocab_parallel_logprobs_entropy(logits, targets, **kwargs)


def _temperatures(num_tokens, seed=5):
    """Per-token temperatures in [0.3, 1.7] (samples of different temperatures share a call)."""
    return 0.3 + 1.4 * torch.rand(num_tokens, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


@pytest.mark.parametrize("entropy_grad", [False, True], ids=["logprob", "logprob+entropy"])
def test_per_token_temperature_is_the_softmax_of_logits_over_t(entropy_grad):
    """log_softmax(z / T) and its entropy, and their gradient w.r.t. z, per token."""
    logits_TV, targets_T, weights_T = make_problem()
    temperature_T = _temperatures(logits_TV.shape[0])
    entropy_weights_T = torch.linspace(-1.0, 1.0, logits_TV.shape[0], dtype=torch.float64) if entropy_grad else None
    logprobs_T, entropy_T = vocab_parallel_logprobs_entropy(logits_TV, targets_T, chunk_tokens=8,
                                                            temperature_T=temperature_T)
    ref_logprobs_T, ref_entropy_T = reference(logits_TV / temperature_T[:, None], targets_T)
    assert (logprobs_T - ref_logprobs_T).abs().max() <= 1e-12
    assert (entropy_T - ref_entropy_T).abs().max() <= 1e-12
    assert (ref_logprobs_T - reference(logits_TV, targets_T)[0]).abs().max() > 0.5, "T must matter here"
    grad = library_grad(logits_TV, targets_T, weights_T, entropy_weights_T, chunk_tokens=8, temperature_T=temperature_T)
    # The reference differentiates through the division: d/dz = (d/dx) / T.
    logits = logits_TV.detach().clone().requires_grad_(True)
    lp, ent = reference(logits / temperature_T[:, None], targets_T)
    ((weights_T * lp).sum() + (0 if entropy_weights_T is None else (entropy_weights_T * ent).sum())).backward()
    assert (grad - logits.grad).abs().max() <= 1e-10


def test_temperature_one_is_bit_for_bit_no_temperature():
    logits_TV, targets_T, weights_T = make_problem(dtype=torch.float32)
    plain = vocab_parallel_logprobs_entropy(logits_TV, targets_T, chunk_tokens=8)
    ones = vocab_parallel_logprobs_entropy(logits_TV, targets_T, chunk_tokens=8,
                                           temperature_T=torch.ones(logits_TV.shape[0]))
    assert torch.equal(plain[0], ones[0]) and torch.equal(plain[1], ones[1])
    assert torch.equal(library_grad(logits_TV, targets_T, weights_T),
                       library_grad(logits_TV, targets_T, weights_T, temperature_T=torch.ones(logits_TV.shape[0])))


def test_temperature_composes_over_three_shards_without_collectives():
    """Each shard divides its own logits: max, sums and gradients combine exactly as at T = 1."""
    math = VocabParallelLogProbMath
    logits_TV, targets_T, weights_T = make_problem(vocab=54)
    temperature_T = _temperatures(logits_TV.shape[0])
    shards = logits_TV.chunk(3, dim=1)
    targets = [math.local_targets(targets_T, rank * 18, 18) for rank in range(3)]
    max_C = torch.stack([math.chunk_max(shard, torch.float64, None, temperature_T) for shard in shards]).amax(dim=0)
    assert torch.equal(max_C, (logits_TV / temperature_T[:, None]).amax(dim=-1))
    stats_3C = sum(math.chunk_partial_stats(shard, max_C, *ids, shard.clone(), shard.clone(),
                                            temperature_C=temperature_T)
                   for shard, ids in zip(shards, targets))
    logprobs_C, entropy_C, lse_C = math.finalize(max_C, stats_3C)
    ref_logprobs_T, ref_entropy_T = reference(logits_TV / temperature_T[:, None], targets_T)
    assert (logprobs_C - ref_logprobs_T).abs().max() <= 1e-12
    assert (entropy_C - ref_entropy_T).abs().max() <= 1e-12
    grads = [math.chunk_grad(shard, lse_C, *ids, weights_T, shard.clone(), temperature_C=temperature_T)
             for shard, ids in zip(shards, targets)]
    logits = logits_TV.detach().clone().requires_grad_(True)
    (weights_T * reference(logits / temperature_T[:, None], targets_T)[0]).sum().backward()
    assert (torch.cat(grads, dim=1) - logits.grad).abs().max() <= 1e-10


@pytest.mark.parametrize("temperature, match", [
    (torch.tensor([1.0, 0.0, 1.0, 1.0]), r"temperature_T\[1\] = 0.0: a sampling temperature must be finite and > 0"),
    (torch.tensor([1.0, 1.0, float("nan"), 1.0]), r"temperature_T\[2\] = nan"),
    (torch.tensor([1.0, 1.0, 1.0, -0.5]), r"temperature_T\[3\] = -0.5"),
    (torch.ones(3), r"temperature_T has 3 tokens but logits_TV has 4"),
    (torch.ones(4, dtype=torch.long), r"temperature_T must be a 1-D float tensor"),
])
def test_bad_temperatures_raise_naming_the_token(temperature, match):
    with pytest.raises(ValueError, match=match):
        vocab_parallel_logprobs_entropy(torch.zeros(4, 5), torch.zeros(4, dtype=torch.long), temperature_T=temperature)
