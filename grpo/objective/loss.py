"""The GRPO objective as pure functions: group advantages, the k3 KL estimator, and the clipped policy loss.

Notation (docs/method.md): G completions per prompt, B rows (prompts x G), T completion tokens
(padded), m the loss mask (1 for a completion token that counts), A the advantages, logp / old / ref the per-token
log-probs under the policy, the sampling policy and the reference policy.

Every function takes tensors and scalar knobs and returns tensors: no trainer, no config object. The tests compare
each one with a naive loop over the same inputs (tests/naive.py) and with numbers worked out by hand.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
SCALE_REWARDS = ("group", "batch", "none")
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")
SAMPLING_CORRECTIONS = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


def _group_view(rewards: torch.Tensor, num_generations: int) -> torch.Tensor:
    if rewards.dim() != 1 or rewards.numel() % num_generations != 0:
        raise ValueError(
            f"rewards must be a 1-D tensor whose length is a multiple of num_generations={num_generations}, "
            f"got shape {tuple(rewards.shape)}"
        )
    return rewards.view(-1, num_generations)  # (B/G, G)


def _group_moments(rewards: torch.Tensor, num_generations: int):
    """Mean, unbiased std and a zero-spread flag per group, ignoring NaN rewards. Each is (B/G, 1)."""
    r = _group_view(rewards, num_generations)  # (N, G)
    valid = ~torch.isnan(r)
    count = valid.sum(dim=1, keepdim=True)  # (N, 1)
    mean = torch.where(valid, r, 0.0).sum(dim=1, keepdim=True) / count.clamp(min=1)
    sq_dev = torch.where(valid, (r - mean) ** 2, 0.0)
    std = (sq_dev.sum(dim=1, keepdim=True) / (count - 1).clamp(min=1)).sqrt()  # 0 for a group of <= 1 valid row
    spread = torch.where(valid, r, -torch.inf).amax(dim=1, keepdim=True) - torch.where(valid, r, torch.inf).amin(
        dim=1, keepdim=True
    )
    # Exact equality, not std < tol: equal rewards must give A = 0 exactly, whatever the rounding of the mean.
    flat = (count <= 1) | (spread == 0)
    return r, valid, mean, std, flat


def group_advantages(
    rewards: torch.Tensor, num_generations: int, scale_rewards: str = "group", eps: float = 1e-4
) -> torch.Tensor:
    """Group-relative advantages (DeepSeekMath, arXiv:2402.03300, eq. 3 with outcome supervision).

        A_i = (r_i - mean(r_group)) / (std(r_group) + eps)

    `rewards` is (B,), each group's G rows consecutive. `scale_rewards` picks the divisor: "group" the group's
    std (GRPO), "batch" the std of all rewards in `rewards`, "none" no division (Dr. GRPO, arXiv:2503.20783).
    std is the unbiased (Bessel) estimate, as TRL computes it.

    Rules that keep the result finite: a NaN reward (no reward function applied to that row) is left out of its
    group's mean and std and gets A = 0; a group whose valid rewards are all equal (or which has at most one) gets
    A = 0 for every row, exactly. Returns (B,).
    """
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"scale_rewards={scale_rewards!r} is not one of {SCALE_REWARDS}")
    r, valid, mean, std, flat = _group_moments(rewards, num_generations)
    advantages = r - mean  # (N, G)
    if scale_rewards == "group":
        advantages = advantages / (std + eps)
    elif scale_rewards == "batch":
        all_valid = rewards[~torch.isnan(rewards)]
        batch_std = all_valid.std() if all_valid.numel() > 1 else rewards.new_zeros(())
        advantages = advantages / (batch_std + eps)
    advantages = torch.where(valid & ~flat, advantages, 0.0)
    return advantages.reshape(-1)


def pad_groups(values: torch.Tensor, group_sizes: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Consecutive groups of different sizes laid out as equal ones: `values` (B, ...) whose groups are
    `group_sizes` consecutive rows, padded with NaN rows to the largest group. Returns the padded (N * G_max, ...)
    tensor and the (N * G_max,) bool mask of the real rows. The group statistics ignore NaN rows, so a function of
    equal groups applied to the padded tensor and read back at the mask is the same function of the ragged groups."""
    sizes = [int(s) for s in group_sizes]
    if sum(sizes) != values.shape[0] or any(s < 1 for s in sizes):
        raise ValueError(f"group_sizes {sizes} (each >= 1) must add up to the {values.shape[0]} rows of the values")
    width = max(sizes, default=1)
    padded = values.new_full((len(sizes) * width, *values.shape[1:]), torch.nan)
    mask = torch.zeros(len(sizes) * width, dtype=torch.bool, device=values.device)
    for g, size in enumerate(sizes):
        mask[g * width : g * width + size] = True
    padded[mask] = values
    return padded, mask


