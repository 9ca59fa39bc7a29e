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


def selection_topk(
    logits_NE: torch.Tensor,
    score_function: str,
    topk: int,
    expert_bias_E: torch.Tensor | None = None,
    num_groups: int = 0,
    group_topk: int = 0,
) -> torch.Tensor:
    """Ids ``[N, K]`` the router itself selects from its logits (Megatron-Core's rule).

    The selection score is the router probability plus the expert bias (sigmoid routing
    with aux-loss-free balancing: the bias moves selection only, never a gate). With
    group-limited routing the experts form ``num_groups`` equal groups, each scored by the
    sum of its top ``K / group_topk`` selection scores; only the best ``group_topk`` groups'
    experts compete for the K places.
    """
    scores_NE = router_log_scores(logits_NE, score_function).exp()
    if expert_bias_E is not None:
        scores_NE = scores_NE + expert_bias_E.float()
    if num_groups:
        n = scores_NE.shape[0]
        grouped_NGX = scores_NE.view(n, num_groups, -1)
        group_scores_NG = grouped_NGX.topk(topk // group_topk, dim=-1).values.sum(dim=-1)
        kept_NG = torch.zeros_like(group_scores_NG, dtype=torch.bool)
        kept_NG.scatter_(1, group_scores_NG.topk(group_topk, dim=-1).indices, True)
        kept_NE = kept_NG[:, :, None].expand_as(grouped_NGX).reshape(n, -1)
        scores_NE = scores_NE.masked_fill(~kept_NE, float("-inf"))
    return scores_NE.topk(topk, dim=-1).indices


def dispatched_topk(
    log_scores_NE: torch.Tensor, routing_map_NE: torch.Tensor, topk: int
) -> torch.Tensor:
    """Ids ``[N, K]`` of the experts each token was dispatched to, by descending score.

    Raises:
        ValueError: a token was dispatched to a number of experts other than K (token
            dropping is not supported by recording).
    """
    return dispatched_by_score(log_scores_NE, routing_map_NE, topk)[0]


def dispatched_by_score(
    log_scores_NE: torch.Tensor, routing_map_NE: torch.Tensor, topk: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dispatched ids ``[N, K]`` (int64) by descending score, and their log scores ``[N, K]``.

    Ties keep ascending expert id (stable sort), so the order is the same on every device.

    Raises:
        ValueError: a token was dispatched to a number of experts other than K (token
            dropping is not supported by recording).
    """
    n = routing_map_NE.shape[0]
    counts_N = routing_map_NE.sum(dim=-1)
    bad_N = counts_N != topk
    # Row-major nonzeros of the map. nonzero waits for the device once (its size is data
    # dependent); reading the validation flag after it then waits for nothing more, so the
    # check costs no second stall on an accelerator.
    flat_ids = torch.nonzero(routing_map_NE)[:, 1]
    if bool(bad_N.any()):
        bad = int(torch.nonzero(bad_N)[0, 0])
        raise ValueError(
            f"token {bad} was dispatched to {int(counts_N[bad])} experts, expected top-{topk}"
            " (expert capacity / token dropping is not supported while recording)"
        )
    # Every row holds exactly K dispatched experts, so the nonzeros are K per row in
    # ascending id. Sorting those K scores costs less than a masked top-K over all E
    # experts (CPU top-K is slow on short rows: ~2x for E=16, K=4, more for larger E).
    ids_NK = flat_ids.view(n, topk)
    log_scores_NK, order_NK = log_scores_NE.gather(1, ids_NK).sort(dim=-1, descending=True, stable=True)
    return ids_NK.gather(1, order_NK), log_scores_NK


def same_expert_set(a_NK: torch.Tensor, b_NK: torch.Tensor) -> torch.Tensor:
    """bool ``[N]``: the two rows hold the same experts, in any order."""
    return (a_NK.sort(dim=-1).values == b_NK.to(a_NK.dtype).sort(dim=-1).values).all(dim=-1)
