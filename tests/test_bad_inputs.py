"""Bad input is stopped before training, with an error that names the problem and the fix.

Each case gives the input, the error type, a pattern for the problem (the field, column, key or row and the bad
value) and a pattern for the remedy the message suggests. Nothing here trains: configs and trainers are only
constructed (with the tiny model), and recipes run through `grpo.cli.main` until their error.
"""

import dataclasses
import math
import re

import pytest
import yaml
from datasets import Dataset, DatasetDict

from grpo import GRPOConfig, GRPOTrainer
from grpo.cli import main
from grpo.config import numeric_ranges
from grpo.data import RESERVED_COLUMNS, InputError, check_prompt_dataset
from grpo.rewards.names import check_reward_funcs, load_reward_funcs
from grpo.rewards.scoring import RewardSet, score_rewards
from grpo.testing import save_tiny_model, tiny_config, tiny_model

NAN, INF = math.nan, math.inf


def config(**kwargs):
    return GRPOConfig(output_dir="/tmp/grpo-test-bad-inputs", report_to="none", **kwargs)


def check(error, problem: str, fix: str):
    message = str(error.value)
    assert re.search(problem, message), f"problem {problem!r} not in: {message}"
    assert re.search(fix, message), f"fix {fix!r} not in: {message}"


# ---- GRPOConfig: type, finiteness and range of numeric fields; reward_weights; generation_kwargs ----

NOT_FINITE = "Set a finite value"
NO_QUOTES = "Pass a plain (int|float|bool) without quotes"

