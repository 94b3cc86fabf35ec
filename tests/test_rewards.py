"""The built-in rewards of grpo/rewards/builtin.py: their docstring examples, and the cases each must get right."""

import doctest

import pytest

import grpo.rewards.builtin as rewards
from grpo.rewards import (
    accuracy,
    answers_match,
    extract_answer,
    format_reward,
    reasoning_gym,
    reasoning_gym_dataset,
    soft_overlong_punishment,
)


def test_docstring_examples_run():
    pytest.importorskip("reasoning_gym")
    results = doctest.testmod(rewards, optionflags=doctest.ELLIPSIS)
    assert results.attempted >= 10 and results.failed == 0


@pytest.fixture(params=["math_verify", "fallback"])
def verifier(request, monkeypatch):
    if request.param == "math_verify":
        pytest.importorskip("math_verify")
    else:
        monkeypatch.setattr(rewards, "_math_verify", lambda: None)
    return request.param


@pytest.mark.parametrize(
    "completion, gold, expected",
    [
        ("So the answer is \\boxed{42}.", "42", 1.0),
        ("So the answer is \\boxed{41}.", "42", 0.0),
        ("I get \\boxed{\\frac{3}{4}}", "0.75", 1.0),
        ("I get \\boxed{\\dfrac{6}{8}}", "\\frac{3}{4}", 1.0),
        ("They sold 1,234,567 cups.", "1234567", 1.0),
        ("First 12, then 7 + 5 = 13", "12", 0.0),  # the last number counts
        ("Natalia sold 48 + 24 = 72 clips.", "She sold 48/2 = 24 in May.\n#### 72", 1.0),  # GSM8K-style gold
        ("no answer here", "3", 0.0),
    ],
)
def test_accuracy(verifier, completion, gold, expected):
    assert accuracy([completion], answer=[gold]) == [expected]


def test_accuracy_on_chat_completions_and_missing_answers(verifier):
    chat = [[{"role": "assistant", "content": "It is \\boxed{7}"}]] * 2
    assert accuracy(chat, answer=["7", None]) == [1.0, None]


def test_accuracy_runs_in_worker_threads():
    pytest.importorskip("math_verify")  # its timeouts use signals, which only the main thread may set
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1) as pool:
        assert pool.submit(accuracy, ["\\boxed{2}", "\\boxed{3}"], answer=["2", "2"]).result() == [1.0, 0.0]


def test_one_completion_text_for_rewards_reports_and_step_positions():
    from grpo.cli import _text
    from grpo.training.metrics import format_completions

    chat = [{"role": "assistant", "content": "2 + 2\n= 4"}]
    assert rewards.completion_text("4") == "4" and rewards.completion_text(chat) == "2 + 2\n= 4"
    assert _text(chat) == "2 + 2\\n= 4"  # the command line's report: the same text on one line
    table = format_completions([{"prompt": "q", "completion": chat, "rewards": [1.0], "advantage": 0.5}], ["r"])
    assert "2 + 2\\n= 4" in table


def test_fallback_comparison():
    assert extract_answer("<answer> x + 1 </answer> and 5") == "x + 1"
    assert extract_answer("nothing") is None
    assert answers_match("-3/6", "-\\frac{1}{2}") and answers_match("\\text{Paris}", "paris.")
    assert not answers_match("1,23", "123") and not answers_match("2", "3") and not answers_match("a", "b")


def test_format_reward():
    fmt = format_reward()
    assert fmt.__name__ == "format"
    ok = "<think>\nadd them\n</think>\n<answer>4</answer>\n"
    assert fmt([ok, "<answer>4</answer>", "<think>x</think><answer>4</answer> trailing", [{"content": ok}]]) == [
        1.0,
        0.0,
        0.0,
        1.0,
    ]
    assert format_reward(r"Answer: \d+")(["Answer: 12", "Answer: twelve"]) == [1.0, 0.0]


def test_soft_overlong_punishment():
    penalty = soft_overlong_punishment(max_completion_len=100, soft_punish_cache=20)
    lengths = [0, 80, 81, 90, 100, 101]
    values = penalty(completion_ids=[[1] * n for n in lengths])
    assert values == [0.0, 0.0, -1 / 20, -10 / 20, -1.0, -1.0]
    with pytest.raises(ValueError, match="soft_punish_cache=0 must be in"):
        soft_overlong_punishment(100, 0)


def test_reasoning_gym_reward_uses_the_tasks_scorer():
    rg = pytest.importorskip("reasoning_gym")
    ds = reasoning_gym_dataset("chain_sum", size=3, seed=7)
    truth = [str(x) for x in ds["answer"]]
    completions = [f"<think>adding</think><answer>{truth[0]}</answer>", "<answer>nonsense</answer>", truth[2]]
    scores = reasoning_gym(completions, metadata=ds["metadata"], answer=ds["answer"], question=ds["question"])
    task = rg.create_dataset("chain_sum", size=3, seed=7)
    expected = [task.score_answer(answer=a, entry=task[i]) for i, a in enumerate([truth[0], "nonsense", truth[2]])]
    assert scores == expected and scores[0] == 1.0 and scores[1] < 1.0
    assert reasoning_gym(["x"], metadata=[None], answer=["1"]) == [None]


def test_every_built_in_plugs_into_the_trainer(tmp_path, tiny_model_path):
    pytest.importorskip("reasoning_gym")
    from grpo import GRPOConfig, GRPOTrainer
    from grpo.rewards import code_execution
    from tests.helpers.scripted import TINY

    dataset = reasoning_gym_dataset("basic_arithmetic", size=4, seed=0)
    dataset = dataset.add_column("tests", [["assert answer() == 42"]] * 4)
    funcs = [
        accuracy,
        reasoning_gym,
        format_reward(),
        soft_overlong_punishment(max_completion_len=8, soft_punish_cache=4),
        code_execution(wall_seconds=5, cpu_seconds=2),
    ]
    # One step, with the reward calls split over 2 threads.
    args = GRPOConfig(output_dir=str(tmp_path / "out"), max_steps=1, reward_num_workers=2, **TINY)
    trainer = GRPOTrainer(tiny_model_path, funcs, args=args, train_dataset=dataset)
    trainer.train()
    logs = trainer.state.log_history[0]
    assert trainer.reward_names == [
        "accuracy",
        "reasoning_gym",
        "format",
        "soft_overlong_punishment",
        "code_execution",
    ]
    # A random tiny model writes 8 random bytes: no format, no passing code, and always the full length
    # (L = 8 = L_max gives -1).
    assert logs["rewards/format/mean"] == 0.0 and logs["rewards/code_execution/mean"] == 0.0
    assert logs["rewards/soft_overlong_punishment/mean"] == -1.0
    assert 0.0 <= logs["rewards/accuracy/mean"] <= 1.0 and 0.0 <= logs["rewards/reasoning_gym/mean"] <= 1.0
