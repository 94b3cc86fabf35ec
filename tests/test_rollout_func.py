"""TRL's `rollout_func` (grpo/generation/rollout_function.py): a function written for TRL 1.16 trains unchanged; its
extra fields reach the reward functions; what it returns is what trains (env_mask: the loss tokens); each bad return
and each misuse gets its clear error; `generate_rollout_completions` samples from the policy inside a round."""

import re

import pytest
import torch
from datasets import Dataset

from grpo import GRPOConfig, GRPOTrainer, generate_rollout_completions
from grpo.data import InputError, encode_prompts
from grpo.generation.rollout_function import RolloutFuncError
from grpo.testing import save_tiny_model, tiny_tokenizer

G = 2  # two completions per prompt: the smallest group with a spread


def config(tmp_path, **overrides):
    settings = dict(
        output_dir=str(tmp_path / "out"),
        use_cpu=True,
        bf16=False,
        report_to="none",
        max_completion_length=8,  # short samples: the tiny model writes noise
        num_generations=G,
        per_device_train_batch_size=G,  # one prompt's group per round
        max_steps=2,
        learning_rate=1e-2,
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        loss_type="grpo",
    )
    return GRPOConfig(**{**settings, **overrides})


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("model")
    save_tiny_model(path)
    tiny_tokenizer().save_pretrained(path)
    return str(path)


def text_prompts(n=2):
    return Dataset.from_dict(
        {"prompt": [f"Q{i}: 2 + {i} =" for i in range(n)], "answer": [str(2 + i) for i in range(n)]}
    )


def chat_prompts(n=2):
    return Dataset.from_dict({"prompt": [[{"role": "user", "content": f"Q{i}: 2 + {i} ="}] for i in range(n)]})


class TrlStyle:
    """A rollout function as a TRL user writes one: it tokenizes each prompt, "samples" an answer that depends on the
    call and the row, and reports an environment's score as the extra field `env_reward`. With `tool`, each
    completion is answer, a tool's output (env_mask 0), a second answer and the EOS. `returned` keeps every output."""

    def __init__(self, tool=False, **extra):
        self.tool, self.extra, self.calls, self.returned, self.prompts = tool, extra, 0, [], []

    def __call__(self, prompts, trainer):
        tokenizer, self.calls = trainer.processing_class, self.calls + 1
        self.prompts.append(prompts)
        out = {"prompt_ids": [], "completion_ids": [], "logprobs": [], "env_reward": []}
        if self.tool:
            out["env_mask"] = []
        for i, prompt in enumerate(prompts):
            answer = tokenizer.encode(f"{self.calls}{i}" * (i + 1), add_special_tokens=False)
            ids, mask = answer, [1] * len(answer)
            if self.tool:
                tool, more = (tokenizer.encode(t, add_special_tokens=False) for t in (" [tool: 42] ", "ok"))
                ids, mask = ids + tool + more, mask + [0] * len(tool) + [1] * len(more)
                out["env_mask"].append(mask + [1])
            out["prompt_ids"].append(tokenizer.encode(prompt, add_special_tokens=False))
            out["completion_ids"].append(ids + [tokenizer.eos_token_id])
            out["logprobs"].append([-0.5] * (len(ids) + 1))
            out["env_reward"].append(float(len(ids) + self.calls))
        out.update(self.extra)
        self.returned.append(out)
        return out


class Recorded:
    """A reward function that returns the extra field `env_reward` and records what every keyword it got held."""

    __name__ = "env_reward"

    def __init__(self):
        self.seen = []

    def __call__(self, prompts, completions, env_reward, **kwargs):
        self.seen.append({"prompts": prompts, "completions": completions, "env_reward": env_reward, **kwargs})
        return list(env_reward)


def make_trainer(tmp_path, model_path, rollout_func, reward=None, dataset=None, **overrides):
    return GRPOTrainer(
        model_path,
        reward or Recorded(),
        args=config(tmp_path, **overrides),
        train_dataset=dataset if dataset is not None else text_prompts(),
        rollout_func=rollout_func,
    )


def trained_rows(trainer):
    """Per row of the buffered round: (completion ids, loss mask) of its completion tokens."""
    rows = []
    for mb in trainer._buffer:
        for ids, mask, loss in zip(mb.completion_ids, mb.completion_mask.bool(), mb.loss_mask):
            rows.append((ids[mask].tolist(), loss[mask].tolist()))
    return rows