CONFIG_CASES = [
    # NaN and infinity, which pass every `x < 0` check unnoticed
    ({"beta": NAN}, ValueError, r"beta=nan is not a finite number; beta must be a number >= 0", NOT_FINITE),
    ({"beta": INF}, ValueError, r"beta=inf is not a finite number", NOT_FINITE),
    ({"temperature": NAN}, ValueError, r"temperature=nan .* must be a number > 0", NOT_FINITE),
    ({"temperature": -INF}, ValueError, r"temperature=-inf is not a finite", NOT_FINITE),
    ({"epsilon": NAN}, ValueError, r"epsilon=nan is not a finite", NOT_FINITE),
    ({"epsilon_high": INF}, ValueError, r"epsilon_high=inf .* > 0, or None", NOT_FINITE),
    ({"delta": INF}, ValueError, r"delta=inf is not a finite", NOT_FINITE),
    ({"top_p": NAN}, ValueError, r"top_p=nan .* in \(0, 1\]", NOT_FINITE),
    ({"min_p": NAN}, ValueError, r"min_p=nan .* in \[0, 1\], or None", NOT_FINITE),
    ({"repetition_penalty": NAN}, ValueError, r"repetition_penalty=nan", NOT_FINITE),
    ({"top_entropy_quantile": NAN}, ValueError, r"top_entropy_quantile=nan", NOT_FINITE),
    ({"reward_timeout": INF}, ValueError, r"reward_timeout=inf", NOT_FINITE),
    ({"vllm_importance_sampling_cap": NAN}, ValueError, r"vllm_importance_sampling_cap=nan", NOT_FINITE),
    ({"learning_rate": NAN}, ValueError, r"learning_rate=nan is not a finite", NOT_FINITE),
    ({"learning_rate": INF}, ValueError, r"learning_rate=inf", NOT_FINITE),
    ({"num_train_epochs": INF}, ValueError, r"num_train_epochs=inf", NOT_FINITE),
    # wrong types, which failed deep inside torch or TrainingArguments
    ({"num_generations": "4"}, TypeError, r"num_generations='4' \(str\) must be an integer >= 2", NO_QUOTES),
    ({"max_completion_length": 2.5}, TypeError, r"max_completion_length=2.5 \(float\) must be an integer", "int"),
    ({"max_steps": "three"}, TypeError, r"max_steps='three' \(str\) must be an integer >= -1", NO_QUOTES),
    ({"per_device_train_batch_size": 2.0}, TypeError, r"per_device_train_batch_size=2.0", "decimal point"),
    ({"gradient_accumulation_steps": "2"}, TypeError, r"gradient_accumulation_steps='2'", NO_QUOTES),
    ({"seed": 1.5}, TypeError, r"seed=1.5 \(float\) must be an integer in \[0, 4294967295\]", NO_QUOTES),
    ({"top_k": 1.5}, TypeError, r"top_k=1.5", NO_QUOTES),
    ({"num_iterations": True}, TypeError, r"num_iterations=True \(bool\) must be an integer", NO_QUOTES),
    ({"beta": "0.04"}, TypeError, r"beta='0.04' \(str\) must be a number >= 0", NO_QUOTES),
    ({"learning_rate": "1e-5"}, TypeError, r"learning_rate='1e-5' \(str\)", NO_QUOTES),
    ({"use_vllm": "false"}, TypeError, r"use_vllm='false' \(str\) must be True or False", NO_QUOTES),
    ({"mask_truncated_completions": 1}, TypeError, r"mask_truncated_completions=1 \(int\)", "e.g. .*=False"),
    ({"logprobs_chunk_size": "big"}, TypeError, r"logprobs_chunk_size='big' .* or None", NO_QUOTES),
    # ranges
    ({"seed": -1}, ValueError, r"seed=-1 must be in \[0, 4294967295\]", "numpy's random seed range"),
    ({"vllm_server_port": 70000}, ValueError, r"vllm_server_port=70000 must be in \[1, 65535\]", r"\[1, 65535\]"),
    ({"num_generations": 1}, ValueError, r"num_generations=1 must be >= 2", "at least 2 completions per prompt"),
    # a learning rate no fine-tuning run means (1e30 trained to 1e30 weights; 1e5 is a lost minus sign)
    ({"learning_rate": 1e30}, ValueError, r"learning_rate=1e\+30 is above 1", "allow_large_learning_rate=True"),
    ({"learning_rate": 1e5}, ValueError, r"learning_rate=100000.0 is above 1", r"Fix its exponent \(e.g. 1e-5\)"),
    ({"truncation_side": "middle"}, ValueError, r"truncation_side='middle' is not one of", "'left' keeps the end"),
    # reward_weights
    ({"reward_weights": [1.0, NAN]}, ValueError, r"reward_weights\[1\]=nan must be a finite", "one finite weight"),
    ({"reward_weights": [INF]}, ValueError, r"reward_weights\[0\]=inf", "one finite weight per reward function"),
    ({"reward_weights": ["1"]}, ValueError, r"reward_weights\[0\]='1'", "one finite weight"),
    ({"reward_weights": 2.0}, TypeError, r"reward_weights=2.0 must be a list", r"e.g. \[1.0, 0.5\]"),
    # generation_kwargs: a misspelt key used to be ignored
    (
        {"generation_kwargs": {"typcal_p": 0.9}},
        ValueError,
        r"key 'typcal_p' is not a field",
        "Did you mean 'typical_p'",
    ),
    (
        {"generation_kwargs": {"no_repeat_ngram": 3}},
        ValueError,
        r"'no_repeat_ngram' is not a field of transformers.GenerationConfig",
        "Did you mean 'no_repeat_ngram_size'",
    ),
    ({"generation_kwargs": {"logits_processor": []}}, ValueError, r"'logits_processor' is an argument", "Remove it"),
    ({"generation_kwargs": "top_p=0.5"}, TypeError, r"generation_kwargs='top_p=0.5'", "must be a dict"),
]


@pytest.mark.parametrize(
    "kwargs, error, problem, fix",
    CONFIG_CASES,
    ids=[f"{next(iter(c[0]))}={next(iter(c[0].values()))!r}" for c in CONFIG_CASES],
)
def test_bad_config_value(kwargs, error, problem, fix):
    with pytest.raises(error) as raised:
        config(**kwargs)
    check(raised, problem, fix)


