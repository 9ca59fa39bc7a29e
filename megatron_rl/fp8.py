"""FP8 training through Transformer Engine: the ``fp8`` config section, its validation, and
the TE recipe and autocast built from it.

Owns :class:`FP8Config`, the rules that decide whether a recipe can run on this machine
(:func:`validate_fp8`, pure; :func:`check_fp8`, against the detected machine), the mapping
to Megatron-Core's ``TransformerConfig`` fields (:func:`transformer_config_fields`) and,
when TE and CUDA are present, the TE recipe object (:func:`build_te_recipe`) and the
autocast context (:func:`fp8_autocast`) for code outside Megatron's transformer block.

Does not own the model: Megatron-Core's ``TransformerBlock`` enters its own FP8 context
per layer once ``TransformerConfig.fp8`` is set, so a model built with
``transformer_config_fields(cfg.fp8)`` runs its TE linear layers in FP8 by itself. What stays
in higher precision, and why:

* the router: Megatron computes the gating GEMM with ``router_gating_linear`` (a torch
  matmul, never a TE module) in ``moe_router_dtype``; ``keep_router_high_precision`` pins
  that to fp32, otherwise it runs in the parameter dtype;
* the output layer and the embedding: ``GPTModel`` builds them as Megatron's own
  ``ColumnParallelLinear``/``VocabParallelEmbedding`` outside the transformer block, so no
  FP8 context ever covers them (log-probs come from BF16/FP32 logits).

Transformer Engine is imported lazily and every import is guarded: it cannot be installed
on a CPU-only machine, and asking for FP8 there fails at config time with a
:class:`~megatron_rl.config.ConfigError` naming ``fp8.<key>``.
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass
from typing import Any, Iterator, Literal

from megatron_rl.config_loading import ConfigError

_MIN_FP8_CAPABILITY = (8, 9)
"""Ada (8.9) is the first architecture with FP8 tensor cores."""
_HOPPER = (9, 0)
_BLACKWELL = (10, 0)
_MXFP8_MAX_CAPABILITY = (12, 0)
"""TE does not run MXFP8 for every GEMM layout on 12.x (consumer Blackwell) yet."""
_BLOCKWISE_MIN_CUDA = (12, 9)
"""TE's FP8 block-scaled GEMM needs CUDA 12.9 or newer."""
_MIN_TE_FOR_RECIPE = {"delayed": (1, 7), "tensorwise": (2, 2), "blockwise": (2, 3), "mxfp8": (2, 1)}
"""Oldest TE release whose recipe Megatron-Core 0.16.1 builds (see megatron/core/fp8_utils.py);
1.7 is also the oldest TE that Megatron accepts for MoE FP8 at all."""


@dataclass(kw_only=True)
class FP8Config:
    """FP8 training with Transformer Engine (Ada, Hopper or Blackwell GPUs)."""

    enabled: bool = False
    """Run the TE linear layers of the transformer block in FP8."""
    recipe: Literal["delayed", "tensorwise", "blockwise", "mxfp8"] = "delayed"
    """Scaling recipe: per-tensor delayed (amax history), per-tensor current, 1x128/128x128
    blockwise (DeepSeek-V3; Hopper), or MXFP8 1x32 blocks (Blackwell only)."""
    format: Literal["e4m3", "hybrid"] = "hybrid"
    """e4m3 everywhere, or hybrid: e4m3 forward and e5m2 for gradients."""
    amax_history_len: int = 1024
    """Delayed scaling only: steps of amax history behind each scaling factor."""
    amax_compute_algo: Literal["max", "most_recent"] = "max"
    """Delayed scaling only: the amax a scaling factor is computed from."""
    margin: int = 0
    """Delayed scaling only: scaling factors are divided by 2**margin (headroom)."""
    keep_router_high_precision: bool = True
    """Compute router logits and probabilities in fp32 (else in the parameter dtype);
    the router is never an FP8 GEMM."""


@dataclass(frozen=True)
class Fp8Environment:
    """What this machine offers FP8 training (see :func:`detect_fp8_environment`)."""

    te_version: str | None
    """Transformer Engine version when ``transformer_engine.pytorch`` imports, else None."""
    cuda_available: bool
    """torch sees a CUDA device."""
    compute_capability: tuple[int, int] | None
    """Compute capability of the GPU this process uses; None without CUDA."""
    cuda_version: str | None = None
    """CUDA version torch was built with (``torch.version.cuda``)."""


