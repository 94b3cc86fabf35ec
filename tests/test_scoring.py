import math

import pytest
import torch

from grpo.rewards.names import reward_name
from grpo.rewards.scoring import combine_rewards, score_rewards


def _scores(funcs, prompts=("p0", "p1", "p2"), completions=("a", "bb", "ccc"), options=None, **columns):
    return score_rewards(
        funcs,
        [None] * len(funcs),
        [],
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

    with pytest.warns(UserWarning, match=r"row\(s\) \[0, 2\]"):
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
    ints = _score([lambda completions: [1] * 2], prompts=["p0", "p1"], completions=["a", "b"])  # (2, 1)
    assert ints[:, 0].tolist() == [1.0, 1.0]


def test_combine_rewards_skips_unscored_entries():
    rewards = torch.tensor([[1.0, 2.0], [math.nan, 3.0], [math.nan, math.nan], [-1.0, math.nan]])
    combined = combine_rewards(rewards, torch.tensor([2.0, 0.5]))
    # 2*1 + 0.5*2 = 3; only the second scored: 1.5; nobody scored: NaN; only the first: -2.
    assert combined[[0, 1, 3]].tolist() == [3.0, 1.5, -2.0] and math.isnan(combined[2])


def test_reward_model_scores_prompt_and_completion(tokenizer):
    from transformers import LlamaForSequenceClassification

    from grpo.testing import tiny_config

    config = tiny_config(tokenizer, num_hidden_layers=1, num_labels=1)
    model = LlamaForSequenceClassification(config).eval()
    batch = dict(prompts=["ab", "ab"], completions=["c", "cd"], completion_ids=[[1], [1, 2]], columns={})
    rewards = score_rewards([model], [tokenizer], [], **batch).rewards
    with torch.no_grad():
        direct = model(**tokenizer(["abc"], return_tensors="pt")).logits[0, 0].item()
    assert rewards.shape == (2, 1)
    assert rewards[0, 0].item() == pytest.approx(direct, abs=1e-5)
    assert rewards[0, 0] != rewards[1, 0]


# ---- concurrency, timeouts and the error policy ----


def test_async_functions_run_concurrently():
    import asyncio
    import time

    async def judge_a(completions):
        await asyncio.sleep(0.3)
        return [1.0] * len(completions)

    class JudgeB:  # an object with an async __call__ counts as async too
        async def __call__(self, completions):
            await asyncio.sleep(0.3)
            return [float(len(c)) for c in completions]

    began = time.perf_counter()
    scores = _scores([judge_a, JudgeB()])
    elapsed = time.perf_counter() - began
    assert scores.rewards.tolist() == [[1.0, 1.0], [1.0, 2.0], [1.0, 3.0]]
    assert elapsed < 0.55, f"two 0.3 s async calls took {elapsed:.2f} s: they did not overlap"
    assert scores.seconds >= 0.3


def test_workers_split_sync_functions_into_row_slices():
    import threading
    import time

    calls = []

    def slow_judge(prompts, completions):
        calls.append((threading.current_thread().name, list(prompts)))
        time.sleep(0.2)
        return [float(len(c)) for c in completions]

    prompts = [f"p{i}" for i in range(6)]
    began = time.perf_counter()
    scores = _scores(
        [slow_judge], prompts=prompts, completions=["x" * i for i in range(6)], options={"num_workers": 3}
    )
    elapsed = time.perf_counter() - began
    assert scores.rewards[:, 0].tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]  # rows back in their places
    assert sorted(p for _, rows in calls for p in rows) == prompts and all(len(rows) == 2 for _, rows in calls)
    assert all(name != threading.main_thread().name for name, _ in calls)
    assert elapsed < 0.5, f"3 slices of 0.2 s took {elapsed:.2f} s: they did not overlap"


def test_timeout_raises_or_skips():
    import time

    def hangs(completions):
        time.sleep(2)
        return [1.0] * len(completions)

    async def hangs_async(completions):
        import asyncio

        await asyncio.sleep(2)
        return [1.0] * len(completions)

    def fine(completions):
        return [0.5] * len(completions)

    for func in (hangs, hangs_async):
        name = func.__name__
        began = time.perf_counter()
        with pytest.raises(RuntimeError, match=rf"'{name}' failed on a batch of 3 rows \(0-2\): TimeoutError"):
            _scores([func, fine], options={"timeout": 0.2})
        scores = _scores([func, fine], options={"timeout": 0.2, "errors": "skip"})
        assert time.perf_counter() - began < 1.5  # neither call waited for the 2 s sleeps
        assert torch.isnan(scores.rewards[:, 0]).all() and scores.rewards[:, 1].tolist() == [0.5] * 3
        assert scores.errors == [3, 0]


