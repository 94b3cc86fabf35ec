"""pi_old, the policy of the clipped ratio pi_theta / pi_old, and the one forward pass it can save.

pi_old is the policy as it was when a generation round was made (for an async round that may be stale: when the
trainer takes it, the proximal policy of the decoupled objective, docs/method.md). Until the first optimizer step
after that moment, the policy being trained *is* pi_old, so a micro-batch trained then has pi_old's log-probs in its
own training forward pass: `logps.detach()`, which is what `policy_loss` uses when `old_logps` is None. Only the
micro-batches first trained after an optimizer step of their round need pi_old's log-probs from a separate no-grad
pass made before any update; a micro-batch that is replayed (`num_iterations > 1`) keeps the log-probs of its first
pass for its replays.

    a round of S micro-batches made at a micro-step with L micro-steps left in its optimizer step:
      the first min(S, L) micro-batches: pi_old from their first training pass (recorded if replayed)
      the rest: a no-grad pass over them before any update

L is not simply `A - s mod A` (A micro-steps per optimizer step): Trainer ends an epoch whose micro-steps are not a
multiple of A with a short optimizer step and starts the next epoch with a new one, so the trainer reads L from the
run's `StepSchedule` (grpo/data/sampler.py), which follows the steps Trainer takes over every epoch.

So a replayed round that fits in one optimizer step (`steps_per_generation` dividing
`gradient_accumulation_steps`, the usual `num_iterations > 1` setting) and an async round trained in one step cost
no pass for pi_old at all; a round spanning several steps costs one for the micro-batches after the first step.
The recorded log-probs are those that computed the first update, so the ratio of a first pass is exactly 1, as
on-policy.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from grpo.rollout import MicroBatch


def first_pass_micro_batches(steps_per_generation: int, steps_left: int) -> int:
    """How many micro-batches of a round are first trained before the next optimizer step, i.e. with the weights of
    pi_old, when the round starts with `steps_left` micro-steps left in its optimizer step (`StepSchedule.steps_left`)."""
    return min(steps_per_generation, steps_left)


def plan(
    micro_batches: list[MicroBatch],
    step: int,
    steps_left: int,
    args,
    global_step: int,
    logprobs: Callable[[MicroBatch], torch.Tensor],
) -> None:
    """Give each micro-batch of a round made at micro-step `step` its pi_old, in place. They are trained in the order
    `step % steps_per_generation`, ..., wrapping around (the buffer's index is the micro-step's); the first
    `first_pass_micro_batches` of that order (`steps_left`: micro-steps left in the optimizer step of `step`) take
    pi_old from their training pass (`old_logps_at_step` set when the round is replayed, left alone otherwise); the
    others get `old_logps` from `logprobs(micro_batch)`, a no-grad pass run now, before any update. A micro-batch that
    already holds `old_logps` (offline data: the stored behaviour policy's) is left as it is. `args`: the run's
    GRPOConfig."""
    start = step % args.steps_per_generation
    first = first_pass_micro_batches(args.steps_per_generation, steps_left)
    for i, micro_batch in enumerate(micro_batches[start:] + micro_batches[:start]):
        if micro_batch.old_logps is not None:
            continue
        if i >= first:
            micro_batch.old_logps = logprobs(micro_batch)
        elif args.num_iterations > 1:
            micro_batch.old_logps_at_step = global_step


def take(micro_batch: MicroBatch, logps: torch.Tensor, global_step: int) -> torch.Tensor | None:
    """pi_old's log-probs for `micro_batch` whose training pass gave `logps`; None means `logps.detach()`
    (on-policy). A micro-batch marked by `plan` records `logps.detach()` as its `old_logps` (in place: its replays
    read them), after checking that no optimizer step came between its round and this pass."""
    step, micro_batch.old_logps_at_step = micro_batch.old_logps_at_step, None
    if step is not None:
        if step != global_step:
            raise RuntimeError(
                f"A micro-batch whose pi_old was planned to come from its first training pass at optimizer step "
                f"{step} was first trained at step {global_step}, after an update: its old log-probs would be wrong. "
                "This is a bug in grpo's step accounting; please report it with your GRPOConfig."
            )
        micro_batch.old_logps = logps.detach()
    return micro_batch.old_logps
