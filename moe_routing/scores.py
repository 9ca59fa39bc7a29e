"""Router score math shared by recording, replay and RSPO (pure torch).

Shape legend: N tokens seen by one router call, E experts, K experts per token.
"""

from __future__ import annotations

import torch


def router_log_scores(logits_NE: torch.Tensor, score_function: str) -> torch.Tensor:
    """Log of the router probability of every expert, in fp32.

    softmax: ``log_softmax`` over all E experts; sigmoid: ``log sigmoid`` per expert (the
    score DeepSeek-V3-style routers select with).
    """
    logits_NE = logits_NE.float()
    if score_function == "softmax":
        return torch.log_softmax(logits_NE, dim=-1)
    if score_function == "sigmoid":
        return torch.nn.functional.logsigmoid(logits_NE)
    raise ValueError(f"unknown router score function {score_function!r}")


def dispatched_topk(
    log_scores_NE: torch.Tensor, routing_map_NE: torch.Tensor, topk: int
) -> torch.Tensor:
    """Ids ``[N, K]`` of the experts each token was dispatched to, by descending score.

    Raises:
        ValueError: a token was dispatched to a number of experts other than K (token
            dropping is not supported by recording).
    """
    counts_N = routing_map_NE.sum(dim=-1)
    if bool((counts_N != topk).any()):
        bad = int(torch.nonzero(counts_N != topk)[0, 0])
        raise ValueError(
            f"token {bad} was dispatched to {int(counts_N[bad])} experts, expected top-{topk}"
            " (expert capacity / token dropping is not supported while recording)"
        )
    masked_NE = log_scores_NE.masked_fill(~routing_map_NE, float("-inf"))
    return masked_NE.topk(topk, dim=-1).indices


def same_expert_set(a_NK: torch.Tensor, b_NK: torch.Tensor) -> torch.Tensor:
    """bool ``[N]``: the two rows hold the same experts, in any order."""
    return (a_NK.sort(dim=-1).values == b_NK.to(a_NK.dtype).sort(dim=-1).values).all(dim=-1)
