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
which starts with any prefilled text). `grpo.loss.process_advantages` turns the step rewards into token advantages.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from grpo.scoring import _accepted_kwargs, reward_name


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


def _text_of(completion: Any) -> str:
    return completion if isinstance(completion, str) else completion[-1]["content"]


def score_process(
    funcs: Sequence[Callable],
    tokenizer,
    *,
    prompts: list,
    completions: list,
    completion_ids: list[list[int]],
    columns: dict[str, list],
    trainer_state: Any = None,
    width: int,
) -> torch.Tensor:
    """Step rewards of every row under every process reward function: (B, K, width) float32, NaN where no step
    ends. The functions receive the same arguments as in `grpo.scoring.score_completions`."""
    available = {
        **columns,
        "prompts": prompts,
        "completions": completions,
        "completion_ids": completion_ids,
        "trainer_state": trainer_state,
    }
    per_func = [step_rewards_tensor(f, available, completion_ids, tokenizer, width) for f in funcs]
    if not per_func:
        return torch.empty(len(prompts), 0, width)
    return torch.stack(per_func, dim=1)  # (B, K, width)


def step_rewards_tensor(
    func: Callable,
    available: dict[str, Any],
    completion_ids: Sequence[Sequence[int]],
    tokenizer,
    width: int,
) -> torch.Tensor:
    """Call a process reward function and lay its step rewards out as `process_advantages` takes them: (B, width)
    float32, the reward of each step at the index of its last token, NaN elsewhere (and on rows it returned None
    for). `available` holds the reward-function arguments."""
    name = reward_name(func)
    num_rows = len(completion_ids)
    try:
        values = func(**_accepted_kwargs(func, available))
    except Exception as error:
        raise RuntimeError(f"Process reward function '{name}' failed: {type(error).__name__}: {error}") from error
    if not isinstance(values, Sequence) or isinstance(values, str) or len(values) != num_rows:
        got = f"length {len(values)}" if isinstance(values, Sequence) else type(values).__name__
        raise ValueError(
            f"Process reward function '{name}' must return a list of {num_rows} StepRewards (one per row), got {got}."
        )
    dense = torch.full((num_rows, width), math.nan)
    for i, steps in enumerate(values):
        if steps is None:
            continue
        if not isinstance(steps, StepRewards):
            raise TypeError(
                f"Process reward function '{name}' returned {steps!r} for row {i}; each entry must be a "
                "grpo.StepRewards (or None). For one number per completion, drop the @process_reward mark."
            )
        num_tokens = len(completion_ids[i])
        if steps.token_ends is not None:
            token_ends = steps.token_ends
        else:
            text = _text_of(available["completions"][i])
            generated = tokenizer.decode(list(completion_ids[i]), skip_special_tokens=True)
            prefill = len(text) - len(generated)
            offsets = _token_char_ends(completion_ids[i], tokenizer, generated)  # (T,), non-decreasing
            token_ends = []
            for end in steps.char_ends:
                if not prefill < end <= len(text):
                    raise ValueError(
                        f"Process reward function '{name}', row {i}: char end {end} is outside the generated text "
                        f"(characters {prefill + 1}..{len(text)} of the completion)."
                    )
                token_ends.append(bisect.bisect_left(offsets, end - prefill))  # the token holding character end-1
        if token_ends and (token_ends[0] < 0 or token_ends[-1] >= num_tokens):
            raise ValueError(
                f"Process reward function '{name}', row {i}: token ends {list(token_ends)} must lie in "
                f"0..{num_tokens - 1} (the completion has {num_tokens} tokens)."
            )
        for reward, end in zip(steps.rewards, token_ends):
            # Two character ends inside one token land on the same token: their rewards add up.
            dense[i, end] = reward if math.isnan(dense[i, end]) else dense[i, end] + reward
    return dense
