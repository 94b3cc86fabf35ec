"""`StepLoss` (grpo/objective/step_loss.py), one micro-batch's loss in one call, against `policy_loss` and the rules
of docs/method.md, on one process and with two processes' worth of collectives played by hand. Float64."""

import pytest
import torch

from grpo.objective.loss import policy_loss
from grpo.objective.settings import EntropySettings, LossSettings, SamplingCorrection
from grpo.objective.step_loss import StepContext, StepLoss
from grpo.rollout import MicroBatch


class Processes:
    """A stand-in for the `Collectives` an `Accelerator` is: `num_processes` processes whose others contribute
    `others` times this one's share to a reduction, and copies of it to a gather."""

    def __init__(self, num_processes=1, sync_gradients=True, others=1.0):
        self.num_processes, self.sync_gradients, self.others = num_processes, sync_gradients, others
        self.calls = []

    def gather(self, tensor):
        self.calls.append("gather")
        return torch.cat([tensor] * self.num_processes)

    def reduce(self, tensor, reduction="sum"):
        self.calls.append("reduce")
        return tensor * (1 + self.others * (self.num_processes - 1))

    def pad_across_processes(self, tensor, dim=0, pad_index=0):
        return tensor


def batch(seed=0, rows=4, width=5, **fields):
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(rows, width, dtype=torch.float64)
    mask[1, 3:] = 0  # a shorter completion
    return MicroBatch(
        prompt_ids=torch.zeros(rows, 2, dtype=torch.long),
        prompt_mask=torch.ones(rows, 2),
        completion_ids=torch.zeros(rows, width, dtype=torch.long),
        completion_mask=mask,
        loss_mask=mask,
        advantages=torch.randn(rows, generator=g, dtype=torch.float64),
        **fields,
    )


def logps_of(seed=1, rows=4, width=5):
    g = torch.Generator().manual_seed(seed)
    return (-torch.rand(rows, width, generator=g, dtype=torch.float64)).requires_grad_()


@pytest.mark.parametrize("micro_steps", [1, 3])
def test_a_micro_batch_mean_is_divided_by_the_step_micro_steps(micro_steps):
    settings = LossSettings(loss_type="grpo", beta=0.0)
    mb, logps, entropy = batch(), logps_of(), torch.rand(4, 5, dtype=torch.float64)
    result = StepLoss(settings, Processes())(logps, entropy, None, mb, StepContext(True, micro_steps, 0))
    expected, stats = policy_loss(logps, None, None, mb.advantages, mb.loss_mask, settings)
    torch.testing.assert_close(result.loss, expected / micro_steps)
    assert result.old_logps is None and result.sampling is None and result.entropy_coef is None
    # Token totals: [loss tokens, stat x tokens, ...] in sorted name order, the entropy among them.
    tokens = mb.loss_mask.sum()
    assert result.token_names == sorted([*stats, "entropy"])
    entropy_mean = (entropy * mb.loss_mask).sum() / tokens
    torch.testing.assert_close(result.token_totals[0], tokens.float())
    at = 1 + result.token_names.index("entropy")
    torch.testing.assert_close(result.token_totals[at], (entropy_mean * tokens).float())
    assert result.terms["loss"].requires_grad is False


def test_a_step_normalised_loss_divides_by_the_step_tokens_over_processes():
    """dapo: the loss tokens of the whole step on every process, divided by P, with no 1 / micro-steps."""
    settings = LossSettings(loss_type="dapo")
    mb, logps = batch(window_loss_tokens=torch.tensor(40.0)), logps_of()
    processes = Processes(num_processes=2)
    result = StepLoss(settings, processes)(logps, torch.zeros(4, 5), None, mb, StepContext(True, 2, 0))
    expected, _ = policy_loss(logps, None, None, mb.advantages, mb.loss_mask, settings, normalizer=20.0)
    torch.testing.assert_close(result.loss, expected)
    # The token totals are summed over the two processes (the stand-in's other process has as many tokens).
    torch.testing.assert_close(result.token_totals[0], 2 * mb.loss_mask.sum().float())


def test_the_sampler_correction_and_pi_old_come_from_the_micro_batch():
    """A micro-batch with the sampler's log-probs under the correction: the weights `policy_loss` gets are the
    truncated ratio pi_old / pi_sampler, and every process's sampling summary is gathered."""
    correction = SamplingCorrection(enabled=True, mode="token_truncate", cap=2.0)
    settings = LossSettings(loss_type="bnpo", sampling=correction)
    old = -torch.rand(4, 5, dtype=torch.float64)
    sampled = old - 0.5 * torch.rand(4, 5, dtype=torch.float64)
    mb, logps = batch(old_logps=old, sampling_logps=sampled), logps_of()
    processes = Processes(num_processes=2)
    result = StepLoss(settings, processes)(logps, torch.zeros(4, 5), None, mb, StepContext(True, 1, 0))
    weights = torch.where(mb.loss_mask.bool(), torch.exp(old - sampled).clamp(max=2.0), 1.0)
    expected, _ = policy_loss(logps, old, None, mb.advantages, mb.loss_mask, settings, sampling_weights=weights)
    torch.testing.assert_close(result.loss, expected)
    assert result.old_logps is old and result.sampling.shape == (2, 7)


def test_the_entropy_bonus_moves_only_at_the_step_end_and_not_in_evaluation():
    settings = LossSettings(loss_type="grpo", entropy=EntropySettings(coef=0.01, adaptive=True, target=10.0))
    step_loss = StepLoss(settings, Processes(sync_gradients=True))
    assert step_loss.forward_options == {"entropy_grad": True, "aux_losses": None}
    args = (logps_of(), torch.rand(4, 5, dtype=torch.float64), None, batch())
    assert step_loss(*args, StepContext(False, 1, 0)).entropy_coef is None  # evaluation observes nothing
    assert step_loss(*args, StepContext(True, 1, 0)).entropy_coef == pytest.approx(0.015)  # below target: up