def test_skip_keeps_the_rows_that_work_and_counts_the_others():
    def fragile(completions):
        return [1.0 / (len(c) - 2) for c in completions]  # fails on "bb" only

    async def fragile_async(completions):
        return fragile(completions)

    for func in (fragile, fragile_async):
        with pytest.warns(UserWarning, match=r"returned None or failed"):
            scores = _scores([func], options={"errors": "skip"})
        values = scores.rewards[:, 0]
        assert values[0].item() == -1.0 and math.isnan(values[1]) and values[2].item() == 1.0
        assert scores.errors == [1]
    with pytest.raises(RuntimeError, match=r"'fragile_async' failed on row 1 \(prompt: 'p1'\): ZeroDivisionError"):
        _scores([fragile_async])
    with pytest.raises(ValueError, match="errors='sometimes'"):
        _scores([fragile], options={"errors": "sometimes"})


def test_malformed_results_raise_even_when_skipping():
    def words(completions):
        return ["good"] * len(completions)

    with pytest.raises(TypeError, match="'words' returned 'good'"):
        _scores([words], options={"errors": "skip", "num_workers": 2})


def test_rows_no_function_scored_are_named_in_a_warning():
    def only_first(completions):
        return [1.0, None, None]

    def only_last(completions):
        return [None, None, 2.0]

    with pytest.warns(UserWarning, match=r"No reward function scored row\(s\) \[1\] of this batch \(1 of 3\)"):
        _scores([only_first, only_last])


# ---- reward models ----


def _reward_model(tokenizer, seed=0):
    from transformers import LlamaForSequenceClassification

    from grpo.testing import tiny_config

    torch.manual_seed(seed)
    return LlamaForSequenceClassification(tiny_config(tokenizer, num_hidden_layers=1, num_labels=1)).eval()


def test_reward_model_from_a_path_scores_like_the_loaded_one(tmp_path, tokenizer):
    from grpo.rewards.names import load_reward_funcs

    model = _reward_model(tokenizer)
    model.save_pretrained(tmp_path / "rm")
    tokenizer.save_pretrained(tmp_path / "rm")
    funcs, tokenizers = load_reward_funcs(str(tmp_path / "rm"))  # the tokenizer comes from the same folder
    assert reward_name(funcs[0]) == "rm" and tokenizers[0] is not None
    kwargs = dict(prompts=["ab", "xy", "ab"], completions=["c", "zzz", "cd"], completion_ids=[[1]] * 3, columns={})
    from_path = score_rewards(funcs, tokenizers, [], **kwargs).rewards
    loaded = score_rewards([model], [tokenizer], [], **kwargs).rewards
    in_batches = score_rewards([model], [tokenizer], [], model_batch_size=2, **kwargs).rewards
    torch.testing.assert_close(from_path, loaded)
    torch.testing.assert_close(in_batches, loaded, atol=1e-5, rtol=1e-5)  # right padding: batching changes nothing


def test_reward_model_uses_the_chat_template_for_conversations(tokenizer):
    model = _reward_model(tokenizer)
    prompt = [{"role": "user", "content": "2+2?"}]
    completion = [{"role": "assistant", "content": "4"}]
    rewards = score_rewards(
        [model], [tokenizer], [], prompts=[prompt], completions=[completion], completion_ids=[[1]], columns={}
    ).rewards
    text = "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>\n"
    assert tokenizer.apply_chat_template(prompt + completion, tokenize=False) == text
    with torch.no_grad():
        direct = model(**tokenizer([text], return_tensors="pt", add_special_tokens=False)).logits[0, 0].item()
    assert rewards[0, 0].item() == pytest.approx(direct, abs=1e-5)


def test_reward_model_checks(tokenizer):
    from transformers import LlamaForSequenceClassification

    from grpo.rewards.names import load_reward_funcs
    from grpo.testing import tiny_config

    two_labels = LlamaForSequenceClassification(tiny_config(tokenizer, num_hidden_layers=1, num_labels=2))
    with pytest.raises(ValueError, match="num_labels=2; a reward model must output one score"):
        load_reward_funcs([two_labels], [tokenizer])
    with pytest.raises(ValueError, match="pass its tokenizer in `reward_processing_classes`"):
        load_reward_funcs([_reward_model(tokenizer)])
    with pytest.raises(ValueError, match="reward_processing_classes has 2 entries for 1"):
        load_reward_funcs([_reward_model(tokenizer)], [tokenizer, None])


