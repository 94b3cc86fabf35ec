"""An environment's own score as a reward function (docs/agents.md). An environment class with a `get_reward()`
method (sync or `async def`, no arguments, returning a number) scores the episodes it ran: the trainer adds one
`EnvironmentReward` per such class (one, even when several factories make it), named after it, weight 1 unless
`reward_weights` says otherwise, as TRL does. It scores the rows whose environment is of its class (None elsewhere:
a dict of environment factories mixes kinds). A `get_turn_rewards()` method scores each turn the same way, for
turn-level credit (grpo/rewards/turns.py)."""

from __future__ import annotations

import asyncio
import inspect

from grpo.rewards.turns import environment_turn_rewards


class EnvironmentReward:
    """`get_reward()` of each row's environment of class `kind`, called in row order."""

    def __init__(self, kind: type):
        self.kind = kind
        self.__name__ = kind.__name__

    def __call__(self, prompts, completions, environments, **kwargs) -> list[float | None]:
        rewards = []
        for environment in environments:
            if type(environment) is not self.kind:
                rewards.append(None)
                continue
            value = environment.get_reward()
            rewards.append(asyncio.run(value) if inspect.isawaitable(value) else value)
        return rewards


def environment_rewards(environment_types: list[type]) -> list[EnvironmentReward]:
    """One reward function per environment class that defines `get_reward`, in the order first given: a dict of
    factories that maps two names to one class scores its episodes once, not twice (as in TRL)."""
    kinds = dict.fromkeys(environment_types)  # one entry per class, in order
    return [EnvironmentReward(kind) for kind in kinds if callable(getattr(kind, "get_reward", None))]


def with_environment_rewards(
    reward_funcs, toolbox, reward_weights=None, turn_credit: bool = False
) -> tuple[list | None, list | None]:
    """(`reward_funcs` followed by the environments' `EnvironmentReward`s, their weights): unchanged without a
    toolbox; None stays None when there are no rewards (no reward at all is refused later, with the fix). With
    `turn_credit` (`turn_advantage` set), the environments' `get_turn_rewards` too (`EnvironmentTurnReward`, turns.py).
    `reward_weights` with one entry per function given is TRL's convention: each `get_reward` then weighs 1. With
    one more entry per environment reward, those entries weigh them."""
    if toolbox is None:
        return reward_funcs, reward_weights
    funcs = [] if reward_funcs is None else list(reward_funcs) if isinstance(reward_funcs, list) else [reward_funcs]
    added = environment_rewards(toolbox.environment_types)
    if turn_credit:
        added += environment_turn_rewards(toolbox.environment_types)
    if reward_weights is not None and added and len(reward_weights) == len(funcs):
        reward_weights = [*reward_weights, *[1.0] * len(added)]
    return (funcs + added) or None, reward_weights
