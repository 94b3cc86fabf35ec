"""The GRPO objective as pure functions: the k3 KL estimator, the clipped policy loss and its aggregation
(the advantages it takes are advantages.py's).

Notation (docs/method.md): G completions per prompt, B rows (prompts x G), T completion tokens
(padded), m the loss mask (1 for a completion token that counts), A the advantages, logp / old / ref the per-token
log-probs under the policy, the sampling policy and the reference policy.

Every function takes tensors and scalar knobs and returns tensors: no trainer, no config object. The tests compare
each one with a naive loop over the same inputs (tests/helpers/naive.py) and with numbers worked out by hand.
"""

from __future__ import annotations

import torch

from grpo.objective.loss_types import loss_type_of, policy_term
from grpo.objective.settings import IMPORTANCE_SAMPLING_LEVELS, LossSettings

DEFAULT_LOSS = LossSettings()  # dapo, no KL term, PPO's clip at 0.2 on both sides


def window_token_totals(tokens_per_micro_batch: torch.Tensor, window: int) -> torch.Tensor:
    """dapo's normaliser: for each micro-batch, the loss tokens of the `window` consecutive micro-batches of its
    optimizer step. `tokens_per_micro_batch` (num,), num a multiple of `window`; returns (num,).

        [3, 1, 2, 2], window 2 -> [4, 4, 4, 4]
    """
    totals = tokens_per_micro_batch.view(-1, window).sum(dim=1)
    return totals.repeat_interleave(window)


