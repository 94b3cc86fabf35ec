"""Turn rewards: scores of each policy turn of a multi-turn episode, for turn-level credit (docs/agents.md,
"Turn-level credit"; `GRPOConfig.turn_advantage`).

Two sources, both scored with the outcome rewards in one pass (`grpo.rewards.scoring.RewardSet.score`):

- an environment class with a `get_turn_rewards()` method (sync or `async def`, no arguments) returning one number
  (or None) per policy turn of the episode it ran: the trainer adds one `EnvironmentTurnReward` per such class,
  named `<Class>_turns`, weight 1;
- a reward function marked `@turn_reward`, called like any other, returning per row a list with one number (or None)
  per policy turn, or None when it does not apply to the row:

    from grpo import turn_reward

    @turn_reward
    def called_a_tool(completions, **kwargs):
        # 1 for each assistant turn that calls a tool, except the last one, which should answer.
        turns = [[m for m in c if m["role"] == "assistant"] for c in completions]
        return [[float("tool_calls" in m) for m in t[:-1]] + [None] for t in turns]

A row's policy turns are its completion's assistant messages, in order; `Rollout.turn_index` marks their tokens.
This module checks what the functions return (`check_turn_rewards`, `lay_out_turns`), as pure functions of the
returned values and the turn counts, and sums them per row for metrics (`turn_reward_sums`).
"""

from __future__ import annotations

import asyncio
import inspect
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch


def turn_reward(func: Callable) -> Callable:
    """Mark `func` as a turn reward function: it returns, per row, one number (or None) per policy turn."""
    func.turn_reward = True
    return func


def is_turn_reward(func: Any) -> bool:
    return bool(getattr(func, "turn_reward", False))


def policy_turns(completion: Any) -> int:
    """How many policy turns a completion holds: its assistant messages (an episode), else 1."""
    if isinstance(completion, list):
        return sum(1 for m in completion if isinstance(m, dict) and m.get("role") == "assistant")
    return 1


def check_turn_rewards(values: Any, name: str, num_rows: int, offset: int = 0) -> list[list[float] | None]:
    """What a turn reward function `name` returned for `num_rows` rows (the first being row `offset` of the batch),
    checked: per row None or a list of numbers and Nones (NaN for None). A wrong length or type is a bug in the
    function, so it raises (even under reward_errors="skip") naming the function and the row."""
    if not isinstance(values, Sequence) or isinstance(values, str) or len(values) != num_rows:
        got = f"length {len(values)}" if isinstance(values, Sequence) else type(values).__name__
        raise ValueError(
            f"Turn reward function '{name}' must return a list of {num_rows} entries (one per row, each a list with "
            f"one number per policy turn, or None), got {got}."
        )
    checked: list[list[float] | None] = []
    for i, row in enumerate(values):
        if row is None:
            checked.append(None)
            continue
        if isinstance(row, torch.Tensor):
            row = row.tolist()
        if not isinstance(row, Sequence) or isinstance(row, str):
            raise TypeError(
                f"Turn reward function '{name}' returned {row!r} for row {offset + i}; each entry must be a list with "
                "one number (or None) per policy turn, or None. For one number per row, drop the @turn_reward mark."
            )
        scores = []
        for value in row:
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
                raise TypeError(
                    f"Turn reward function '{name}' returned {value!r} among the turn scores of row {offset + i}; "
                    "each must be a number or None."
                )
            scores.append(math.nan if value is None else float(value))
        checked.append(scores)
    return checked


def lay_out_turns(values: Sequence[list[float] | None], turn_counts: Sequence[int], width: int, name: str):
    """A turn reward function's checked scores (`check_turn_rewards`) as a (B, width) float32 tensor: row i's score
    of policy turn n at column n, NaN past its turns and on rows without a value. A row whose list does not have one
    score per policy turn (`turn_counts[i]`) raises, naming the function `name`, the row and the expected count."""
    dense = torch.full((len(values), width), math.nan)
    for i, scores in enumerate(values):
        if scores is None:
            continue
        if len(scores) != turn_counts[i]:
            raise ValueError(
                f"Turn reward function '{name}' returned {len(scores)} scores for row {i}, whose episode has "
                f"{turn_counts[i]} policy turns (assistant messages): return exactly {turn_counts[i]}, one per turn "
                "(None for a turn it does not score)."
            )
        dense[i, : len(scores)] = torch.tensor(scores, dtype=torch.float32)
    return dense


def turn_reward_sums(turn_rewards: torch.Tensor) -> torch.Tensor:
    """Each turn function's total over a row's turns, for metrics: (B, K_t, N) -> (B, K_t), NaN where the function
    scored no turn of the row."""
    return torch.where(torch.isnan(turn_rewards).all(dim=2), torch.nan, turn_rewards.nansum(dim=2))


class EnvironmentTurnReward:
    """`get_turn_rewards()` of each row's environment of class `kind`, in row order (None for other classes)."""

    turn_reward = True

    def __init__(self, kind: type):
        self.kind = kind
        self.__name__ = f"{kind.__name__}_turns"

    def __call__(self, prompts, completions, environments, **kwargs) -> list[list[float] | None]:
        rewards = []
        for environment in environments:
            if type(environment) is not self.kind:
                rewards.append(None)
                continue
            value = environment.get_turn_rewards()
            rewards.append(asyncio.run(value) if inspect.isawaitable(value) else value)
        return rewards


def environment_turn_rewards(environment_types: Sequence[type]) -> list[EnvironmentTurnReward]:
    """One turn reward function per environment class that defines `get_turn_rewards`."""
    return [EnvironmentTurnReward(k) for k in environment_types if callable(getattr(k, "get_turn_rewards", None))]


def check_turn_credit(turn_advantage: str | None, toolbox, turn_funcs: Sequence[Callable]) -> None:
    """Refuse, when the trainer is built, turn-level credit without turns to credit or scores to credit them with,
    and turn scores that nothing would use. `toolbox`: the trainer's tools and environments (None without);
    `turn_funcs`: its turn reward functions (`RewardSet.turn_funcs`)."""
    if turn_advantage is None:
        if turn_funcs:
            names = [getattr(f, "__name__", repr(f)) for f in turn_funcs]
            raise ValueError(
                f"The reward functions {names} score each turn (@turn_reward), but turn_advantage=None, so their "
                "scores would be unused. Set turn_advantage='mt_grpo' (or 'reward_to_go'), or drop the mark."
            )
        return
    if toolbox is None:
        raise ValueError(
            f"turn_advantage={turn_advantage!r} credits each turn of a multi-turn episode, but the trainer has no "
            "tools or environment_factory, so every completion is one turn. Pass tools= or environment_factory=, or "
            "set turn_advantage=None."
        )
    if not turn_funcs:
        raise ValueError(
            f"turn_advantage={turn_advantage!r} needs a score per turn: give the environment class a "
            "get_turn_rewards() method, or pass a reward function marked @turn_reward (docs/agents.md, "
            "'Turn-level credit'). Or set turn_advantage=None."
        )
