"""The bookkeeping of dynamic sampling (grpo/training/dynamic_sampling.py, `Rollout.select`) on hand-made rounds."""

import math

import torch

from grpo.rollout import Rollout
from grpo.training.dynamic_sampling import zero_advantage_groups

PAD = 9


def _round(prompt_rows, completion_rows, rewards):
    """A gathered round: left-padded prompts, right-padded completions, one outcome reward and one step row each."""
    p_width = max(len(r) for r in prompt_rows)
    c_width = max(len(r) for r in completion_rows)
    prompt_ids = torch.tensor([[PAD] * (p_width - len(r)) + r for r in prompt_rows])
    completion_ids = torch.tensor([r + [PAD] * (c_width - len(r)) for r in completion_rows])
    completion_mask = torch.tensor([[1] * len(r) + [0] * (c_width - len(r)) for r in completion_rows])
    return Rollout(
        prompts=[f"p{r[0]}" for r in prompt_rows],
        completions=[f"c{r[0]}" for r in completion_rows],
        prompt_ids=prompt_ids,
        prompt_mask=(prompt_ids != PAD).long(),
        completion_ids=completion_ids,
        completion_mask=completion_mask,
        sampled_mask=completion_mask.clone(),
        loss_mask=completion_mask.clone(),
        is_truncated=torch.tensor([len(r) == c_width for r in completion_rows]),
        rewards_per_func=torch.tensor(rewards).unsqueeze(1),
        step_rewards=torch.full((len(rewards), 1, c_width), math.nan),
    )


def test_zero_advantage_groups():
    assert zero_advantage_groups(torch.tensor([0.0, 0.0, 1.0, -1.0]), 2) == [True, False]
    per_token = torch.zeros(4, 3)
    per_token[3, 2] = 0.5  # one non-zero token makes its group count
    assert zero_advantage_groups(per_token, 2) == [True, False]


def test_select_takes_rows_from_several_rounds_and_trims_them():
    first = _round([[1], [2, 2, 2]], [[5], [6, 6]], [0.0, 1.0])
    second = _round([[3, 3], [4]], [[7, 7, 7, 7], [8]], [2.0, 3.0])
    rows = [(1, 1), (0, 0), (1, 0), (0, 1)]  # the batch order
    mine = Rollout.select([first, second], rows, slice(0, 2), PAD)  # this process holds the first two rows
    assert mine.prompts == ["p4", "p1"] and mine.completions == ["c8", "c5"]
    # Both prompts have one token: the common width is trimmed to 1 (left), completions to 1 (right).
    assert mine.prompt_ids.tolist() == [[4], [1]] and mine.prompt_mask.tolist() == [[1], [1]]
    assert mine.completion_ids.tolist() == [[8], [5]]
    # The rewards stay global, in batch order; step rewards are padded to the widest round (4) with NaN.
    assert mine.rewards_per_func.view(-1).tolist() == [3.0, 0.0, 2.0, 1.0]
    assert mine.step_rewards.shape == (4, 1, 4) and torch.isnan(mine.step_rewards).all()
    theirs = Rollout.select([first, second], rows, slice(2, 4), PAD)
    assert theirs.prompt_ids.tolist() == [[PAD, 3, 3], [2, 2, 2]]
    assert theirs.completion_ids.tolist() == [[7, 7, 7, 7], [6, 6, PAD, PAD]]
    assert theirs.completion_mask.tolist() == [[1, 1, 1, 1], [1, 1, 0, 0]]
    assert theirs.is_truncated.tolist() == [True, True]
