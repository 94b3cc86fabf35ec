"""pi_old from the training pass (grpo/objective/old_policy.py): which micro-batches need a pass of their own, and
that taking the others' from their first training pass changes no update."""

import pytest
import torch

from grpo import GRPOConfig
from grpo.objective import old_policy
from grpo.objective.old_policy import RECORD_AT_STEP, first_pass_micro_batches, plan, take
from tests.scripted import sgd_step_update


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
    assert first_pass_micro_batches(step, steps_per_generation, accumulation) == expected


def _args(**kwargs):
    settings = dict(steps_per_generation=4, gradient_accumulation_steps=2, num_iterations=2)
    return GRPOConfig(output_dir="unused", report_to="none", **{**settings, **kwargs})


def test_plan_passes_only_the_micro_batches_after_an_update_in_training_order():
    # A round made at micro-step 6 with 4 micro-batches: trained in the order 2, 3, 0, 1 (the buffer index is the
    # micro-step's); 6 % 2 == 0, so the first 2 of that order (2 and 3) come before the update.
    batches = [{"id": torch.tensor(i)} for i in range(4)]
    passed = []

    def logprobs(micro_batch):
        passed.append(int(micro_batch["id"]))
        return torch.full((1,), float(micro_batch["id"]))

    plan(batches, 6, _args(), global_step=3, logprobs=logprobs)
    assert passed == [0, 1]
    assert [RECORD_AT_STEP in b for b in batches] == [False, False, True, True]
    assert batches[2][RECORD_AT_STEP] == 3 and batches[0]["old_logps"].item() == 0.0


def test_plan_marks_nothing_without_replays_and_keeps_given_old_logps():
    given = torch.tensor([-1.0])
    batches = [{"old_logps": given}, {}, {}, {}]
    plan(batches, 0, _args(num_iterations=1), global_step=0, logprobs=lambda mb: torch.zeros(1))
    assert batches[0]["old_logps"] is given  # offline: the stored behaviour policy's, kept
    assert batches[1] == {}  # on-policy and trained once: nothing to record
    assert all("old_logps" in b for b in batches[2:])


def test_take_records_the_first_pass_and_refuses_one_after_an_update():
    logps = torch.randn(2, 3, requires_grad=True)
    inputs = {RECORD_AT_STEP: 5}
    old = take(inputs, logps, global_step=5)
    assert RECORD_AT_STEP not in inputs and inputs["old_logps"] is old
    assert torch.equal(old, logps) and not old.requires_grad
    assert take(inputs, logps * 2, global_step=6) is old  # the replay reads what the first pass recorded
    assert take({}, logps, global_step=6) is None  # on-policy: the loss uses logps.detach()
    with pytest.raises(RuntimeError, match="first trained at step 7, after an update"):
        take({RECORD_AT_STEP: 6}, logps, global_step=7)


def _counted_passes(monkeypatch) -> list[int]:
    """Record, per pi_old pass the trainer runs, the micro-step of its round."""
    passes, real = [], old_policy.plan

    def counted(micro_batches, step, args, global_step, logprobs):
        def counting(micro_batch):
            passes.append(step)
            return logprobs(micro_batch)

        return real(micro_batches, step, args, global_step, counting)

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
    for name in update:
        torch.testing.assert_close(update[name], before[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.slow
def test_the_comparison_fails_when_replays_forget_pi_old(tmp_path, monkeypatch):
    # The check above can fail: replays that use the current policy as pi_old (no recording) give another update.
    settings = dict(loss_type="grpo", beta=0.04, num_iterations=2, max_steps=4, learning_rate=0.5, epsilon=0.05)
    right, _ = sgd_step_update(tmp_path / "right", **settings)
    monkeypatch.setattr(old_policy, "take", lambda inputs, logps, global_step: None)
    wrong, _ = sgd_step_update(tmp_path / "wrong", **settings)
    assert max((right[n] - wrong[n]).abs().max().item() for n in right) > 1e-4
