import pytest
from torch.utils.data import BatchSampler

from grpo.data.sampler import RepeatSampler


def test_repeat_sampler_layout():
    sampler = RepeatSampler(4, num_generations=3, prompts_per_round=2, repeat_count=2, shuffle=False)
    assert list(sampler) == [0, 0, 0, 1, 1, 1] * 2 + [2, 2, 2, 3, 3, 3] * 2
    assert len(sampler) == 24


def test_repeat_sampler_drops_incomplete_round_and_keeps_groups_whole():
    sampler = RepeatSampler(7, num_generations=4, prompts_per_round=3, shuffle=True, seed=1)
    indices = list(sampler)
    assert len(indices) == len(sampler) == 2 * 3 * 4
    groups = [indices[i : i + 4] for i in range(0, len(indices), 4)]
    assert all(len(set(g)) == 1 for g in groups)
    assert len({g[0] for g in groups}) == 6  # no prompt twice in an epoch


def test_repeat_sampler_is_deterministic_per_epoch_and_reshuffles_across_epochs():
    a = RepeatSampler(32, num_generations=2, prompts_per_round=4, seed=3)
    b = RepeatSampler(32, num_generations=2, prompts_per_round=4, seed=3)
    assert list(a) == list(b)  # every process builds the same order
    first = list(a)
    a.set_epoch(1)
    assert list(a) != first
    b.set_epoch(1)
    assert list(a) == list(b)


def test_processes_receive_their_share_of_each_round():
    # 2 processes, 2 rows per process per micro-step, 2 micro-steps per round: a round is 8 rows, a loader batch 4.
    # accelerate gives loader batch k to process k % 2; each round is repeated steps_per_generation=2 times.
    sampler = RepeatSampler(8, num_generations=4, prompts_per_round=2, repeat_count=2, shuffle=False)
    batches = list(BatchSampler(sampler, batch_size=4, drop_last=True))
    process0, process1 = batches[0::2], batches[1::2]
    assert process0[0] == process0[1] == [0, 0, 0, 0]  # same share at both micro-steps of the round
    assert process1[0] == process1[1] == [1, 1, 1, 1]
    assert process0[2] == [2, 2, 2, 2] and process1[2] == [3, 3, 3, 3]
    assert len(process0) == len(process1)  # loaders stay in step


def test_repeat_sampler_rejects_too_small_dataset():
    with pytest.raises(ValueError, match="generation round needs 4"):
        RepeatSampler(3, num_generations=2, prompts_per_round=4)
