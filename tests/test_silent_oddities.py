"""Oddities that used to change training without a word (issue 38), each made impossible or loud: a reward that
reseeds torch, reward functions sharing a name, prompts longer than the model's context, a near-zero temperature, a
tokenizer larger than the model's vocabulary, and a multi-process launch whose processes each
train alone. Rows of the fault matrix in docs/reliability.md."""

import os
import subprocess
import sys
import warnings

import pytest
import torch
from datasets import Dataset

from grpo import GRPOConfig, GRPOTrainer
from grpo.data import InputError
from grpo.generation.base import SamplingRNG
from grpo.rewards.names import distinct_names
from grpo.testing import tiny_model, tiny_tokenizer
from tests.helpers.net import ROOT, TWO_CPU_PROCESSES, free_port
from tests.helpers.scripted import TINY, reward_len
from tests.test_cli import write_tiny_recipe


def make_trainer(tmp_path, tokenizer, dataset, rewards, **kwargs):
    settings = {**TINY, "max_steps": 3, "learning_rate": 1e-2, **kwargs}
    args = GRPOConfig(output_dir=str(tmp_path / "out"), **settings)
    return GRPOTrainer(tiny_model(tokenizer), rewards, args=args, train_dataset=dataset, processing_class=tokenizer)


# ---- A reward that reseeds torch cannot move the sampler ----


def sampled_completions(tmp_path, tokenizer, dataset, other_reward):
    """Every round's completions of a 3-step run whose second reward function is `other_reward`."""
    seen = []

    def records(completions):
        seen.append(list(completions))
        return [float(len(c)) for c in completions]

    make_trainer(tmp_path, tokenizer, dataset, [records, other_reward]).train()
    return seen


def test_a_reward_that_reseeds_torch_does_not_change_what_is_sampled(tmp_path, tokenizer, prompt_dataset):
    # It used to: generation drew from torch's default generator, which the reward set back to seed 0 at every
    # round, so every later round drew the very same random numbers.
    def reseeds(completions):
        torch.manual_seed(0)
        return [0.0] * len(completions)

    def leaves_torch_alone(completions):
        return [0.0] * len(completions)

    reseeded = sampled_completions(tmp_path / "a", tokenizer, prompt_dataset, reseeds)
    plain = sampled_completions(tmp_path / "b", tokenizer, prompt_dataset, leaves_torch_alone)
    assert len(plain) == 3 and reseeded == plain


def test_the_sampling_stream_is_apart_from_torchs_and_continues_from_its_state():
    rng = SamplingRNG(seed=7)
    torch.manual_seed(123)
    before = torch.get_rng_state()
    with rng.as_default():
        first = torch.rand(4)
    assert torch.equal(torch.get_rng_state(), before)  # the process's generator is as it was
    saved = rng.state_dict()
    with rng.as_default():
        second = torch.rand(4)
    assert not torch.equal(first, second)  # the stream moved on
    restored = SamplingRNG(seed=99)
    restored.load_state_dict(saved)
    with restored.as_default():
        assert torch.equal(torch.rand(4), second)  # a saved stream continues where it was
    with SamplingRNG(seed=7).as_default():
        assert torch.equal(torch.rand(4), first)  # the same seed, the same draws
    assert torch.equal(torch.get_rng_state(), before)


# ---- Reward functions sharing a name are logged apart ----


def constant(value):
    def score(completions):  # every function this factory makes is named `score`
        return [value] * len(completions)

    return score


def test_two_reward_functions_of_one_name_are_logged_apart(tmp_path, tokenizer, prompt_dataset):
    # They used to log into one merged rewards/score/mean.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = make_trainer(tmp_path, tokenizer, prompt_dataset, [constant(1.0), constant(3.0)], max_steps=1)
    shared = [str(w.message) for w in caught if "share a name" in str(w.message)]
    assert len(shared) == 1 and "2 named 'score', logged as score, score_2" in shared[0], shared
    assert "__name__" in shared[0]
    trainer.train()
    logged = trainer.state.log_history[0]
    assert logged["rewards/score/mean"] == 1.0 and logged["rewards/score_2/mean"] == 3.0