def test_every_numeric_field_of_grpo_config_has_a_range():
    from transformers import TrainingArguments

    inherited = {f.name for f in dataclasses.fields(TrainingArguments)}
    hints = {f.name: str(f.type) for f in dataclasses.fields(GRPOConfig) if f.name not in inherited}
    numeric = {name for name, hint in hints.items() if re.fullmatch(r"(int|float)( \| None)?", hint)}
    assert numeric <= set(numeric_ranges()), sorted(numeric - set(numeric_ranges()))
    assert config(learning_rate=1, beta=0).learning_rate == 1  # an int is a fine float


def test_a_large_learning_rate_is_taken_when_asked_for():
    assert config(learning_rate=1.0).learning_rate == 1.0  # the bound itself is allowed
    assert config(learning_rate=5.0, allow_large_learning_rate=True).learning_rate == 5.0


# ---- Prompt data sets: reserved column names, and every prompt checked once before training ----

GOOD = "A prompt is a non-empty string, or a non-empty list of messages"


def rows(bad, k=3, n=6):
    """n good string prompts with `bad` at row k."""
    prompts = [f"Question {i}" for i in range(n)]
    prompts[k] = bad
    return prompts


def chat_rows(bad, k=2, n=5):
    prompts = [[{"role": "user", "content": f"Question {i}"}] for i in range(n)]
    prompts[k] = bad
    return prompts


DATASET_CASES = [
    ({"prompt": ["q"], "completions": ["x"]}, r"column\(s\) \['completions'\]", r"rename_column\('completions'"),
    ({"prompt": ["q"], "completion_ids": [[1]]}, r"\['completion_ids'\], a name the trainer passes", "Rename it"),
    ({"prompt": ["q"], "prompts": ["x"]}, r"\['prompts'\]", r"rename_column\('prompts', 'reference_prompts'\)"),
    ({"prompt": ["q"], "trainer_state": ["x"]}, r"\['trainer_state'\]", "Rename it"),
    ({"question": ["q"]}, r"needs a 'prompt' column; it has \['question'\]", r"rename_column\('question', 'prompt'\)"),
    ({"prompt": rows(None)}, r"train_dataset row 3: the prompt is missing \(None\)", GOOD),
    ({"prompt": rows("", k=4)}, r"row 4: the prompt is an empty string", GOOD),
    ({"prompt": [1, 2, 3]}, r"row 0: the prompt is of type int: '1' \(3 bad rows in all\)", GOOD),
    ({"prompt": chat_rows([])}, r"row 2: the prompt is an empty list of messages", r"\[\{'role': 'user'"),
    ({"prompt": chat_rows([{"role": "user"}])}, r"row 2: .*message 0 has no 'content'", GOOD),
    ({"prompt": chat_rows([{"content": "hi"}], k=4)}, r"row 4: .*message 0 has no 'role'", GOOD),
    ({"prompt": [["just", "strings"]]}, r"row 0: .*message 0 is a str, not a \{'role', 'content'\} dict", GOOD),
    ({"prompt": [[{"role": 1, "content": "hi"}]]}, r"row 0: .*role 1, not one of system", r"prompt_problem"),
    # roles a chat template does not know were rendered as given
    ({"prompt": chat_rows([{"role": "bot", "content": "hi"}], k=1)}, r"row 1: .*role 'bot', not one of", GOOD),
    ({"prompt": chat_rows([{"role": "User", "content": "hi"}])}, r"row 2: .*role 'User', not one of system", GOOD),
]


@pytest.mark.parametrize("columns, problem, fix", DATASET_CASES)
def test_bad_prompt_dataset(columns, problem, fix):
    with pytest.raises(InputError) as raised:
        check_prompt_dataset(Dataset.from_dict(columns), "train_dataset")
    check(raised, problem, fix)


