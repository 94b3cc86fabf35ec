"""Process reward functions (grpo/process.py): the StepRewards contract and how step ends become token positions."""

import math
import re

import pytest
import torch

from grpo import StepRewards, process_reward
from grpo.process import is_process_reward, score_process, step_rewards_tensor


def _available(completions, completion_ids):
    return {"prompts": ["p"] * len(completions), "completions": completions, "completion_ids": completion_ids}


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


def test_token_ends_are_laid_out_at_each_steps_last_token(tokenizer):
    @process_reward
    def steps(completions):
        return [StepRewards([0.5, -1.0], token_ends=[1, 3]), None]

    assert is_process_reward(steps) and not is_process_reward(lambda completions: [1.0])
    ids = [[10, 11, 12, 13, 14], [10, 11]]
    dense = step_rewards_tensor(steps, _available(["abcde", "ab"], ids), ids, tokenizer, width=6)
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
    dense = step_rewards_tensor(digit_lines, _available([text, ""], [ids, empty]), [ids, empty], tokenizer, 10)
    expected = [None] * 10
    expected[1], expected[4], expected[8] = 1.0, 0.0, 1.0
    assert _nan_to_none(dense) == [expected, [None] * 10]

    # A step ending right after "é" (character 7) ends at its second byte (token 7), not at the first.
    @process_reward
    def at_e(completions):
        return [StepRewards([1.0], char_ends=[7])]

    dense = step_rewards_tensor(at_e, _available([text], [ids]), [ids], tokenizer, 10)
    assert dense[0, 7] == 1.0 and torch.isnan(dense[0, :7]).all()


def test_char_ends_skip_a_prefilled_start(tokenizer):
    # Conversational prompt with a prefilled "Answer: " (8 characters): the function sees the whole content, and
    # positions count from its start; the generated tokens are "42".
    @process_reward
    def last_char(completions):
        return [StepRewards([1.0], char_ends=[len(c[0]["content"])]) for c in completions]

    ids = tokenizer("42", add_special_tokens=False)["input_ids"]
    completions = [[{"role": "assistant", "content": "Answer: 42"}]]
    dense = step_rewards_tensor(last_char, _available(completions, [ids]), [ids], tokenizer, 3)
    assert _nan_to_none(dense) == [[None, 1.0, None]]

    @process_reward
    def in_prefill(completions):
        return [StepRewards([1.0], char_ends=[3]) for _ in completions]

    with pytest.raises(ValueError, match="char end 3 is outside the generated text \\(characters 9..10"):
        step_rewards_tensor(in_prefill, _available(completions, [ids]), [ids], tokenizer, 3)


def test_process_reward_misuse_gives_clear_errors(tokenizer):
    ids = [[10, 11]]

    @process_reward
    def numbers(completions):
        return [1.0]

    with pytest.raises(TypeError, match="'numbers' returned 1.0 for row 0; .*drop the @process_reward mark"):
        step_rewards_tensor(numbers, _available(["ab"], ids), ids, tokenizer, 2)

    @process_reward
    def too_far(completions):
        return [StepRewards([1.0], token_ends=[2])]

    with pytest.raises(ValueError, match=r"token ends \[2\] must lie in 0..1"):
        step_rewards_tensor(too_far, _available(["ab"], ids), ids, tokenizer, 2)

    @process_reward
    def broken(completions):
        raise KeyError("label")

    with pytest.raises(RuntimeError, match="Process reward function 'broken' failed: KeyError: 'label'"):
        step_rewards_tensor(broken, _available(["ab"], ids), ids, tokenizer, 2)

    @process_reward
    def short(completions):
        return []

    with pytest.raises(ValueError, match="must return a list of 1 StepRewards"):
        step_rewards_tensor(short, _available(["ab"], ids), ids, tokenizer, 2)


def test_score_process_stacks_functions_and_passes_columns(tokenizer):
    @process_reward
    def by_answer(completions, answer):
        return [StepRewards([float(a)], token_ends=[0]) for a in answer]

    @process_reward
    def constant(completions):
        return [StepRewards([2.0], token_ends=[1]) for _ in completions]

    ids = [[10, 11], [12, 13]]
    out = score_process(
        [by_answer, constant],
        tokenizer,
        prompts=["p", "q"],
        completions=["ab", "cd"],
        completion_ids=ids,
        columns={"answer": [3, 4]},
        width=3,
    )
    assert out.shape == (2, 2, 3)
    assert _nan_to_none(out[:, 0]) == [[3.0, None, None], [4.0, None, None]]
    assert _nan_to_none(out[:, 1]) == [[None, 2.0, None], [None, 2.0, None]]
    assert score_process(
        [], tokenizer, prompts=["p"], completions=["a"], completion_ids=[[1]], columns={}, width=4
    ).shape == torch.Size([1, 0, 4])