def test_distinct_names_by_hand():
    assert distinct_names(["a", "b"]) == ["a", "b"]
    with pytest.warns(UserWarning, match=r"3 named 'f', logged as f, f_3, f_4"):
        # `f_2` is taken by a function of that name, so the second `f` gets `f_3`.
        assert distinct_names(["f", "f", "f_2", "f"]) == ["f", "f_3", "f_2", "f_4"]


# ---- Prompts that leave no room in the model's context ----


def test_prompts_longer_than_the_context_are_refused_before_training(tmp_path, tokenizer):
    # A context of 64 positions; one prompt has 100 (byte tokens). With max_prompt_length=None it used to train past
    # the positions the model knows, without a word.
    short = ["short question"] * 7

    def build(prompts, **settings):
        args = GRPOConfig(output_dir=str(tmp_path / "out"), **{**TINY, "max_steps": 1, **settings})
        model = tiny_model(tokenizer, max_position_embeddings=64)
        data = Dataset.from_dict({"prompt": prompts})
        return GRPOTrainer(model, reward_len, args=args, train_dataset=data, processing_class=tokenizer)

    with pytest.raises(InputError) as raised:
        build(short[:5] + ["x" * 100] + short[:2], max_prompt_length=None)
    message = str(raised.value)
    assert "train_dataset row 5: the prompt is 100 tokens, which fills the model's context of 64 tokens" in message
    assert "max_prompt_length=None keeps every prompt whole" in message and "Set max_prompt_length=56" in message
    with pytest.raises(InputError, match=r"max_prompt_length=512 cuts prompts only beyond that"):
        build(short + ["x" * 100], max_prompt_length=512)  # a limit that cuts, but not down to the context
    # A prompt that fits, but not with a whole completion (60 + 8 > 64): one warning, and the run is built.
    with pytest.warns(
        UserWarning, match=r"train_dataset: 1, the first row 7 with 60 tokens.*Set max_prompt_length=56"
    ):
        build(short + ["x" * 60], max_prompt_length=None)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # cut to fit: taken without a word
        build(short + ["x" * 100], max_prompt_length=56)


def test_prompt_lengths_by_hand(tokenizer):
    from types import SimpleNamespace

    from grpo.data import check_prompt_lengths

    config = tiny_model(tokenizer, max_position_embeddings=64).config  # room for 56-token prompts below
    whole = SimpleNamespace(max_prompt_length=None, max_completion_length=8, chat_template_kwargs=None)
    short, full, tight = {"prompt": "q"}, {"prompt": "x" * 64}, {"prompt": "x" * 57}
    evals = {"a": Dataset.from_list([short]), "b": Dataset.from_list([short, full])}
    with pytest.raises(InputError, match=r"eval_dataset\['b'\] row 1: the prompt is 64 tokens, which fills"):
        check_prompt_lengths(tokenizer, config, whole, Dataset.from_list([short]), evals)
    # A sized data set that is not a `datasets.Dataset` (offline training's groups) is read item by item.
    with pytest.raises(InputError, match=r"train_dataset item 1: the prompt is 64 tokens \(2 prompts in all\)"):
        check_prompt_lengths(tokenizer, config, whole, [short, full, full])
    with pytest.warns(UserWarning, match=r"train_dataset: 2, the first item 1 with 57 tokens"):
        check_prompt_lengths(tokenizer, config, whole, [short, tight, tight])
    with pytest.warns(UserWarning, match=r"Lower max_completion_length below 64"):  # no room for 64 tokens
        check_prompt_lengths(
            tokenizer,
            config,
            SimpleNamespace(max_prompt_length=None, max_completion_length=64, chat_template_kwargs=None),
            [short],
        )
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        check_prompt_lengths(tokenizer, config, whole, [short, {"prompt": "x" * 56}])  # exactly the room: fits

    class Unreadable(list):
        def __getitem__(self, index):
            if index != 0:  # the first prompt says whether they are strings (conversations are read: cut_turns)
                raise AssertionError("read although max_prompt_length leaves the room")
            return super().__getitem__(index)

    cut = SimpleNamespace(max_prompt_length=56, max_completion_length=8, chat_template_kwargs=None)
    check_prompt_lengths(tokenizer, config, cut, Unreadable([full]))  # every prompt is cut to fit: nothing read