def kl_k3(logps: torch.Tensor, ref_logps: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL(pi_theta || pi_ref), per token (http://joschu.net/blog/kl-approx.html).

        kl = exp(ref - logp) - (ref - logp) - 1

    Unbiased for samples from pi_theta, always >= 0, and 0 exactly when ref == logp. Any shape; same shape out.
    """
    log_ratio = ref_logps - logps
    return torch.exp(log_ratio) - log_ratio - 1


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """sum(values * mask) / sum(mask), 0 when the mask is empty. Masked entries may hold anything, even NaN."""
    mask = mask.bool()
    return torch.where(mask, values, 0.0).sum() / mask.sum().clamp(min=1)


def aggregate(
    per_token_loss: torch.Tensor,
    mask: torch.Tensor,
    loss_type: str,
    *,
    max_completion_length: int | None = None,
    normalizer: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """Reduce per-token losses l (B, T) under the mask m (B, T) to one number (docs/method.md, "Per-token loss and
    aggregation"), by the `reduction` of `loss_type` (loss_types.py):

        sequence_mean  mean_i ( sum_t l_it m_it / |o_i| )   grpo, sapo: per-sequence mean, then mean over rows
        token_mean     sum l m / sum m                      bnpo: token mean over this micro-batch
                       sum l m / normalizer                 dapo, cispo, vespo: token mean over the whole optimizer
                                                            step; `normalizer` defaults to sum m (then as bnpo)
        constant       sum l m / (B * max_completion_length)    dr_grpo (Dr. GRPO)
        sequence_sum   mean_i ( sum_t l_it m_it )           luspo: each row's loss scaled by its length

    A row with no loss tokens contributes 0 to the per-row reductions but still counts in their mean over rows.
    """
    kind = loss_type_of(loss_type)
    mask = mask.to(per_token_loss.dtype)
    masked = per_token_loss * mask
    total = masked.sum()
    per_row = masked.sum(dim=-1)  # (B,)
    if kind.reduction == "sequence_mean":
        return (per_row / mask.sum(dim=-1).clamp(min=1.0)).mean()
    if kind.reduction == "sequence_sum":
        return per_row.mean()
    if kind.reduction == "constant":
        if max_completion_length is None:
            raise ValueError(f"loss_type={loss_type!r} needs max_completion_length")
        return total / (per_token_loss.shape[0] * max_completion_length)
    if normalizer is None or kind.normalised_over == "micro_batch":
        normalizer = mask.sum()
    return total / torch.as_tensor(normalizer, dtype=total.dtype).clamp(min=1.0)


def spans_the_step(loss_type: str) -> bool:
    """Whether `loss_type`'s normaliser counts the loss tokens of the whole optimizer step (its `normalised_over` in
    loss_types.py): its micro-batches then need those counts (`window_token_totals`) before the step's first one
    trains."""
    return loss_type_of(loss_type).normalised_over == "step"


def accumulation(
    loss_type: str, micro_steps: int, step_tokens: torch.Tensor | None, num_processes: int
) -> tuple[torch.Tensor | None, float]:
    """How one micro-batch's loss joins its optimizer step's under gradient accumulation: (the `normalizer` to give
    `aggregate`, the factor for the aggregated loss). `micro_steps`: the micro-batches of this optimizer step on this
    process (1 outside training); `step_tokens`: the loss tokens of those micro-batches on every process
    (`window_token_totals`, for a loss whose normaliser spans the step).

        over the micro-batch (grpo, bnpo, dr_grpo, sapo, luspo):  normalizer None,              factor 1 / micro_steps
        over the step (dapo, cispo, vespo):                      normalizer step_tokens / P,   factor 1

    The step's loss is then the mean of the micro-batch means, or the step's token mean; the division by P undoes
    data parallelism's averaging of the P processes' gradients, so the sum over processes is the step's token mean.
    """
    if spans_the_step(loss_type):
        return step_tokens / num_processes, 1.0
    return None, 1.0 / micro_steps


def process_weight(loss_type: str, rows: int, tokens: torch.Tensor) -> torch.Tensor:
    """What one process's micro-batch loss counts for when the P processes' losses of one batch are averaged into
    the batch's loss and they hold different numbers of rows (a last, shorter evaluation batch), by `loss_type`'s
    aggregation (`aggregate`): its `rows` for a mean over its rows, its loss `tokens` for a token mean over its
    micro-batch, and 1 for a loss normalised over the step, which is already P x its share of the batch's token
    mean (so the plain mean over processes is that token mean). With equal rows, each weighting gives the plain
    mean for the loss types normalised over the micro-batch, as data parallelism's gradient average does."""
    kind = loss_type_of(loss_type)
    if kind.normalised_over == "step":
        return torch.ones((), device=tokens.device)
    return tokens.float() if kind.reduction == "token_mean" else torch.tensor(float(rows), device=tokens.device)


def policy_loss(
    logps: torch.Tensor,
    old_logps: torch.Tensor | None,
    ref_logps: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    settings: LossSettings = DEFAULT_LOSS,
    *,
    policy_mask: torch.Tensor | None = None,
    normalizer: float | torch.Tensor | None = None,
    sampling_weights: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    entropy_coef: float = 0.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The GRPO objective of `settings.loss_type` with a k3 KL penalty, aggregated by the loss type (docs/method.md).

        ratio_it = exp(logp_it - old_it)                                   importance_sampling_level="token"
        ratio_i  = exp( sum_t (logp_it - old_it) m_it / |o_i| )            "sequence" (GSPO, arXiv:2507.18071)
        s_it     = min( min(ratio, delta) * A_it, clip(ratio, 1 - epsilon_low, 1 + epsilon_high) * A_it )   (PPO)
        k_it     = kl_k3(logp_it, ref_it)            times ratio (not detached) with `bias_correction_kl`
        l_it     = -(s_it * h_it - beta * k_it + c * H_it * h_it) * w_it
        loss     = aggregate(l, m, loss_type)        one normaliser for the policy, KL and entropy terms

    `settings` (`LossSettings`) fixes the loss type, beta, the clipping range, `delta` (two-sided clipping,
    INTELLECT-2, arXiv:2505.07291: it bounds the update of a token with A < 0 whose ratio has grown large), the
    ratio's level, dr_grpo's `max_completion_length` and `bias_correction_kl` (DeepSeek-V3.2: d(ratio * k3) =
    d logp * log(pi_theta / pi_ref) at theta = old, unbiased for the reverse KL's gradient, docs/method.md). cispo,
    sapo and vespo replace s with terms of their own (loss_types.py `policy_term`); vespo folds w into its weight.
    The keywords are the micro-batch's: `policy_mask` h (B, T) keeps the policy term only where it is 1 (the KL term
    and the normaliser still cover every loss token); `normalizer` replaces the micro-batch's token count
    (`accumulation`); `sampling_weights` w (B, T) reweights each token's loss, for samples of another engine
    (`sampling_correction`); `entropy` H (B, T) and `entropy_coef` c: the entropy bonus. None means h = 1, w = 1.

    Shapes: logps, old_logps, ref_logps, mask (B, T); advantages (B,) or (B, T). `old_logps=None`: on-policy, old =
    logp.detach() (ratio 1, gradient d logp; at sequence level the row's mean d logp). `ref_logps`: only for beta
    != 0. Masked positions may hold anything: they are neutralised before exp, so no inf or NaN reaches a gradient.

    Returns (loss, stats); stats are detached means over the loss tokens: `kl` (when beta != 0), PPO's clip
    fractions (`clip_fractions`: where the min() took a clipped term and cut the token's gradient), and the other
    terms' own (`policy_term`).
    """
    mask = mask.bool()
    old_logps = logps.detach() if old_logps is None else old_logps
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)  # (B, 1), broadcast over tokens
    ratio = importance_ratio(logps, old_logps, mask, settings.importance_sampling_level)  # (B, T) or (B, 1)
    surrogate, stats = policy_term(ratio, logps, old_logps, advantages, mask, settings, sampling_weights)  # (B, T)
    if policy_mask is not None:
        surrogate = surrogate * policy_mask.to(surrogate.dtype)
    penalty, penalty_stats = penalty_terms(
        logps, ref_logps, ratio, mask, settings, entropy=entropy, entropy_coef=entropy_coef, policy_mask=policy_mask
    )  # (B, T) or 0
    per_token_loss = -surrogate + (penalty if sampling_weights is None else penalty * sampling_weights)
    stats.update(penalty_stats)
    length, kind = settings.max_completion_length, settings.loss_type
    loss = aggregate(per_token_loss, mask, kind, max_completion_length=length, normalizer=normalizer)
    if loss_type_of(kind).term == "clipped":
        epsilons = (settings.epsilon_low, settings.epsilon_high, settings.delta)
        stats.update(clip_fractions(ratio.detach(), advantages, mask, *epsilons, policy_mask))
    return loss, stats


def penalty_terms(
    logps: torch.Tensor,
    ref_logps: torch.Tensor | None,
    ratio: torch.Tensor,
    mask: torch.Tensor,
    settings: LossSettings,
    *,
    entropy: torch.Tensor | None = None,
    entropy_coef: float = 0.0,
    policy_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor | float, dict[str, torch.Tensor]]:
    """The per-token terms `policy_loss` adds to -s before aggregating (so they share its normaliser):

        beta * k_it (* ratio with `bias_correction_kl`) - c * H_it * h_it

    The KL penalty (beta = `settings.beta` != 0, `ref_logps` needed) over every loss token; the entropy bonus
    (c = `entropy_coef` != 0, `entropy` H needed: regularizers.py decides c) over the tokens the policy term trains
    (`policy_mask` h, None = 1), which raises their entropy, its gradient flowing into H
    (`completion_logprobs(entropy_grad=True)`). Shapes:
    logps, ref_logps, entropy, mask, policy_mask (B, T); ratio (B, T) or (B, 1). Returns ((B, T), or 0 with neither
    term; stats: `kl`, its mean over the loss tokens, detached)."""
    beta = settings.beta
    if beta != 0 and ref_logps is None:
        raise ValueError("beta != 0 needs ref_logps (the reference policy's log-probs)")
    if entropy_coef != 0 and entropy is None:
        raise ValueError("entropy_coef != 0 needs the per-token entropy (completion_logprobs(with_entropy=True))")
    penalty, stats = 0.0, {}
    if beta != 0:
        # Masked positions become kl(0, 0) = 0 before exp, so their value and gradient are exactly 0.
        kl = kl_k3(torch.where(mask, logps, 0.0), torch.where(mask, ref_logps, 0.0))  # (B, T)
        kl = kl * ratio if settings.bias_correction_kl else kl  # ratio (B, T) or (B, 1): 1 where masked, where kl is 0
        stats["kl"] = masked_mean(kl.detach(), mask)
        penalty = beta * kl
    if entropy_coef != 0:
        bonus = torch.where(mask, entropy, 0.0)  # (B, T)
        penalty = penalty - entropy_coef * (bonus if policy_mask is None else bonus * policy_mask.to(bonus.dtype))
    return penalty, stats


def importance_ratio(logps: torch.Tensor, old_logps: torch.Tensor, mask: torch.Tensor, level: str) -> torch.Tensor:
    """pi_theta / pi_old per loss token, (B, T) (`level="token"`), or one per row from the mean log-ratio of its
    loss tokens, (B, 1) (`"sequence"`, GSPO; a row without loss tokens gets 1). Masked positions are set to log-ratio
    0 before exp, so nothing non-finite leaks from them."""
    if level not in IMPORTANCE_SAMPLING_LEVELS:
        raise ValueError(f"importance_sampling_level={level!r} is not one of {IMPORTANCE_SAMPLING_LEVELS}")
    log_ratio = torch.where(mask, logps - old_logps, 0.0)  # (B, T)
    if level == "sequence":
        log_ratio = log_ratio.sum(dim=-1, keepdim=True) / mask.sum(dim=-1, keepdim=True).clamp(min=1)  # (B, 1)
    return torch.exp(log_ratio)


def clip_fractions(ratio, advantages, mask, epsilon_low, epsilon_high, delta=None, policy_mask=None):
    """The fraction of loss tokens where the objective's min() took a clipped (constant) term, so that the token
    gets no gradient from the policy term: `clip_ratio/low_mean` (ratio < 1 - eps_low with A < 0),
    `clip_ratio/high_mean` (ratio > 1 + eps_high with A > 0), `clip_ratio/region_mean` (either, or ratio > delta
    with A < 0). Tokens outside `policy_mask` never count as clipped."""
    low = (ratio < 1 - epsilon_low) & (advantages < 0)  # (B, T)
    high = (ratio > 1 + epsilon_high) & (advantages > 0)
    region = low | high
    if delta is not None:
        region = region | ((ratio > delta) & (advantages < 0))
    if policy_mask is not None:
        low, high, region = (x & policy_mask.bool() for x in (low, high, region))
    return {
        "clip_ratio/low_mean": masked_mean(low.float().expand_as(mask), mask),
        "clip_ratio/high_mean": masked_mean(high.float().expand_as(mask), mask),
        "clip_ratio/region_mean": masked_mean(region.float().expand_as(mask), mask),
    }
