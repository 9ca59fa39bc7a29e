"""The one overflow-safe exponential of a log-ratio, used by every ratio in the library.

``exp(d)`` overflows to inf once ``d`` passes log(max float): 88.7 in fp32 and bf16, 709.8
in fp64, 11.1 in fp16. Where a clip, a saturated gate or an unused ``torch.where`` branch
cuts that inf out of the loss value, autograd still multiplies the branch's zero gradient
by the inf derivative of ``exp`` and the token (for sequence ratios, its whole sequence)
gets a NaN gradient with a finite loss. So every ``exp`` of a log-ratio goes through
:func:`exp_log_ratio`, which clamps the exponent to ``[-c, c]`` first, as verl does with
c = 20: token ratios ``exp(d_t)``, GSPO's ``exp(mean d)``, GMPO's geometric means, the
GSPO-token ratio, k3's ``pi_ref / pi``, and the TIS / MIS / IcePop weights. c is
``ObjectiveConfig.log_ratio_clamp`` and must stay below log(max float) of the dtype.

What the clamp changes (``e^20 = 4.85e8``, ``e^-20 = 2.1e-9``):

* nothing for ``|d| <= c``: value and gradient are exact;
* beyond ``c`` the ratio is held at ``e^{+-c}`` and its gradient is **zero** (the clamp's
  derivative). ``ObjectiveConfig`` requires every upper clip bound below ``e^c`` (GMPO's
  log-space bounds below ``c``), so for clipped gates such a token is already outside the
  trust region: with A > 0 and ``d > c`` (or A < 0 and ``d < -c``) the clip had already
  made the gradient zero and the value is unchanged; for A < 0 and ``d > c`` the value is
  capped at ``-A e^c`` instead of an astronomically large one and the gradient, ``-A e^d``
  (at least 4.85e8 |A|), becomes 0 -- the step that would wreck the update is skipped, as
  dual clip would cap it; for A > 0 and ``d < -c`` the true gradient is below
  2.1e-9 |A| and becomes 0 (a lower bound ``1 - eps_low`` under ``e^-c`` can only differ
  by that much, so it is not restricted);
* SAPO's soft gate is saturated long before ``|d| = c`` (its gradient weight
  ``4p(1-p) r`` is 0 in float at ``r = e^20``), so nothing changes in practice;
* CISPO differentiates ``log pi``, not the ratio: its gradient is never cut off, only the
  stop-gradient weight ``clip(r, ., 1 + eps_high_is)`` is computed from the clamped ratio
  (unchanged above; below, ``e^-c`` instead of ``e^d``, a difference under 2.1e-9);
* the gate ``none`` (``-A r``, no trust region) loses the gradient of tokens beyond ``c``
  -- that gradient is at least 4.85e8 |A| and would dominate any update;
* REINFORCE (ratio unit ``none``) has no ratio and is unaffected.

k3 needs ``expm1`` for precision near ``r = 1`` and uses :func:`clamp_log_ratio` directly.
This module owns the clamp and its default only.
"""

from __future__ import annotations

import torch
from torch import Tensor

DEFAULT_LOG_RATIO_CLAMP = 20.0
"""verl's value: exp(20) = 4.85e8 is far beyond any clip band, and exp(20)^2 fits fp32."""


def clamp_log_ratio(log_ratio: Tensor, clamp: float) -> Tensor:
    """``log_ratio`` clamped to ``[-clamp, clamp]`` (gradient 1 inside, 0 outside)."""
    return log_ratio.clamp(min=-clamp, max=clamp)


def exp_log_ratio(log_ratio: Tensor, clamp: float) -> Tensor:
    """``exp(clamp(log_ratio, -clamp, clamp))``: finite, with zero gradient outside the range.

    Args:
        log_ratio: log-ratios of any shape; differentiable.
        clamp: c > 0, below log(max float) of the dtype.

    Returns:
        Ratios in ``[e^-c, e^c]``, same shape and dtype.
    """
    return torch.exp(clamp_log_ratio(log_ratio, clamp))