def _error(key: str, rule: str) -> ConfigError:
    return ConfigError(f"{key}: {rule}")


def _version_tuple(version: str | None) -> tuple[int, ...]:
    """Leading numeric components of a version ("2.3.0.dev0+5fdd7bb" -> (2, 3, 0), "12.9" -> (12, 9))."""
    parts = []
    for piece in (version or "").split("+")[0].split("."):
        match = re.match(r"\d+", piece)
        if match is None:
            break
        parts.append(int(match.group()))
        if match.end() < len(piece):
            break
    return tuple(parts)


def _cc(capability: tuple[int, int]) -> str:
    return f"{capability[0]}.{capability[1]}"


def _check_fields(cfg: FP8Config) -> None:
    """Rules that hold whether or not FP8 is enabled (so a disabled section is still sane)."""
    if cfg.amax_history_len < 1:
        raise _error("fp8.amax_history_len", "must be >= 1")
    if cfg.margin < 0:
        raise _error("fp8.margin", "must be >= 0")
    if cfg.recipe != "delayed":
        defaults = FP8Config()
        for name in ("amax_history_len", "amax_compute_algo", "margin"):
            if getattr(cfg, name) != getattr(defaults, name):
                raise _error(
                    f"fp8.{name}",
                    f"only the delayed recipe uses it, but fp8.recipe is {cfg.recipe!r}; "
                    "remove it or use fp8.recipe=delayed",
                )


def validate_fp8(cfg: FP8Config, env: Fp8Environment) -> None:
    """Check that ``cfg`` can run in ``env``; pure, so tests can pass any machine.

    Raises:
        ConfigError: naming ``fp8.<key>`` and the rule, when FP8 is asked for without TE or
            CUDA, on a GPU without FP8 tensor cores, or with a recipe that this GPU, CUDA
            or TE release does not run (mxfp8 needs Blackwell, blockwise needs Hopper or
            newer and CUDA >= 12.9).
    """
    _check_fields(cfg)
    if not cfg.enabled:
        return
    problems = []
    if env.te_version is None:
        problems.append(
            "Transformer Engine does not import here (install it on a CUDA machine: pip install -e '.[te]')"
        )
    if not env.cuda_available or env.compute_capability is None:
        problems.append("torch sees no CUDA GPU")
    if problems:
        raise _error(
            "fp8.enabled",
            f"FP8 training needs Transformer Engine and a CUDA GPU, but {'; '.join(problems)}; "
            "set fp8.enabled=false to train without FP8",
        )
    cap, te = env.compute_capability, _version_tuple(env.te_version)
    if cap < _MIN_FP8_CAPABILITY:
        raise _error(
            "fp8.enabled",
            f"FP8 needs compute capability >= {_cc(_MIN_FP8_CAPABILITY)} (Ada, Hopper, Blackwell); "
            f"this GPU is {_cc(cap)}",
        )
    needed_te = _MIN_TE_FOR_RECIPE[cfg.recipe]
    if te < needed_te:
        raise _error(
            "fp8.recipe",
            f"{cfg.recipe} needs Transformer Engine >= {'.'.join(map(str, needed_te))}; "
            f"installed: {env.te_version}",
        )
    if cfg.recipe == "mxfp8" and not _BLACKWELL <= cap < _MXFP8_MAX_CAPABILITY:
        raise _error(
            "fp8.recipe",
            f"mxfp8 needs a data-center Blackwell GPU (compute capability {_cc(_BLACKWELL)} to "
            f"<{_cc(_MXFP8_MAX_CAPABILITY)}); this GPU is {_cc(cap)}: use blockwise or tensorwise",
        )
    if cfg.recipe == "blockwise":
        if cap < _HOPPER:
            raise _error(
                "fp8.recipe",
                f"blockwise needs compute capability >= {_cc(_HOPPER)} (Hopper); this GPU is {_cc(cap)}",
            )
        cuda = _version_tuple(env.cuda_version)
        if cuda and cuda < _BLOCKWISE_MIN_CUDA:
            raise _error(
                "fp8.recipe",
                f"blockwise needs CUDA >= {'.'.join(map(str, _BLOCKWISE_MIN_CUDA))}; "
                f"torch uses CUDA {env.cuda_version}",
            )


