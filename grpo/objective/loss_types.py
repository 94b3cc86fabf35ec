"""Everything a `loss_type` decides, in one table: the per-token policy term it trains, how its per-token losses become
one number, whether that number's normaliser spans the micro-batch or the whole optimizer step, and the settings it
refuses (`LossType.check`, run when `LossSettings` is built). `loss.py` reads the table (`aggregate`, `accumulation`,
`policy_loss`), settings.py its rules; nothing else names a loss type.

Notation as in loss.py (docs/method.md): r the importance ratio pi_theta / pi_old (per token, or per row at
`importance_sampling_level="sequence"`), A the advantages, logp the policy's log-probs, m the loss mask, sg() stop
gradient. Each term is the surrogate s the loss maximises (the per-token loss is -s); all of them have the on-policy
gradient A * d logp of the plain policy gradient (r = 1), and differ in how they treat tokens whose ratio has moved.
"""

from __future__ import annotations

import difflib
import math
from typing import NamedTuple

import torch


class LossType(NamedTuple):
    """One row of `LOSS_TYPE_TABLE`: what the loss type computes, then the settings it refuses (`check`)."""

    term: str  # the per-token policy term: "clipped", "cispo", "sapo" or "vespo" (`policy_term`)
    reduction: str  # how per-token losses become one number: "sequence_mean", "token_mean", "constant", "sequence_sum"
    normalised_over: str  # "micro_batch": a mean over the micro-batch; "step": over the whole optimizer step
    level: str | None = None  # the one importance_sampling_level it is defined on (None: either), and why:
    level_why: str = ""
    min_epsilon_high: float | None = None  # the lowest epsilon_high its term makes sense with, and why:
    epsilon_high_why: str = ""
    token_corrections_only: bool = False  # the sampler's correction weights must be per token

    def check(self, settings) -> None:
        """Refuse the `LossSettings` this loss type cannot train with, naming the fix."""
        name = settings.loss_type
        if self.term != "clipped" and settings.delta is not None:
            clipped = ", ".join(n for n, row in LOSS_TYPE_TABLE.items() if row.term == "clipped")
            raise ValueError(
                f"delta={settings.delta} caps the ratio of PPO's clipped term, which loss_type={name!r} does not use. "
                f"Set delta=None, or pick a loss_type with the clipped term ({clipped})."
            )
        # A knob of another term (sapo's gate, vespo's weight) moved off its default: TRL ignores it; refused here.
        moved = [n for n, v in settings.term_knobs.items() if v != TERM_DEFAULTS[n] and not n.startswith(self.term)]
        if moved:
            owner = moved[0].split("_")[0]
            moved = [n for n in moved if n.startswith(owner)]  # one loss type's knobs per message
            values = ", ".join(f"{n}={settings.term_knobs[n]}" for n in moved)
            raise ValueError(
                f"{values} shapes the term of loss_type={owner!r}, which loss_type={name!r} does not use, so it "
                f"would be ignored. Set loss_type={owner!r}, or leave the default: "
                f"{', '.join(f'{n}={TERM_DEFAULTS[n]}' for n in moved)}."
            )
        if self.min_epsilon_high is not None and settings.epsilon_high < self.min_epsilon_high:
            raise ValueError(self.epsilon_high_why.format(epsilon_high=settings.epsilon_high))
        if self.level is not None and settings.importance_sampling_level != self.level:
            raise ValueError(self.level_why)

    def check_sampler(self, name: str, sampling, other_sampler: bool) -> None:
        """Refuse a correction of another engine's samples (`SamplingCorrection`, used when `other_sampler`: vLLM or
        async generation) that loss type `name`, this row's, cannot fold in."""
        corrected = other_sampler and sampling.enabled
        if self.token_corrections_only and corrected and sampling.mode.startswith("sequence"):
            raise ValueError(
                f"loss_type={name!r} folds the sampler's per-token correction weights into its sequence weight; "
                f"vllm_importance_sampling_mode={sampling.mode!r} gives one per sequence. "
                "Set vllm_importance_sampling_mode='token_truncate' or 'token_mask'."
            )