def test_dataset_dict_and_good_prompts():
    good = Dataset.from_dict({"prompt": ["q", "r"]})
    with pytest.raises(
        InputError, match=r"train_dataset is a dict of data sets with keys \[.train.\]; pass one split"
    ):
        check_prompt_dataset(DatasetDict({"train": good}), "train_dataset")
    chat = [[{"role": "user", "content": "2 + 2?"}, {"role": "assistant", "content": "It is"}]]  # prefill is fine
    check_prompt_dataset(Dataset.from_dict({"prompt": chat}))
    check_prompt_dataset(good)
    check_prompt_dataset({"a": good, "b": good}, "eval_dataset")  # a dict of evaluation sets
    tools = [{"role": r, "content": "x"} for r in ("system", "user", "assistant", "tool", "user")]
    check_prompt_dataset(Dataset.from_dict({"prompt": [tools]}))  # every role a chat template knows


@pytest.mark.parametrize("name", ["train_dataset", "eval_dataset"])
def test_a_plain_dict_of_columns_is_told_to_become_a_dataset(name):
    # It used to be taken for a dict of splits: "pass one split, e.g. train_dataset=dataset['prompt']".
    with pytest.raises(InputError) as raised:
        check_prompt_dataset({"prompt": ["q", "r"], "answer": ["1", "2"]}, name)
    check(raised, rf"{name} is a plain dict \(keys \['answer', 'prompt'\]\), not a data set", r"Dataset.from_dict\(")


def test_reserved_columns_are_the_arguments_the_trainer_passes():
    seen = {}

    def spy(**kwargs):
        seen.update(kwargs)
        return [0.0]

    score_rewards([spy], [None], [], prompts=["p"], completions=["c"], completion_ids=[[1]], columns={"answer": ["a"]})
    assert set(seen) - {"answer"} == set(RESERVED_COLUMNS)


def trainer(tiny_model_path, tmp_path, **kwargs):
    args = GRPOConfig(output_dir=str(tmp_path), report_to="none", num_generations=2, per_device_train_batch_size=2)
    kwargs.setdefault("reward_funcs", lambda completions, **kw: [0.0] * len(completions))
    kwargs.setdefault("train_dataset", Dataset.from_dict({"prompt": ["q"] * 4}))
    return GRPOTrainer(tiny_model_path, args=args, **kwargs)


@pytest.mark.parametrize(
    "which, data, problem",
    [
        ("train_dataset", {"prompt": rows(None, k=5, n=8)}, r"train_dataset row 5: the prompt is missing"),
        ("eval_dataset", {"prompt": rows("", k=1)}, r"eval_dataset row 1: the prompt is an empty string"),
        (
            "train_dataset",
            {"prompt": ["q"], "completions": ["gold"]},
            r"train_dataset has column\(s\) \['completions'\]",
        ),
    ],
)
def test_trainer_refuses_bad_data_before_training(tiny_model_path, tmp_path, which, data, problem):
    with pytest.raises(InputError) as raised:
        trainer(tiny_model_path, tmp_path, **{which: Dataset.from_dict(data)})
    check(raised, problem, r"A prompt is|Rename it")


# ---- Rewards given as strings (the same resolver as recipes) and reward models ----


@pytest.fixture(scope="module")
def causal_lm_path(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("causal-lm"))


def classifier(tokenizer, num_labels):
    from transformers import LlamaForSequenceClassification

    return LlamaForSequenceClassification(tiny_config(tokenizer, num_hidden_layers=1, num_labels=num_labels))


def test_builtin_reward_names_work_in_python():
    from grpo.rewards import accuracy

    funcs, tokenizers = load_reward_funcs(["accuracy", "format_reward"])
    assert funcs[0] is accuracy and funcs[1](["<think>a</think><answer>1</answer>"]) == [1.0]
    assert tokenizers == [None, None]


