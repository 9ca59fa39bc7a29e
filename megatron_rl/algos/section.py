"""The ``objective`` section of a run config: a named preset plus typed overrides.

Owns :class:`ObjectiveSection` and how it becomes an :class:`ObjectiveConfig`
(:meth:`ObjectiveSection.resolve`). Every option mirrors the ObjectiveConfig field of the
same name, with the same type and one-line docstring, and may also hold
:data:`FROM_PRESET` (``"preset"``, the default), which means "the preset's value". Null
keeps ObjectiveConfig's meaning (for ``rspo_gamma_min`` it disables RSPO, for ``max_len``
it unsets the length), so any preset value can be overridden, None included, and a
written-out config (``to_dict``) loads back as the same section. A unit test holds the
mirror one for one.

Types are checked by the generic loader (``megatron_rl.config_loading``) when the run config
is read; the rules across options are ObjectiveConfig's own. This module imports nothing
from ``megatron_rl.config``: it raises :class:`ObjectiveConfigError` and the run config
turns that into its ``ConfigError``.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Literal

from .config import ObjectiveConfig, ObjectiveConfigError
from .presets import OBJECTIVE_PRESETS, get_preset

FROM_PRESET = "preset"
"""Value of an option left to the preset (the default of every option)."""

FromPreset = Literal["preset"]


@dataclass(kw_only=True)
class ObjectiveSection:
    """Objective: ``preset`` (``algos.presets``) and overrides of its ObjectiveConfig fields.

    An option set to ``preset`` (the default) keeps the preset's value; any other value,
    null included, replaces it.
    """

    preset: str = "grpo"
    """Named objective preset the other options start from (``OBJECTIVE_PRESETS``)."""
    ratio_unit: Literal["token", "sequence", "sequence_token", "geometric", "none"] | FromPreset = FROM_PRESET
    """Ratio the gate sees: token r_t, sequence (GSPO), sequence_token, geometric (GMPO), none."""
    gate: Literal["clip", "soft", "cispo", "none"] | FromPreset = FROM_PRESET
    """clip (PPO), soft (SAPO), cispo (clipped stop-gradient IS weight x log pi) or none."""
    eps_low: float | FromPreset = FROM_PRESET
    """Lower clip width: ratio bound 1 - eps_low; geometric unit: log-ratio bound -eps_low."""
    eps_high: float | FromPreset = FROM_PRESET
    """Upper clip width: ratio bound 1 + eps_high; geometric unit: log-ratio bound +eps_high."""
    dual_clip_c: float | None | FromPreset = FROM_PRESET
    """Dual clip for A < 0: per-token loss capped at -A*c (c > 1); None disables it."""
    tau_pos: float | FromPreset = FROM_PRESET
    """SAPO gate temperature for tokens with A > 0."""
    tau_neg: float | FromPreset = FROM_PRESET
    """SAPO gate temperature for tokens with A <= 0."""
    eps_low_is: float | None | FromPreset = FROM_PRESET
    """CISPO: IS weight lower bound 1 - eps_low_is; None = no lower bound (the paper)."""
    eps_high_is: float | FromPreset = FROM_PRESET
    """CISPO: IS weight upper bound 1 + eps_high_is (unpublished; verl's example uses 0.2)."""
    cispo_trust_region_mask: bool | FromPreset = FROM_PRESET
    """CISPO unified form: zero tokens with A > 0, r > 1 + eps_high or A < 0, r < 1 - eps_low."""
    log_ratio_clamp: float | FromPreset = FROM_PRESET
    """Every exp(log-ratio) clamps its exponent to [-c, c] (zero gradient outside); c > 0."""
    rspo_gamma_min: float | None | FromPreset = FROM_PRESET
    """RSPO: floor of the router-shift weight gamma (applied once); None disables RSPO."""
    rspo_apply: Literal["before_clip", "after_clip"] | FromPreset = FROM_PRESET
    """RSPO: sg[gamma] scales the ratio before the gate, or the gated term after it."""
    mismatch: Literal["none", "tis", "mis", "icepop"] | FromPreset = FROM_PRESET
    """Train/rollout correction: tis truncates the ratio, mis/icepop zero it outside a band."""
    mismatch_level: Literal["token", "sequence"] | FromPreset = FROM_PRESET
    """Per-token ratio pi_old/pi_rollout, or per-sequence product of those ratios."""
    mismatch_low: float | None | FromPreset = FROM_PRESET
    """Lower band edge; None = the mode's default (tis 0, mis 0.5, icepop 0.5)."""
    mismatch_high: float | None | FromPreset = FROM_PRESET
    """Upper band edge; None = the mode's default (tis 2, mis 2, icepop 5)."""
    overlong_filter: bool | FromPreset = FROM_PRESET
    """DAPO overlong filtering: drop every token of a truncated sample (needs truncated_S)."""
    entropy_top_rho: float | None | FromPreset = FROM_PRESET
    """Beyond-80/20: keep only the top ceil(rho*N) entropy tokens of the batch; None disables."""
    stapo_tau_p: float | None | FromPreset = FROM_PRESET
    """STAPO S2T probability threshold tau_p; None disables the S2T mask."""
    stapo_q: float | FromPreset = FROM_PRESET
    """STAPO: entropy quantile (linear interpolation) over the S2T candidate tokens."""
    aggregation: Literal[
        "token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "constant_normalizer"
    ] | FromPreset = FROM_PRESET
    """How per-token losses become one scalar (global counts come from the caller)."""
    max_len: int | None | FromPreset = FROM_PRESET
    """Dr. GRPO constant normaliser L_max; required by (and only by) constant_normalizer."""
    kl_estimator: Literal["k1", "k2", "k3"] | FromPreset = FROM_PRESET
    """Estimator of KL(pi || pi_ref) used as a loss term (see ``algos.kl``)."""
    kl_coef: float | FromPreset = FROM_PRESET
    """Weight of the KL loss term; 0 disables it."""
    kl_in_reward_coef: float | FromPreset = FROM_PRESET
    """Weight beta of the k1 KL penalty put into the reward by ``compute_advantages``."""
    entropy_coef: float | FromPreset = FROM_PRESET
    """Weight of the entropy bonus (loss -= coef * entropy); 0 disables it."""
    advantage: str | FromPreset = FROM_PRESET
    """Advantage estimator name in ``ADVANTAGE_ESTIMATORS``."""
    std_estimator: Literal["sample", "population"] | FromPreset = FROM_PRESET
    """GRPO std and whitening variance: sample (N - 1, as torch.std) or population (N)."""
    adv_std_eps: float | FromPreset = FROM_PRESET
    """GRPO: advantage = (R - mean) / (std + adv_std_eps)."""
    whiten_eps: float | FromPreset = FROM_PRESET
    """REINFORCE++ whitening: (x - mean) * rsqrt(var + whiten_eps), as verl's masked_whiten."""
    dynamic_sampling: bool | FromPreset = FROM_PRESET
    """DAPO dynamic sampling: the trainer keeps only groups whose rewards are not all equal."""
    overlong_penalty_max_len: int | None | FromPreset = FROM_PRESET
    """DAPO soft overlong punishment L_max (tokens); None disables the punishment."""
    overlong_penalty_cache_len: int | FromPreset = FROM_PRESET
    """DAPO soft overlong punishment buffer L_cache (tokens)."""
    check_inputs: bool | FromPreset = FROM_PRESET
    """Validate input tensors (one host sync per call); turn off in trusted hot loops."""

    def overrides(self) -> dict[str, Any]:
        """The options this section sets, by ObjectiveConfig field name."""
        return {
            f.name: getattr(self, f.name)
            for f in fields(self)
            if f.name != "preset" and getattr(self, f.name) != FROM_PRESET
        }

    def resolve(self, prefix: str = "objective") -> ObjectiveConfig:
        """The preset with this section's overrides applied, validated.

        Raises:
            ObjectiveConfigError: the message starts with ``<prefix>.<option>: `` (the
                option the rule names; ``<prefix>.preset`` for an unknown preset).
        """
        if self.preset not in OBJECTIVE_PRESETS.names():
            raise ObjectiveConfigError(
                f"{prefix}.preset: unknown objective {self.preset!r}; "
                f"available: {sorted(OBJECTIVE_PRESETS.names())}"
            )
        try:
            return get_preset(self.preset, **self.overrides())
        except ObjectiveConfigError as err:
            option, rule = _split_error(str(err))
            raise ObjectiveConfigError(f"{prefix}.{option}: {rule}") from None


_FIELD_NAMES = tuple(f.name for f in fields(ObjectiveConfig))


def _split_error(message: str) -> tuple[str, str]:
    """(option, rule) of an ObjectiveConfig validation message.

    ObjectiveConfig writes ``ObjectiveConfig.<field>: <rule>`` for ranges and combinations
    and ``<field>=<value> is not one of ...`` or ``<field> is NaN`` for single values.
    """
    head, sep, rule = message.partition(": ")
    if sep and head.startswith("ObjectiveConfig.") and head.split(".", 1)[1] in _FIELD_NAMES:
        return head.split(".", 1)[1], rule
    word = message.replace("=", " ").split(" ", 1)[0]
    return (word, message) if word in _FIELD_NAMES else ("preset", message)
