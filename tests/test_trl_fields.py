"""TRL 1.16's GRPOConfig fields for data, generation and logging: `chat_template_kwargs` at every
`apply_chat_template` call, `trust_remote_code` at every load, `cache_implementation` in `model.generate`,
`pad_to_multiple_of` in the widths the model sees, `log_unique_prompts` and `log_completions_hub_repo`, and the
errors each gives when set wrong."""

import json
import sys
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from transformers import PreTrainedTokenizerBase, StaticCache

import grpo.training.trainer as trainer_module
from grpo import GRPOConfig, GRPOTrainer
from grpo.data import InputError
from grpo.generation import make_generation_backend
from grpo.objective.logprobs import completion_logprobs
from grpo.testing import (
    CHATML_TEMPLATE,
    save_tiny_model,
    save_tiny_reward_model,
    tiny_model,
    tiny_tokenizer,
)
from grpo.training import hub_log
from tests.helpers.agents import ScriptedTurns, add, chat_prompts, multiply, reward_25, tool_tokenizer

G = 4


def config(tmp_path, **overrides):
    settings = dict(
        output_dir=str(tmp_path / "out"),
        use_cpu=True,
        bf16=False,
        report_to="none",
        max_completion_length=8,  # short completions: the tests look at shapes and calls, not at learning
        num_generations=G,
        per_device_train_batch_size=G,
        per_device_eval_batch_size=G,
        max_steps=1,
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
    )
    return GRPOConfig(**{**settings, **overrides})


def length_reward(completions, **kwargs):
    return [float(len(str(c))) for c in completions]


# ---- chat_template_kwargs ----


@pytest.fixture
def template_calls(monkeypatch):
    """Every `apply_chat_template` call: (the calling function's qualified name, its keyword arguments); a call from
    a comprehension inside a function counts as the function's."""
    calls = []
    original = PreTrainedTokenizerBase.apply_chat_template

    def recording(self, *args, **kwargs):
        calls.append((sys._getframe(1).f_code.co_qualname.split(".<locals>")[0], kwargs))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(PreTrainedTokenizerBase, "apply_chat_template", recording)
    return calls


# A template that needs the variable `flavour` and writes it into the system turn: a call without it fails.
FLAVOURED = "{% if flavour is not defined %}{{ raise_exception('no flavour') }}{% endif %}[{{ flavour }}]"


def test_chat_template_kwargs_reach_generation_evaluation_reward_models_and_the_prompt_checks(
    tmp_path, template_calls
):
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = FLAVOURED + CHATML_TEMPLATE
    # A context of 80 positions, prompts cut to 56 tokens with a 32-token completion: the trainer reads every prompt
    # against the context (check_prompt_lengths), and a long conversation loses its first turn (cut_turns).
    model_path = save_tiny_model(tmp_path / "model", max_position_embeddings=80)
    reward_path = save_tiny_reward_model(tmp_path / "rm")
    system, answer, go_on = (
        {"role": "system", "content": "Be brief."},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "Go on."},
    )
    prompts = [[system, {"role": "user", "content": f"Question {i}: " + "x" * 60}, answer, go_on] for i in range(2)]
    data = Dataset.from_dict({"prompt": prompts})
    args = config(tmp_path, max_prompt_length=56, max_completion_length=32, chat_template_kwargs={"flavour": "mint"})
    with pytest.warns(UserWarning):  # prompts cut, and too long for a whole completion: warned of
        trainer = GRPOTrainer(
            str(model_path),
            [length_reward, str(reward_path)],
            args=args,
            train_dataset=data,
            eval_dataset=data,
            processing_class=tokenizer,
            reward_processing_classes=[None, tokenizer],
        )
        trainer.train()
        trainer.evaluate()
    callers = {name for name, _ in template_calls}
    assert {"render_prompt", "score_with_model"} <= callers
    assert all(kwargs.get("flavour") == "mint" for _, kwargs in template_calls)
    # The rendered prompt the policy saw carries the variable's value.
    rollout, _ = trainer.sample_round([data[0]] * G, trainer.generation)
    assert tokenizer.decode(rollout.prompt_ids[0][rollout.prompt_mask[0].bool()]).startswith("[mint]")
    assert rollout.prompt_truncated.tolist() == [1] * G  # its first turn dropped, rendered with the variable


