"""Process reward functions (grpo/rewards/process.py): the StepRewards contract, how step ends become token positions, and
that they are called like outcome functions (grpo/rewards/runner.py: async, reward_timeout, reward_errors)."""

import math
import re

import pytest
import torch

from grpo import StepRewards, process_reward
from grpo.rewards.process import is_process_reward, step_reward_sums
from grpo.rewards.scoring import RewardSet


def _scores(funcs, completions, completion_ids, tokenizer, width, **options):
    """Score through the trainer's path (`RewardSet.score`), every row with prompt 'p'."""
    return RewardSet(funcs).score(
        prompts=["p"] * len(completions),
        completions=completions,
        completion_ids=completion_ids,
        columns={},
        tokenizer=tokenizer,
        width=width,
        **options,
    )


def _dense(func, completions, completion_ids, tokenizer, width, **options):
    """One process function's step rewards, (B, width)."""
    return _scores([func], completions, completion_ids, tokenizer, width, **options).step_rewards[:, 0]


def _nan_to_none(tensor):
    return [[None if math.isnan(v) else v for v in row] for row in tensor.tolist()]


def test_step_rewards_validation():
    assert StepRewards([1, 0], token_ends=[0, 3]).rewards == [1.0, 0.0]
    with pytest.raises(ValueError, match="exactly one of token_ends= or char_ends="):
        StepRewards([1.0])
    with pytest.raises(ValueError, match="exactly one of"):
        StepRewards([1.0], token_ends=[0], char_ends=[1])
    with pytest.raises(ValueError, match="2 rewards but 1 step ends"):
        StepRewards([1.0, 2.0], token_ends=[3])
    with pytest.raises(ValueError, match="strictly increasing"):
        StepRewards([1.0, 2.0], token_ends=[3, 3])
    with pytest.raises(ValueError, match="finite"):
        StepRewards([math.nan], token_ends=[0])


def test_step_reward_sums():
    steps = torch.full((2, 1, 4), math.nan)
    steps[0, 0, 1], steps[0, 0, 3] = 1.0, 0.5
    sums = step_reward_sums(steps)
    assert sums.shape == (2, 1) and sums[0, 0] == 1.5 and math.isnan(sums[1, 0])


def test_token_ends_are_laid_out_at_each_steps_last_token(tokenizer):
    @process_reward
    def steps(completions):
        return [StepRewards([0.5, -1.0], token_ends=[1, 3]), None]

    assert is_process_reward(steps) and not is_process_reward(lambda completions: [1.0])
    ids = [[10, 11, 12, 13, 14], [10, 11]]
    with pytest.warns(UserWarning, match=r"No reward function scored row\(s\) \[1\]"):  # the None row
        dense = _dense(steps, ["abcde", "ab"], ids, tokenizer, 6)
    assert _nan_to_none(dense) == [[None, 0.5, None, -1.0, None, None], [None] * 6]


def test_char_ends_map_to_the_token_holding_the_last_character(tokenizer):
    # The tiny tokenizer has one token per byte: an ASCII character c is token c; "é" is two tokens; EOS decodes
    # to nothing. The docstring example (one step per non-empty line) on "a1\nbc\né9" + EOS:
    #   tokens: a 1 \n b c \n é(2 tokens) 9 EOS -> indices 0..9; lines end at chars 2 ("a1"), 5 ("bc"), 8 ("é9")
    #   -> tokens 1, 4 and 8 (the "9"); rewards 1, 0, 1.
    @process_reward
    def digit_lines(completions, **kwargs):
        out = []
        for text in completions:
            lines = list(re.finditer(r"[^\n]+", text))
            rewards = [float(any(c.isdigit() for c in line.group())) for line in lines]
            out.append(StepRewards(rewards, char_ends=[line.end() for line in lines]) if lines else None)
        return out

    text = "a1\nbc\né9"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    assert len(ids) == 10
    empty = [tokenizer.eos_token_id]
    with pytest.warns(UserWarning, match=r"No reward function scored row\(s\) \[1\]"):  # the None row
        dense = _dense(digit_lines, [text, ""], [ids, empty], tokenizer, 10)
    expected = [None] * 10
    expected[1], expected[4], expected[8] = 1.0, 0.0, 1.0
    assert _nan_to_none(dense) == [expected, [None] * 10]

    # A step ending right after "é" (character 7) ends at its second byte (token 7), not at the first.
    @process_reward
    def at_e(completions):
        return [StepRewards([1.0], char_ends=[7])]

    dense = _dense(at_e, [text], [ids], tokenizer, 10)
    assert dense[0, 7] == 1.0 and torch.isnan(dense[0, :7]).all()


