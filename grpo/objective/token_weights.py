"""Per-token weights of the policy term: the high-entropy token mask (`top_entropy_quantile`, a threshold over every
process's tokens), off-policy sequence masking (`off_policy_mask_threshold`), and the truncated importance-sampling
weights of a sampler with numerics, or weights, of its own (vLLM; async generation's stale rounds). `policy_mask` and
`sampling_weights` gather what the formulas need (through the step loss's `Collectives`) and return this process's
share of their metrics; the formulas themselves are the pure functions at the end (`entropy_threshold`,
`sampling_correction`, `off_policy_sequence_mask`), tested against hand-worked numbers in tests/test_loss.py."""

from __future__ import annotations

import torch

from grpo.objective.settings import SAMPLING_CORRECTIONS, LossSettings, SamplingCorrection
from grpo.rollout import MicroBatch


def policy_mask(
    entropy: torch.Tensor, logps: torch.Tensor, batch: MicroBatch, settings: LossSettings, collectives
) -> torch.Tensor | None:
    """Where the policy term trains (B, T), None for every token: with `top_entropy_quantile` < 1 the highest-entropy
    tokens only, the threshold over the loss tokens of this micro-step on every process (ragged widths padded with
    NaN, ignored; `collectives`: step_loss.py's); with `off_policy_mask_threshold`, not in the rows that off-policy
    sequence masking drops."""
    keep, quantile, threshold = None, settings.top_entropy_quantile, settings.off_policy_mask_threshold
    if quantile < 1.0:
        local = torch.where(batch.loss_mask.bool(), entropy, torch.nan).reshape(-1)
        everyone = collectives.gather(collectives.pad_across_processes(local, dim=0, pad_index=torch.nan))
        keep = entropy >= entropy_threshold(everyone, quantile)
    if threshold is not None:
        # The sampler's own log-probs where it reports them (vLLM), else pi_old's: the policy that drew the tokens.
        sampler = batch.sampling_logps
        if sampler is None:
            sampler = batch.old_logps if batch.old_logps is not None else logps.detach()
        rows = off_policy_sequence_mask(batch.advantages, logps, sampler, batch.loss_mask, threshold).bool()  # (B, 1)
        keep = rows.expand_as(batch.loss_mask) if keep is None else keep & rows
    return keep


def sampling_weights(
    logps: torch.Tensor, batch: MicroBatch, correction: SamplingCorrection
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The sampler drew the tokens from its own distribution, not exactly pi_old (numerics, or older weights):
    truncated importance-sampling weights pi_old / pi_sampler (`sampling_correction`) and this process's share of the
    sampling/* metrics (`sampling_summary`); (None, None) without sampler log-probs. On-policy, pi_old is the current
    policy (logps.detach()): no extra forward."""
    if batch.sampling_logps is None or not correction.enabled:
        return None, None  # (sampler log-probs kept for off-policy masking alone correct nothing)
    old = batch.old_logps if batch.old_logps is not None else logps.detach()
    weights, stats = sampling_correction(
        old,
        batch.sampling_logps,
        batch.loss_mask,
        mode=correction.mode,
        cap=correction.cap,
        floor=correction.floor,
    )
    return weights, sampling_summary(stats, batch.loss_mask)


def sampling_summary(stats: dict[str, torch.Tensor], loss_mask: torch.Tensor) -> torch.Tensor:
    """This process's share of the `sampling/*` metrics (`sampling_correction`'s stats over the loss tokens; per
    sequence modes: over the rows with a loss token), as one (7,) tensor to gather: sums and counts of the log-prob
    difference and of the ratio, then the peaks (max difference, max ratio, -min ratio; -inf when empty)."""
    mask = loss_mask.bool()
    ratio = stats["ratio"]  # (B, T), or (B, 1) per sequence
    ratio = ratio[mask] if ratio.shape == mask.shape else ratio[mask.any(dim=1)].reshape(-1)
    difference = stats["logp_difference"][mask]
    floor = torch.full((1,), -torch.inf, device=mask.device)  # max() of nothing
    counts = torch.tensor([float(difference.numel()), float(ratio.numel())], device=mask.device)
    return torch.stack(
        [
            difference.sum(),
            counts[0],
            ratio.sum(),
            counts[1],
            torch.cat([difference, floor]).max(),
            torch.cat([ratio, floor]).max(),
            torch.cat([-ratio, floor]).max(),
        ]
    )


# ---- The formulas, as pure functions ----


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
    cap: float | None = 2.0,
    floor: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Importance weights that correct for sampling with an engine whose log-probs differ from the trainer's.

    An inference engine (vLLM) samples o ~ pi_sampler, close to but not equal to the trainer's pi_old (other kernels,
    other precision). Truncated importance sampling (Yao et al. 2025, "Your Efficient RL Framework Secretly Brings
    You Off-Policy RL Training") reweights each token's loss by the capped ratio:

        rho_it = exp(old_it - sampling_it)
        w_it   = clamp(rho_it, c, C)                             "token_truncate"
        w_it   = rho_it if c <= rho_it <= C else 0                "token_mask"
        rho_i  = exp( sum_t (old_it - sampling_it) m_it )        "sequence_*": the sequence's likelihood ratio,
        w_i    = clamp(rho_i, c, C)  or  rho_i if c <= rho_i <= C else 0        one weight for every token of the row

    C = `cap` (TRL's `vllm_importance_sampling_clip_max`) and c = `floor` (`..._clip_min`); None leaves that side
    unbounded.

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
        weights = ratio if cap is None and floor is None else torch.clamp(ratio, min=floor, max=cap)
    else:
        inside = (ratio <= (torch.inf if cap is None else cap)) & (ratio >= (0.0 if floor is None else floor))
        weights = torch.where(inside, ratio, 0.0)
    weights = torch.where(mask, weights.expand_as(mask), 1.0)
    difference = torch.where(mask, (old_logps - sampling_logps).abs(), 0.0).detach()
    return weights, {"logp_difference": difference, "ratio": ratio}


def off_policy_sequence_mask(
    advantages: torch.Tensor,
    logps: torch.Tensor,
    sampling_logps: torch.Tensor,
    mask: torch.Tensor,
    threshold: float,
) -> torch.Tensor:
    """DeepSeek-V3.2's off-policy sequence masking (arXiv:2512.02556, eq. 9): a completion with a negative advantage
    whose tokens have drifted far from the policy that sampled them is dropped from the policy term.

        d_i   = sum_t (sampling_it - logp_it) m_it / |o_i|       mean log(pi_sampler / pi_theta) over the row
        M_i   = 1 if A_i >= 0 or d_i <= threshold, else 0

    d_i estimates KL(pi_sampler || pi_theta) from the sampler's own tokens. A positive-advantage row is always kept:
    reinforcing a sampled token is safe however stale it is; pushing down a token the policy has already moved away
    from is where stale samples do harm. Tokens with a NaN sampler log-prob (the engine could not score them) count
    as 0. Shapes: advantages (B,) or (B, T) (a row's sign is read from its first token), logps, sampling_logps, mask
    (B, T). Returns M (B, 1), detached, in logps' dtype; rows without a loss token are kept.
    """
    mask = mask.bool()
    drift = torch.nan_to_num(sampling_logps - logps.detach(), nan=0.0)
    drift = torch.where(mask, drift, 0.0).sum(dim=-1, keepdim=True) / mask.sum(dim=-1, keepdim=True).clamp(min=1)
    sign = advantages if advantages.dim() == 1 else advantages[:, 0]
    return ((sign[:, None] >= 0) | (drift <= threshold)).to(logps.dtype)  # (B, 1)