def test_a_trl_style_rollout_func_trains_and_its_extra_field_reaches_the_rewards(tmp_path, model_path):
    function, reward = TrlStyle(), Recorded()
    trainer = make_trainer(tmp_path, model_path, function, reward)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    assert trainer.state.global_step == 2 and function.calls == 2
    assert any(not torch.equal(before[n], p) for n, p in trainer.model.named_parameters())
    # One prompt per row of the round, each prompt repeated G times; the rewards saw each row's own value.
    assert all(len(prompts) == G and len(set(prompts)) == 1 for prompts in function.prompts)
    assert [seen["env_reward"] for seen in reward.seen] == [out["env_reward"] for out in function.returned]
    assert [seen["answer"] for seen in reward.seen] == [[str(2 + int(p[0][1]))] * G for p in function.prompts]
    # The last round trained exactly the returned completion ids, every token in the loss.
    last = function.returned[-1]
    assert trained_rows(trainer) == [(ids, [1] * len(ids)) for ids in last["completion_ids"]]
    assert reward.seen[-1]["completion_ids"] == last["completion_ids"]
    tokenizer = trainer.processing_class
    assert reward.seen[-1]["completions"] == tokenizer.batch_decode(last["completion_ids"], skip_special_tokens=True)


def test_env_mask_marks_the_loss_tokens(tmp_path, model_path):
    function = TrlStyle(tool=True)
    trainer = make_trainer(tmp_path, model_path, function, max_steps=1)
    trainer.train()
    last = function.returned[-1]
    assert 0 in last["env_mask"][0]  # the tool's tokens are there, and out of the loss
    assert trained_rows(trainer) == list(zip(last["completion_ids"], last["env_mask"]))


def test_a_round_is_the_returned_rows(tmp_path, model_path):
    function = TrlStyle(tool=True, task="arith")
    trainer = make_trainer(tmp_path, model_path, function)
    rows = [trainer.train_dataset[1]] * G
    rollout, columns = trainer.sample_round(rows, trainer.generation)
    out = function.returned[-1]
    width = rollout.completion_ids.shape[1]
    assert function.prompts[-1] == [row["prompt"] for row in rows]
    assert [r[m.bool()].tolist() for r, m in zip(rollout.prompt_ids, rollout.prompt_mask)] == out["prompt_ids"]
    assert rollout.completion_lists() == out["completion_ids"]
    assert rollout.sampled_mask.tolist() == [m + [0] * (width - len(m)) for m in out["env_mask"]]
    assert rollout.sampling_logps.tolist() == [lp + [0.0] * (width - len(lp)) for lp in out["logprobs"]]
    assert not rollout.is_truncated.any()  # every completion ends with the EOS
    # A scalar extra field goes to every row; a list gives each row its own value.
    assert columns == {"answer": ["3"] * G, "env_reward": out["env_reward"], "task": ["arith"] * G}


def test_a_completion_without_eos_is_truncated_and_logprobs_may_be_none(tmp_path, model_path):
    def no_eos(prompts, trainer):
        tokenizer = trainer.processing_class
        ids = [tokenizer.encode("abc", add_special_tokens=False)] * len(prompts)
        ends = [ids[0], ids[0] + [tokenizer.pad_token_id]]
        return {"prompt_ids": ids, "completion_ids": ends, "logprobs": None}

    trainer = make_trainer(tmp_path, model_path, no_eos, reward=lambda completions, **kw: [0.0] * len(completions))
    rollout, _ = trainer.sample_round([trainer.train_dataset[0]] * G, trainer.generation)
    assert rollout.is_truncated.tolist() == [True, False]  # TRL's rule: the last id neither an EOS nor the padding
    assert rollout.sampling_logps is None


def good_output(prompts, trainer):
    tokenizer = trainer.processing_class
    ids = [tokenizer.encode("Hi!", add_special_tokens=False) + [tokenizer.eos_token_id] for _ in prompts]
    return {"prompt_ids": [[5, 6]] * len(prompts), "completion_ids": ids, "logprobs": [[-1.0] * 4] * len(prompts)}


