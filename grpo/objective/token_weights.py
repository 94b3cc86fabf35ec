"""Per-token weights of the policy term that need more than one micro-batch's numbers: the high-entropy token mask
(`top_entropy_quantile`, a threshold over every process's tokens) and the truncated importance-sampling weights of a
sampler with numerics, or weights, of its own (vLLM; async generation's stale rounds). The formulas are pure
functions in loss.py; this module gathers what they need and records their metrics."""

from __future__ import annotations

import torch
from accelerate.utils import gather

from grpo import metrics
from grpo.objective.loss import entropy_threshold, sampling_correction


def policy_mask(entropy: torch.Tensor, loss_mask: torch.Tensor, quantile: float, accelerator) -> torch.Tensor | None:
    """With `quantile` < 1, train the policy term only on the highest-entropy tokens; the threshold is over the loss
    tokens of this micro-step on every process (ragged widths padded with NaN, ignored). None: every token."""
    if quantile >= 1.0:
        return None
    local = torch.where(loss_mask.bool(), entropy, torch.nan).reshape(-1)
    everyone = gather(accelerator.pad_across_processes(local, dim=0, pad_index=torch.nan))
    return entropy >= entropy_threshold(everyone, quantile)


def sampling_weights(logps: torch.Tensor, inputs: dict, args, window, accelerator) -> torch.Tensor | None:
    """The sampler drew the tokens from its own distribution, not exactly pi_old (numerics, or older weights):
    truncated importance-sampling weights pi_old / pi_sampler (`sampling_correction`), None without sampler
    log-probs. On-policy, pi_old is the current policy (logps.detach()): no extra forward. Records sampling/*."""
    if "sampling_logps" not in inputs:
        return None
    old = inputs["old_logps"] if "old_logps" in inputs else logps.detach()
    weights, stats = sampling_correction(
        old,
        inputs["sampling_logps"],
        inputs["loss_mask"],
        mode=args.vllm_importance_sampling_mode,
        cap=args.vllm_importance_sampling_cap,
    )
    metrics.add_sampling_metrics(window, gather(metrics.sampling_summary(stats, inputs["loss_mask"])[None]))
    return weights
