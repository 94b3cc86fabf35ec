"""Per-token weights of the policy term that need more than one micro-batch's numbers: the high-entropy token mask
(`top_entropy_quantile`, a threshold over every process's tokens) and the truncated importance-sampling weights of a
sampler with numerics, or weights, of its own (vLLM; async generation's stale rounds). The formulas are pure
functions in loss.py; this module gathers what they need and returns this process's share of their metrics, which
the trainer gathers and records."""

from __future__ import annotations

import torch
from accelerate.utils import gather

from grpo.objective.loss import entropy_threshold, off_policy_sequence_mask, sampling_correction
from grpo.rollout import MicroBatch


def policy_mask(
    entropy: torch.Tensor, logps: torch.Tensor, batch: MicroBatch, args, accelerator
) -> torch.Tensor | None:
    """Where the policy term trains (B, T), None for every token: with `top_entropy_quantile` < 1 the highest-entropy
    tokens only, the threshold over the loss tokens of this micro-step on every process (ragged widths padded with
    NaN, ignored); with `off_policy_mask_threshold`, not in the rows that off-policy sequence masking drops."""
    keep = None
    if args.top_entropy_quantile < 1.0:
        local = torch.where(batch.loss_mask.bool(), entropy, torch.nan).reshape(-1)
        everyone = gather(accelerator.pad_across_processes(local, dim=0, pad_index=torch.nan))
        keep = entropy >= entropy_threshold(everyone, args.top_entropy_quantile)
    if args.off_policy_mask_threshold is not None:
        # The sampler's own log-probs where it reports them (vLLM), else pi_old's: the policy that drew the tokens.
        sampler = batch.sampling_logps
        if sampler is None:
            sampler = batch.old_logps if batch.old_logps is not None else logps.detach()
        rows = off_policy_sequence_mask(
            batch.advantages, logps, sampler, batch.loss_mask, args.off_policy_mask_threshold
        ).bool()  # (B, 1)
        keep = rows.expand_as(batch.loss_mask) if keep is None else keep & rows
    return keep


def keeps_sampling_logps(args) -> bool:
    """Whether a round keeps the sampler's own log-probs: for the importance-sampling correction, or as the
    behaviour policy of off-policy sequence masking."""
    return args.vllm_importance_sampling_correction or args.off_policy_mask_threshold is not None


def sampling_weights(logps: torch.Tensor, batch: MicroBatch, args) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The sampler drew the tokens from its own distribution, not exactly pi_old (numerics, or older weights):
    truncated importance-sampling weights pi_old / pi_sampler (`sampling_correction`) and this process's share of the
    sampling/* metrics (`sampling_summary`); (None, None) without sampler log-probs. On-policy, pi_old is the current
    policy (logps.detach()): no extra forward."""
    if batch.sampling_logps is None or not args.vllm_importance_sampling_correction:
        return None, None  # (sampler log-probs kept for off-policy masking alone correct nothing)
    old = batch.old_logps if batch.old_logps is not None else logps.detach()
    weights, stats = sampling_correction(
        old,
        batch.sampling_logps,
        batch.loss_mask,
        mode=args.vllm_importance_sampling_mode,
        cap=args.vllm_importance_sampling_clip_max,
        floor=args.vllm_importance_sampling_clip_min,
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
