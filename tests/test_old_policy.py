"""pi_old from the training pass (grpo/objective/old_policy.py): which micro-batches need a pass of their own, and
that taking the others' from their first training pass changes no update."""

from dataclasses import replace

import pytest
import torch
from datasets import Dataset

from grpo import GRPOConfig, GRPOTrainer
from grpo.data.sampler import StepSchedule
from grpo.objective import old_policy
from grpo.objective.old_policy import first_pass_micro_batches, plan, take
from grpo.rollout import MicroBatch
from tests.helpers.compare import assert_same_update
from tests.helpers.scripted import sgd_step_update


@pytest.mark.parametrize(
    "step, steps_per_generation, accumulation, expected",
    [
        (0, 2, 4, 2),  # rounds tile the step: every micro-batch before the update
        (2, 2, 4, 2),
        (0, 4, 2, 2),  # a round of 4 micro-steps over 2 optimizer steps: the last 2 come after an update
        (0, 4, 1, 1),
        (4, 2, 3, 2),  # rounds of 2 micro-steps, 3 per optimizer step: round 3 (micro-steps 4, 5) fits
        (2, 2, 3, 1),  # round 2 (micro-steps 2, 3) straddles the update after micro-step 2
        (0, 1, 1, 1),
    ],
)
def test_first_pass_micro_batches(step, steps_per_generation, accumulation, expected):
    schedule = StepSchedule(micro_steps_per_epoch=1200, accumulation=accumulation)  # no epoch end near `step`
    assert first_pass_micro_batches(steps_per_generation, schedule.steps_left(step)) == expected


def test_step_schedule_follows_short_steps_at_epoch_ends():
    # 8 micro-steps per epoch, 3 per optimizer step:  0 1 2 | 3 4 5 | 6 7 || 8 9 10 | 11 12 13 | 14 15 || 16 ...
    schedule = StepSchedule(micro_steps_per_epoch=8, accumulation=3)
    assert schedule.steps_per_epoch == 3
    assert [schedule.steps_left(s) for s in range(17)] == [3, 2, 1, 3, 2, 1, 2, 1, 3, 2, 1, 3, 2, 1, 2, 1, 3]
    assert [schedule.optimizer_step(s) for s in range(17)] == [0, 0, 0, 1, 1, 1, 2, 2, 3, 3, 3, 4, 4, 4, 5, 5, 6]
    assert [schedule.first_micro_step(k) for k in range(7)] == [0, 3, 6, 8, 11, 14, 16]
    # The case: a round of 2 micro-batches made at micro-step 10 has one before the update, not two.
    assert first_pass_micro_batches(2, schedule.steps_left(10)) == 1


def _micro_batch(i: int) -> MicroBatch:
    """A stand-in micro-batch whose prompt_ids hold its index (plan and take read only the pi_old fields)."""
    one = torch.ones(1, 1)
    return MicroBatch(torch.tensor(i), one, one, one, one, torch.zeros(1))


def _args(**kwargs):
    settings = dict(steps_per_generation=4, gradient_accumulation_steps=2, num_iterations=2)
    return GRPOConfig(output_dir="unused", report_to="none", **{**settings, **kwargs})


def test_plan_passes_only_the_micro_batches_after_an_update_in_training_order():
    # A round made at micro-step 6 with 4 micro-batches: trained in the order 2, 3, 0, 1 (the buffer index is the
    # micro-step's); 6 % 2 == 0, so the first 2 of that order (2 and 3) come before the update.
    batches = [_micro_batch(i) for i in range(4)]
    passed = []

    def logprobs(micro_batch):
        passed.append(int(micro_batch.prompt_ids))
        return torch.full((1,), float(micro_batch.prompt_ids))

    plan(batches, 6, 2, _args(), global_step=3, logprobs=logprobs)
    assert passed == [0, 1]
    assert [b.old_logps_at_step for b in batches] == [None, None, 3, 3]
    assert batches[0].old_logps.item() == 0.0 and batches[2].old_logps is None


