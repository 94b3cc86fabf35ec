"""Keeping non-finite numbers out of the weights (`GRPOConfig.nonfinite`).

Three places can bring an inf or NaN into an update, and each is checked where its cause can still be named:
  1. rewards: a reward function returned +-inf (NaN is not an error: it is how an unscored row is marked, and a
     round where most rows are unscored only warns, by function: `grpo.training.metrics.warn_mostly_unscored`), or the
     rewards are so large that their group spread overflows float32 (std = inf would give every row A = 0, a
     silently zero gradient);
  2. the loss: its value and the terms it is made of (the KL, the policy log-probs, the importance ratio, the
     advantages), recorded per micro-step (`LossRecord`) and checked at the optimizer step whether or not the
     gradients are finite: a -inf reference log-prob makes the KL, and so the loss, inf while its gradient,
     1 - exp(ref - logp), stays finite. The terms' flag is all-reduced and read together with the gradients' (no
     device sync per micro-step, none added per optimizer step); the row is looked for only once a problem is found;
  3. the gradients, all-reduced over processes, just before the optimizer step.

With `nonfinite="error"` (the default) training stops with a `NonFiniteError` before the optimizer step, naming the
step, the reward function (and row) or the loss term (with the row and micro-step of the micro-batch), and the
likely fix: the weights and the last checkpoint stay as they were. With `nonfinite="skip"`, rows with a non-finite
reward are treated as unscored (advantage 0) and counted in `nonfinite/reward_rows`, and a step whose loss or
gradients are non-finite makes no update (its gradients are dropped, so the optimizer skips every parameter) and is
counted in `nonfinite/skipped_steps`; a skipped step's non-finite loss is logged as it was (inf or NaN), not as
`Trainer`'s `logging_nan_inf_filter` stand-in. A reward spread that overflows is an error in both modes: skipping
it would drop every group of the batch. Tests: tests/test_reliability.py (docs/reliability.md lists them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from transformers import TrainerCallback

from grpo.objective.advantages import group_reward_stats
from grpo.objective.loss import importance_ratio, kl_k3
from grpo.rollout import MicroBatch


class NonFiniteError(RuntimeError):
    """A non-finite reward, loss or gradient was about to reach the weights."""


def infinite_rewards(rewards: torch.Tensor) -> list[tuple[int, int, float]]:
    """(row, function, value) of every +-inf entry of `rewards`: (B, K) outcome rewards, or (B, K, T) step rewards.
    NaN is not listed: it marks a row (or token) the function did not score."""
    found = torch.nonzero(torch.isinf(rewards))  # (n, rewards.dim())
    return [(int(i[0]), int(i[1]), float(rewards[tuple(i)])) for i in found]


def infinite_reward_message(found: list[tuple[int, int, float]], names: list[str], step: int, rows: int) -> str:
    row, col, value = found[0]
    more = f" ({len(found) - 1} more non-finite rewards in this round)" if len(found) > 1 else ""
    return (
        f"Reward function '{names[col]}' returned {value} for row {row} of the generation round "
        f"(process {row // rows}, its row {row % rows}) before optimizer step {step + 1}{more}. Rewards must be "
        "finite numbers; return None to leave a completion unscored. Fix the function (look for a division by "
        "zero or an overflow), or set nonfinite='skip' to treat such rows as unscored."
    )


def reward_overflow_message(rewards: torch.Tensor, num_generations: int, step: int) -> str | None:
    """Why the combined rewards (B,) cannot give finite advantages, or None when they can: a weighted sum that
    overflowed, or a group spread whose square overflows float32."""
    scored = rewards[~torch.isnan(rewards)]
    if scored.numel() and not torch.isfinite(scored).all():
        return (
            f"The weighted sum of the rewards overflowed to {scored[~torch.isfinite(scored)][0].item()} before "
            f"optimizer step {step + 1}. Scale the reward functions or reward_weights down to moderate magnitudes."
        )
    std = group_reward_stats(rewards.float(), num_generations)["reward_std"]
    if not torch.isfinite(std):
        largest = scored.abs().max().item()
        return (
            f"The rewards' spread overflows float32 before optimizer step {step + 1}: rewards reach {largest:.3g}, "
            "so the group standard deviation is inf and every advantage would be 0 (no gradient). Rescale the "
            "reward (advantages depend only on rewards relative to their group) to magnitudes below about 1e15."
        )
    return None


def check_reward_spread(rewards: torch.Tensor, num_generations, step: int) -> None:
    """Raise `NonFiniteError` when the combined rewards (B,) cannot give finite advantages (`reward_overflow_message`):
    in both `nonfinite` modes, since skipping would drop every group of the batch."""
    problem = reward_overflow_message(rewards, num_generations, step)
    if problem is not None:
        raise NonFiniteError(problem)


def gradients_finite(parameters) -> torch.Tensor:
    """A 0-d bool tensor: every gradient of `parameters` is finite (parameters without a gradient are ignored). For a
    sharded gradient (a DTensor) the local shard is checked; the trainer all-reduces the answer over processes.

    First the sum of all entries (accumulated in float32), one cheap pass: it is NaN or infinite when an entry is,
    so a finite sum proves every entry finite. Only when it is not (a non-finite entry, or finite entries whose sum
    overflowed) does each gradient's max-norm decide, which is exact but about 12x slower on a CPU (SmolLM2-135M's
    gradients, one thread: 0.36 s against 0.03 s)."""
    grads = [getattr(p.grad, "_local_tensor", p.grad) for p in parameters if p.grad is not None]
    if not grads:
        return torch.tensor(True)
    device = grads[0].device
    total = torch.stack([grad.sum(dtype=torch.float32).to(device) for grad in grads]).sum()
    if torch.isfinite(total):
        return torch.tensor(True, device=device)
    return torch.isfinite(torch.stack([torch.linalg.vector_norm(grad, math.inf).to(device) for grad in grads]).max())


@dataclass
class LossRecord:
    """One micro-step's loss as the trainer computed it, kept until the optimizer step: its scalar `terms` (`loss`,
    scaled for accumulation, and the stats of `policy_loss`) and the inputs they came from, read only to name the
    row when a term is not finite. Nothing is copied: the inputs live in the round's buffer anyway, and `logps`
    (detached) is kept until the optimizer step."""

    terms: dict[str, torch.Tensor]  # name -> 0-d tensor
    logps: torch.Tensor  # (B, T) policy log-probs
    old_logps: torch.Tensor | None  # (B, T); None: on-policy (ratio = 1)
    ref_logps: torch.Tensor | None  # (B, T); None: beta = 0
    advantages: torch.Tensor  # (B,) or (B, T)
    mask: torch.Tensor  # (B, T) loss mask
    level: str = "token"  # importance_sampling_level

    @classmethod
    def of(cls, batch: MicroBatch, logps: torch.Tensor, result, level: str) -> LossRecord:
        """The record of a micro-batch whose training pass gave `logps` and whose `StepLossResult` is `result`
        (its terms, and the pi_old its ratio used), at importance-sampling `level`."""
        return cls(
            terms=result.terms,
            logps=logps.detach(),
            old_logps=result.old_logps,
            ref_logps=batch.ref_logps,
            advantages=batch.advantages,
            mask=batch.loss_mask,
            level=level,
        )


@dataclass
class Finding:
    """The first non-finite entry of one term in one micro-step: `row` of the micro-batch (None for a scalar term),
    `token` (None for a per-row value), the value, and every row where the term is not finite."""

    term: str
    micro_step: int  # 0-based, within the optimizer step
    row: int | None
    token: int | None
    value: float
    rows: list[int]


def terms_finite(records: list[LossRecord]) -> torch.Tensor:
    """A 0-d bool tensor: every recorded scalar term of every micro-step is finite. One kernel and no device read:
    the caller reads it together with the gradient check, so the good path pays no extra sync."""
    values = [value.detach().float().reshape(()) for record in records for value in record.terms.values()]
    if not values:
        return torch.tensor(True)
    return torch.isfinite(torch.stack(values)).all()


def per_row_terms(record: LossRecord) -> dict[str, torch.Tensor]:
    """The loss's inputs and per-token terms, (B, T) or (B,) or (B, 1), to find which row made a scalar term
    non-finite: `logps` at the loss tokens, the k3 `kl` (when there is a reference), the importance `ratio` (when
    pi_old differs from the policy) and the `advantages`. kl and ratio are taken only where the policy's own log-prob
    is finite, so that each names its own cause (a -inf reference or old log-prob), not a non-finite `logps`."""
    mask = record.mask.bool()
    logps = record.logps.detach()
    usable = mask & torch.isfinite(logps)
    terms = {"logps": torch.where(mask, logps, 0.0)}
    if record.ref_logps is not None:
        kl = kl_k3(torch.where(usable, logps, 0.0), torch.where(usable, record.ref_logps, 0.0))
        terms["kl"] = kl
    if record.old_logps is not None:
        terms["ratio"] = importance_ratio(torch.where(usable, logps, 0.0), record.old_logps, usable, record.level)
    terms["advantages"] = record.advantages
    return terms


def nonfinite_findings(records: list[LossRecord]) -> list[Finding]:
    """Every term that was non-finite in a micro-step of this optimizer step, in micro-step order: the per-row terms
    of `per_row_terms` with their first row and token, then any scalar term (`loss`, `kl`, ...) no per-row term
    explains. Reads the device: called only once a problem is known."""
    found: list[Finding] = []
    for step, record in enumerate(records):
        explained = False
        for term, values in per_row_terms(record).items():
            bad = ~torch.isfinite(values)
            if not bad.any():
                continue
            at = torch.nonzero(bad)[0].tolist()
            rows = torch.nonzero(bad.reshape(bad.shape[0], -1).any(dim=1)).flatten().tolist()
            token = at[1] if values.shape == record.mask.shape else None
            found.append(Finding(term, step, at[0], token, float(values[tuple(at)]), rows))
            explained = True
        if not explained:  # nothing per row explains it: name the scalar terms
            found += [
                Finding(term, step, None, None, float(value), [])
                for term, value in record.terms.items()
                if not torch.isfinite(value).all()
            ]
    return found


HINTS = {
    "kl": "the KL term: a reference log-prob of -inf (a token the reference cannot produce, e.g. after changing "
    "the tokenizer or the reference) or a huge beta",
    "logps": "the policy's log-probs: the model's activations overflowed (try float32 or bf16 instead of fp16, or a "
    "lower learning rate)",
    "ratio": "the importance ratio exp(logp - old) overflowed: the policy moved far from the one that sampled the "
    "batch (lower the learning rate or num_iterations), or the old log-probs are wrong (-inf)",
    "advantages": "the advantages: rewards or reward weights of extreme magnitude",
}


def _where(finding: Finding, micro_steps: int) -> str:
    place = f"of micro-step {finding.micro_step + 1} of {micro_steps}"
    if finding.row is None:
        return place
    token = f" (token {finding.token})" if finding.token is not None else ""
    more = f"; rows {finding.rows}" if len(finding.rows) > 1 else ""
    return f"at row {finding.row}{token} {place}{more}"


def nonfinite_message(
    step: int, findings: list[Finding], gradients_ok: bool, terms_ok: bool, micro_steps: int, process: int = 0
) -> str:
    """The error for optimizer step `step` (0-based, as `state.global_step`): what was non-finite, the loss terms
    with their first row, token and micro-step on this process (or that another process found them), and the likely
    fix. `gradients_ok`, `terms_ok`: the gradients, and the recorded loss terms, were finite on every process."""
    header = f"Non-finite {'loss' if gradients_ok else 'gradients'} at optimizer step {step + 1}"
    if gradients_ok:
        header += " (its gradients were finite)"
    if findings:
        detail = "; ".join(f"{f.term} = {f.value} {_where(f, micro_steps)}" for f in findings)
        cause = f"on process {process}: {detail}"
        hints = [HINTS[t] for t in dict.fromkeys(f.term for f in findings) if t in HINTS]
        likely = "; ".join(hints) if hints else "the values fed to the loss (rewards, advantages, log-probs)"
    elif not terms_ok:
        cause = f"in the loss of another process than process {process}, whose error names the term and the row"
        likely = "see that process's error"
    else:
        cause = "with a finite loss"
        likely = "an overflow in the backward pass (lower the learning rate, or train in float32 or bf16, not fp16)"
    return (
        f"{header}, {cause}. The step was not applied: the weights and the last checkpoint are unchanged. Likely "
        f"cause: {likely}. To skip such steps instead of stopping, set nonfinite='skip'."
    )


class GradientGuard(TrainerCallback):
    """Checks 2 and 3, between gradient clipping and the optimizer step: every gradient and every loss term the
    micro-steps `record`ed is finite on every process. The loss terms add no device read: their flag joins the
    gradient flag and the step's loss in one all-reduce, whose result is read once, as the gradient check alone was
    (one read per optimizer step, none per micro-step); the per-row terms are looked at only after a problem is
    found. Then it stops
    with the term, the row and the micro-step, or with `policy="skip"` drops the gradients so the step changes
    nothing, counted in `metrics`; a skipped step whose loss was not finite logs that loss (inf or NaN) as `loss`,
    in place of `Trainer`'s `logging_nan_inf_filter` stand-in (the average of the window's earlier losses)."""

    def __init__(self, accelerator, policy: str, metrics):
        self.accelerator, self.policy, self.metrics = accelerator, policy, metrics
        self.records: list[LossRecord] = []  # this optimizer step's micro-steps

    def record(self, record: LossRecord) -> None:
        self.records.append(record)

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        records, self.records = self.records, []
        device = self.accelerator.device
        gradients = gradients_finite(model.parameters()).to(device)
        step_loss = sum((r.terms["loss"].float().to(device) for r in records), torch.zeros((), device=device))
        local = torch.stack([gradients.float(), terms_finite(records).to(device).float(), step_loss])  # (3,)
        # Summed over processes and read at once: the loss check adds no device read to the gradient check's.
        gradients_ok, terms_ok, step_loss = self.accelerator.reduce(local, reduction="sum").tolist()
        processes = self.accelerator.num_processes
        if gradients_ok == terms_ok == processes:
            return
        if self.policy == "error":
            findings = nonfinite_findings(records)
            process = self.accelerator.process_index
            raise NonFiniteError(
                nonfinite_message(
                    state.global_step,
                    findings,
                    gradients_ok == processes,
                    terms_ok == processes,
                    len(records),
                    process,
                )
            )
        for parameter in model.parameters():
            parameter.grad = None  # torch optimizers skip parameters without a gradient: no update, no moment change
        self.metrics.add_sum("nonfinite/skipped_steps", 1)
        if not math.isfinite(step_loss):  # `GRPOTrainer.log` logs the window's value in place of Trainer's
            self.metrics.set_last("loss", step_loss / processes)


def finite_rewards(rewards: torch.Tensor, names: list[str], policy: str, step: int, rows: int):
    """Check 1 on gathered rewards (the same tensor on every process, so all stop together): raise at a +-inf
    reward, or with `policy="skip"` turn it into NaN (unscored). Returns the rewards and how many rows had one.
    `rows`: rows per process, for the message."""
    found = infinite_rewards(rewards)
    if not found:
        return rewards, 0
    if policy == "error":
        raise NonFiniteError(infinite_reward_message(found, names, step, rows))
    return torch.where(torch.isinf(rewards), torch.nan, rewards), len({row for row, _, _ in found})