CISPO_CAP = (
    "loss_type='cispo' caps its importance weight at epsilon_high={epsilon_high}, below the ratio 1 of every "
    "on-policy token, so every token's gradient would shrink. Set epsilon_high to the cap itself, e.g. "
    "epsilon_high=5.0 (ScaleRL's eps_max; TRL reads it the same way)."
)
LUSPO_LEVEL = (
    "loss_type='luspo' is GSPO with each sequence's loss scaled by its length: it is defined on the sequence ratio. "
    "Set importance_sampling_level='sequence'."
)
VESPO_LEVEL = (
    "loss_type='vespo' builds its own sequence weight from the token ratios; importance_sampling_level='sequence' "
    "would change only the KL term's ratio. Leave importance_sampling_level='token'."
)
LOSS_TYPE_TABLE = {
    "grpo": LossType("clipped", "sequence_mean", "micro_batch"),  # DeepSeekMath
    "bnpo": LossType("clipped", "token_mean", "micro_batch"),
    "dr_grpo": LossType("clipped", "constant", "micro_batch"),  # Dr. GRPO
    "dapo": LossType("clipped", "token_mean", "step"),  # DAPO
    "cispo": LossType("cispo", "token_mean", "step", min_epsilon_high=1.0, epsilon_high_why=CISPO_CAP),  # MiniMax-M1
    "sapo": LossType("sapo", "sequence_mean", "micro_batch"),  # SAPO
    "luspo": LossType("clipped", "sequence_sum", "micro_batch", level="sequence", level_why=LUSPO_LEVEL),  # LUSPO
    "vespo": LossType(
        "vespo", "token_mean", "step", level="token", level_why=VESPO_LEVEL, token_corrections_only=True
    ),  # VESPO
}
LOSS_TYPES = tuple(LOSS_TYPE_TABLE)
# The knobs of the terms beyond epsilon: TRL 1.16's GRPOConfig field names and defaults.
TERM_DEFAULTS = {
    "sapo_temperature_pos": 1.0,
    "sapo_temperature_neg": 1.05,
    "vespo_k_pos": 2.0,
    "vespo_lambda_pos": 3.0,
    "vespo_k_neg": 3.0,
    "vespo_lambda_neg": 2.0,
}


def loss_type_of(name: str) -> LossType:
    """The table's row for `name`, or an error listing the valid names (and the closest, for a misspelt one)."""
    if name not in LOSS_TYPE_TABLE:
        close = difflib.get_close_matches(str(name), LOSS_TYPES, n=1, cutoff=0.6)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"loss_type={name!r} is not one of {LOSS_TYPES}.{hint}")
    return LOSS_TYPE_TABLE[name]


def clipped_surrogate(ratio, advantages, epsilon_low: float, epsilon_high: float, delta: float | None = None):
    """PPO's clipped surrogate (grpo, bnpo, dr_grpo, dapo, luspo), with two-sided clipping (INTELLECT-2):

        s = min( min(r, delta) * A, clip(r, 1 - epsilon_low, 1 + epsilon_high) * A )

    ratio (B, T) or (B, 1), advantages (B, 1) or (B, T); returns their broadcast shape."""
    clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high)
    capped = ratio if delta is None else torch.clamp(ratio, max=delta)
    return torch.min(capped * advantages, clipped * advantages)


def cispo_surrogate(ratio, logps, advantages, cap: float):
    """CISPO (MiniMax-M1, arXiv:2506.13585, eq. 4): the ratio is clipped as a weight, never the token's gradient:

        s = sg(min(r, cap)) * A * logp

    so d s = min(r, cap) * A * d logp: every token keeps a gradient (PPO's clip zeroes those outside the range),
    only its weight is bounded. `cap` is TRL's `epsilon_high` (ScaleRL's eps_max, recommended 5.0). `logps` must be
    finite (masked positions set to 0 by the caller). Shapes as `clipped_surrogate`, logps (B, T)."""
    return torch.clamp(ratio, max=cap).detach() * advantages * logps


def sapo_surrogate(ratio, advantages, temperature_pos: float, temperature_neg: float):
    """SAPO (Soft Adaptive Policy Optimization, arXiv:2511.20347): a smooth gate in place of the hard clip,

        tau = temperature_pos if A > 0 else temperature_neg
        s   = (4 / tau) * sigmoid(tau * (r - 1)) * A

    d s = 4 sigmoid'(tau (r - 1)) r A d logp, which is A d logp at r = 1 (sigmoid'(0) = 1/4) and decays smoothly as
    r leaves 1, faster for a larger tau (the paper makes negative tokens' gate the steeper). Shapes as
    `clipped_surrogate`."""
    tau = torch.full_like(advantages, temperature_neg).masked_fill(advantages > 0, temperature_pos)
    return torch.sigmoid(tau * (ratio - 1)) * 4 / tau * advantages