def test_chat_template_kwargs_reach_the_turns_of_an_episode(tmp_path, template_calls):
    path = save_tiny_model(tmp_path / "model", max_position_embeddings=4096)  # the tools' schemas are long
    tokenizer = tool_tokenizer()
    tokenizer.chat_template = FLAVOURED + tokenizer.chat_template
    trainer = GRPOTrainer(
        str(path),
        reward_25,
        args=config(tmp_path, max_completion_length=1000, max_prompt_length=None, chat_template_kwargs={"flavour": 1}),
        train_dataset=chat_prompts(2),
        processing_class=tokenizer,
        tools=[add, multiply],
    )
    trainer.generation = ScriptedTurns(tokenizer)  # calls add, then multiply, then answers
    rollout, _ = trainer.sample_round([trainer.train_dataset[0]] * G, trainer.generation)
    assert rollout.episode_stats["tool_calls"] == 2 * G
    callers = {name for name, _ in template_calls}
    expected = {"check_template_renders_tools", "ToolTurnTokens.__init__", "ToolTurnTokens.__call__", "render_prompt"}
    assert expected <= callers
    assert all(kwargs.get("flavour") == 1 for _, kwargs in template_calls)


def test_chat_template_kwargs_from_a_command_line_and_their_misuse(tmp_path):
    assert config(tmp_path, chat_template_kwargs='{"enable_thinking": false}').chat_template_kwargs == {
        "enable_thinking": False
    }
    with pytest.raises(ValueError, match=r"sets \['add_generation_prompt'\], which the trainer passes"):
        config(tmp_path, chat_template_kwargs={"add_generation_prompt": False})
    with pytest.raises(ValueError, match="is not JSON"):
        config(tmp_path, chat_template_kwargs="enable_thinking=False")
    with pytest.raises(TypeError, match="must be a dict"):
        config(tmp_path, chat_template_kwargs=["enable_thinking"])


# ---- trust_remote_code ----

CONFIGURATION_CODE = """
from transformers import LlamaConfig


class RemoteConfig(LlamaConfig):
    model_type = "grpo_remote_test"
"""
MODELING_CODE = """
import torch
from transformers import LlamaForCausalLM, LlamaForSequenceClassification, LlamaModel, LlamaPreTrainedModel

from .configuration_remote import RemoteConfig


class RemoteForCausalLM(LlamaForCausalLM):
    config_class = RemoteConfig


class RemoteForSequenceClassification(LlamaForSequenceClassification):
    config_class = RemoteConfig

    def __init__(self, config):
        # Llama's classifier builds its backbone with AutoModel.from_config, which knows no config of this folder.
        LlamaPreTrainedModel.__init__(self, config)
        self.num_labels = config.num_labels
        self.model = LlamaModel(config)
        self.score = torch.nn.Linear(config.hidden_size, config.num_labels, bias=False)
        self.post_init()
"""
TOKENIZATION_CODE = """
from transformers import PreTrainedTokenizerFast


class RemoteTokenizer(PreTrainedTokenizerFast):
    pass
"""


def make_remote_code(path: Path, architecture: str) -> Path:
    """Turn the saved model folder `path` into one whose model, config and tokenizer are classes of its own code."""
    (path / "configuration_remote.py").write_text(CONFIGURATION_CODE)
    (path / "modeling_remote.py").write_text(MODELING_CODE)
    (path / "tokenization_remote.py").write_text(TOKENIZATION_CODE)
    config = json.loads((path / "config.json").read_text())
    config["model_type"] = "grpo_remote_test"
    config["architectures"] = [architecture]
    config["auto_map"] = {
        "AutoConfig": "configuration_remote.RemoteConfig",
        "AutoModelForCausalLM": "modeling_remote.RemoteForCausalLM",
        "AutoModelForSequenceClassification": "modeling_remote.RemoteForSequenceClassification",
    }
    (path / "config.json").write_text(json.dumps(config))
    tokenizer_config = json.loads((path / "tokenizer_config.json").read_text())
    tokenizer_config["auto_map"] = {"AutoTokenizer": [None, "tokenization_remote.RemoteTokenizer"]}
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return path


def test_trust_remote_code_reaches_the_policy_its_tokenizer_and_the_reward_models(tmp_path):
    policy = make_remote_code(save_tiny_model(tmp_path / "policy"), "RemoteForCausalLM")
    reward = make_remote_code(save_tiny_reward_model(tmp_path / "rm"), "RemoteForSequenceClassification")
    data = Dataset.from_dict({"prompt": ["a", "b"]})
    with pytest.raises(ValueError, match="trust_remote_code"):  # transformers refuses to run the folder's code
        GRPOTrainer(str(policy), length_reward, args=config(tmp_path), train_dataset=data)
    with pytest.raises(ValueError, match="trust_remote_code"):
        GRPOTrainer(str(policy), [length_reward, str(reward)], args=config(tmp_path), train_dataset=data)
    args = config(tmp_path, trust_remote_code=True)
    trainer = GRPOTrainer(str(policy), [length_reward, str(reward)], args=args, train_dataset=data)
    assert type(trainer.model).__name__ == "RemoteForCausalLM"
    assert type(trainer.processing_class).__name__ == "RemoteTokenizer"
    assert type(trainer.reward_funcs[1]).__name__ == "RemoteForSequenceClassification"
    assert type(trainer.rewards.outcome_tokenizers[1]).__name__ == "RemoteTokenizer"


