"""Input checks at the API boundary of the objective library.

Owns the rejection of bad inputs with errors that name the tensor (and the first bad
position): wrong rank or length, wrong dtype, an empty batch, NaN/inf anywhere (masked
positions included: a non-finite number anywhere is an upstream bug), sequence ids out of
range, masks that are not 0/1, RSPO weights outside (0, 1], negative global counts. Which
tensor of a loss call gets which check is ``algos.batch``'s.

Shape checks are free (a ``TokenBatch`` runs them whenever one is built). Value checks
are reduced to one boolean per check and fetched in **one** host synchronisation per call;
only when that flag is False are the individual checks revisited to name the culprit.
Callers that trust their inputs turn the value checks off with
``ObjectiveConfig.check_inputs=False``.

Shape legend: T tokens, S sequences.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

# (tensor name, 0-dim bool tensor "all good", message factory run only on failure)
ValueCheck = tuple[str, Tensor, Callable[[], str]]


class InputError(ValueError):
    """A tensor or argument passed to the objective library is malformed; names it."""


def check_shapes(
    *,
    per_token: dict[str, Tensor | None],
    per_seq: dict[str, Tensor | None],
    num_seqs: int,
    floating: tuple[str, ...],
) -> int:
    """Checks ranks, lengths and dtypes; returns T.

    Args:
        per_token: name -> [T] tensor (None entries are skipped); the first given sets T.
        per_seq: name -> [S] tensor (None entries are skipped).
        num_seqs: S, must be a positive int.
        floating: names that must have a floating dtype; all others must be bool/integer.

    Raises:
        InputError: naming the first offending tensor.
    """
    if isinstance(num_seqs, bool) or not isinstance(num_seqs, int) or num_seqs < 1:
        raise InputError(f"num_seqs must be a positive int, got {num_seqs!r}")
    present = {
        **{k: v for k, v in per_token.items() if v is not None},
        **{k: v for k, v in per_seq.items() if v is not None},
    }
    for name, tensor in present.items():
        if not isinstance(tensor, Tensor):
            raise InputError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
        if tensor.dim() != 1:
            raise InputError(f"{name} must be 1-D, got shape {tuple(tensor.shape)}")
        if (name in floating) != tensor.dtype.is_floating_point:
            kind = "a floating" if name in floating else "a bool or integer"
            raise InputError(f"{name} must have {kind} dtype, got {tensor.dtype}")
    first_name = next(name for name, tensor in per_token.items() if tensor is not None)
    num_tokens = per_token[first_name].numel()
    if num_tokens == 0:
        raise InputError(f"empty batch: {first_name} has 0 tokens")
    for name, tensor in per_token.items():
        if tensor is not None and tensor.numel() != num_tokens:
            raise InputError(
                f"{name} has {tensor.numel()} tokens but {first_name} has {num_tokens}"
            )
    for name, tensor in per_seq.items():
        if tensor is not None and tensor.numel() != num_seqs:
            raise InputError(f"{name} has {tensor.numel()} entries but num_seqs={num_seqs}")
    return num_tokens


def finite_checks(tensors: dict[str, Tensor | None]) -> list[ValueCheck]:
    """One 'all finite' check per floating tensor.

    A finite sum proves every element finite (NaN and inf propagate through a sum), and a
    sum is several times cheaper than ``isfinite``; only a non-finite sum (a bad element,
    or a rare overflow of huge values) is followed by the element-wise test.
    """
    checks = []
    for name, tensor in tensors.items():
        if tensor is not None:
            tensor = tensor.detach()
            fast_ok = torch.isfinite(tensor.sum())
            checks.append(
                (
                    name,
                    fast_ok,
                    first_bad_message(
                        name, lambda t=tensor: ~torch.isfinite(t), "contains NaN/inf"
                    ),
                )
            )
    return checks


def range_check(name: str, tensor: Tensor, ok_T: Tensor, what: str) -> ValueCheck:
    """A check that every element satisfies ``ok_T`` ([N] bool); ``what`` describes the rule."""
    return name, ok_T.all(), first_bad_message(name, lambda: ~ok_T, what)


def id_checks(
    seq_ids_T: Tensor, num_seqs: int, mask_names: dict[str, Tensor | None]
) -> list[ValueCheck]:
    """Sequence ids in [0, num_seqs) and 0/1 masks."""
    low, high = torch.aminmax(seq_ids_T)
    checks = [
        (
            "seq_ids_T",
            (low >= 0) & (high < num_seqs),
            first_bad_message(
                "seq_ids_T",
                lambda: (seq_ids_T < 0) | (seq_ids_T >= num_seqs),
                f"has an id outside [0, {num_seqs})",
            ),
        ),
    ]
    for name, mask in mask_names.items():
        if mask is not None and mask.dtype != torch.bool:
            checks.append(
                range_check(name, mask, (mask == 0) | (mask == 1), "has a value other than 0/1")
            )
    return checks


def count_checks(counts: dict[str, int | float | Tensor | None]) -> list[ValueCheck]:
    """Caller-supplied global counts: a number or 1-element tensor, finite and >= 0.

    Raises:
        InputError: a count is neither a number nor a 1-element tensor (no sync needed).
    """
    checks = []
    for name, count in counts.items():
        if count is None:
            continue
        if (
            isinstance(count, bool)
            or not isinstance(count, (int, float, Tensor))
            or torch.as_tensor(count).numel() != 1
        ):
            raise InputError(f"{name} must be a number or a 1-element tensor, got {count!r}")
        value = torch.as_tensor(count).reshape(1)
        ok = torch.isfinite(value.double()) & (value >= 0)
        checks.append(
            (name, ok.all(), first_bad_message(name, lambda ok=ok: ~ok, "is negative or not finite"))
        )
    return checks


def run_value_checks(checks: list[ValueCheck]) -> None:
    """Evaluates all checks with one host synchronisation; raises naming the first failure."""
    if not checks:
        return
    all_ok = torch.stack([ok.reshape(()) for _, ok, _ in checks]).all()
    if bool(all_ok):
        return
    for _, ok, message in checks:
        if not bool(ok):
            text = message()
            if text:
                raise InputError(text)


def first_bad_message(name: str, bad_fn: Callable[[], Tensor], what: str) -> Callable[[], str]:
    """Message naming the first bad element; empty if none is bad (a false alarm)."""

    def message() -> str:
        bad = torch.nonzero(bad_fn().reshape(-1))
        if bad.numel() == 0:
            return ""
        unit = "token" if name.endswith("_T") else "sequence" if name.endswith("_S") else "index"
        return f"{name} {what} at {unit} {int(bad[0, 0])}"

    return message
