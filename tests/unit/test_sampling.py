"""Next-token sampling: the tokens top-k and top-p keep and the distribution drawn from them,
worked out by hand from four probabilities (0.5, 0.3, 0.15, 0.05), never at a boundary where
the mass reaches top-p exactly."""

import math

import pytest
import torch

from megatron_rl.rollout.sampling import sample_next_tokens

PROBS = [0.5, 0.3, 0.15, 0.05]
DRAWS = 4_000


def _renormalized(kept: list[float]) -> list[float]:
    return [p / sum(kept) for p in kept]


@pytest.mark.parametrize("temperature,top_p,top_k,expected", [
    (1.0, 1.0, 0, PROBS),
    (1.0, 0.75, 0, _renormalized([0.5, 0.3])),  # 0.5 < 0.75 <= 0.8: two tokens reach it
    (1.0, 0.85, 0, _renormalized([0.5, 0.3, 0.15])),  # 0.8 < 0.85 <= 0.95: three
    (1.0, 0.4, 0, [1.0]),  # the first token alone reaches it
    (1.0, 1.0, 2, _renormalized([0.5, 0.3])),
    (1.0, 1.0, 3, _renormalized([0.5, 0.3, 0.15])),
    (1.0, 0.75, 3, _renormalized([0.5, 0.3])),  # top-k first, then top-p over what is left
    (1.0, 0.9, 2, _renormalized([0.5, 0.3])),
    # Temperature 2 first: p ** (1/2), renormalized, then top-k 2.
    (2.0, 1.0, 2, _renormalized([math.sqrt(0.5), math.sqrt(0.3)])),
])
def test_top_k_and_top_p_keep_the_tokens_that_reach_them(temperature, top_p, top_k, expected):
    logits_BV = torch.tensor(PROBS, dtype=torch.float64).log().expand(DRAWS, -1)
    tokens_B = sample_next_tokens(logits_BV, temperature=temperature, top_p=top_p, top_k=top_k,
                                  generator=torch.Generator().manual_seed(7))
    counts = torch.bincount(tokens_B, minlength=len(PROBS)).tolist()
    assert [c > 0 for c in counts] == [i < len(expected) for i in range(len(PROBS))], counts
    for count, p in zip(counts, expected):
        # Five standard deviations of a binomial share: a wrong distribution is far outside.
        assert abs(count / DRAWS - p) <= 5 * math.sqrt(p * (1 - p) / DRAWS), (counts, expected)


def test_greedy_and_bad_parameters():
    logits_BV = torch.tensor([[0.1, 2.0, -1.0], [3.0, 0.0, 2.9]])
    assert sample_next_tokens(logits_BV, temperature=0.0).tolist() == [1, 0]
    for bad in (dict(temperature=-1.0), dict(temperature=1.0, top_p=0.0), dict(temperature=1.0, top_k=-1)):
        with pytest.raises(ValueError, match="bad sampling parameters"):
            sample_next_tokens(logits_BV, **bad)