def _by_groups(group_sizes: Sequence[int], values: torch.Tensor, fn) -> torch.Tensor:
    """`fn(values, G)`, a function of equal groups of G consecutive rows, for ragged groups: applied to the
    NaN-padded layout of `pad_groups` and read back at the real rows."""
    padded, mask = pad_groups(values, group_sizes)
    return fn(padded, max(int(s) for s in group_sizes))[mask]


def grouped_advantages(
    rewards: torch.Tensor,
    group_sizes: Sequence[int],
    scale_rewards: str = "group",
    eps: float = 1e-4,
    baseline: float | None = None,
) -> torch.Tensor:
    """`group_advantages` for consecutive groups of different sizes (offline data: any number of stored completions
    per prompt). `rewards` (B,), `group_sizes` (N,) adding up to B; the same formula and rules in every group:

        A_i = (r_i - mean(r_group)) / (std(r_group) + eps)

    with "batch" the std of every reward in `rewards`. A group of one row gets A = 0 (its mean is its own reward),
    or with a fixed `baseline` b, A = r - b, unscaled (a row alone has no spread to divide by); groups of two or more
    rows never use b. Equal sizes give exactly `group_advantages(rewards, G)`. Returns (B,)."""
    advantages = _by_groups(group_sizes, rewards, lambda r, g: group_advantages(r, g, scale_rewards, eps))
    if baseline is None:
        return advantages
    sizes = torch.tensor([int(s) for s in group_sizes], device=rewards.device)
    alone = torch.repeat_interleave(sizes == 1, sizes) & ~torch.isnan(rewards)  # (B,)
    return torch.where(alone, rewards - baseline, advantages)


def group_reward_stats(rewards: torch.Tensor, num_generations: int | Sequence[int]) -> dict[str, torch.Tensor]:
    """Metrics of the reward spread: `reward_std` (mean over groups of the group std) and `frac_reward_zero_std`
    (fraction of groups whose rewards are all equal, so that they contribute no gradient). `num_generations`: G,
    or each group's size when they differ (NaN-padded groups give the same statistics)."""
    if not isinstance(num_generations, int):
        rewards, _ = pad_groups(rewards, num_generations)
        num_generations = max(int(s) for s in num_generations)
    _, _, _, std, flat = _group_moments(rewards, num_generations)
    return {"reward_std": std.mean(), "frac_reward_zero_std": flat.float().mean()}


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
    """Reduce per-token losses l (B, T) under the mask m (B, T) to one number (docs/method.md, "Per-token loss and aggregation").

        grpo     mean_i ( sum_t l_it m_it / |o_i| )        per-sequence mean, then mean over rows
        bnpo     sum l m / sum m                           token mean over this micro-batch
        dr_grpo  sum l m / (B * max_completion_length)     constant normaliser (Dr. GRPO)
        dapo     sum l m / normalizer                      token mean over the whole optimizer step (DAPO);
                                                           `normalizer` defaults to sum m (then equal to bnpo)

    A row with no loss tokens contributes 0 to grpo but still counts in its mean over rows.
    """
    mask = mask.to(per_token_loss.dtype)
    total = (per_token_loss * mask).sum()
    if loss_type == "grpo":
        per_row = (per_token_loss * mask).sum(dim=-1) / mask.sum(dim=-1).clamp(min=1.0)  # (B,)
        return per_row.mean()
    if loss_type == "bnpo":
        return total / mask.sum().clamp(min=1.0)
    if loss_type == "dr_grpo":
        if max_completion_length is None:
            raise ValueError("loss_type='dr_grpo' needs max_completion_length")
        return total / (per_token_loss.shape[0] * max_completion_length)
    if loss_type == "dapo":
        if normalizer is None:
            normalizer = mask.sum()
        return total / torch.as_tensor(normalizer, dtype=total.dtype).clamp(min=1.0)
    raise ValueError(f"loss_type={loss_type!r} is not one of {LOSS_TYPES}")


