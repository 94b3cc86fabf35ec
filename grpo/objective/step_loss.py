"""`StepLoss`: the loss of one training micro-batch, called once per micro-step with what its forward pass gave,
returning the loss and everything recorded about it together (`StepLossResult`).

    1. pi_old: from the micro-batch (a pass before any update, stored data) or this pass (old_policy.py)
    2. the sampler's correction weights, when another engine drew the tokens, and where the policy term trains: the
       high-entropy tokens, the rows off-policy masking keeps (token_weights.py)
    3. how the micro-batch joins its optimizer step: a normaliser over the step's tokens, or 1 / micro-steps
       (`accumulation` in loss.py, by the loss type)
    4. `policy_loss` with this step's entropy coefficient
    5. scaled for accumulation, plus a MoE router's loss (regularizers.py)
    6. the entropy control observes the step; the token-weighted statistics are summed over processes

Everything it needs of the other processes goes through `Collectives`, which an `accelerate.Accelerator` is.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from grpo.objective import old_policy
from grpo.objective.loss import accumulation, policy_loss, process_weight
from grpo.objective.regularizers import EntropyControl, router_aux_term
from grpo.objective.settings import LossSettings
from grpo.objective.token_weights import policy_mask, sampling_weights
from grpo.rollout import MicroBatch


class Collectives(Protocol):
    """What the step loss asks of the processes training together; `accelerate.Accelerator` answers all of it."""

    num_processes: int
    sync_gradients: bool  # this micro-batch ends its optimizer step

    def gather(self, tensor: torch.Tensor) -> torch.Tensor: ...

    def reduce(self, tensor: torch.Tensor, reduction: str = "sum") -> torch.Tensor: ...

    def pad_across_processes(self, tensor: torch.Tensor, dim: int = 0, pad_index: float = 0) -> torch.Tensor: ...


@dataclass(frozen=True)
class StepContext:
    """Where a micro-batch stands in the run: `training` (else evaluation, which records no entropy step),
    `micro_steps` (the micro-batches of its optimizer step on this process; 1 in evaluation) and `global_step`
    (the optimizer steps taken, which pi_old's bookkeeping checks)."""

    training: bool
    micro_steps: int
    global_step: int


@dataclass
class StepLossResult:
    """One micro-batch's loss and what is recorded of it. `loss`: scaled for gradient accumulation, the router's
    loss added; `stats`: its detached terms (kl, clip ratios, the terms' own, aux_loss); `token_totals`: [loss
    tokens, stat x tokens, ...] for `token_names` (the stats and the entropy), summed over processes;
    `sampling`: every process's `sampling_summary` (P, 7), or None without a correction; `entropy_coef`: the
    coefficient the next step starts from, at an optimizer step's last micro-batch with an entropy bonus, else
    None; `old_logps`: the pi_old the ratio used (None: on-policy), for the non-finite guard; `evaluated`: in
    evaluation, [the batch's loss x its rows, its rows] over every process's rows of the batch (each process's
    loss weighted by `process_weight`), so that batches of different sizes count by their rows; else None."""

    loss: torch.Tensor
    stats: dict[str, torch.Tensor]
    token_totals: torch.Tensor
    token_names: list[str]
    sampling: torch.Tensor | None
    entropy_coef: float | None
    old_logps: torch.Tensor | None
    evaluated: torch.Tensor | None = None

    @property
    def terms(self) -> dict[str, torch.Tensor]:
        """The scalar terms the non-finite guard checks: the loss (detached) and its statistics."""
        return {"loss": self.loss.detach(), **self.stats}


class StepLoss:
    """The loss of a run's micro-batches (`LossSettings`), with the entropy bonus's control (its state goes into
    checkpoints: `entropy_control`) and a MoE router loss weighted by `router_coef` (0: none)."""

    def __init__(self, settings: LossSettings, collectives: Collectives, router_coef: float = 0.0):
        self.settings, self.collectives, self.router_coef = settings, collectives, router_coef
        self.entropy_control = EntropyControl.from_settings(settings.entropy)

    @property
    def forward_options(self) -> dict:
        """What the forward pass must give this loss: the entropy's gradient under an entropy bonus, and a list to
        collect a router's loss in (None without one)."""
        return {"entropy_grad": self.entropy_control.enabled, "aux_losses": [] if self.router_coef else None}

    def run(self, logprobs, model, batch: MicroBatch, context: StepContext) -> tuple[torch.Tensor, StepLossResult]:
        """The training pass and its loss: `batch`'s log-probs and entropy under `model` (`logprobs`, the run's
        `LogProbs`), then this loss of them; returns (logps, result). (liger.py's subclass runs Liger's fused loss.)"""
        forward = self.forward_options
        logps, entropy = logprobs(model, batch, with_entropy=True, **forward)
        return logps, self(logps, entropy, forward["aux_losses"], batch, context)

    def __call__(
        self,
        logps: torch.Tensor,
        entropy: torch.Tensor,
        aux_losses: list[torch.Tensor] | None,
        batch: MicroBatch,
        context: StepContext,
        fused: Callable[..., torch.Tensor] | None = None,
    ) -> StepLossResult:
        """Steps 1-6 of the module docstring for `batch`, whose forward pass gave `logps` and `entropy` (B, T) and,
        for a MoE model, `aux_losses`. `fused(old_logps, sampling_weights, normalizer)`, where given, computes the
        step 4 loss that trains (Liger's fused loss, liger.py); `policy_loss` on `logps` still gives its stats."""
        settings, processes = self.settings, self.collectives
        old_logps = old_policy.take(batch, logps, context.global_step)  # None: on-policy, logps.detach()
        weights, sampling = sampling_weights(logps, batch, settings.sampling)
        sampling = None if sampling is None else processes.gather(sampling[None])  # (P, 7)
        keep = policy_mask(entropy.detach(), logps, batch, settings, processes)
        normalizer, factor = accumulation(
            settings.loss_type, context.micro_steps, batch.window_loss_tokens, processes.num_processes
        )
        loss, stats = policy_loss(
            logps,
            old_logps,
            batch.ref_logps,
            batch.advantages,
            batch.loss_mask,
            settings,
            policy_mask=keep,
            sampling_weights=weights,
            normalizer=normalizer,
            entropy=entropy,
            entropy_coef=self.entropy_control.coefficient,
        )
        if fused is not None:
            loss = fused(old_logps, weights, normalizer)
        # A MoE router's loss joins as a mean over the step's micro-batches, whatever the loss type.
        aux, aux_stats = router_aux_term(aux_losses, self.router_coef, context.micro_steps)
        loss, stats = loss * factor + aux, {**stats, **aux_stats}
        coef = self.entropy_control.observe(entropy, batch.loss_mask, keep, processes) if context.training else None
        totals, names = token_metric_totals(stats, entropy.detach(), batch.loss_mask)
        totals = processes.reduce(totals, reduction="sum")
        evaluated = None if context.training else self.batch_loss(loss.detach(), batch)
        return StepLossResult(loss, stats, totals, names, sampling, coef, old_logps, evaluated)

    def batch_loss(self, loss: torch.Tensor, batch: MicroBatch) -> torch.Tensor:
        """An evaluation batch's loss over every process's rows, as [loss x rows, rows] (`StepLossResult.evaluated`):
        the processes' losses averaged with `process_weight`, which a last, shorter batch split unevenly needs."""
        rows, tokens = batch.loss_mask.shape[0], batch.loss_mask.sum()
        weight = process_weight(self.settings.loss_type, rows, tokens)
        sums = self.collectives.reduce(torch.stack([loss.float() * weight, weight, weight.new_tensor(rows)]), "sum")
        mean = torch.where(sums[1] > 0, sums[0] / sums[1].clamp(min=1e-12), 0.0)  # no loss token anywhere: 0
        return torch.stack([mean * sums[2], sums[2]])


def token_metric_totals(
    stats: dict[str, torch.Tensor], entropy: torch.Tensor, loss_mask: torch.Tensor
) -> tuple[torch.Tensor, list[str]]:
    """This process's share of the token-weighted metrics of one micro-step: [loss tokens, stat_1 x tokens, ...]
    for the loss statistics (means over the loss tokens) and the mean entropy, with the names in that order; summed
    over processes, they give means over every process's tokens."""
    mask = loss_mask.bool()
    tokens = mask.sum().float()
    stats = {**stats, "entropy": torch.where(mask, entropy, 0.0).sum() / tokens.clamp(min=1)}
    names = sorted(stats)
    return torch.stack([tokens] + [stats[name].float() * tokens for name in names]), names