REWARD_CASES = [
    ("acuracy", r"Unknown reward 'acuracy'", r"Did you mean 'accuracy'\?"),
    ("Accuracy", r"Unknown reward 'Accuracy'", r"Did you mean 'accuracy'\?"),
    ("format_rewrd", r"'format_rewrd': it is not a built-in reward", r"Did you mean 'format_reward'\?"),
    (
        "./no_such_reward_model",
        r"'./no_such_reward_model' looks like a local reward-model path, but it does not exist",
        "Fix the path",
    ),
    ("no_such_module:f", r"cannot import module 'no_such_module'", r"Put no_such_module.py in the working directory"),
    ("tests.helpers.reward_module:nope", r"has no attribute 'nope'", r"Check the function's name"),
    (
        "soft_overlong_punishment",
        r"'soft_overlong_punishment' needs settings",
        r"call grpo.rewards.soft_overlong_punishment",
    ),
]


@pytest.mark.parametrize("name, problem, fix", REWARD_CASES)
def test_bad_reward_string(name, problem, fix):
    with pytest.raises(InputError) as raised:
        load_reward_funcs([name])
    check(raised, problem, fix)


def test_causal_lm_path_is_not_a_reward_model(causal_lm_path):
    with pytest.raises(InputError) as raised:
        load_reward_funcs([str(causal_lm_path)])
    check(raised, r"is a LlamaForCausalLM, not a sequence-classification model", "Pass a trained reward model")


@pytest.mark.parametrize(
    "make, problem, fix",
    [
        (lambda tok: tiny_model(tok), r"'.*' is a LlamaForCausalLM, not a sequence-classification", "Use a trained"),
        (lambda tok: classifier(tok, 2), r"has num_labels=2", "trained with num_labels=1"),
        (lambda tok: classifier(tok, 3), r"has num_labels=3", "wrap this classifier in a reward function"),
    ],
    ids=["causal-lm", "two-labels", "three-labels"],
)
def test_reward_model_object_must_have_one_label(tokenizer, make, problem, fix):
    with pytest.raises(InputError) as raised:
        load_reward_funcs([make(tokenizer)], [tokenizer])
    check(raised, problem, fix)


def test_multi_label_reward_model_from_a_path(tmp_path, tokenizer):
    classifier(tokenizer, 2).save_pretrained(tmp_path / "rm2")
    with pytest.raises(InputError) as raised:
        load_reward_funcs([str(tmp_path / "rm2")])
    check(raised, r"has num_labels=2", "trained with num_labels=1")


def test_trainer_with_a_misspelt_reward_name(tiny_model_path, tmp_path):
    with pytest.raises(InputError) as raised:
        trainer(tiny_model_path, tmp_path, reward_funcs="acuracy")
    check(raised, r"Unknown reward 'acuracy'", r"Did you mean 'accuracy'\?")


def test_model_path_that_does_not_exist(tmp_path):
    with pytest.raises(FileNotFoundError) as raised:
        GRPOTrainer(str(tmp_path / "no-model"), lambda completions, **kw: [0.0], args=config())
    check(raised, r"Model path '.*no-model' does not exist", "Fix the path, or give a hub id")


# ---- Every check that needs no weights runs before any weight loads ----


def positional_only(prompts, completions, /):
    return [0.0] * len(completions)


def star_args(*args):
    return [0.0]


def needs_answer(completions, answer, **kwargs):
    return [0.0] * len(completions)


def singular(completion, **kwargs):
    return [0.0] * len(completion)


SIGNATURES = r"Supported signatures: def \w+\(prompts, completions, \*\*kwargs\).* or async def the same; the keywords"