def process_advantages(
    step_rewards: torch.Tensor, num_generations: int | Sequence[int], scale_rewards: str = "group", eps: float = 1e-4
) -> torch.Tensor:
    """Token advantages from process (step) rewards (DeepSeekMath, arXiv:2402.03300, section 4.1.3;
    docs/method.md, "Process supervision").

        r~_i^(j) = (r_i^(j) - mean(R)) / (std(R) + eps)      R = every step reward of the group's G completions
        A_{i,t}  = sum over steps j of completion i with index(j) >= t of r~_i^(j)

    `step_rewards` is (B, T), each group's G rows consecutive: entry (i, t) holds the reward of the step of
    completion i that ends at token t (its last token), NaN where no step ends. `scale_rewards` as in
    `group_advantages` ("batch": the std of every step reward in `step_rewards`). A group whose step rewards are all
    equal, or which has at most one, gets 0 everywhere. Returns (B, T); tokens after a row's last step get 0.

    Naive form: for each row i and token t, add up r~ over the steps of row i that end at t or later. An outcome
    reward is the special case of one step ending at the last token, and then A_{i,t} = A_i of `group_advantages`.
    """
    if step_rewards.dim() != 2:
        raise ValueError(f"step_rewards must be (B, T), got shape {tuple(step_rewards.shape)}")
    if not isinstance(num_generations, int):  # ragged groups (offline data): NaN rows pad them and count nowhere
        return _by_groups(num_generations, step_rewards, lambda s, g: process_advantages(s, g, scale_rewards, eps))
    rows, width = step_rewards.shape
    # A group's G rows are G * width consecutive entries of the flattened tensor, so the outcome formula applies to
    # the group's step rewards as they are (NaN entries are ignored and come back as 0).
    normalised = group_advantages(step_rewards.reshape(-1), num_generations * width, scale_rewards, eps)
    normalised = normalised.view(rows, width)  # (B, T), r~ at each step end, 0 elsewhere
    return normalised.flip(-1).cumsum(-1).flip(-1)  # (B, T): sum over t' >= t


def mixed_advantages(
    rewards: torch.Tensor,
    step_rewards: torch.Tensor,
    step_weights: torch.Tensor,
    num_generations: int | Sequence[int],
    scale_rewards: str = "group",
    eps: float = 1e-4,
    baseline: float | None = None,
) -> torch.Tensor:
    """Advantages of outcome and process rewards together.

        A_{i,t} = A_i + sum_k w_k * A^(k)_{i,t}

    A_i is `group_advantages` of the combined outcome reward `rewards` (B,) (NaN where no outcome function scored the
    row: A_i = 0). A^(k) is `process_advantages` of process function k's step rewards, `step_rewards[:, k]` of
    (B, K, T), and w_k = `step_weights[k]` (K,). The weight multiplies the normalised advantage, not the raw step
    rewards, since group normalisation would cancel a positive scale. Returns (B,) when K = 0, else (B, T).
    `num_generations` is G, or each group's size when they differ (`grouped_advantages` and its `baseline` for
    groups of one row, offline data).
    """
    if isinstance(num_generations, int):
        advantages = group_advantages(rewards, num_generations, scale_rewards, eps)  # (B,)
    else:
        advantages = grouped_advantages(rewards, num_generations, scale_rewards, eps, baseline)
    if step_rewards.shape[1] == 0:
        return advantages
    advantages = advantages.unsqueeze(1).expand(-1, step_rewards.shape[2])  # (B, T)
    for k in range(step_rewards.shape[1]):
        advantages = advantages + step_weights[k] * process_advantages(
            step_rewards[:, k], num_generations, scale_rewards, eps
        )
    return advantages