def test_reward_set_splits_functions_by_kind_and_scores_both_in_one_pass(tokenizer):
    from grpo import StepRewards, process_reward
    from grpo.rewards.scoring import RewardSet

    def length(completions):
        return [float(len(c)) for c in completions]

    @process_reward
    def last_token(completion_ids):
        return [StepRewards([1.0], token_ends=[len(ids) - 1]) for ids in completion_ids]

    model = _reward_model(tokenizer)
    rewards = RewardSet([last_token, length, model], [None, None, tokenizer], reward_weights=[0.5, 1.0, 2.0])
    assert rewards.names == [reward_name(length), reward_name(model), "last_token"]  # outcome first, then process
    assert rewards.outcome_funcs == [length, model] and rewards.outcome_tokenizers == [None, tokenizer]
    assert rewards.process_funcs == [last_token]
    assert rewards.outcome_weights.tolist() == [1.0, 2.0] and rewards.process_weights.tolist() == [0.5]
    assert rewards.outcome_weights.dtype == torch.float32 and rewards.process_weights.dtype == torch.float32

    scores = rewards.score(
        prompts=["p0", "p1"], completions=["a", "bb"], completion_ids=[[1], [1, 2]], columns={}, width=3
    )
    assert scores.rewards.shape == (2, 2) and scores.rewards[:, 0].tolist() == [1.0, 2.0]
    assert scores.step_rewards.shape == (2, 1, 3) and scores.step_rewards[0, 0, 0] == 1.0
    assert scores.step_rewards[1, 0, 1] == 1.0 and scores.errors == [0, 0, 0]
    # Without width the step rewards are as wide as the longest completion.
    unpadded = rewards.score(prompts=["p0", "p1"], completions=["a", "bb"], completion_ids=[[1], [1, 2]], columns={})
    assert unpadded.step_rewards.shape == (2, 1, 2)


def test_reward_set_checks_weights_and_refuses_a_process_reward_model(tokenizer):
    from grpo import process_reward
    from grpo.rewards.scoring import RewardSet

    def length(completions):
        return [float(len(c)) for c in completions]

    with pytest.raises(
        ValueError, match=r"reward_weights has 2 entries but there are 1 reward functions \(\['length'\]\)"
    ):
        RewardSet([length], reward_weights=[1.0, 2.0])
    with pytest.raises(TypeError, match="is marked @process_reward, but a reward model scores whole completions"):
        RewardSet([process_reward(_reward_model(tokenizer))], [tokenizer])


def test_process_workers_run_slices_in_other_processes_and_survive_timeouts():
    import os
    import time

    from tests.helpers.process_rewards import fails_on_row_1, sleeps_on_long_completions, worker_pid

    options = {"num_workers": 2, "worker_type": "process"}
    pids = _score([worker_pid], options=options)[:, 0].tolist()
    assert os.getpid() not in pids and len(pids) == 3

    with pytest.raises(RuntimeError, match=r"'fails_on_row_1' failed on row 1 \(prompt: 'p1'\): KeyError"):
        _score([fails_on_row_1], options=options)

    began = time.perf_counter()
    with pytest.warns(UserWarning, match=r"row\(s\) \[2\] of this batch \(1 of 3\): each returned None or failed"):
        scores = _scores([sleeps_on_long_completions], options={**options, "timeout": 1.0, "errors": "skip"})
    assert time.perf_counter() - began < 10  # the stuck worker was killed, not waited for
    # Slices are rows [0, 2) and [2, 3): only the one holding "ccc" sleeps.
    assert scores.rewards[:2, 0].tolist() == [1.0, 1.0] and torch.isnan(scores.rewards[2, 0])
    assert scores.errors == [1]
    assert _score([worker_pid], options=options).shape == (3, 1)  # a fresh pool serves the next round

    with pytest.raises(TypeError, match="cannot be sent to a worker process"):
        _score([lambda completions: [0.0] * len(completions)], options=options)


