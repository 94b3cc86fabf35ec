import math

import pytest
import torch

from grpo.scoring import call_reward_function, reward_name, score_completions


def _scores(funcs, prompts=("p0", "p1", "p2"), completions=("a", "bb", "ccc"), options=None, **columns):
    return score_completions(
        funcs,
        [None] * len(funcs),
        prompts=list(prompts),
        completions=list(completions),
        completion_ids=[[1] * (i + 1) for i in range(len(completions))],
        columns={k: list(v) for k, v in columns.items()},
        trainer_state="STATE",
        **(options or {}),
    )


def _score(funcs, **kwargs):
    return _scores(funcs, **kwargs).rewards


def test_functions_receive_only_the_arguments_they_accept():
    seen = {}

    def minimal(prompts, completions):
        return [float(len(c)) for c in completions]

    def with_columns(completions, answer, trainer_state):
        seen["answer"], seen["state"] = answer, trainer_state
        return [1.0 if c == a else 0.0 for c, a in zip(completions, answer)]

    def with_kwargs(completions, **kwargs):
        seen["kwargs"] = sorted(kwargs)
        return [0.0] * len(completions)

    rewards = _score([minimal, with_columns, with_kwargs], answer=["a", "x", "ccc"], other=[1, 2, 3])
    assert rewards.shape == (3, 3)
    assert rewards[:, 0].tolist() == [1.0, 2.0, 3.0]
    assert rewards[:, 1].tolist() == [1.0, 0.0, 1.0]
    assert seen["answer"] == ["a", "x", "ccc"] and seen["state"] == "STATE"
    assert seen["kwargs"] == ["answer", "completion_ids", "other", "prompts", "trainer_state"]


def test_none_becomes_nan():
    def partial(completions):
        return [None, 1.0, None]

    rewards = _score([partial])
    assert math.isnan(rewards[0, 0]) and rewards[1, 0] == 1.0 and math.isnan(rewards[2, 0])


def test_failing_function_names_itself_and_the_row():
    def fragile(prompts, completions):
        return [1.0 / (len(c) - 2) for c in completions]  # ZeroDivisionError on "bb"

    with pytest.raises(RuntimeError, match=r"'fragile' failed on row 1 \(prompt: 'p1'\): ZeroDivisionError"):
        _score([fragile])


def test_wrong_length_and_wrong_type_are_reported():
    def short(completions):
        return [1.0]

    def words(completions):
        return ["good"] * len(completions)

    with pytest.raises(ValueError, match="'short' must return a list of 3 values"):
        _score([short])
    with pytest.raises(TypeError, match="'words' returned 'good'.*row 0"):
        _score([words])


def test_missing_required_argument_is_reported():
    def needs_solution(completions, solution):
        return [0.0] * len(completions)

    with pytest.raises(TypeError, match=r"requires argument\(s\) \['solution'\]"):
        _score([needs_solution], answer=["a", "b", "c"])


def test_tensor_and_numpy_results_are_accepted():
    import numpy as np

    def as_tensor(completions):
        return torch.tensor([1.0, 2.0, 3.0])

    def as_numpy(completions):
        return [np.float32(0.5)] * 3

    assert _score([as_tensor, as_numpy]).tolist() == [[1.0, 0.5], [2.0, 0.5], [3.0, 0.5]]


def test_reward_names():
    def my_reward(completions):
        return []

    class Scorer:
        def __call__(self, completions):
            return []

    assert reward_name(my_reward) == "my_reward"
    assert reward_name(Scorer()) == "Scorer"
    assert call_reward_function(lambda completions: [1] * 2, {"completions": ["a", "b"]}, 2) == [1.0, 1.0]


def test_reward_model_scores_prompt_and_completion(tokenizer):
    from transformers import LlamaForSequenceClassification

    from grpo.testing import tiny_config

    config = tiny_config(tokenizer, num_hidden_layers=1, num_labels=1)
    model = LlamaForSequenceClassification(config).eval()
    rewards = score_completions(
        [model], [tokenizer], prompts=["ab", "ab"], completions=["c", "cd"], completion_ids=[[1], [1, 2]], columns={}
    ).rewards
    with torch.no_grad():
        direct = model(**tokenizer(["abc"], return_tensors="pt")).logits[0, 0].item()
    assert rewards.shape == (2, 1)
    assert rewards[0, 0].item() == pytest.approx(direct, abs=1e-5)
    assert rewards[0, 0] != rewards[1, 0]
