"""`StoredCompletions`: the generation backend of offline training (docs/offline.md). A round's completions are
the stored ones of the groups the sampler drew, tokenized as generation would have produced them
(`OfflineGroups.rollout`, grpo/data/offline.py); their stored rewards are scored by the first reward function
(`StoredReward`). From the `Rollout` on, the trainer's path is the online one, with no branch of its own."""

from __future__ import annotations

from typing import Any

from torch import nn

from grpo.data.offline import OfflineGroups
from grpo.generation.base import Completions
from grpo.rollout import Rollout


class StoredCompletions:
    """Replays stored, scored completions instead of sampling. `sample_rollout` asks it for whole rollouts
    (`rollout`), since each row brings its own completion; `generate`, which takes prompt ids alone, refuses."""

    def __init__(self, groups: OfflineGroups, accelerator):
        self.groups, self.accelerator = groups, accelerator

    def sync_weights(self, model: nn.Module, version: int) -> None:
        """Nothing samples, so no weights are needed."""

    def generate(self, model: nn.Module, prompt_ids: list[list[int]]) -> Completions:
        raise TypeError(
            "StoredCompletions replays stored completions of drawn groups; it cannot sample completions for bare "
            "prompt ids. Use sample_rollout (GRPOTrainer.sample_round) with the drawn groups."
        )

    def rollout(self, groups: list[dict[str, Any]], tokenizer, eos_token_ids) -> tuple[Rollout, dict[str, list]]:
        """The drawn `groups` (this process's) as a `Rollout` on the accelerator's device, and the rows' other
        columns for the reward functions (the stored reward among them)."""
        return self.groups.rollout(groups, tokenizer, eos_token_ids, self.accelerator)
