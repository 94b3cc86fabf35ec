"""`policy_loss` called the way the loss tests write their cases: one flat set of keywords, split here into the
run's `LossSettings` (loss type, beta, epsilons, delta, level, max_completion_length, bias_correction_kl and the
terms' knobs) and the micro-batch's own inputs (policy_mask, normalizer, sampling_weights, entropy, entropy_coef)."""

from grpo.objective.loss import policy_loss
from grpo.objective.loss_types import TERM_DEFAULTS
from grpo.objective.settings import LossSettings

PER_MICRO_BATCH = ("policy_mask", "normalizer", "sampling_weights", "entropy", "entropy_coef")


def settings_of(**keywords) -> LossSettings:
    """The `LossSettings` of keywords named as `LossSettings`' fields, with the terms' knobs (TRL's names) among
    them."""
    knobs = {name: keywords.pop(name) for name in TERM_DEFAULTS if name in keywords}
    return LossSettings(**keywords, term_knobs=knobs)


def loss_with(logps, old_logps, ref_logps, advantages, mask, **keywords):
    """`policy_loss` with `keywords` split into its settings and this micro-batch's inputs."""
    inputs = {name: keywords.pop(name) for name in PER_MICRO_BATCH if name in keywords}
    return policy_loss(logps, old_logps, ref_logps, advantages, mask, settings_of(**keywords), **inputs)