def changed(**changes):
    """A rollout_func returning `good_output` with `changes` (a value None removes the key)."""

    def function(prompts, trainer):
        out = good_output(prompts, trainer)
        for key, value in changes.items():
            if value is None:
                out.pop(key)
            else:
                out[key] = value(out) if callable(value) else value
        return out

    return function


def boom(prompts, trainer):
    raise KeyError("no such environment")


BAD = {
    "missing logprobs": (changed(logprobs=None), ValueError, "rollout_func must return keys ['logprobs'] in its"),
    "missing two": (
        changed(completion_ids=None, logprobs=None),
        ValueError,
        "rollout_func must return keys ['completion_ids', 'logprobs']",
    ),
    "not a dict": (lambda prompts, trainer: [], TypeError, "rollout_func returned a list"),
    "a row short": (changed(prompt_ids=[[5, 6]]), ValueError, "returned 1 rows in 'prompt_ids' for 2 prompts"),
    "logprobs too long": (changed(logprobs=[[-1.0] * 5] * 2), ValueError, "logprobs[0] has 5 values for the 4"),
    "a None logprob": (changed(logprobs=[[-1.0, None], [-1.0]]), ValueError, "logprobs[0] holds None"),
    "env_mask length": (changed(env_mask=[[1] * 4, [1] * 3]), ValueError, "env_mask[1] has 3 values for the 4"),
    "env_mask values": (changed(env_mask=[[1] * 4, [1, 2, 1, 1]]), ValueError, "env_mask[1] holds values other"),
    "a float id": (changed(completion_ids=[[1.5], [7]]), ValueError, "completion_ids[0] holds 1.5 (float)"),
    "an id past the vocabulary": (changed(prompt_ids=[[5], [10**6]]), ValueError, "prompt_ids[1] holds the token id"),
    "an empty completion": (changed(completion_ids=[[7], []]), ValueError, "completion_ids[1] is empty"),
    "a row's column": (changed(answer=["1", "2"]), ValueError, "extra field(s) ['answer'], which name a column"),
    "a reserved column": (changed(completions=["a", "b"]), ValueError, "extra field(s) ['completions']"),
    "a short extra list": (changed(env_reward=[1.0]), ValueError, "extra field 'env_reward' is a list of 1 values"),
    "the function raises": (boom, RolloutFuncError, "rollout_func 'boom' raised KeyError: 'no such environment'"),
}


@pytest.fixture(scope="module")
def bad_trainer(tmp_path_factory, model_path):
    return make_trainer(tmp_path_factory.mktemp("bad"), model_path, good_output)


@pytest.mark.parametrize("case", list(BAD))
def test_each_bad_return_gets_its_clear_error(bad_trainer, case):
    function, error, message = BAD[case]
    bad_trainer.agent.function = function
    rows = [bad_trainer.train_dataset[0]] * G
    with pytest.raises(error, match=re.escape(message)):
        bad_trainer.sample_round(rows, bad_trainer.generation)
    bad_trainer.agent.function = good_output  # the same trainer takes a good round after a bad one
    rollout, _ = bad_trainer.sample_round(rows, bad_trainer.generation)
    assert rollout.num_rows == G


def test_misuse_is_refused_when_the_trainer_is_built(tmp_path, model_path):
    def build(**kwargs):
        GRPOTrainer(model_path, Recorded(), args=config(tmp_path), train_dataset=chat_prompts(), **kwargs)

    def tool(x: int) -> int:
        """A tool.

        Args:
            x: a number
        """
        return x

    with pytest.raises(InputError, match="cannot be combined with tools=, environment_factory or agent_func"):
        build(rollout_func=good_output, tools=[tool])
    with pytest.raises(InputError, match="cannot be combined with tools=, environment_factory or agent_func"):
        build(rollout_func=good_output, agent_func=lambda row, endpoint: None)
    with pytest.raises(InputError, match="must be a function `f\\(prompts, trainer\\)`, got a str"):
        build(rollout_func="good_output")
    with pytest.raises(InputError, match="must take two positional arguments, \\(prompts, trainer\\)"):
        build(rollout_func=lambda prompts: {})