def test_a_reward_module_from_a_recipe_folder_runs_in_worker_processes(tmp_path, monkeypatch):
    """A worker process is spawned with the trainer's sys.path, which no longer holds the recipe's folder once the
    module is imported (grpo.rewards.names.import_from_folders): the pool puts that folder on its workers' path."""
    import os
    import sys

    from grpo.rewards.names import resolve_reward_name

    (tmp_path / "worker_probe_rewards.py").write_text(
        "import os\n\n\ndef pid(completions, **kwargs):\n    return [float(os.getpid())] * len(completions)\n"
    )
    monkeypatch.setattr(sys, "path", list(sys.path))  # the test's own sys.path is put back even when it fails
    try:
        pid = resolve_reward_name("worker_probe_rewards:pid", search_dirs=[tmp_path])
        pids = _score([pid], options={"num_workers": 2, "worker_type": "process"})[:, 0].tolist()
        assert os.getpid() not in pids and len(pids) == 3
    finally:
        sys.modules.pop("worker_probe_rewards", None)


def _exits_on_row_1(prompts, completions):
    if "p1" in prompts:
        raise SystemExit(0)  # what `sys.exit(0)` raises
    return [1.0] * len(completions)


async def _async_exits_on_row_1(prompts, completions):
    return _exits_on_row_1(prompts, completions)


def _interrupted_on_row_1(prompts, completions):
    if "p1" in prompts:
        raise KeyboardInterrupt
    return [1.0] * len(completions)


@pytest.mark.parametrize(
    "func, options",
    [
        (_exits_on_row_1, {}),
        (_exits_on_row_1, {"num_workers": 2}),
        (_exits_on_row_1, {"timeout": 30.0}),
        (_async_exits_on_row_1, {}),
        (_interrupted_on_row_1, {"num_workers": 2}),
    ],
    ids=["inline", "threads", "timed", "async", "interrupt-in-a-thread"],
)
def test_a_reward_that_exits_fails_like_any_error_and_never_ends_the_run(func, options):
    name = reward_name(func)
    why = "(SystemExit: 0|KeyboardInterrupt: ) \\(a reward function cannot end the run"
    with pytest.raises(RuntimeError, match=rf"'{name}' failed on row 1 \(prompt: 'p1'\): {why}"):
        _score([func], options=options)
    with pytest.warns(UserWarning, match=r"row\(s\) \[1\]"):
        scores = _scores([func], options={**options, "errors": "skip"})
    assert scores.rewards[[0, 2], 0].tolist() == [1.0, 1.0] and torch.isnan(scores.rewards[1, 0])
    assert scores.errors == [1]


def test_a_reward_that_exits_in_a_worker_process_fails_like_any_error():
    from tests.helpers.process_rewards import exits_on_row_1, interrupted_on_row_1

    options = {"num_workers": 3, "worker_type": "process"}
    for func, why in ((exits_on_row_1, "SystemExit: 0"), (interrupted_on_row_1, "KeyboardInterrupt")):
        with pytest.raises(RuntimeError, match=rf"'{func.__name__}' failed on row 1 \(prompt: 'p1'\): {why}"):
            _score([func], options=options)


def test_ctrl_c_in_the_main_thread_still_stops_scoring():
    # A KeyboardInterrupt in the main thread is the user's Ctrl-C (that is where the signal lands): it passes.
    with pytest.raises(KeyboardInterrupt):
        _score([_interrupted_on_row_1])


@pytest.mark.parametrize(
    "options", [{}, {"num_workers": 2}, {"num_workers": 2, "worker_type": "process"}, {"timeout": 30.0}]
)
def test_each_function_gets_its_own_copy_of_completions_and_columns(options):
    from tests.helpers.process_rewards import edits_its_arguments, untouched

    prompts = [[{"role": "user", "content": f"p{i}"}] for i in range(3)]
    completions = [[{"role": "assistant", "content": c}] for c in ("a", "bb", "ccc")]
    columns = {"answer": [{"value": "a"}, {"value": "bb"}, {"value": "x"}]}
    original = repr((prompts, completions, columns))
    scores = score_rewards(
        [edits_its_arguments, untouched, edits_its_arguments, untouched],
        [None] * 4,
        [],
        prompts=prompts,
        completions=completions,
        completion_ids=[[1] * (i + 1) for i in range(3)],
        columns=columns,
        **options,
    )
    # `untouched` saw every row as it was, after one function and before another that edit theirs in place ...
    assert scores.rewards[:, 1].tolist() == [1.0, 1.0, 1.0] == scores.rewards[:, 3].tolist()
    assert repr((prompts, completions, columns)) == original  # ... and the caller's data is unchanged