BEFORE_LOADING_CASES = {
    "misspelt-reward": (dict(reward_funcs="acuracy"), InputError, r"Unknown reward 'acuracy'", "Did you mean"),
    # A reward model named by path is not loaded before a misspelt name after it is refused.
    "misspelt-after-a-reward-model": (
        dict(reward_funcs=["{tmp_path}", "acuracy"]),
        InputError,
        r"Unknown reward 'acuracy'",
        "Did you mean",
    ),
    "reward-weights-count": (
        dict(reward_weights=[1.0, 2.0]),
        ValueError,
        r"reward_weights has 2 entries but there are 1 reward functions \(\['<lambda>'\]\)",
        "one weight per function",
    ),
    "no-prompt-column": (
        dict(train_dataset={"question": ["q"] * 4}),
        InputError,
        r"train_dataset needs a 'prompt' column",
        r"rename_column\('question', 'prompt'\)",
    ),
    "bad-eval-prompt": (dict(eval_dataset={"prompt": ["q", ""]}), InputError, r"eval_dataset row 1", GOOD),
    "positional-only-reward": (
        dict(reward_funcs=positional_only),
        InputError,
        r"Reward function 'positional_only\(prompts, completions, /\)' cannot receive its arguments: .* so its "
        r"positional-only parameter\(s\) \['prompts', 'completions'\] would never be given",
        SIGNATURES,
    ),
    "star-args-reward": (
        dict(reward_funcs=star_args),
        InputError,
        r"Reward function 'star_args\(\*args\)' cannot receive its arguments: .* and it takes none",
        SIGNATURES,
    ),
    # A parameter the trainer will not pass fails here, not at the first reward call after the model loaded.
    "reward-column-missing": (
        dict(reward_funcs=needs_answer, train_dataset={"prompt": ["q"] * 4, "solution": ["1"] * 4}),
        InputError,
        r"Reward function 'needs_answer' takes `answer`, which the trainer does not pass: .* columns but `prompt` "
        r"\(solution\)",
        r"dataset.rename_column\('solution', 'answer'\)",
    ),
    "reward-parameter-misspelt": (
        dict(reward_funcs=singular),
        InputError,
        r"Reward function 'singular' takes `completion`, which the trainer does not pass",
        r"Did you mean `completions`\? Rename the parameter.",
    ),
    "built-in-reward-column-missing": (
        dict(reward_funcs="accuracy"),
        InputError,
        r"Reward function 'accuracy' takes `answer`",
        r"Rename a column of the data set to it",
    ),
    "too-few-prompts": (
        dict(train_dataset={"prompt": ["q"]}),
        ValueError,
        r"The dataset has 1 prompts but one generation round needs 2",
        "Use more prompts",
    ),
    "peft-with-moving-reference": (
        dict(peft_config=object(), beta=0.04, sync_ref_model=True),
        ValueError,
        r"move the reference, but with a PEFT model",
        r"merge_and_unload",
    ),
    "peft-config-type": (
        dict(peft_config={"r": 8}),
        InputError,
        r"peft_config must be a peft.PeftConfig",
        "LoraConfig",
    ),
}


@pytest.mark.parametrize("case", list(BEFORE_LOADING_CASES))
def test_inputs_are_checked_before_any_weight_loads(tmp_path, monkeypatch, case):
    """The spies stand for every weight load: the policy's (`load_causal_lm`, which `load_policy` calls for a path),
    the reference's (`make_reference`) and the reward models' (`load_reward_model`). None may run before the error."""
    import grpo.models
    import grpo.rewards.names
    import grpo.training.trainer

    kwargs, error, problem, fix = BEFORE_LOADING_CASES[case]
    loaded = []

    def spy(name):
        def loads(*args, **kwargs):
            loaded.append(name)
            raise AssertionError(f"{name} ran before the {case} error")

        return loads

    monkeypatch.setattr(grpo.models, "load_causal_lm", spy("load_causal_lm"))
    monkeypatch.setattr(grpo.training.trainer, "make_reference", spy("make_reference"))
    monkeypatch.setattr(grpo.rewards.names, "load_reward_model", spy("load_reward_model"))
    kwargs = dict(kwargs)
    settings = {k: kwargs.pop(k) for k in ("reward_weights", "beta", "sync_ref_model") if k in kwargs}
    # 2 prompts per round (4 rows per round, G = 2): one prompt is too few.
    args = config(num_generations=2, per_device_train_batch_size=4, **settings)
    if isinstance(kwargs.get("reward_funcs"), list):
        kwargs["reward_funcs"] = [f.format(tmp_path=tmp_path) for f in kwargs["reward_funcs"]]
    for which in ("train_dataset", "eval_dataset"):
        if which in kwargs:
            kwargs[which] = Dataset.from_dict(kwargs[which])
    kwargs.setdefault("reward_funcs", lambda completions, **kw: [0.0] * len(completions))
    kwargs.setdefault("train_dataset", Dataset.from_dict({"prompt": ["q1", "q2"]}))
    with pytest.raises(error) as raised:
        GRPOTrainer("never-loaded", args=args, **kwargs)
    check(raised, problem, fix)
    assert loaded == [] and "\n" not in str(raised.value)