def vespo_weights(
    logps, old_logps, mask, advantages, sampling_weights=None, *, k_pos, lambda_pos, k_neg, lambda_neg
) -> torch.Tensor:
    """VESPO's sequence weight (arXiv:2602.10693), a smooth Gamma-shaped function of the sequence's importance ratio
    w = prod_t r_t (times the sampler's correction weights, when the tokens came from another engine):

        log w = sum_t clamp(logp_t - old_t, -20, 20) m_t + sum_t log(c_t) m_t      c: `sampling_weights`
        phi   = exp( lambda + k log w - lambda w )     (k, lambda) = (k_pos, lambda_pos) if A >= 0 else the _neg pair

    computed in log space with log w clamped to [log 1e-8, 20] (and log c_t to the same range), phi(1) = 1, and a
    non-finite phi set to 0. k pulls the weight down for w < 1, lambda for w > 1. Returns phi detached, (B, 1) for
    advantages (B,) or (B, 1), (B, T) for token advantages; the loss trains sg(phi) * A * logp."""
    with torch.no_grad():
        floor = math.log(1e-8)
        mask = mask.bool()
        log_ratio = torch.where(mask, torch.clamp(logps - old_logps, -20.0, 20.0), 0.0)
        log_w = log_ratio.sum(dim=-1, keepdim=True)  # (B, 1)
        if sampling_weights is not None:
            log_c = torch.clamp(torch.log(sampling_weights), floor, 20.0)
            log_w = log_w + torch.where(mask, log_c, 0.0).sum(dim=-1, keepdim=True)
        log_w = torch.clamp(log_w, floor, 20.0)
        nonnegative = advantages >= 0
        k = torch.full_like(advantages, k_neg).masked_fill(nonnegative, k_pos)  # in A's dtype, not float32
        lam = torch.full_like(advantages, lambda_neg).masked_fill(nonnegative, lambda_pos).clamp(min=1e-4)
        phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w))
        return torch.nan_to_num(phi, nan=0.0, posinf=0.0, neginf=0.0)


def policy_term(
    ratio: torch.Tensor,
    logps: torch.Tensor,
    old_logps: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    settings,
    sampling_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The surrogate s of `settings.loss_type` per token (`LossSettings`: its epsilons, delta and `term_knobs`), with
    the sampler's correction weights c (`sampling_weights`, (B, T) or None) applied: s * c, except for vespo, which
    folds c into its sequence weight. Shapes: ratio (B, T) or (B, 1), logps, old_logps, mask (B, T), advantages
    (B, 1) or (B, T). Returns (s (B, T), stats of the term's own): `cispo_clip_ratio`, the fraction of loss tokens
    with A > 0 whose weight the cap bounds (cispo), `vespo/phi_seq_mean`, the mean weight over loss tokens (vespo);
    the clipped term's clip fractions are `clip_fractions`'."""
    knobs, high = settings.term_knobs, settings.epsilon_high
    term = loss_type_of(settings.loss_type).term
    stats = {}
    finite_logps = torch.where(mask.bool(), logps, 0.0)  # masked positions may hold anything
    if term == "clipped":
        surrogate = clipped_surrogate(ratio, advantages, settings.epsilon_low, high, settings.delta)
    elif term == "cispo":
        surrogate = cispo_surrogate(ratio, finite_logps, advantages, high)
        capped = ((ratio > high) & (advantages > 0)).expand_as(mask)
        stats["cispo_clip_ratio"] = _mean_over(capped.detach(), mask)
    elif term == "sapo":
        surrogate = sapo_surrogate(ratio, advantages, knobs["sapo_temperature_pos"], knobs["sapo_temperature_neg"])
    else:  # vespo
        shape = {name.removeprefix("vespo_"): value for name, value in knobs.items() if name.startswith("vespo_")}
        phi = vespo_weights(logps, old_logps, mask, advantages, sampling_weights, **shape)
        stats["vespo/phi_seq_mean"] = _mean_over(phi.expand_as(mask), mask)
        return (phi * advantages * finite_logps).expand_as(mask), stats
    surrogate = surrogate.expand_as(mask) if surrogate.shape != mask.shape else surrogate
    if sampling_weights is not None:
        surrogate = surrogate * sampling_weights
    return surrogate, stats


def _mean_over(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    mask = mask.bool()
    return torch.where(mask, values.to(torch.float32), 0.0).sum() / mask.sum().clamp(min=1)
