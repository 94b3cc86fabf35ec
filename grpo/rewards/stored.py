"""The stored reward of offline training as a reward column (docs/offline.md).

A training set of scored completions carries its reward in a column (`offline_reward_column`). Rather than give
that reward a path of its own, it is scored like any reward function, first in the trainer's reward set: its
metrics (`rewards/<column>/mean`), its weight and its share of the advantages are then those of every function, and
reward functions given beside it add to it with their weights.
"""

from __future__ import annotations

from grpo.data import InputError
from grpo.data.offline import OfflineGroups


class StoredReward:
    """The stored reward column as a reward function: it returns the column's values for the rows it is given. A
    module-level class, so that it pickles for `reward_worker_type="process"`."""

    def __init__(self, column: str):
        self.column = column
        self.__name__ = column

    def __call__(self, prompts, completions, **columns) -> list:
        return list(columns[self.column])


def offline_rewards(offline: OfflineGroups | None, reward_funcs, processing_classes, reward_weights):
    """(reward functions, their tokenizers, their weights) for `RewardSet`: online, as given (reward functions
    required); offline, the stored reward first (`StoredReward`, weight 1, or the first of `reward_weights` when it
    has one more entry than there are functions), then the functions given, which may be none."""
    weights = reward_weights
    funcs = [] if reward_funcs is None else list(reward_funcs) if isinstance(reward_funcs, list) else [reward_funcs]
    if offline is None:
        if not funcs:
            raise InputError(
                "reward_funcs is empty: online training needs at least one reward function or reward model. (To "
                "train on stored, already scored completions, give train_dataset a 'completion' column; "
                "docs/offline.md.)"
            )
        return reward_funcs, processing_classes, weights
    if not offline.has_reward:
        return funcs, processing_classes, weights
    classes = processing_classes if isinstance(processing_classes, list) else [processing_classes] * len(funcs)
    if processing_classes is None:
        classes = [None] * len(funcs)
    if weights is not None and len(weights) == len(funcs):
        weights = [1.0, *weights]
    return [StoredReward(offline.reward), *funcs], [None, *classes], weights