# ---- A temperature at which nothing is learned ----


def test_a_near_zero_temperature_warns_with_the_fix():
    # temperature=1e-9 was taken silently: every group's completions came out identical.
    with pytest.warns(UserWarning, match=r"temperature=1e-09 is below 0.1: .* nothing is learned") as caught:
        GRPOConfig(output_dir="/tmp/grpo-test-oddities", report_to="none", temperature=1e-9)
    assert "use a temperature of 0.6 to 1.0" in str(caught[0].message)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a usual temperature is taken without a word
        GRPOConfig(output_dir="/tmp/grpo-test-oddities", report_to="none", temperature=0.7)


# ---- A tokenizer with more ids than the model has embedding rows ----


def test_a_tokenizer_larger_than_the_models_vocabulary_is_refused(tmp_path, prompt_dataset):
    tokenizer = tiny_tokenizer()
    model = tiny_model(tokenizer)  # 259 embedding rows
    tokenizer.add_tokens(["<extra_1>", "<extra_2>"])  # ids 259 and 260: a prompt holding one would index past them
    args = GRPOConfig(output_dir=str(tmp_path / "out"), **TINY)
    with pytest.raises(InputError) as raised:
        GRPOTrainer(model, reward_len, args=args, train_dataset=prompt_dataset, processing_class=tokenizer)
    message = str(raised.value)
    assert "The tokenizer has 261 tokens but the model's embedding has 259 rows: ids 259 to 260" in message
    assert "'<extra_1>', '<extra_2>'" in message and "model.resize_token_embeddings(len(tokenizer))" in message
    model.resize_token_embeddings(len(tokenizer))
    GRPOTrainer(model, reward_len, args=args, train_dataset=prompt_dataset, processing_class=tokenizer)


# ---- A multi-process launch whose processes would each train alone ----


def test_a_process_launched_as_one_of_two_that_would_train_alone_is_refused(tmp_path, monkeypatch):
    # What `accelerate launch --num_processes 2` gives on a machine without GPUs when ACCELERATE_USE_CPU is not set:
    # WORLD_SIZE=2 in each process, yet one process each, so both trained into one output_dir.
    settings = dict(output_dir=str(tmp_path / "out"), report_to="none", use_cpu=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError) as raised:
        GRPOConfig(**settings)
    message = str(raised.value)
    assert "one of 2 that a launcher started (WORLD_SIZE=2), but it would train alone" in message
    assert "ACCELERATE_USE_CPU=1 accelerate launch --num_processes 2" in message and "use_cpu=True" in message
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert GRPOConfig(**settings).world_size == 1  # one process, launched as one: fine


@pytest.mark.distributed
def test_a_cpu_launch_without_accelerate_use_cpu_stops_every_process(tmp_path, tiny_model_path):
    write_tiny_recipe(tmp_path, tiny_model_path)
    command = [
        sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(TWO_CPU_PROCESSES),
        "--main_process_port", str(free_port()), "-m", "grpo", "train", "tiny.yaml", "--max_steps", "2",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    env.pop("ACCELERATE_USE_CPU", None)
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode != 0
    assert result.stderr.count("ACCELERATE_USE_CPU=1 accelerate launch --num_processes 2") == 2, result.stderr[-3000:]
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
