"""Argument checks of :func:`~megatron_rl.parallel.vocab_parallel.vocab_parallel_logprobs_entropy`.

Every rank of a tensor-parallel group sees the same shapes, targets, sizes and temperatures,
so all raise alike, before any collective; each message names the offending tensor (and the
first bad token). Shape legend: T tokens, V_local this rank's vocabulary shard.
"""

from __future__ import annotations

import torch


def check_temperatures(temperature_T: torch.Tensor | None, num_tokens: int) -> None:
    """Temperatures are a ``[T]`` float tensor of finite values > 0; raises naming the token."""
    if temperature_T is None:
        return
    if not isinstance(temperature_T, torch.Tensor) or temperature_T.dim() != 1 or not temperature_T.is_floating_point():
        what = (f"{temperature_T.dtype} {tuple(temperature_T.shape)}" if isinstance(temperature_T, torch.Tensor)
                else type(temperature_T).__name__)
        raise ValueError(f"temperature_T must be a 1-D float tensor [T]; got {what}")
    if temperature_T.shape[0] != num_tokens:
        raise ValueError(f"temperature_T has {temperature_T.shape[0]} tokens but logits_TV has {num_tokens}")
    bad_T = ~(torch.isfinite(temperature_T) & (temperature_T > 0))
    if bad_T.any():
        token = int(bad_T.nonzero()[0, 0])
        raise ValueError(
            f"temperature_T[{token}] = {float(temperature_T[token])}: a sampling temperature must be finite and > 0 "
            "(greedy decoding has no distribution to score)"
        )


def check_inputs(
    logits_TV: torch.Tensor,
    targets_T: torch.Tensor,
    tp_size: int,
    chunk_tokens: int,
    vocab_size: int | None,
) -> int:
    """The true vocabulary size; raises naming the offending tensor (and token)."""
    # All ranks see the same shapes, targets and sizes, so all raise alike.
    if not isinstance(logits_TV, torch.Tensor) or logits_TV.dim() != 2:
        shape = tuple(logits_TV.shape) if isinstance(logits_TV, torch.Tensor) else type(logits_TV)
        raise ValueError(f"logits_TV must be a 2-D tensor [T, V_local]; got {shape}")
    if not logits_TV.is_floating_point():
        raise TypeError(f"logits_TV must be floating point; got {logits_TV.dtype}")
    if not isinstance(targets_T, torch.Tensor) or targets_T.dim() != 1:
        shape = tuple(targets_T.shape) if isinstance(targets_T, torch.Tensor) else type(targets_T)
        raise ValueError(f"targets_T must be a 1-D tensor [T]; got {shape}")
    if targets_T.is_floating_point() or targets_T.is_complex() or targets_T.dtype == torch.bool:
        raise TypeError(f"targets_T must hold integer token ids; got {targets_T.dtype}")
    if targets_T.shape[0] != logits_TV.shape[0]:
        raise ValueError(
            f"targets_T has {targets_T.shape[0]} tokens but logits_TV has "
            f"{logits_TV.shape[0]} (shape {tuple(logits_TV.shape)})"
        )
    if targets_T.device != logits_TV.device:
        raise ValueError(
            f"targets_T is on {targets_T.device} but logits_TV is on {logits_TV.device}"
        )
    if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens <= 0:
        raise ValueError(f"chunk_tokens must be a positive int; got {chunk_tokens!r}")
    columns = logits_TV.shape[1] * tp_size
    if vocab_size is not None and (isinstance(vocab_size, bool) or not 0 < vocab_size <= columns):
        raise ValueError(
            f"vocab_size must be an int in [1, {columns}] (V_local {logits_TV.shape[1]} x tp_size "
            f"{tp_size}); got {vocab_size!r}"
        )
    vocab = columns if vocab_size is None else vocab_size
    outside_T = (targets_T < 0) | (targets_T >= vocab)
    if outside_T.any():
        token = int(outside_T.nonzero()[0, 0])
        padding = f", {columns - vocab} padding columns after it" if vocab < columns else ""
        raise ValueError(
            f"targets_T[{token}] = {int(targets_T[token])} is outside the vocabulary "
            f"[0, {vocab}) (V_local {logits_TV.shape[1]} x tp_size {tp_size}{padding})"
        )
    return vocab