def test_trust_remote_code_reaches_grpo_vllm_serve():
    import argparse

    from grpo.generation.vllm.serve import add_arguments, engine_settings

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert engine_settings(parser.parse_args(["--model", "m", "--trust-remote-code"]))["trust_remote_code"] is True
    assert engine_settings(parser.parse_args(["--model", "m"]))["trust_remote_code"] is False


# ---- cache_implementation ----


def test_cache_implementation_reaches_model_generate(tmp_path):
    tokenizer, model = tiny_tokenizer(), tiny_model()
    caches = []
    # The forward's cache argument: `cache` from transformers 5.24 on, `past_key_values` before.
    model.register_forward_pre_hook(
        lambda module, args, kwargs: caches.append(type(kwargs.get("cache", kwargs.get("past_key_values")))),
        with_kwargs=True,
    )
    for setting, kind in ((None, "DynamicCache"), ("static", StaticCache.__name__)):
        args = config(tmp_path, cache_implementation=setting)
        backend = make_generation_backend(args, None, tokenizer, [tokenizer.eos_token_id])
        caches.clear()
        backend.generate(model, [[5, 6, 7], [8, 9]])
        assert {cache.__name__ for cache in caches} == {kind}


def test_cache_implementation_misuse(tmp_path):
    with pytest.raises(ValueError, match="is not a cache `model.generate` knows"):
        config(tmp_path, cache_implementation="statik")
    with pytest.raises(ValueError, match="use_vllm=True generates with vLLM"):
        config(tmp_path, cache_implementation="static", use_vllm=True)
    with pytest.raises(ValueError, match="both as a field and in generation_kwargs"):
        config(tmp_path, cache_implementation="static", generation_kwargs={"cache_implementation": "static"})


# ---- pad_to_multiple_of ----


def test_pad_to_multiple_of_pads_what_the_model_sees_and_changes_no_log_prob(tmp_path):
    model = tiny_model().double()  # float64: the padded and unpadded passes compare to 1e-12
    widths = []
    model.register_forward_pre_hook(
        lambda module, args, kwargs: widths.append(kwargs["input_ids"].shape[1]), with_kwargs=True
    )
    prompt_ids = torch.tensor([[0, 0, 5, 6, 7], [8, 9, 10, 11, 12]])  # (2, 5), left-padded
    prompt_mask = (prompt_ids != 0).long()
    completion_ids = torch.tensor([[20, 21, 22, 0, 0, 0, 0], [23, 24, 25, 26, 27, 28, 0]])  # (2, 7), right-padded
    completion_mask = (completion_ids != 0).long()
    batch = (prompt_ids, prompt_mask, completion_ids, completion_mask)
    plain, plain_entropy = completion_logprobs(model, *batch, with_entropy=True)
    assert widths == [5 + 6]  # the all-padding completion column is dropped
    widths.clear()
    padded, padded_entropy = completion_logprobs(model, *batch, with_entropy=True, pad_to_multiple_of=8)
    assert widths == [8 + 8]
    assert padded.shape == plain.shape == (2, 7)
    torch.testing.assert_close(padded, plain, rtol=0, atol=1e-12)
    torch.testing.assert_close(padded_entropy, plain_entropy, rtol=0, atol=1e-12)
    # Generation: every input wider than one token (the prefill; decoding feeds one token at a time) is padded too.
    tokenizer = tiny_tokenizer()
    backend = make_generation_backend(
        config(tmp_path, pad_to_multiple_of=8), None, tokenizer, [tokenizer.eos_token_id]
    )
    widths.clear()
    backend.generate(model, [[5, 6, 7], [5, 6, 7], [8, 9, 10, 11, 12]])
    assert [w for w in widths if w > 1] == [8]


def test_pad_to_multiple_of_in_a_training_step(tmp_path):
    path = save_tiny_model(tmp_path / "model")
    args = config(tmp_path, pad_to_multiple_of=16, beta=0.1)  # generation, policy and reference passes
    trainer = GRPOTrainer(str(path), length_reward, args=args, train_dataset=Dataset.from_dict({"prompt": ["ab"] * 2}))
    widths = []
    for model in (trainer.model, trainer.ref_model):
        model.register_forward_pre_hook(
            lambda module, args, kwargs: widths.append(kwargs["input_ids"].shape[1]), with_kwargs=True
        )
    trainer.train()
    assert not [w for w in widths if w > 1 and w % 16], widths


