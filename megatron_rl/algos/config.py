"""The one configuration of the gated policy surrogate.

Every objective of the library is one choice per axis of :class:`ObjectiveConfig`:
ratio unit, gate, token weights (RSPO, train/rollout mismatch), token masks (overlong,
entropy top-rho, STAPO), aggregation, KL and entropy terms, advantage estimator, and the
reward-shaping / group-filtering switches a trainer reads. Named presets
(``algos.presets``) are instances of it with paper defaults; ``dataclasses.replace``
combines pieces. The config validates itself on construction (and again on every
``replace``), so an invalid or incompatible combination can never reach the math.

This module owns the fields, their meaning and their validation. It owns no tensor math.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Literal

from .advantages import ADVANTAGE_ESTIMATORS
from .log_ratio import DEFAULT_LOG_RATIO_CLAMP

RATIO_UNITS = ("token", "sequence", "sequence_token", "geometric", "none")
GATES = ("clip", "soft", "cispo", "none")
AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "constant_normalizer")
MISMATCH_MODES = ("none", "tis", "mis", "icepop")
MISMATCH_LEVELS = ("token", "sequence")
KL_ESTIMATORS = ("k1", "k2", "k3")
STD_ESTIMATORS = ("sample", "population")
RSPO_APPLY = ("before_clip", "after_clip")
TURN_CREDITS = ("trajectory", "turn")
DISTILL_ESTIMATORS = ("sampled", "topk")

# Paper defaults of the (low, high) band per mismatch mode (objectives.md §16, §17, §19.10).
MISMATCH_DEFAULT_BOUNDS = {"tis": (0.0, 2.0), "mis": (0.5, 2.0), "icepop": (0.5, 5.0)}

# Which gates each ratio unit accepts; everything else is an incompatible combination.
_UNIT_GATES = {
    "token": ("clip", "soft", "cispo", "none"),
    "sequence": ("clip", "soft", "none"),
    "sequence_token": ("clip", "soft", "none"),
    "geometric": ("clip", "none"),
    "none": ("none",),
}


class ObjectiveConfigError(ValueError):
    """An objective option is invalid or incompatible with another; names the field."""


@dataclass(kw_only=True, frozen=True, slots=True)
class ObjectiveConfig:
    """Choices that define one policy objective (see ``algos.loss.policy_loss``).

    The exact formulas of the ratio units and gates are in ``algos.surrogate``, of the
    token weights in ``algos.weights``, of the masks in ``algos.masks``. In short, with
    ``r_t = pi/pi_old`` and A the advantage: clip ``max(-A x, -A clip(x, 1 - eps_low,
    1 + eps_high))``; soft ``-A sigmoid(tau (x - 1)) 4 / tau``; cispo
    ``-sg(clip(r, 1 - eps_low_is, 1 + eps_high_is)) A log pi``; none ``-A x``; ratio unit
    none is REINFORCE, ``-A log pi``. RSPO ``after_clip`` on the geometric unit puts gamma
    inside the geometric mean (RSPO's ``prod_t (W_t gamma_t)``). Every ``exp`` of a
    log-ratio sees an exponent clamped to ``+-log_ratio_clamp`` (``algos.log_ratio`` says
    what that changes: nothing inside the clip bands, which must lie within the clamp).
    """

    ratio_unit: Literal["token", "sequence", "sequence_token", "geometric", "none"] = "token"
    """Ratio the gate sees: token r_t, sequence (GSPO), sequence_token, geometric (GMPO), none."""
    gate: Literal["clip", "soft", "cispo", "none"] = "clip"
    """clip (PPO), soft (SAPO), cispo (clipped stop-gradient IS weight x log pi) or none."""
    eps_low: float = 0.2
    """Lower clip width: ratio bound 1 - eps_low; geometric unit: log-ratio bound -eps_low."""
    eps_high: float = 0.2
    """Upper clip width: ratio bound 1 + eps_high; geometric unit: log-ratio bound +eps_high."""
    dual_clip_c: float | None = None
    """Dual clip for A < 0: per-token loss capped at -A*c (c > 1); None disables it."""
    tau_pos: float = 1.0
    """SAPO gate temperature for tokens with A > 0."""
    tau_neg: float = 1.05
    """SAPO gate temperature for tokens with A <= 0."""
    eps_low_is: float | None = None
    """CISPO: IS weight lower bound 1 - eps_low_is; None = no lower bound (the paper)."""
    eps_high_is: float = 0.2
    """CISPO: IS weight upper bound 1 + eps_high_is (unpublished; verl's example uses 0.2)."""
    cispo_trust_region_mask: bool = False
    """CISPO unified form: zero tokens with A > 0, r > 1 + eps_high or A < 0, r < 1 - eps_low."""
    log_ratio_clamp: float = DEFAULT_LOG_RATIO_CLAMP
    """Every exp(log-ratio) clamps its exponent to [-c, c] (zero gradient outside); c > 0."""
    rspo_gamma_min: float | None = None
    """RSPO: floor of the router-shift weight gamma (applied once); None disables RSPO."""
    rspo_apply: Literal["before_clip", "after_clip"] = "after_clip"
    """RSPO: sg[gamma] scales the ratio before the gate, or the gated term after it."""
    mismatch: Literal["none", "tis", "mis", "icepop"] = "none"
    """Train/rollout correction: tis truncates the ratio, mis/icepop zero it outside a band."""
    mismatch_level: Literal["token", "sequence"] = "token"
    """Per-token ratio pi_old/pi_rollout, or per-sequence product of those ratios."""
    mismatch_low: float | None = None
    """Lower band edge; None = the mode's default (tis 0, mis 0.5, icepop 0.5)."""
    mismatch_high: float | None = None
    """Upper band edge; None = the mode's default (tis 2, mis 2, icepop 5)."""
    overlong_filter: bool = False
    """DAPO overlong filtering: drop every token of a truncated sample (needs truncated_S)."""
    entropy_top_rho: float | None = None
    """Beyond-80/20: keep only the top ceil(rho*N) entropy tokens of the batch; None disables."""
    stapo_tau_p: float | None = None
    """STAPO S2T probability threshold tau_p; None disables the S2T mask."""
    stapo_q: float = 0.75
    """STAPO: entropy quantile (linear interpolation) over the S2T candidate tokens."""
    aggregation: Literal[
        "token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "constant_normalizer"
    ] = "token_mean"
    """How per-token losses become one scalar (global counts come from the caller)."""
    max_len: int | None = None
    """Dr. GRPO constant normaliser L_max; required by (and only by) constant_normalizer."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """Estimator of KL(pi || pi_ref) used as a loss term (see ``algos.kl``)."""
    kl_coef: float = 0.0
    """Weight of the KL loss term; 0 disables it."""
    kl_in_reward_coef: float = 0.0
    """Weight beta of the k1 KL penalty put into the reward by ``compute_advantages``."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus (loss -= coef * entropy); 0 disables it."""
    distill_coef: float = 0.0
    """Weight of the on-policy distillation term (reverse KL to the ``distill`` teachers, ``algos.distill``); 0 disables it."""
    distill_estimator: Literal["sampled", "topk"] = "sampled"
    """sampled: the sampled token's log-ratio as an advantage; topk: the KL over the teacher's top-k (+ tail) as a loss."""
    rl_coef: float = 1.0
    """Weight of the reward advantages; 0 with distill_coef > 0 is pure distillation."""
    advantage: str = "grpo"
    """Advantage estimator name in ``ADVANTAGE_ESTIMATORS``."""
    std_estimator: Literal["sample", "population"] = "sample"
    """GRPO std and whitening variance: sample (N - 1, as torch.std) or population (N)."""
    adv_std_eps: float = 1e-6
    """GRPO: advantage = (R - mean) / (std + adv_std_eps)."""
    whiten_eps: float = 1e-8
    """REINFORCE++ whitening: (x - mean) * rsqrt(var + whiten_eps), as verl's masked_whiten."""
    turn_credit: Literal["trajectory", "turn"] = "trajectory"
    """Multi-turn credit: one reward per trajectory, or per turn a discounted return (``algos.turn_credit``)."""
    turn_discount: float = 1.0
    """gamma of the per-turn returns G_k = sum_{j >= k} gamma^(j - k) r_j; in (0, 1]."""
    dynamic_sampling: bool = False
    """DAPO dynamic sampling: the trainer keeps only groups whose rewards are not all equal."""
    overlong_penalty_max_len: int | None = None
    """DAPO soft overlong punishment L_max (tokens); None disables the punishment."""
    overlong_penalty_cache_len: int = 4096
    """DAPO soft overlong punishment buffer L_cache (tokens)."""
    check_inputs: bool = True
    """Check input values (NaN/inf, ids, masks; one host sync per call); off in trusted hot loops."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Rejects invalid values and incompatible combinations.

        Raises:
            ObjectiveConfigError: the message names the offending field(s).
        """
        self._validate_choices()
        self._validate_ranges()
        self._validate_combinations()

    @property
    def uses_reference(self) -> bool:
        """Whether a KL term (as a loss or in the reward) needs a frozen reference model's log-probs."""
        return self.kl_coef > 0 or self.kl_in_reward_coef > 0

    def mismatch_bounds(self) -> tuple[float, float]:
        """Returns the (low, high) band of the mismatch correction, defaults resolved."""
        default_low, default_high = MISMATCH_DEFAULT_BOUNDS.get(self.mismatch, (0.0, 0.0))
        low = default_low if self.mismatch_low is None else self.mismatch_low
        high = default_high if self.mismatch_high is None else self.mismatch_high
        return low, high

    def _validate_choices(self) -> None:
        choices = {
            "ratio_unit": RATIO_UNITS,
            "gate": GATES,
            "aggregation": AGGREGATIONS,
            "mismatch": MISMATCH_MODES,
            "mismatch_level": MISMATCH_LEVELS,
            "kl_estimator": KL_ESTIMATORS,
            "std_estimator": STD_ESTIMATORS,
            "rspo_apply": RSPO_APPLY,
            "advantage": ADVANTAGE_ESTIMATORS.names(),
            "turn_credit": TURN_CREDITS,
            "distill_estimator": DISTILL_ESTIMATORS,
        }
        for name, allowed in choices.items():
            value = getattr(self, name)
            if value not in allowed:
                raise ObjectiveConfigError(f"{name}={value!r} is not one of {', '.join(allowed)}")
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, float) and value != value:
                raise ObjectiveConfigError(f"{f.name} is NaN")

    def _validate_ranges(self) -> None:
        _require(self.eps_low >= 0, "eps_low", f"must be >= 0, got {self.eps_low}")
        _require(self.eps_high >= 0, "eps_high", f"must be >= 0, got {self.eps_high}")
        if self.ratio_unit != "geometric":
            # 1 - eps_low is a ratio bound and ratios are positive.
            _require(
                self.eps_low <= 1,
                "eps_low",
                f"must be <= 1 (1 - eps_low is the lower ratio bound), got {self.eps_low}",
            )
        if self.dual_clip_c is not None:
            _require(self.dual_clip_c > 1, "dual_clip_c", f"must be > 1, got {self.dual_clip_c}")
        _require(self.tau_pos > 0, "tau_pos", f"must be > 0, got {self.tau_pos}")
        _require(self.tau_neg > 0, "tau_neg", f"must be > 0, got {self.tau_neg}")
        if self.eps_low_is is not None:
            _require(
                0 <= self.eps_low_is <= 1,
                "eps_low_is",
                f"must be in [0, 1] or None, got {self.eps_low_is}",
            )
        _require(self.eps_high_is >= 0, "eps_high_is", f"must be >= 0, got {self.eps_high_is}")
        _require(
            0 < self.log_ratio_clamp < math.inf,
            "log_ratio_clamp",
            f"must be a finite number > 0, got {self.log_ratio_clamp}",
        )
        if self.rspo_gamma_min is not None:
            _require(
                0 <= self.rspo_gamma_min <= 1,
                "rspo_gamma_min",
                f"must be in [0, 1] or None, got {self.rspo_gamma_min}",
            )
        low, high = self.mismatch_bounds()
        if self.mismatch != "none":
            _require(low >= 0, "mismatch_low", f"must be >= 0, got {low}")
            _require(high > low, "mismatch_high", f"must be > mismatch_low ({low}), got {high}")
        if self.entropy_top_rho is not None:
            _require(
                0 < self.entropy_top_rho <= 1,
                "entropy_top_rho",
                f"must be in (0, 1], got {self.entropy_top_rho}",
            )
        if self.stapo_tau_p is not None:
            _require(
                0 < self.stapo_tau_p <= 1,
                "stapo_tau_p",
                f"must be in (0, 1], got {self.stapo_tau_p}",
            )
        _require(0 < self.stapo_q <= 1, "stapo_q", f"must be in (0, 1], got {self.stapo_q}")
        _require(0 < self.turn_discount <= 1, "turn_discount", f"must be in (0, 1], got {self.turn_discount}")
        for name in ("kl_coef", "kl_in_reward_coef", "entropy_coef", "adv_std_eps", "whiten_eps", "distill_coef",
                     "rl_coef"):
            _require(getattr(self, name) >= 0, name, f"must be >= 0, got {getattr(self, name)}")
        if self.overlong_penalty_max_len is not None:
            _require(
                0 < self.overlong_penalty_cache_len < self.overlong_penalty_max_len,
                "overlong_penalty_cache_len",
                f"must be in (0, overlong_penalty_max_len={self.overlong_penalty_max_len}), "
                f"got {self.overlong_penalty_cache_len}",
            )

    def _validate_combinations(self) -> None:
        _require(self.rl_coef > 0 or self.distill_coef > 0, "rl_coef",
                 "is 0 and so is distill_coef: the objective would have no signal")
        allowed = _UNIT_GATES[self.ratio_unit]
        _require(
            self.gate in allowed,
            "gate",
            f"gate={self.gate!r} is incompatible with ratio_unit={self.ratio_unit!r} "
            f"(allowed: {', '.join(allowed)})",
        )
        if self.dual_clip_c is not None:
            _require(
                self.gate == "clip" and self.ratio_unit in ("token", "sequence", "sequence_token"),
                "dual_clip_c",
                "needs gate='clip' with ratio_unit token, sequence or sequence_token",
            )
        if self.cispo_trust_region_mask:
            _require(self.gate == "cispo", "cispo_trust_region_mask", "needs gate='cispo'")
        self._validate_bounds_inside_clamp()
        if self.rspo_gamma_min is not None and self.rspo_apply == "before_clip":
            _require(
                self.ratio_unit != "none",
                "rspo_apply",
                "'before_clip' needs a ratio; ratio_unit='none' has none",
            )
        if self.mismatch == "none":
            for name in ("mismatch_low", "mismatch_high"):
                _require(getattr(self, name) is None, name, "is set but mismatch='none'")
            _require(
                self.mismatch_level == "token",
                "mismatch_level",
                "is 'sequence' but mismatch='none'",
            )
        if self.aggregation == "constant_normalizer":
            _require(
                isinstance(self.max_len, int) and self.max_len >= 1,
                "max_len",
                f"must be a positive int for aggregation='constant_normalizer', "
                f"got {self.max_len!r}",
            )
        else:
            _require(
                self.max_len is None,
                "max_len",
                f"is only used by aggregation='constant_normalizer', not {self.aggregation!r}",
            )

    def _validate_bounds_inside_clamp(self) -> None:
        # A bound past the clamp would be cut by it: the clip would no longer be exact there.
        c = self.log_ratio_clamp
        bounds: dict[str, float] = {}
        if self.gate == "clip" and self.ratio_unit == "geometric":
            bounds = {"eps_low": self.eps_low, "eps_high": self.eps_high}
        elif self.gate == "clip":
            bounds = {"eps_high": math.log1p(self.eps_high)}
            if self.dual_clip_c is not None:
                bounds["dual_clip_c"] = math.log(self.dual_clip_c)
        elif self.gate == "cispo":
            bounds = {"eps_high_is": math.log1p(self.eps_high_is)}
            if self.cispo_trust_region_mask:
                bounds["eps_high"] = math.log1p(self.eps_high)
        for name, log_bound in bounds.items():
            _require(
                log_bound < c,
                "log_ratio_clamp",
                f"{c} must exceed the log of the {name} bound ({log_bound:.6g}); "
                "raise log_ratio_clamp or narrow the clip",
            )


def _require(ok: bool, field_name: str, message: str) -> None:
    if not ok:
        raise ObjectiveConfigError(f"ObjectiveConfig.{field_name}: {message}")