def te_version() -> str | None:
    """Version of an importable Transformer Engine (with its PyTorch extension), else None.

    A broken install fails at import with ImportError, OSError (a missing shared library)
    or RuntimeError (cuDNN or the extension not found); each counts as "not available".
    """
    try:
        import transformer_engine
        import transformer_engine.pytorch  # noqa: F401
    except (ImportError, OSError, RuntimeError):
        return None
    return str(getattr(transformer_engine, "__version__", "0"))


def detect_fp8_environment(device: int | None = None) -> Fp8Environment:
    """Probe this machine: imports torch and tries to import Transformer Engine."""
    import torch

    if not torch.cuda.is_available():
        return Fp8Environment(te_version=te_version(), cuda_available=False, compute_capability=None)
    index = torch.cuda.current_device() if device is None else device
    return Fp8Environment(
        te_version=te_version(),
        cuda_available=True,
        compute_capability=tuple(torch.cuda.get_device_capability(index)),
        cuda_version=torch.version.cuda,
    )


def check_fp8(cfg: FP8Config, env: Fp8Environment | None = None, *, this_machine: bool = True) -> None:
    """:func:`validate_fp8` against this machine; probes it only when FP8 is enabled.

    ``this_machine=False`` (a config planned for another machine: ``megatron-rl-plan``) checks
    only the section's own rules, none of this machine's TE, CUDA or GPU."""
    if not this_machine:
        _check_fields(cfg)
        return
    if env is None and cfg.enabled:
        env = detect_fp8_environment()
    validate_fp8(cfg, env or Fp8Environment(te_version=None, cuda_available=False, compute_capability=None))


def transformer_config_fields(cfg: FP8Config) -> dict[str, Any]:
    """Megatron-Core ``TransformerConfig`` fields for ``cfg`` (empty when FP8 is off).

    Pass them to ``build_model(..., **fields)``: Megatron's transformer block then enters
    the TE FP8 context per layer (the whole block for delayed scaling) and TE grouped
    experts pad tokens per expert to the FP8 GEMM alignment.
    """
    if not cfg.enabled:
        return {}
    fields: dict[str, Any] = {
        "fp8": cfg.format,
        "fp8_recipe": cfg.recipe,
        "moe_router_dtype": "fp32" if cfg.keep_router_high_precision else None,
    }
    if cfg.recipe == "delayed":
        fields.update(
            fp8_margin=cfg.margin,
            fp8_amax_history_len=cfg.amax_history_len,
            fp8_amax_compute_algo=cfg.amax_compute_algo,
        )
    return fields


def build_te_recipe(cfg: FP8Config) -> Any:
    """The ``transformer_engine.common.recipe`` object for ``cfg``.

    Raises:
        ConfigError: Transformer Engine does not import here.
    """
    try:
        from transformer_engine.common import recipe as te_recipe
    except (ImportError, OSError, RuntimeError) as err:
        raise _error("fp8.recipe", f"building an FP8 recipe needs Transformer Engine ({err})") from err
    fmt = te_recipe.Format.E4M3 if cfg.format == "e4m3" else te_recipe.Format.HYBRID
    if cfg.recipe == "delayed":
        return te_recipe.DelayedScaling(
            margin=cfg.margin,
            fp8_format=fmt,
            amax_history_len=cfg.amax_history_len,
            amax_compute_algo=cfg.amax_compute_algo,
        )
    builders = {
        "tensorwise": "Float8CurrentScaling",
        "blockwise": "Float8BlockScaling",
        "mxfp8": "MXFP8BlockScaling",
    }
    return getattr(te_recipe, builders[cfg.recipe])(fp8_format=fmt)


@contextlib.contextmanager
def fp8_autocast(cfg: FP8Config, amax_reduction_group: Any = None) -> Iterator[None]:
    """TE's FP8 autocast with the recipe of ``cfg``; a no-op when FP8 is off.

    For TE modules used outside Megatron's transformer block (which enters its own context).

    Args:
        cfg: the fp8 section.
        amax_reduction_group: process group whose ranks share amax values (delayed scaling);
            Megatron uses its TP x DP x CP amax-reduction group.
    """
    if not cfg.enabled:
        yield
        return
    recipe = build_te_recipe(cfg)
    import transformer_engine.pytorch as te

    # TE 2.8 renamed fp8_autocast to autocast; older releases only have fp8_autocast.
    if hasattr(te, "autocast"):
        context = te.autocast(enabled=True, recipe=recipe, amax_reduction_group=amax_reduction_group)
    else:
        context = te.fp8_autocast(enabled=True, fp8_recipe=recipe, fp8_group=amax_reduction_group)
    with context:
        yield
