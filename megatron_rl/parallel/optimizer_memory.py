"""Bytes per parameter of the training state (weights, gradient buffer, fp32 main weights,
optimizer state) with the plain and with Megatron's distributed optimizer, as Megatron-Core
allocates them. Pure arithmetic: imports nothing, so a memory planner can call it before
any process or model exists.

Owns the facts, with where Megatron-Core 0.16.1 allocates each term:

- weights: the parameter dtype. With the distributed optimizer they are views into DDP's
  parameter buffer (``param_and_grad_buffer.py:795-801, 825-835``), no second copy.
- gradient buffer (``main_grad``): fp32 when ``grad_reduce_in_fp32`` (what
  ``schedule.wrap_for_training`` builds, and Megatron-LM's default for bf16), else the
  parameter dtype; **full size on every rank**, also with the distributed optimizer, whose
  reduce-scatter writes this rank's slice in place (``distributed_data_parallel.py:147``,
  ``param_and_grad_buffer.py:803-808``).
- fp32 main weights: for 16-bit weights a fp32 copy, of this rank's slice only with the
  distributed optimizer (``distrib_optimizer.py:399``), of everything with the plain one
  (``optimizer.py:674``); for fp32 weights none (the plain optimizer steps the weights, the
  distributed one a view of its slice, ``distrib_optimizer.py:421``).
- optimizer state: Adam's two fp32 moments (SGD: one momentum buffer when momentum > 0),
  of this rank's slice only with the distributed optimizer.

"This rank's slice" is 1/D of the parameter, D its data-parallel size: dense weights D = DP
(x CP), expert weights D = expert-DP = world / (ETP x EP x PP). Not counted: the
distributed optimizer's padding (each parameter starts at a multiple of 64 elements, each
bucket ends at a multiple of lcm(D, 128)), well under 1% of any real model.
"""

from __future__ import annotations

from dataclasses import dataclass

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
"""Bytes per element of the parameter dtypes a model may use (``model.params_dtype``)."""


@dataclass(frozen=True)
class BytesPerParam:
    """Bytes one parameter element costs on one rank, by term."""

    weights: float
    """The model weight itself (parameter dtype)."""
    grads: float
    """Its element of DDP's gradient buffer."""
    main_weights: float
    """The optimizer's fp32 main copy (0 when it steps the weights themselves)."""
    optimizer_state: float
    """Adam's moments (or SGD's momentum)."""

    @property
    def total(self) -> float:
        """All four terms."""
        return self.weights + self.grads + self.main_weights + self.optimizer_state


def grad_buffer_dtype(params_dtype: str, grad_reduce_in_fp32: bool = True) -> str:
    """The dtype of DDP's gradient buffer (``main_grad``)."""
    return "float32" if grad_reduce_in_fp32 else params_dtype


def optimizer_bytes_per_param(
    params_dtype: str,
    *,
    distributed: bool,
    data_parallel_size: int = 1,
    grad_reduce_in_fp32: bool = True,
    optimizer: str = "adam",
    sgd_momentum: float = 0.0,
) -> BytesPerParam:
    """Bytes per element of a parameter on one rank (see the module docstring for sources).

    Args:
        params_dtype: ``"float32"``, ``"bfloat16"`` or ``"float16"`` (``model.params_dtype``).
        distributed: Megatron's distributed optimizer (``optim.distributed``).
        data_parallel_size: D, the ranks the parameter's optimizer state is sliced over
            (dense: DP x CP; experts: expert-DP). Ignored without ``distributed``.
        grad_reduce_in_fp32: fp32 gradient buffer (what this project builds).
        optimizer: ``"adam"`` or ``"sgd"`` (``optim.optimizer``).
        sgd_momentum: SGD keeps a momentum buffer only when this is non-zero.

    Returns:
        The four terms. E.g. bf16 weights, fp32 gradients, Adam: 2 + 4 + 4 + 8 = 18 bytes
        plain; 2 + 4 + (4 + 8) / D distributed. fp32 weights: 4 + 4 + 0 + 8 = 16 plain,
        4 + 4 + 0 + 8 / D distributed.

    Raises:
        ValueError: an unknown dtype or optimizer, D < 1, or SGD with the distributed
            optimizer (which this project refuses: ``optim.distributed``).
    """
    if params_dtype not in DTYPE_BYTES:
        raise ValueError(f"params_dtype {params_dtype!r}: one of {sorted(DTYPE_BYTES)}")
    if optimizer not in ("adam", "sgd"):
        raise ValueError(f"optimizer {optimizer!r}: 'adam' or 'sgd'")
    if data_parallel_size < 1:
        raise ValueError(f"data_parallel_size {data_parallel_size}: must be >= 1")
    if distributed and optimizer != "adam":
        raise ValueError("the distributed optimizer is built for Adam only here (optim.distributed)")
    slice_fraction = 1.0 / data_parallel_size if distributed else 1.0
    weight_bytes = DTYPE_BYTES[params_dtype]
    main_bytes = 4 if weight_bytes < 4 else 0
    state_bytes = 8 if optimizer == "adam" else (4 if sgd_momentum else 0)
    return BytesPerParam(
        weights=float(weight_bytes),
        grads=float(DTYPE_BYTES[grad_buffer_dtype(params_dtype, grad_reduce_in_fp32)]),
        main_weights=main_bytes * slice_fraction,
        optimizer_state=state_bytes * slice_fraction,
    )