def test_plan_marks_nothing_without_replays_and_keeps_given_old_logps():
    given = torch.tensor([-1.0])
    batches = [_micro_batch(i) for i in range(4)]
    batches[0].old_logps = given
    plan(batches, 0, 2, _args(num_iterations=1), global_step=0, logprobs=lambda mb: torch.zeros(1))
    assert batches[0].old_logps is given  # offline: the stored behaviour policy's, kept
    assert batches[1].old_logps is None and batches[1].old_logps_at_step is None  # trained once: nothing to record
    assert all(b.old_logps is not None for b in batches[2:])


def test_take_records_the_first_pass_and_refuses_one_after_an_update():
    logps = torch.randn(2, 3, requires_grad=True)
    marked = replace(_micro_batch(0), old_logps_at_step=5)
    old = take(marked, logps, global_step=5)
    assert marked.old_logps_at_step is None and marked.old_logps is old
    assert torch.equal(old, logps) and not old.requires_grad
    assert take(marked, logps * 2, global_step=6) is old  # the replay reads what the first pass recorded
    assert take(_micro_batch(0), logps, global_step=6) is None  # on-policy: the loss uses logps.detach()
    with pytest.raises(RuntimeError, match="first trained at step 7, after an update"):
        take(replace(_micro_batch(0), old_logps_at_step=6), logps, global_step=7)


def _counted_passes(monkeypatch) -> list[int]:
    """Record, per pi_old pass the trainer runs, the micro-step of its round."""
    passes, real = [], old_policy.plan

    def counted(micro_batches, step, steps_left, args, global_step, logprobs):
        def counting(micro_batch):
            passes.append(step)
            return logprobs(micro_batch)

        return real(micro_batches, step, steps_left, args, global_step, counting)

    monkeypatch.setattr(old_policy, "plan", counted)
    return passes


# (num_iterations, gradient_accumulation_steps, steps_per_generation, max_steps, pi_old passes with the first-pass
# rule, passes when every micro-batch gets one): see test_first_pass_micro_batches for the counts.
LAYOUTS = [
    (2, 1, 1, 4, 0, 2),  # each round replayed once, one micro-batch per step
    (2, 2, 2, 2, 0, 2),  # a round of 2 micro-batches per step, replayed in the next step
    (1, 1, 2, 2, 1, 2),  # a round spanning 2 steps, trained once: its second micro-batch needs a pass
    (2, 3, 2, 4, 1, 6),  # rounds of 2 micro-steps replayed, 3 micro-steps per step: round 3 straddles an update
]


@pytest.mark.slow
@pytest.mark.parametrize("iterations, accumulation, steps_per_generation, steps, fewer, every", LAYOUTS)
def test_first_pass_old_logps_give_the_update_of_a_pass_before_any_update(
    tmp_path, monkeypatch, iterations, accumulation, steps_per_generation, steps, fewer, every
):
    settings = dict(
        loss_type="grpo",
        beta=0.04,
        num_iterations=iterations,
        gradient_accumulation_steps=accumulation,
        steps_per_generation=steps_per_generation,
        max_steps=steps,
        learning_rate=0.5,  # large steps, so replays are clearly off-policy and clipping acts
        epsilon=0.05,
    )
    with monkeypatch.context() as patch:
        passes = _counted_passes(patch)
        patch.setattr(old_policy, "first_pass_micro_batches", lambda *args: 0)  # a pass for every micro-batch
        before, _ = sgd_step_update(tmp_path / "every", **settings)
    assert len(passes) == every
    with monkeypatch.context() as patch:
        passes = _counted_passes(patch)
        update, trainer = sgd_step_update(tmp_path / "first", **settings)
    assert len(passes) == fewer
    clipped = [h["clip_ratio/region_mean"] for h in trainer.state.log_history if "clip_ratio/region_mean" in h]
    assert max(clipped) > 0  # pi_old really differs from the policy in some micro-step
    assert sum(d.abs().sum() for d in update.values()) > 0
    params = dict(trainer.model.named_parameters())
    assert_same_update(update, before, params, steps=trainer.state.global_step, what="pi_old from the first pass")


