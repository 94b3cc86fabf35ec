"""`Rollout` (grpo/rollout.py): built from token lists, trimmed, cut into micro-batches, gathered."""

import math

import torch
from accelerate import Accelerator

from grpo.rollout import Rollout

PAD = 0


def _rollout(mask_truncated=False, sampling=None):
    return Rollout.from_tokens(
        prompts=["a", "bb", "c", "dd"],
        completions=["x", "yy", "zzz", "w"],
        prompt_ids=[[5], [6, 6], [7], [8, 8]],
        completion_ids=[[1], [2, 2], [3, 3, 3], [4]],
        is_truncated=[False, False, True, False],
        pad_token_id=PAD,
        mask_truncated=mask_truncated,
        sampling_logps=sampling,
    )


def test_from_tokens_pads_prompts_left_and_completions_right():
    r = _rollout()
    assert r.num_rows == 4
    assert r.prompt_ids.tolist() == [[PAD, 5], [6, 6], [PAD, 7], [8, 8]]
    assert r.prompt_mask.tolist() == [[0, 1], [1, 1], [0, 1], [1, 1]]
    assert r.completion_ids.tolist() == [[1, PAD, PAD], [2, 2, PAD], [3, 3, 3], [4, PAD, PAD]]
    assert torch.equal(r.loss_mask, r.completion_mask)
    assert r.is_truncated.tolist() == [False, False, True, False]
    assert r.sampling_logps is None and r.advantages is None


def test_from_tokens_masks_truncated_rows_and_pads_sampler_logprobs():
    r = _rollout(mask_truncated=True, sampling=[[-1.0], [-2.0, -2.5], [-3.0, -3.0, -3.0], [-4.0]])
    assert r.loss_mask.tolist() == [[1, 0, 0], [1, 1, 0], [0, 0, 0], [1, 0, 0]]
    assert r.sampling_logps.tolist() == [[-1.0, 0, 0], [-2.0, -2.5, 0], [-3.0] * 3, [-4.0, 0, 0]]


def test_micro_batches_are_consecutive_rows_each_trimmed_to_its_own_width():
    r = _rollout()
    r.advantages = torch.tensor([1.0, -1.0, 0.5, -0.5])
    r.ref_logps = torch.arange(12.0).view(4, 3)
    first, second = r.micro_batches(2)
    assert set(first.state_dict()) == {
        "prompt_ids",
        "prompt_mask",
        "completion_ids",
        "completion_mask",
        "loss_mask",
        "advantages",
        "ref_logps",
    }
    # Rows 0-1: prompts of 1 and 2 tokens, completions of 1 and 2 -> widths 2 and 2.
    assert first.prompt_ids.tolist() == [[PAD, 5], [6, 6]]
    assert first.completion_ids.tolist() == [[1, PAD], [2, 2]]
    assert first.ref_logps.tolist() == [[0.0, 1.0], [3.0, 4.0]]
    # Rows 2-3: prompts of 1 and 2 tokens, completions of 3 and 1 -> widths 2 and 3.
    assert second.completion_ids.tolist() == [[3, 3, 3], [4, PAD, PAD]]
    assert second.advantages.tolist() == [0.5, -0.5]


def test_trim_drops_columns_that_are_padding_in_every_row():
    r = _rollout()
    wide = Rollout(
        **{
            **vars(r),
            "prompt_ids": torch.cat([torch.full((4, 2), PAD), r.prompt_ids], dim=1),
            "prompt_mask": torch.cat([torch.zeros(4, 2, dtype=torch.long), r.prompt_mask], dim=1),
            "completion_ids": torch.cat([r.completion_ids, torch.full((4, 2), PAD)], dim=1),
            "completion_mask": torch.cat([r.completion_mask, torch.zeros(4, 2, dtype=torch.long)], dim=1),
            "loss_mask": torch.cat([r.loss_mask, torch.zeros(4, 2, dtype=torch.long)], dim=1),
            "sampled_mask": torch.cat([r.sampled_mask, torch.zeros(4, 2, dtype=torch.long)], dim=1),
            "advantages": torch.ones(4, 5),  # per token: trimmed with the completions
        }
    )
    trimmed = wide.trim()
    assert torch.equal(trimmed.prompt_ids, r.prompt_ids) and torch.equal(trimmed.completion_ids, r.completion_ids)
    assert trimmed.advantages.shape == (4, 3)


def test_gather_on_one_process_keeps_every_row_and_local_slice_finds_them():
    r = _rollout()
    r.rewards_per_func = torch.tensor([[1.0], [0.0], [math.nan], [2.0]])
    gathered = r.gather(Accelerator(), PAD)
    assert gathered.prompts == r.prompts and torch.equal(gathered.completion_ids, r.completion_ids)
    assert r.local_slice(0) == slice(0, 4) and r.local_slice(1) == slice(4, 8)