def test_pad_to_multiple_of_values(tmp_path):
    assert config(tmp_path).pad_to_multiple_of is None  # "auto": 128 on Neuron only
    assert config(tmp_path, pad_to_multiple_of="64").pad_to_multiple_of == 64  # a command line's string
    assert config(tmp_path, pad_to_multiple_of="None").pad_to_multiple_of is None
    for bad in (0, -8, "auto8", 1.5, True):
        with pytest.raises(ValueError, match="must be a positive number of tokens"):
            config(tmp_path, pad_to_multiple_of=bad)


# ---- log_unique_prompts and log_completions_hub_repo ----


def train_with_log(tmp_path, **overrides):
    path = save_tiny_model(tmp_path / "model")
    args = config(tmp_path, log_completions=True, gradient_accumulation_steps=2, **overrides)  # both prompts
    data = Dataset.from_dict({"prompt": ["first prompt", "second prompt"]})
    trainer = GRPOTrainer(str(path), length_reward, args=args, train_dataset=data)
    trainer.train()
    lines = (Path(args.output_dir) / "completions.jsonl").read_text().splitlines()
    return trainer, [json.loads(line) for line in lines]


@pytest.mark.parametrize("unique", [False, True])
def test_log_unique_prompts_shows_each_prompt_once(tmp_path, capsys, unique):
    _, records = train_with_log(tmp_path, log_unique_prompts=unique)
    lines = capsys.readouterr().out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("prompt | completion")) + 1
    prompts = [row.split(" | ")[0] for row in lines[start:] if row.startswith(("first prompt |", "second prompt |"))]
    assert sorted(set(prompts)) == ["first prompt", "second prompt"]
    assert len(prompts) == (2 if unique else 2 * G)
    assert len(records) == 2 * G  # the log file keeps every completion


def test_log_completions_hub_repo_fails_at_start_without_a_token(tmp_path, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("HUGGING_FACE_HUB_TOKEN", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_TOKEN_PATH", str(tmp_path / "no-token"))
    monkeypatch.setattr(trainer_module, "load_policy", lambda *a, **k: pytest.fail("weights loaded before the check"))
    args = config(tmp_path, log_completions=True, log_completions_hub_repo="me/completions")
    with pytest.raises(InputError, match="no Hugging Face token is set") as error:
        GRPOTrainer("any-model", length_reward, args=args, train_dataset=Dataset.from_dict({"prompt": ["a"]}))
    assert "\n" not in str(error.value)


def test_log_completions_hub_repo_fails_at_start_when_the_hub_cannot_be_reached(tmp_path, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setenv("HF_TOKEN", "hf_not_a_real_token")
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", "http://127.0.0.1:9")  # nothing listens on port 9
    monkeypatch.setattr(trainer_module, "load_policy", lambda *a, **k: pytest.fail("weights loaded before the check"))
    args = config(tmp_path, log_completions=True, log_completions_hub_repo="me/completions")
    with pytest.raises(InputError, match="could not create or find the repository") as error:
        GRPOTrainer("any-model", length_reward, args=args, train_dataset=Dataset.from_dict({"prompt": ["a"]}))
    assert "\n" not in str(error.value)


def test_log_completions_hub_repo_pushes_the_log_at_each_logged_step(tmp_path, monkeypatch):
    from concurrent.futures import Future

    created, pushed = [], []

    def upload(repo_id, token, files, step):
        pushed.append((repo_id, token, len(Path(files.pop("completions.jsonl")).read_text().splitlines()), step))
        assert files == {}  # no images in a text run
        done = Future()
        done.set_result(None)
        return done

    monkeypatch.setattr(hub_log, "create_repository", lambda *a: created.append(a) or "https://hub/me/completions")
    monkeypatch.setattr(hub_log, "upload", upload)
    train_with_log(tmp_path, log_completions_hub_repo="me/completions", hub_token="hf_abc", hub_private_repo=True)
    assert created == [("me/completions", "hf_abc", True)]
    assert pushed == [("me/completions", "hf_abc", 2 * G, 1)]


def test_a_failed_push_is_one_warning_and_training_goes_on(monkeypatch):
    from concurrent.futures import Future

    monkeypatch.setattr(hub_log, "create_repository", lambda *a: "url")
    failed = Future()
    failed.set_exception(ConnectionError("no route to host\nmore detail"))
    monkeypatch.setattr(hub_log, "upload", lambda *a: failed)
    hub = hub_log.CompletionsHub("me/completions", "hf_abc", None)
    hub.push("completions.jsonl", 1)
    with pytest.warns(UserWarning, match=r"failed \(ConnectionError: no route to host\); training goes on"):
        hub.wait()


def test_logging_fields_misuse(tmp_path):
    for name, value in (("log_unique_prompts", True), ("log_completions_hub_repo", "me/completions")):
        with pytest.raises(ValueError, match="Set log_completions=True"):
            config(tmp_path, **{name: value})
    with pytest.raises(ValueError, match="is not a Hub repository id"):
        config(tmp_path, log_completions=True, log_completions_hub_repo="me/my/completions")