@pytest.mark.slow
def test_the_comparison_fails_when_replays_forget_pi_old(tmp_path, monkeypatch):
    # The check above can fail: replays that use the current policy as pi_old (no recording) give another update.
    settings = dict(loss_type="grpo", beta=0.04, num_iterations=2, max_steps=4, learning_rate=0.5, epsilon=0.05)
    right, _ = sgd_step_update(tmp_path / "right", **settings)
    monkeypatch.setattr(old_policy, "take", lambda inputs, logps, global_step: None)
    wrong, _ = sgd_step_update(tmp_path / "wrong", **settings)
    assert max((right[n] - wrong[n]).abs().max().item() for n in right) > 1e-4


# (gradient_accumulation_steps, steps_per_generation, num_iterations) on 8 prompts, G = 4 and 4 rows per micro-step
# (a round holds steps_per_generation prompts): every epoch's micro-steps leave a remainder modulo the accumulation,
# so each epoch ends with a short optimizer step and the next starts a new one.
EPOCH_LAYOUTS = [
    (3, 2, 1),  # 8 micro-steps an epoch: steps of 3, 3, 2 (a round at micro-step 10 straddles an update)
    (3, 2, 2),  # 16: 3, 3, 3, 3, 3, 1
    (3, 1, 2),  # 16, a round of one micro-batch, replayed
    (5, 2, 2),  # 16: 5, 5, 5, 1
    (4, 3, 1),  # 2 rounds of 3 prompts, 6: 4, 2
    (4, 4, 2),  # 2 rounds of 4 prompts replayed, 16: 4, 4, 4, 4 (no remainder: the control)
]


@pytest.mark.slow
@pytest.mark.parametrize("accumulation, steps_per_generation, iterations", EPOCH_LAYOUTS)
def test_pi_old_over_epochs_ending_with_a_short_step(
    tmp_path, monkeypatch, accumulation, steps_per_generation, iterations
):
    """Three epochs; pi_old from first training passes gives the update of a run where every micro-batch gets pi_old
    from a no-grad pass made before any update (right by construction), and every micro-step's optimizer step is
    the one `StepSchedule` says."""
    settings = dict(
        dataset=Dataset.from_dict({"prompt": [f"Question {i}: count to three." for i in range(8)]}),
        loss_type="grpo",
        beta=0.04,
        num_iterations=iterations,
        gradient_accumulation_steps=accumulation,
        steps_per_generation=steps_per_generation,
        max_steps=-1,
        num_train_epochs=3,
        learning_rate=0.05,  # steps large enough that pi_old differs visibly one step later, over 10-18 steps
        epsilon=0.02,
    )
    with monkeypatch.context() as patch:
        patch.setattr(old_policy, "first_pass_micro_batches", lambda *args: 0)  # a pass for every micro-batch
        every, _ = sgd_step_update(tmp_path / "every", **settings)
    seen = []  # (global_step, micro-steps in this optimizer step) of every training pass, in order
    real_loss = GRPOTrainer.compute_loss

    def compute_loss(self, model, inputs, *args, **kwargs):
        seen.append((self.state.global_step, self.current_gradient_accumulation_steps))
        return real_loss(self, model, inputs, *args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(GRPOTrainer, "compute_loss", compute_loss)
        update, trainer = sgd_step_update(tmp_path / "first", **settings)
    schedule = trainer.step_schedule
    assert schedule.micro_steps_per_epoch == len(trainer.get_train_dataloader())
    assert len(seen) == 3 * schedule.micro_steps_per_epoch
    for step, (global_step, in_this_step) in enumerate(seen):
        assert schedule.optimizer_step(step) == global_step, step
        # steps_left counts down to 1 within each optimizer step, from the step's real (maybe short) length.
        first = schedule.first_micro_step(global_step)
        assert schedule.steps_left(first) == in_this_step, step
    clipped = [h["clip_ratio/region_mean"] for h in trainer.state.log_history if "clip_ratio/region_mean" in h]
    assert max(clipped) > 0  # pi_old really differs from the policy in some micro-step
    params = dict(trainer.model.named_parameters())
    assert_same_update(update, every, params, steps=trainer.state.global_step, what="pi_old over epochs")