def test_char_ends_skip_a_prefilled_start(tokenizer):
    # Conversational prompt with a prefilled "Answer: " (8 characters): the function sees the whole content, and
    # positions count from its start; the generated tokens are "42".
    @process_reward
    def last_char(completions):
        return [StepRewards([1.0], char_ends=[len(c[0]["content"])]) for c in completions]

    ids = tokenizer("42", add_special_tokens=False)["input_ids"]
    completions = [[{"role": "assistant", "content": "Answer: 42"}]]
    dense = _dense(last_char, completions, [ids], tokenizer, 3)
    assert _nan_to_none(dense) == [[None, 1.0, None]]

    @process_reward
    def in_prefill(completions):
        return [StepRewards([1.0], char_ends=[3]) for _ in completions]

    with pytest.raises(ValueError, match="char end 3 is outside the generated text \\(characters 9..10"):
        _dense(in_prefill, completions, [ids], tokenizer, 3)


def test_process_reward_misuse_gives_clear_errors(tokenizer):
    ids = [[10, 11]]

    @process_reward
    def numbers(completions):
        return [1.0]

    with pytest.raises(TypeError, match="'numbers' returned 1.0 for row 0; .*drop the @process_reward mark"):
        _dense(numbers, ["ab"], ids, tokenizer, 2)

    @process_reward
    def too_far(completions):
        return [StepRewards([1.0], token_ends=[2])]

    with pytest.raises(ValueError, match=r"token ends \[2\] must lie in 0..1"):
        _dense(too_far, ["ab"], ids, tokenizer, 2)

    @process_reward
    def broken(completions):
        raise KeyError("label")

    # Named like an outcome failure: the function, the row, its prompt and what it raised.
    with pytest.raises(
        RuntimeError, match=r"Process reward function 'broken' failed on row 0 \(prompt: 'p'\): KeyError"
    ):
        _dense(broken, ["ab"], ids, tokenizer, 2)

    @process_reward
    def short(completions):
        return []

    with pytest.raises(ValueError, match="must return a list of 1 StepRewards"):
        _dense(short, ["ab"], ids, tokenizer, 2)


def test_process_functions_are_stacked_and_receive_the_columns(tokenizer):
    @process_reward
    def by_answer(completions, answer):
        return [StepRewards([float(a)], token_ends=[0]) for a in answer]

    @process_reward
    def constant(completions):
        return [StepRewards([2.0], token_ends=[1]) for _ in completions]

    ids = [[10, 11], [12, 13]]
    inputs = dict(prompts=["p", "q"], completions=["ab", "cd"], completion_ids=ids, columns={"answer": [3, 4]})
    out = RewardSet([by_answer, constant]).score(**inputs, tokenizer=tokenizer, width=3).step_rewards
    assert out.shape == (2, 2, 3)
    assert _nan_to_none(out[:, 0]) == [[3.0, None, None], [4.0, None, None]]
    assert _nan_to_none(out[:, 1]) == [[None, 2.0, None], [None, 2.0, None]]
    only_outcome = RewardSet([lambda completions: [1.0]]).score(
        prompts=["p"], completions=["a"], completion_ids=[[1]], columns={}, width=4
    )
    assert only_outcome.step_rewards.shape == torch.Size([1, 0, 4])


# ---- called like outcome functions: reward_errors, reward_timeout, async, workers ----

