"""DAPO dynamic sampling (`GRPOConfig.dynamic_sampling`): replace the groups whose advantages are all zero.

A group whose G rewards are all equal has zero advantages and gives no policy gradient. `fill_groups` keeps the
groups with a spread and generates further rounds from extra prompts (`refill_indices`) until the batch's groups
are filled or `max_dynamic_sampling_rounds` extra rounds are spent; slots still empty then keep zero-advantage
groups, so the batch size never changes (docs/method.md). It works on gathered rollouts (a kept group may come
from another process); `Rollout.select` then builds this process's share.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from grpo.data.sampler import RepeatSampler, train_sampler
from grpo.rollout import Rollout


def refill_indices(sampler: RepeatSampler) -> Iterator[int]:
    """Dataset indices from `sampler`, epoch after epoch, without end: where extra rounds take their prompts. Every
    process builds the same sampler, so all see the same order and each takes its own block of every round."""
    epoch = 0
    while True:
        sampler.set_epoch(epoch)
        yield from sampler
        epoch += 1


class RefillPrompts:
    """Where extra rounds take their prompts: a stream of dataset indices apart from the training order (the
    training sampler's settings with its own seed, one pass per epoch), the same on every process, each process
    taking its block of every round. `position` (indices taken so far) is saved in checkpoints: a resumed run
    continues the stream where it stopped."""

    def __init__(self, args, position: int = 0):
        self.args, self.position = args, position
        self._indices: Iterator[int] | None = None

    def take(self, dataset, process_index: int, num_rows: int) -> list[dict]:
        """This process's `num_rows` examples of the next round of `generation_batch_size` prompts."""
        if self._indices is None:
            sampler = train_sampler(self.args, len(dataset))
            sampler.repeat_count, sampler.seed = 1, sampler.seed + 1  # another order than the rounds' own
            self._indices = refill_indices(sampler)
            for _ in range(self.position):  # resumed: skip what the stopped run took
                next(self._indices)
        indices = [next(self._indices) for _ in range(self.args.generation_batch_size)]
        self.position += len(indices)
        start = process_index * num_rows
        return [dataset[i] for i in indices[start : start + num_rows]]


def zero_advantage_groups(advantages: torch.Tensor, num_generations: int) -> list[bool]:
    """For each group of G consecutive rows, whether every advantage of its rows is exactly 0 (equal rewards: the
    group gives no policy gradient). `advantages` is (B,) or (B, T)."""
    groups = advantages.reshape(-1, num_generations * (advantages[0].numel()))  # (B/G, G) or (B/G, G*T)
    return (groups == 0).all(dim=1).tolist()


def fill_groups(
    rollout: Rollout,
    *,
    gather: Callable[[Rollout], Rollout],
    advantages: Callable[[Rollout], torch.Tensor],
    next_rollout: Callable[[], Rollout],
    num_groups: int,
    num_generations: int,
    max_extra_rounds: int,
) -> tuple[list[Rollout], list[tuple[int, int]], dict[str, int]]:
    """Choose `num_groups` groups, those with a spread first, generating extra rounds while too few have one.

    Returns the gathered rounds, the chosen rows as (round, row) pairs in batch order (whole groups), and counts for
    metrics: groups dropped, zero-advantage groups kept to fill the batch, extra rounds generated."""
    rounds: list[Rollout] = []
    kept: list[tuple[int, int]] = []  # (round, group) with a spread
    flat: list[tuple[int, int]] = []  # (round, group) without
    while True:
        rounds.append(gather(rollout))
        for g, is_zero in enumerate(zero_advantage_groups(advantages(rounds[-1]), num_generations)):
            (flat if is_zero else kept).append((len(rounds) - 1, g))
        if len(kept) >= num_groups or len(rounds) > max_extra_rounds:
            break
        rollout = next_rollout()
    chosen = (kept + flat)[:num_groups]
    zero_kept = max(num_groups - len(kept), 0)  # slots the extra rounds could not fill
    counts = {
        "dynamic_sampling/dropped_groups": len(flat) - zero_kept,
        "dynamic_sampling/zero_std_groups_kept": zero_kept,
        "dynamic_sampling/extra_rounds": len(rounds) - 1,
    }
    rows = [(r, g * num_generations + k) for r, g in chosen for k in range(num_generations)]
    return rounds, rows, counts