@pytest.mark.parametrize(
    "func, problem",
    [
        (positional_only, r"'positional_only\(prompts, completions, /\)' cannot .* positional-only parameter"),
        (star_args, r"'star_args\(\*args\)' cannot receive its arguments: .* it takes none"),
    ],
    ids=["positional-only", "star-args"],
)
def test_reward_signature_that_cannot_receive_its_arguments(func, problem):
    # Refused when the set is built, not at the first reward call hours later.
    with pytest.raises(InputError) as raised:
        RewardSet([func])
    check(raised, problem, SIGNATURES + r" are prompts, completions, completion_ids, trainer_state and every other")


def test_reward_signatures_that_receive_their_arguments():
    async def judged(prompts, completions, **kwargs):
        return [0.0] * len(completions)

    class Callable:
        def __call__(self, completions, *, answer):
            return [0.0] * len(completions)

    accepted = [
        judged,
        Callable(),
        lambda *args, **kwargs: [0.0],
        lambda completions, *args: [0.0],
        lambda scale=1.0, /, **kwargs: [0.0],  # a positional-only parameter with a default is left alone
        print,  # a signature that cannot be read is not checked
    ]
    funcs, _ = check_reward_funcs(accepted)
    assert funcs == accepted


def test_a_completion_column_says_it_switched_to_stored_completions(tmp_path, caplog):
    """A prompt data set with a reference `completion` column is read as stored completions; the log says so, and
    the error about them (one completion per prompt) starts with why it was read that way."""
    data = Dataset.from_dict({"prompt": ["q1", "q2"], "completion": ["a1", "a2"]})
    switched = (
        r"^train_dataset was read as stored, scored completions to train on without generation \(offline training, "
        r"docs/offline.md\) because it has a 'completion' column"
    )
    with caplog.at_level("INFO", logger="grpo.data.offline"), pytest.raises(InputError) as raised:
        GRPOTrainer(
            "never-loaded", lambda completions, **kw: [0.0] * len(completions), args=config(), train_dataset=data
        )
    check(raised, switched + r"; if it holds prompts to generate from, rename that column", "offline_baseline")
    check(
        raised,
        r"2 prompt\(s\) have a single scored completion",
        r"rename_column\('completion', 'reference_completion'\)",
    )
    assert [r.levelname for r in caplog.records if re.search(switched, r.getMessage())] == ["INFO"]


# ---- Recipes through `grpo train`: exit status 2 and one line on stderr ----


def recipe_file(tmp_path, model=None, text=None, **content):
    path = tmp_path / "recipe.yaml"
    if text is not None:
        path.write_text(text)
        return path
    data = tmp_path / "data.jsonl"
    if not data.exists():
        data.write_text("".join(f'{{"prompt": "Question {i}", "answer": "1"}}\n' for i in range(4)))
    base = {
        "model": str(model or tmp_path / "missing-model"),
        "dataset": {"path": str(data)},
        "rewards": ["accuracy"],
        "output_dir": str(tmp_path / "out"),
        "num_generations": 2,
        "per_device_train_batch_size": 2,
    }
    path.write_text(yaml.safe_dump({**base, **content}))
    return path