_IDS = [[10, 11], [12, 13], [14, 15]]
_COMPLETIONS = ["ab", "cd", "ef"]


@process_reward
def _fails_on_cd(completions):
    if "cd" in completions:
        raise KeyError("cd")
    return [StepRewards([1.0], token_ends=[1]) for _ in completions]


def test_skip_gives_failed_rows_no_steps_and_counts_each_failed_row(tokenizer):
    with pytest.raises(RuntimeError, match=r"Process reward function '_fails_on_cd' failed on row 1 \(prompt: 'p'\)"):
        _dense(_fails_on_cd, _COMPLETIONS, _IDS, tokenizer, 2)
    with pytest.warns(UserWarning, match=r"No reward function scored row\(s\) \[1\].*returned None or failed"):
        scores = _scores([_fails_on_cd], _COMPLETIONS, _IDS, tokenizer, 2, errors="skip")
    # The rows that work alone keep their steps; the failed row has none (all NaN); one error per failed row.
    assert _nan_to_none(scores.step_rewards[:, 0]) == [[None, 1.0], [None, None], [None, 1.0]]
    assert scores.errors == [1]


def test_errors_are_counted_per_function_outcome_functions_first(tokenizer):
    def outcome(completions):
        return [0.5] * len(completions)

    scores = _scores([_fails_on_cd, outcome], _COMPLETIONS, _IDS, tokenizer, 2, errors="skip")
    assert scores.rewards.tolist() == [[0.5]] * 3
    assert scores.errors == [0, 1]  # RewardSet.names order: ['outcome', '_fails_on_cd']
    assert RewardSet([_fails_on_cd, outcome]).names == ["outcome", "_fails_on_cd"]


def test_a_slow_process_function_times_out_like_an_outcome_one(tokenizer):
    import asyncio
    import time

    @process_reward
    def hangs(completions):
        time.sleep(2)
        return [StepRewards([1.0], token_ends=[0]) for _ in completions]

    @process_reward
    async def hangs_async(completions):
        await asyncio.sleep(2)
        return [StepRewards([1.0], token_ends=[0]) for _ in completions]

    for func in (hangs, hangs_async):
        began = time.perf_counter()
        pattern = rf"Process reward function '{func.__name__}' failed on a batch of 3 rows \(0-2\): TimeoutError"
        with pytest.raises(RuntimeError, match=pattern):
            _dense(func, _COMPLETIONS, _IDS, tokenizer, 2, timeout=0.2)
        with pytest.warns(UserWarning, match="No reward function scored"):
            scores = _scores([func], _COMPLETIONS, _IDS, tokenizer, 2, timeout=0.2, errors="skip")
        assert time.perf_counter() - began < 1.5  # neither call waited for the 2 s sleeps
        assert torch.isnan(scores.step_rewards).all() and scores.errors == [3]  # a timed-out call: all its rows


def test_async_process_functions_run_and_row_slices_are_put_back_in_order(tokenizer):
    @process_reward
    async def first_token(completions):
        return [StepRewards([float(len(c))], token_ends=[0]) for c in completions]

    @process_reward
    def by_prompt(prompts, completions):
        return [StepRewards([float(p[1:])], token_ends=[1]) for p in prompts]

    assert _nan_to_none(_dense(first_token, ["a", "bb"], [[1, 2], [3, 4]], tokenizer, 2)) == [[1.0, None], [2.0, None]]
    scores = RewardSet([by_prompt]).score(
        prompts=["p0", "p1", "p2"], completions=_COMPLETIONS, completion_ids=_IDS, columns={}, width=2, num_workers=2
    )
    assert _nan_to_none(scores.step_rewards[:, 0]) == [[None, 0.0], [None, 1.0], [None, 2.0]]


def test_malformed_step_rewards_raise_even_when_skipping(tokenizer):
    @process_reward
    def numbers(completions):
        return [1.0] * len(completions)

    with pytest.raises(TypeError, match="'numbers' returned 1.0 for row 0"):
        _dense(numbers, _COMPLETIONS, _IDS, tokenizer, 2, errors="skip", num_workers=2)