def entropy_threshold(entropies: torch.Tensor, top_quantile: float) -> torch.Tensor:
    """The entropy above which a token is among the `top_quantile` fraction of highest-entropy tokens
    ("Beyond the 80/20 Rule", Wang et al., arXiv:2506.01939): the (1 - top_quantile) quantile of `entropies`.

    `entropies` is 1-D: the entropy of every loss token the threshold is taken over (NaN entries, e.g. padding from
    gathering ragged processes, are ignored). Returns a 0-d tensor; +inf when there is no entropy at all."""
    entropies = entropies.float().reshape(-1)
    if torch.isnan(entropies).all():
        return entropies.new_tensor(torch.inf)
    return torch.nanquantile(entropies, 1.0 - top_quantile, interpolation="linear")


def sampling_correction(
    old_logps: torch.Tensor,
    sampling_logps: torch.Tensor,
    mask: torch.Tensor,
    mode: str = "token_truncate",
    cap: float = 2.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Importance weights that correct for sampling with an engine whose log-probs differ from the trainer's.

    An inference engine (vLLM) samples o ~ pi_sampler, close to but not equal to the trainer's pi_old (other kernels,
    other precision). Truncated importance sampling (Yao et al. 2025, "Your Efficient RL Framework Secretly Brings
    You Off-Policy RL Training") reweights each token's loss by the capped ratio:

        rho_it = exp(old_it - sampling_it)
        w_it   = min(rho_it, C)                                  "token_truncate"
        w_it   = rho_it if rho_it <= C else 0                     "token_mask"
        rho_i  = exp( sum_t (old_it - sampling_it) m_it )        "sequence_*": the sequence's likelihood ratio,
        w_i    = min(rho_i, C)  or  rho_i if rho_i <= C else 0    one weight for every token of the row

    Shapes: old_logps, sampling_logps, mask (B, T). Returns (weights (B, T), stats) with the weights detached and 1 at
    masked positions. stats, over the loss tokens (rows without one count as empty): `logp_difference` (B, T) =
    |old - sampling| and `ratio`, the weights before the cap, (B, T) for token modes or (B, 1) for sequence modes.
    """
    if mode not in SAMPLING_CORRECTIONS:
        raise ValueError(f"vllm_importance_sampling_mode={mode!r} is not one of {SAMPLING_CORRECTIONS}")
    mask = mask.bool()
    log_ratio = torch.where(mask, old_logps - sampling_logps, 0.0).detach()  # (B, T)
    if mode.startswith("sequence"):
        log_ratio = log_ratio.sum(dim=-1, keepdim=True)  # (B, 1)
    ratio = torch.exp(log_ratio)
    if mode.endswith("truncate"):
        weights = torch.clamp(ratio, max=cap)
    else:
        weights = torch.where(ratio <= cap, ratio, 0.0)
    weights = torch.where(mask, weights.expand_as(mask), 1.0)
    difference = torch.where(mask, (old_logps - sampling_logps).abs(), 0.0).detach()
    return weights, {"logp_difference": difference, "ratio": ratio}


def loss_settings(args) -> dict[str, Any]:
    """The `policy_loss` settings a `GRPOConfig` fixes for a whole run."""
    return {
        "loss_type": args.loss_type,
        "beta": args.beta,
        "epsilon_low": args.epsilon,
        "epsilon_high": args.epsilon_high,
        "delta": args.delta,
        "importance_sampling_level": args.importance_sampling_level,
        "max_completion_length": args.max_completion_length,
    }


def policy_loss(
    logps: torch.Tensor,
    old_logps: torch.Tensor | None,
    ref_logps: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    loss_type: str = "dapo",
    beta: float = 0.0,
    epsilon_low: float = 0.2,
    epsilon_high: float | None = None,
    delta: float | None = None,
    importance_sampling_level: str = "token",
    policy_mask: torch.Tensor | None = None,
    max_completion_length: int | None = None,
    normalizer: float | torch.Tensor | None = None,
    sampling_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The clipped GRPO objective with a k3 KL penalty, aggregated by `loss_type` (docs/method.md).

        ratio_it = exp(logp_it - old_it)                                   importance_sampling_level="token"
        ratio_i  = exp( sum_t (logp_it - old_it) m_it / |o_i| )            "sequence" (GSPO, arXiv:2507.18071)
        s_it     = min( min(ratio, delta) * A_it, clip(ratio, 1 - epsilon_low, 1 + epsilon_high) * A_it )
        l_it     = -(s_it * h_it - beta * kl_k3(logp_it, ref_it)) * w_it
        loss     = aggregate(l, m, loss_type)        one normaliser for the policy and the KL term

    `delta` (two-sided clipping, INTELLECT-2, arXiv:2505.07291) caps the unclipped ratio, which bounds the update of
    a token with A < 0 whose ratio has grown large; None leaves it uncapped. `policy_mask` h (B, T) keeps the policy
    term only where it is 1 (e.g. the highest-entropy tokens); the KL term and the normaliser still cover every
    loss token. None means h = 1. `sampling_weights` w (B, T) reweights each token's whole loss, for samples drawn by
    another engine (`sampling_correction`); None means w = 1.

    Shapes: logps, old_logps, ref_logps, mask (B, T); advantages (B,) or (B, T). `old_logps=None` means the batch is
    on-policy: old = logp.detach(), so ratio is 1 in value while its gradient is d logp (at sequence level, the
    mean of d logp over the row). `ref_logps` is needed only when beta != 0. Masked positions may hold any value
    (they are neutralised before exp, so no inf or NaN leaks into the gradient).

    Returns (loss, stats); stats are detached means over the loss tokens: `kl` (when beta != 0), and the fraction of
    tokens where the min() picked a clipped term, so that the token's gradient is cut: `clip_ratio/low_mean`
    (ratio < 1 - eps_low with A < 0), `clip_ratio/high_mean` (ratio > 1 + eps_high with A > 0) and
    `clip_ratio/region_mean` (either, or ratio > delta with A < 0).
    """
    epsilon_high = epsilon_low if epsilon_high is None else epsilon_high
    if beta != 0 and ref_logps is None:
        raise ValueError("beta != 0 needs ref_logps (the reference policy's log-probs)")
    if delta is not None and delta <= 1 + epsilon_high:
        raise ValueError(f"delta={delta} must be > 1 + epsilon_high = {1 + epsilon_high}, or None")
    mask = mask.bool()
    old_logps = logps.detach() if old_logps is None else old_logps
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)  # (B, 1), broadcast over tokens

    ratio = importance_ratio(logps, old_logps, mask, importance_sampling_level)  # (B, T) or (B, 1)
    clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high)
    capped = ratio if delta is None else torch.clamp(ratio, max=delta)
    surrogate = torch.min(capped * advantages, clipped * advantages)  # (B, T)
    if policy_mask is not None:
        surrogate = surrogate * policy_mask.to(surrogate.dtype)
    per_token_loss = -surrogate
    stats = {}
    if beta != 0:
        # Masked positions become kl(0, 0) = 0 before exp, so their value and gradient are exactly 0.
        kl = kl_k3(torch.where(mask, logps, 0.0), torch.where(mask, ref_logps, 0.0))  # (B, T)
        per_token_loss = per_token_loss + beta * kl
        stats["kl"] = masked_mean(kl.detach(), mask)
    if sampling_weights is not None:
        per_token_loss = per_token_loss * sampling_weights

    loss = aggregate(
        per_token_loss, mask, loss_type, max_completion_length=max_completion_length, normalizer=normalizer
    )

    stats.update(clip_fractions(ratio.detach(), advantages, mask, epsilon_low, epsilon_high, delta, policy_mask))
    return loss, stats


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