def run_cli(capsys, path, *overrides, loads_model=False):
    """`grpo train` on a recipe that must fail: exit status 2 and one error line on stderr. A recipe that gets as far
    as loading the model and the data also leaves tqdm progress bars there, which are not error lines."""
    code = main(["train", str(path), *overrides])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err, (code, err)
    assert err[-1].startswith("grpo train: error: ") and "Traceback" not in "\n".join(err)
    if not loads_model:
        assert len(err) == 1, err
    return err[-1]


RECIPE_CASES = [
    # (recipe content or raw text, overrides, problem, fix); the model exists unless the case is about it
    (
        {"text": "rewards: [accuracy]\ndataset:\n  path: data.jsonl\n   size: 3\n"},
        [],
        r"YAML syntax error at line 4, column 8 \('size: 3'\)",
        "Fix that line",
    ),
    ({"text": "rewards: [accuracy\n"}, [], r"YAML syntax error at line 2", "quotes and brackets must close"),
    ({"max_steps": "three"}, [], r"max_steps='three' \(str\) must be an integer", NO_QUOTES),
    ({}, ["--max_steps", "three"], r"max_steps='three'", NO_QUOTES),
    ({"beta": float("nan")}, [], r"beta=nan is not a finite number", NOT_FINITE),
    ({"learning_rat": 1e-5}, [], r"Unknown key 'learning_rat'", r"Did you mean 'learning_rate'\?"),
    (
        {"dataset": {"path": "data.jsonl", "size": "ten"}},
        [],
        r"dataset.size: 'ten' \(str\) is not of type",
        "Write it",
    ),
    ({"run": {"plot": "yes please"}}, [], r"run.plot: 'yes please' \(str\) is not of type bool", "true/false"),
    ({"rewards": [{"name": "accuracy", "weight": "high"}]}, [], r"rewards\[0\].weight: 'high'", "Write it as"),
    ({"rewards": ["acuracy"]}, [], r"rewards\[0\]: Unknown reward 'acuracy'", r"Did you mean 'accuracy'\?"),
    ({"model": "./no/such/model"}, [], r"model: './no/such/model' does not exist", "Fix the path, or give a hub id"),
    ({"dataset": {"path": "missing.jsonl"}}, [], r"dataset.path: 'missing.jsonl' not found", "Fix the path"),
    ({}, ["--report_to", "[tensorboard"], r"--report_to '\[tensorboard' is not valid YAML", "quote the value"),
    ({"generation_kwargs": {"top_pp": 0.5}}, [], r"generation_kwargs key 'top_pp'", r"Did you mean 'top_p'\?"),
]


@pytest.mark.parametrize("content, overrides, problem, fix", RECIPE_CASES)
def test_bad_recipe_exits_2_with_one_line(
    tmp_path, capsys, monkeypatch, tiny_model_path, content, overrides, problem, fix
):
    monkeypatch.chdir(tmp_path)
    content = {"model": str(tiny_model_path), **content}
    line = run_cli(capsys, recipe_file(tmp_path, **content), *overrides)
    assert re.search(problem, line), line
    assert re.search(fix, line), line


@pytest.mark.parametrize(
    "rows_text, problem",
    [
        ('{"prompt": "q", "completions": "gold"}\n' * 4, r"train_dataset has column\(s\) \['completions'\]"),
        ('{"prompt": "q"}\n{"prompt": "q"}\n{"prompt": null}\n{"prompt": "q"}\n', r"train_dataset row 2: .*missing"),
    ],
    ids=["reserved-column", "null-prompt"],
)
def test_bad_recipe_data_exits_2(tmp_path, capsys, monkeypatch, tiny_model_path, rows_text, problem):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data.jsonl").write_text(rows_text)
    line = run_cli(capsys, recipe_file(tmp_path, model=tiny_model_path), loads_model=True)
    assert re.search(problem, line), line
