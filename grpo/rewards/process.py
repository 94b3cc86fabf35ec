"""Process rewards (PRM): reward functions that score each reasoning step of a completion (docs/method.md, "Process supervision").

A process reward function is an ordinary reward function marked with `@process_reward`. It receives the same
arguments, and returns, per completion, a `StepRewards` (or `None` when it does not apply to that row):

    from grpo import StepRewards, process_reward

    @process_reward
    def line_steps(completions, **kwargs):
        # Each line is a step; a line that contains a digit earns 1.
        out = []
        for text in completions:
            lines = text.split("\\n")
            ends = [sum(len(line) + 1 for line in lines[: k + 1]) - 1 for k in range(len(lines))]
            ends[-1] = len(text)  # the last line has no newline after it
            out.append(StepRewards([float(any(c.isdigit() for c in line)) for line in lines], char_ends=ends))
        return out

Step positions are given either as `token_ends` (the index, in the completion's tokens, of each step's last
token) or as `char_ends` (the number of characters of the completion text up to and including each step, i.e. the
exclusive end offset; the text is the one the function received: for a conversational prompt, the message content,
which starts with any prefilled text). `grpo.objective.advantages.process_advantages` turns the step rewards into token advantages.

Process functions are called exactly like outcome ones, by `grpo.rewards.scoring.RewardSet.score` (async functions,
`reward_timeout`, `reward_num_workers`, `reward_errors`: grpo/rewards/runner.py); this module only checks what they
return (`check_step_rewards`), lays it out per token (`lay_out_steps`) and sums it per row for metrics
(`step_reward_sums`), as pure functions of the returned values.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from grpo.data import completion_text


@dataclass
class StepRewards:
    """The step rewards of one completion: `rewards[j]` for the step ending at `token_ends[j]` (index of its last
    completion token) or at `char_ends[j]` (exclusive character offset in the completion text). Give exactly one of
    the two, strictly increasing, one position per reward."""

    rewards: Sequence[float]
    token_ends: Sequence[int] | None = None
    char_ends: Sequence[int] | None = None

    def __post_init__(self):
        if (self.token_ends is None) == (self.char_ends is None):
            raise ValueError("StepRewards needs exactly one of token_ends= or char_ends= (where each step ends).")
        ends = self.token_ends if self.token_ends is not None else self.char_ends
        self.rewards = [float(r) for r in self.rewards]
        ends = [int(e) for e in ends]
        if len(ends) != len(self.rewards):
            raise ValueError(
                f"StepRewards has {len(self.rewards)} rewards but {len(ends)} step ends; give one end per step."
            )
        if any(b <= a for a, b in zip(ends, ends[1:])):
            raise ValueError(f"StepRewards step ends must be strictly increasing, got {ends}.")
        if any(not math.isfinite(r) for r in self.rewards):
            raise ValueError(f"StepRewards rewards must be finite numbers, got {self.rewards}.")
        if self.token_ends is not None:
            self.token_ends = ends
        else:
            self.char_ends = ends


def process_reward(func: Callable) -> Callable:
    """Mark `func` as a process reward function: it returns one `StepRewards` (or None) per completion."""
    func.process_reward = True
    return func


def is_process_reward(func: Any) -> bool:
    return bool(getattr(func, "process_reward", False))


def _token_char_ends(ids: Sequence[int], tokenizer, text: str) -> list[int]:
    """For each completion token k, how many characters of `text` (the decoded completion) tokens 0..k spell out
    completely: the common prefix of their decoded text with `text`, so that a token holding only part of a
    multi-byte character does not count that character (special tokens decode to '')."""
    ends = []
    for k in range(len(ids)):
        prefix = tokenizer.decode(list(ids[: k + 1]), skip_special_tokens=True)
        n = min(len(prefix), len(text))
        ends.append(next((j for j in range(n) if prefix[j] != text[j]), n))
    return ends


def check_step_rewards(values: Any, name: str, num_rows: int, offset: int = 0) -> list[StepRewards | None]:
    """What a process function `name` returned for `num_rows` rows (the first being row `offset` of the batch),
    checked: one `StepRewards` or None per row. A wrong length or type is a bug in the function, so it raises
    (even under reward_errors="skip") naming the function and the row."""
    if not isinstance(values, Sequence) or isinstance(values, str) or len(values) != num_rows:
        got = f"length {len(values)}" if isinstance(values, Sequence) else type(values).__name__
        raise ValueError(
            f"Process reward function '{name}' must return a list of {num_rows} StepRewards (one per row), got {got}."
        )
    for i, steps in enumerate(values):
        if steps is not None and not isinstance(steps, StepRewards):
            raise TypeError(
                f"Process reward function '{name}' returned {steps!r} for row {offset + i}; each entry must be a "
                "grpo.StepRewards (or None). For one number per completion, drop the @process_reward mark."
            )
    return list(values)


def _token_ends(steps: StepRewards, ids: Sequence[int], completion: Any, tokenizer, name: str, row: int) -> list[int]:
    """The token index of each step's end: `token_ends` as given, or each char end mapped to the token that
    completes that character of the generated text (after any prefill, which the function saw but did not
    generate)."""
    if steps.token_ends is not None:
        return list(steps.token_ends)
    if tokenizer is None:
        raise ValueError(
            f"Process reward function '{name}', row {row}: char_ends need the policy's tokenizer to find tokens; "
            "pass tokenizer= when scoring, or return token_ends."
        )
    text = completion_text(completion)
    generated = tokenizer.decode(list(ids), skip_special_tokens=True)
    prefill = len(text) - len(generated)
    offsets = _token_char_ends(ids, tokenizer, generated)  # (T,), non-decreasing
    token_ends = []
    for end in steps.char_ends:
        if not prefill < end <= len(text):
            raise ValueError(
                f"Process reward function '{name}', row {row}: char end {end} is outside the generated text "
                f"(characters {prefill + 1}..{len(text)} of the completion)."
            )
        token_ends.append(bisect.bisect_left(offsets, end - prefill))  # the token holding character end-1
    return token_ends


def lay_out_steps(
    values: Sequence[StepRewards | None],
    completion_ids: Sequence[Sequence[int]],
    completions: Sequence[Any],
    tokenizer,
    width: int,
    name: str,
) -> torch.Tensor:
    """A process function's checked step rewards (`check_step_rewards`, one per row) laid out as
    `process_advantages` takes them: (B, width) float32, the reward of each step at the index of its last token,
    NaN elsewhere and on rows without a value (None: not applicable, or failed under reward_errors="skip").
    `tokenizer` (the policy's) maps `char_ends` to tokens; a step end outside the completion raises, naming the
    function `name` and the row."""
    dense = torch.full((len(values), width), math.nan)
    for i, steps in enumerate(values):
        if steps is None:
            continue
        num_tokens = len(completion_ids[i])
        token_ends = _token_ends(steps, completion_ids[i], completions[i], tokenizer, name, i)
        if token_ends and (token_ends[0] < 0 or token_ends[-1] >= num_tokens):
            raise ValueError(
                f"Process reward function '{name}', row {i}: token ends {token_ends} must lie in "
                f"0..{num_tokens - 1} (the completion has {num_tokens} tokens)."
            )
        for reward, end in zip(steps.rewards, token_ends):
            # Two character ends inside one token land on the same token: their rewards add up.
            dense[i, end] = reward if math.isnan(dense[i, end]) else dense[i, end] + reward
    return dense


def step_reward_sums(step_rewards: torch.Tensor) -> torch.Tensor:
    """Each process function's total step reward per row, for metrics: (B, K_p, T) -> (B, K_p), NaN where the
    function gave the row no step."""
    return torch.where(torch.isnan(step_rewards).all(dim=2), torch.nan, step_rewards.nansum(dim=2))