def helper_rollout(prompts, trainer):
    """TRL's OpenEnv pattern: sample with the helper, return its fields, and the texts as an extra field."""
    outs = generate_rollout_completions(trainer, prompts)
    helper_rollout.outs = outs
    out = {key: [o[key] for o in outs] for key in ("prompt_ids", "completion_ids", "logprobs")}
    return {**out, "text": [o["text"] for o in outs]}


def completion_length(completions, **kwargs):
    return [float(len(c)) for c in completions]


def length_reward(completions, text, **kwargs):  # a spread for random samples: the length of each text
    return [float(len(t)) for t in text]


def test_the_helper_samples_the_policy_inside_a_round(tmp_path, model_path):
    trainer = make_trainer(
        tmp_path, model_path, helper_rollout, length_reward, dataset=chat_prompts(), temperature=0.7
    )
    rows = [trainer.train_dataset[0]] * G
    rollout, columns = trainer.sample_round(rows, trainer.generation)
    outs, tokenizer = helper_rollout.outs, trainer.processing_class
    prompts = [row["prompt"] for row in rows]
    assert [o["prompt_ids"] for o in outs] == encode_prompts(prompts, tokenizer, None)[0]  # the chat template's
    assert rollout.completion_lists() == [o["completion_ids"] for o in outs]
    assert all(0 < len(o["completion_ids"]) <= 8 for o in outs)
    assert columns["text"] == [tokenizer.decode(o["completion_ids"], skip_special_tokens=True) for o in outs]
    # Its log-probs are the policy's at the run's temperature: the trainer's own log-prob pass over the round.
    logps, _ = trainer.logprobs(trainer.model, rollout)
    mask = rollout.completion_mask.bool()
    assert torch.allclose(rollout.sampling_logps[mask], logps[mask].float(), atol=1e-4)
    # Training: the last round trains the helper's ids.
    trainer.train()
    assert trainer.state.global_step == 2
    assert trained_rows(trainer) == [
        (o["completion_ids"], [1] * len(o["completion_ids"])) for o in helper_rollout.outs
    ]


def test_the_helper_refuses_outside_a_round_and_on_a_sharded_policy(tmp_path, model_path):
    trainer = make_trainer(tmp_path, model_path, helper_rollout, length_reward)
    with pytest.raises(RuntimeError, match="no round is running now"):
        generate_rollout_completions(trainer, ["Q: 1 + 1 ="])
    with pytest.raises(ValueError, match="generation_overrides"):
        generate_rollout_completions(trainer, ["Q: 1 + 1 ="], generation_overrides={"temperature": 0.1})
    rows = [trainer.train_dataset[0]] * G
    with pytest.raises(RolloutFuncError, match="cannot sample from a sharded policy"):
        trainer.agent.rollout(rows, trainer.generation, trainer.model, lockstep=lambda anyone: anyone)
    # A trainer without a rollout function (its reward reads the completions: `text` would come from the function,
    # and is refused without one).
    other = GRPOTrainer(model_path, completion_length, args=config(tmp_path), train_dataset=text_prompts())
    with pytest.raises(RuntimeError, match="this trainer has none"):
        generate_rollout_completions(other, ["Q: 1 + 1 ="])


@pytest.mark.parametrize("sampler", ["helper", "its own"])
def test_async_generation_trains_rounds_made_ahead(tmp_path, model_path, sampler):
    # max_staleness=1: rounds are made a step ahead in the producer thread, where the function runs; its log-probs
    # (the helper's, or its own) correct for the older weights.
    function, reward, dataset = (
        (helper_rollout, length_reward, chat_prompts()) if sampler == "helper" else (TrlStyle(), None, None)
    )
    trainer = make_trainer(
        tmp_path, model_path, function, reward, dataset, async_generation=True, max_staleness=1, max_steps=3
    )
    trainer.train()
    assert trainer.state.global_step == 3
    assert max(h["async/staleness"] for h in trainer.state.log_history if "async/staleness" in h) == 1


def test_async_generation_with_stale_rounds_needs_the_logprobs(tmp_path, model_path):
    function = changed(logprobs=lambda out: None)
    trainer = make_trainer(tmp_path, model_path, function, async_generation=True, max_staleness=1)
    with pytest.raises(Exception, match="returned logprobs=None, but async_generation with max_staleness > 0"):
        trainer.train()
