"""The objective's settings as typed, frozen values, built once from a `GRPOConfig` (`objective_settings`), which
does so in its `__post_init__`: every check below runs when the config is built, before any weight loads.

    AdvantageSettings   how rewards become advantages (advantages.py)
    LogProbSettings     how the log-prob pass reads the model (logprobs.py), for the policy, pi_old and pi_ref alike
    LossSettings        the policy loss of one micro-batch (loss.py) and what the step loss adds around it
                        (step_loss.py): token weights, the entropy bonus, the sampler's correction

The public `GRPOConfig` stays TRL's flat class; these values are what the objective's functions take instead of a
config or a dozen keywords. What a loss type allows is a field of its row in loss_types.py, checked here when the
settings come from a config (`LossSettings.from_config`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from grpo.objective.loss_types import TERM_DEFAULTS, loss_type_of
from grpo.objective.sequence_parallel import check_config, parallel_sizes

SCALE_REWARDS = ("group", "batch", "none")
# TRL's `multi_objective_aggregation` values: sum the weighted rewards, then normalise (GRPO); or normalise each reward
# function within its group, then sum (GDPO).
MULTI_OBJECTIVE_AGGREGATIONS = ("sum_then_normalize", "normalize_then_sum")
# Turn-level credit (`GRPOConfig.turn_advantage`, advantages.py `turn_group_advantages`): each turn's own reward
# against its group's (MT-GRPO, arXiv:2505.11821), or its rewards from that turn on.
TURN_ADVANTAGES = ("mt_grpo", "reward_to_go")
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")
SAMPLING_CORRECTIONS = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


@dataclass(frozen=True)
class AdvantageSettings:
    """`mixed_advantages`' settings: `scale_rewards` ("group", "batch", "none"), the `baseline` of a group of one
    (offline data), and how several reward functions are combined (`aggregation`); turn-level credit's `turn_scheme`
    (None: off) and `turn_coef` (`turn_credit_advantages`)."""

    scale_rewards: str = "group"
    baseline: float | None = None
    aggregation: str = "sum_then_normalize"
    turn_scheme: str | None = None
    turn_coef: float = 1.0

    def __post_init__(self):
        if self.turn_scheme is not None and self.turn_scheme not in TURN_ADVANTAGES:
            raise ValueError(
                f"turn_advantage={self.turn_scheme!r} is not one of {TURN_ADVANTAGES} (or None, off): 'mt_grpo' "
                "credits each turn's own reward, 'reward_to_go' its rewards from that turn on (docs/agents.md)."
            )
        if self.turn_scheme is None and self.turn_coef != 1.0:
            raise ValueError(
                f"turn_advantage_coef={self.turn_coef} weighs turn-level credit, which is off (turn_advantage=None). "
                "Set turn_advantage='mt_grpo' (or 'reward_to_go'), or leave turn_advantage_coef at 1.0."
            )
        if self.scale_rewards not in SCALE_REWARDS:
            raise ValueError(f"scale_rewards={self.scale_rewards!r} is not one of {SCALE_REWARDS} (or True/False).")
        if self.aggregation not in MULTI_OBJECTIVE_AGGREGATIONS:
            raise ValueError(
                f"multi_objective_aggregation={self.aggregation!r} is not one of {MULTI_OBJECTIVE_AGGREGATIONS}: sum "
                "the rewards then normalise, or normalise each then sum (GDPO)."
            )
        if self.aggregation == "normalize_then_sum" and self.baseline is not None:
            raise ValueError(
                "offline_baseline gives a lone stored completion the advantage reward - baseline, but "
                "multi_objective_aggregation='normalize_then_sum' normalises each reward function on its own, where a "
                "lone row has no spread. Set offline_baseline=None (lone rows then get 0), or sum_then_normalize."
            )

    @classmethod
    def from_config(cls, args) -> AdvantageSettings:
        return cls(
            args.scale_rewards,
            args.offline_baseline,
            args.multi_objective_aggregation,
            args.turn_advantage,
            args.turn_advantage_coef,
        )


@dataclass(frozen=True)
class LogProbSettings:
    """`completion_logprobs`' settings for a whole run: the sampling `temperature` the logits are divided by, the
    projection's row `chunk_size` (None: from the vocabulary), `head_fp32` (`cast_lm_head_to_fp32`), and the widths
    the forward sees rounded up to `pad_to_multiple_of`, and the processes that split each sequence,
    `sequence_parallel_size` (accelerate's sp_size; sequence_parallel.py)."""

    temperature: float = 1.0
    chunk_size: int | None = None
    head_fp32: bool = False
    pad_to_multiple_of: int | None = None
    sequence_parallel_size: int = 1

    @classmethod
    def from_config(cls, args) -> LogProbSettings:
        sp_size, cp_size = parallel_sizes(args)
        if sp_size > 1 or cp_size > 1:
            check_config(args, sp_size, cp_size)
        head = args.cast_lm_head_to_fp32
        return cls(args.temperature, args.logprobs_chunk_size, head, args.pad_to_multiple_of, sp_size)


@dataclass(frozen=True)
class SamplingCorrection:
    """Truncated importance sampling against a sampler with numerics or weights of its own (`sampling_correction`
    in token_weights.py): `enabled` (`vllm_importance_sampling_correction`), its `mode` and the ratio's bounds
    [floor, cap] (`vllm_importance_sampling_clip_min` / `_max`; None leaves a side open)."""

    enabled: bool = False
    mode: str = "token_truncate"
    cap: float | None = 2.0
    floor: float | None = None

    def __post_init__(self):
        if self.mode not in SAMPLING_CORRECTIONS:
            raise ValueError(f"vllm_importance_sampling_mode={self.mode!r} is not one of {SAMPLING_CORRECTIONS}.")
        if self.floor is not None and self.cap is not None and self.floor >= self.cap:
            raise ValueError(
                f"vllm_importance_sampling_clip_min={self.floor} must be below vllm_importance_sampling_clip_max="
                f"{self.cap}: they bound the importance-sampling ratio from below and above. Lower clip_min or raise "
                "clip_max."
            )
        if self.floor is None and self.cap is None and self.mode.endswith("truncate"):
            raise ValueError(
                f"vllm_importance_sampling_mode={self.mode!r} truncates the ratio to [clip_min, clip_max], but both "
                "are None. Set vllm_importance_sampling_clip_max (e.g. 2.0)."
            )


@dataclass(frozen=True)
class EntropySettings:
    """The entropy bonus (regularizers.py): its coefficient `coef`, fixed or under adaptive control (`adaptive`,
    with `target`, the step `delta` and the bounds [minimum, maximum])."""

    coef: float = 0.0
    adaptive: bool = False
    target: float = 0.2
    delta: float = 0.005
    minimum: float = 0.0
    maximum: float = 1.0

    def __post_init__(self):
        if self.minimum > self.maximum:
            raise ValueError(
                f"entropy_coef_min={self.minimum} is above entropy_coef_max={self.maximum}: they bound the adaptive "
                "entropy coefficient from below and above. Lower entropy_coef_min or raise entropy_coef_max."
            )
        if self.adaptive and not self.minimum <= self.coef <= self.maximum:
            raise ValueError(
                f"use_adaptive_entropy=True starts from entropy_coef={self.coef}, outside [entropy_coef_min, "
                f"entropy_coef_max] = [{self.minimum}, {self.maximum}]. Set entropy_coef within the bounds (e.g. "
                f"{self.minimum})."
            )

    @property
    def enabled(self) -> bool:
        """Whether the loss has an entropy term at all (adaptive: always, since the coefficient may rise from 0)."""
        return self.coef != 0.0 or self.adaptive


@dataclass(frozen=True)
class LossSettings:
    """The loss of one micro-batch for a whole run (docs/method.md). `policy_loss` reads the first group: the loss
    type, the KL weight `beta`, the clipping range [1 - epsilon_low, 1 + epsilon_high] (None: epsilon_low), the cap
    `delta` of two-sided clipping, the ratio's `importance_sampling_level`, `max_completion_length` (dr_grpo's
    constant), `bias_correction_kl`, and `term_knobs` (sapo's and vespo's, TRL's names: `TERM_DEFAULTS`). The step
    loss reads the rest: the high-entropy token mask, off-policy sequence masking, the sampler's correction and the
    entropy bonus."""

    loss_type: str = "dapo"
    beta: float = 0.0
    epsilon_low: float = 0.2
    epsilon_high: float | None = None
    delta: float | None = None
    importance_sampling_level: str = "token"
    max_completion_length: int | None = None
    bias_correction_kl: bool = False
    term_knobs: dict[str, float] = field(default_factory=lambda: dict(TERM_DEFAULTS))
    top_entropy_quantile: float = 1.0
    off_policy_mask_threshold: float | None = None
    sampling: SamplingCorrection = SamplingCorrection()
    entropy: EntropySettings = EntropySettings()

    def __post_init__(self):
        if self.epsilon_high is None:
            object.__setattr__(self, "epsilon_high", self.epsilon_low)
        object.__setattr__(self, "term_knobs", TERM_DEFAULTS | self.term_knobs)
        if self.importance_sampling_level not in IMPORTANCE_SAMPLING_LEVELS:
            raise ValueError(
                f"importance_sampling_level={self.importance_sampling_level!r} is not one of "
                f"{IMPORTANCE_SAMPLING_LEVELS}."
            )
        loss_type_of(self.loss_type)  # a known loss type
        if self.delta is not None and self.delta <= 1 + self.epsilon_high:
            raise ValueError(
                f"delta={self.delta} must be > 1 + epsilon_high = {1 + self.epsilon_high}: it caps ratios above the "
                "clipping range. Raise delta, or set None to turn two-sided clipping off."
            )

    @property
    def keeps_sampling_logps(self) -> bool:
        """Whether a round keeps the sampler's own log-probs: for the importance-sampling correction, or as the
        behaviour policy of off-policy sequence masking."""
        return self.sampling.enabled or self.off_policy_mask_threshold is not None

    @property
    def spans_the_step(self) -> bool:
        """Whether the loss type's normaliser counts the loss tokens of the whole optimizer step (loss_types.py)."""
        return loss_type_of(self.loss_type).normalised_over == "step"

    @classmethod
    def from_config(cls, args) -> LossSettings:
        """A `GRPOConfig`'s loss, refused where its loss type's rules refuse it (`LossType.check`: what its term
        cannot use, and a sampler correction it cannot fold in, for which the config says whether another engine
        samples). Built directly, as the loss tests do, the settings are checked for consistency only."""
        sampling = SamplingCorrection(
            args.vllm_importance_sampling_correction,
            args.vllm_importance_sampling_mode,
            args.vllm_importance_sampling_clip_max,
            args.vllm_importance_sampling_clip_min,
        )
        entropy = EntropySettings(
            args.entropy_coef,
            args.use_adaptive_entropy,
            args.entropy_target,
            args.entropy_coef_delta,
            args.entropy_coef_min,
            args.entropy_coef_max,
        )
        settings = cls(
            loss_type=args.loss_type,
            beta=args.beta,
            epsilon_low=args.epsilon,
            epsilon_high=args.epsilon_high,
            delta=args.delta,
            importance_sampling_level=args.importance_sampling_level,
            max_completion_length=args.max_completion_length,
            bias_correction_kl=args.use_bias_correction_kl,
            term_knobs={name: getattr(args, name) for name in TERM_DEFAULTS},
            top_entropy_quantile=args.top_entropy_quantile,
            off_policy_mask_threshold=args.off_policy_mask_threshold,
            sampling=sampling,
            entropy=entropy,
        )
        rules = loss_type_of(args.loss_type)
        rules.check(settings)
        rules.check_sampler(args.loss_type, sampling, other_sampler=args.use_vllm or args.async_generation)
        return settings


class ObjectiveSettings(NamedTuple):
    """The objective's settings of one run, by stage."""

    advantages: AdvantageSettings
    logprobs: LogProbSettings
    loss: LossSettings


def objective_settings(args) -> ObjectiveSettings:
    """Every objective setting of a `GRPOConfig`, each checked as it is built (in the order the checks ran before
    they moved here: advantages, the loss, the sampler's correction, the entropy bonus)."""
    advantages = AdvantageSettings.from_config(args)
    return ObjectiveSettings(advantages, LogProbSettings.from_config(args), LossSettings.from_config(args))
