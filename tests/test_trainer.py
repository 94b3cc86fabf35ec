"""GRPOTrainer end to end on a tiny model built in code. Fast tests train a step or two; `slow` ones train longer
or compare parameter updates across batch layouts."""

import contextlib
import gc
import math

import pytest
import torch
from datasets import Dataset

from grpo import GRPOConfig, GRPOTrainer
from grpo.testing import tiny_model, tiny_tokenizer
from tests.helpers.compare import assert_same_update
from tests.helpers.scripted import TINY, ScriptedGeneration, capture_batches, reward_len, sgd_step_update


def make_config(tmp_path, **kwargs):
    return GRPOConfig(output_dir=str(tmp_path / "out"), **{**TINY, **kwargs})


def params_of(model):
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def test_train_logs_every_metric(tmp_path, tiny_model_path, prompt_dataset):
    def answer_match(completions, answer):
        return [1.0 if a in c else 0.0 for c, a in zip(completions, answer)]

    def sometimes(completions):  # applies to every other row only
        return [None if i % 2 else 0.5 for i in range(len(completions))]

    args = make_config(tmp_path, max_steps=2, gradient_accumulation_steps=2, beta=0.04)
    trainer = GRPOTrainer(
        tiny_model_path, [reward_len, answer_match, sometimes], args=args, train_dataset=prompt_dataset
    )
    trainer.train()
    logs = trainer.state.log_history[0]
    expected = [
        "loss",
        "reward",
        "reward_std",
        "frac_reward_zero_std",
        "kl",
        "entropy",
        "clip_ratio/low_mean",
        "clip_ratio/high_mean",
        "clip_ratio/region_mean",
        "completions/mean_length",
        "completions/min_length",
        "completions/max_length",
        "completions/clipped_ratio",
        "num_tokens",
    ]
    expected += [f"rewards/{n}/{s}" for n in ("reward_len", "answer_match", "sometimes") for s in ("mean", "std")]
    missing = [k for k in expected if k not in logs]
    assert not missing, missing
    assert logs["rewards/sometimes/mean"] == 0.5
    assert (
        1 <= logs["completions/min_length"] <= logs["completions/mean_length"] <= logs["completions/max_length"] <= 8
    )
    assert logs["kl"] >= 0 and math.isfinite(logs["loss"])
    assert trainer.state.log_history[1]["num_tokens"] > logs["num_tokens"]  # cumulative


def test_conversational_prompts_and_evaluation(tmp_path, tiny_model_path, chat_dataset):
    seen = {}

    def spy(prompts, completions, answer):
        seen["prompt"], seen["completion"], seen["answer"] = prompts[0], completions[0], answer[0]
        return [float(len(c[0]["content"])) for c in completions]

    args = make_config(tmp_path, max_steps=1, per_device_eval_batch_size=4)
    trainer = GRPOTrainer(tiny_model_path, spy, args=args, train_dataset=chat_dataset, eval_dataset=chat_dataset)
    trainer.train()
    assert seen["prompt"][0]["role"] == "user"
    assert seen["completion"][0]["role"] == "assistant" and isinstance(seen["completion"][0]["content"], str)
    metrics = trainer.evaluate()
    for key in ("eval_loss", "eval_reward", "eval_rewards/spy/mean", "eval_completions/mean_length", "eval_entropy"):
        assert key in metrics, key


def test_model_object_with_processing_class_and_reused_batches(tmp_path, tokenizer, prompt_dataset):
    # num_iterations=2 replays each round, so old log-probs are recorded and the clip metrics become meaningful.
    model = tiny_model(tokenizer)
    args = make_config(
        tmp_path, max_steps=2, num_iterations=2, learning_rate=1e-2, mask_truncated_completions=True, loss_type="grpo"
    )
    trainer = GRPOTrainer(model, reward_len, args=args, train_dataset=prompt_dataset, processing_class=tokenizer)
    captured = capture_batches(trainer)
    trainer.train()
    assert all(batch.old_logps is not None for batch in captured)  # recorded by the first pass, read by the replay
    assert captured[0].advantages.data_ptr() == captured[1].advantages.data_ptr()  # the same round, replayed
    truncated = captured[0].completion_mask.sum(1) == 8
    assert (captured[0].loss_mask[truncated] == 0).all()  # masked truncated rows count zero tokens


def test_misuse_gives_clear_errors(tmp_path, tiny_model_path, tokenizer):
    args = make_config(tmp_path)
    with pytest.raises(ValueError, match="needs a 'prompt' column"):
        GRPOTrainer(tiny_model_path, reward_len, args=args, train_dataset=Dataset.from_dict({"text": ["a"] * 8}))
    with pytest.raises(ValueError, match="reward_weights has 2 entries but there are 1"):
        GRPOTrainer(tiny_model_path, reward_len, args=make_config(tmp_path, reward_weights=[1.0, 2.0]))
    with pytest.raises(ValueError, match="pass it as `processing_class=`"):
        GRPOTrainer(tiny_model(tokenizer), reward_len, args=args)
    with pytest.raises(TypeError, match="must be callable"):
        GRPOTrainer(tiny_model_path, [reward_len, 3], args=args)


def test_failing_reward_stops_training_with_function_and_row(tmp_path, tiny_model_path):
    def broken(prompts, completions, bad):
        return [float("x") if b else 1.0 for b in bad]

    # Prompts in order, two per round of 4 rows: rows 2 and 3 are copies of prompt 1, the first bad one.
    dataset = Dataset.from_dict({"prompt": [f"q{i}" for i in range(8)], "bad": [i % 2 == 1 for i in range(8)]})
    args = make_config(tmp_path, max_steps=1, num_generations=2, shuffle_dataset=False)
    trainer = GRPOTrainer(tiny_model_path, broken, args=args, train_dataset=dataset)
    with pytest.raises(RuntimeError, match="'broken' failed on row 2 \\(prompt: 'q1'\\): ValueError"):
        trainer.train()


def test_rewards_async_skip_errors_timing_and_reward_model_by_path(tmp_path, tiny_model_path, prompt_dataset):
    from transformers import LlamaForSequenceClassification

    from grpo.testing import tiny_config, tiny_tokenizer

    tokenizer = tiny_tokenizer()
    LlamaForSequenceClassification(tiny_config(tokenizer, num_hidden_layers=1, num_labels=1)).save_pretrained(
        tmp_path / "judge"
    )
    tokenizer.save_pretrained(tmp_path / "judge")

    async def async_len(completions):
        return [float(len(c)) for c in completions]

    def flaky(prompts, completions):  # fails on "Question 0: ...", the prompt of the first round
        if any(p.startswith("Question 0:") for p in prompts):
            raise ConnectionError("judge unreachable")
        return [1.0] * len(completions)

    args = make_config(
        tmp_path, max_steps=2, reward_errors="skip", reward_num_workers=2, reward_timeout=30, shuffle_dataset=False
    )
    funcs = [async_len, flaky, str(tmp_path / "judge")]
    trainer = GRPOTrainer(tiny_model_path, funcs, args=args, train_dataset=prompt_dataset)
    assert trainer.reward_names == ["async_len", "flaky", "judge"]
    trainer.train()
    first, second = trainer.state.log_history[:2]
    # One round of 4 rows is one prompt x G: all 4 rows of prompt 0 fail, none of prompt 1.
    assert (first["rewards/flaky/errors"], second["rewards/flaky/errors"]) == (4.0, 0.0)
    assert math.isnan(first["rewards/flaky/mean"]) and second["rewards/flaky/mean"] == 1.0
    assert first["rewards/async_len/errors"] == 0.0 and first["rewards/async_len/mean"] > 0
    assert first["timing/rewards"] > 0 and math.isfinite(first["rewards/judge/mean"])


# ---- slow: longer runs and update-equality checks ----


@pytest.mark.slow
def test_user_script_trains_every_parameter(tmp_path, tiny_model_path, prompt_dataset):
    # The script, unchanged but for the model path and the data.
    output_dir = str(tmp_path / "user")
    dataset = prompt_dataset
    model_path = tiny_model_path
    training_args = GRPOConfig(
        output_dir=output_dir,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        logging_steps=2,
    )

    def reward_len(prompts, completions):
        return [len(completion) for completion in completions]

    trainer = GRPOTrainer(model=model_path, reward_funcs=reward_len, args=training_args, train_dataset=dataset)
    before = params_of(trainer.model)
    trainer.train()
    after = params_of(trainer.model)
    unchanged = [n for n in before if torch.equal(before[n], after[n])]
    assert not unchanged, unchanged
    assert trainer.state.global_step == 48  # 16 prompts x 3 epochs, one prompt (8 rows) per optimizer step
    assert all(math.isfinite(h["loss"]) for h in trainer.state.log_history if "loss" in h)


@pytest.mark.slow
@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo"])
def test_accumulation_gives_the_same_update(tmp_path, loss_type):
    reference, trainer = sgd_step_update(
        tmp_path / "ref",
        loss_type=loss_type,
        beta=0.04,
        per_device_train_batch_size=8,
        gradient_accumulation_steps=1,
    )
    params = dict(trainer.model.named_parameters())
    assert sum(d.abs().sum() for d in reference.values()) > 0
    for per_device, accumulation in [(4, 2), (2, 4)]:
        update, _ = sgd_step_update(
            tmp_path / f"{per_device}",
            loss_type=loss_type,
            beta=0.04,
            per_device_train_batch_size=per_device,
            gradient_accumulation_steps=accumulation,
        )
        assert_same_update(update, reference, params, what=f"{loss_type} {per_device}x{accumulation}")


@pytest.mark.slow
def test_dapo_normaliser_is_the_optimizer_step_when_a_round_feeds_two_steps(tmp_path):
    # One round of 8 rows feeding two optimizer steps of 2 x 2 rows: the first step sees exactly the rows (group 1)
    # that a round of 4 rows feeding one step sees, so both first updates must match if dapo divides by the
    # step's tokens (dividing by the round's tokens would shrink it).
    aligned, trainer = sgd_step_update(
        tmp_path / "aligned",
        loss_type="dapo",
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
    )
    spanning, _ = sgd_step_update(
        tmp_path / "spanning",
        loss_type="dapo",
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        steps_per_generation=4,
    )
    assert_same_update(spanning, aligned, dict(trainer.model.named_parameters()), what="dapo spanning")


@pytest.mark.slow
def test_beta_zero_on_policy_grpo_logs_zero_loss_and_still_learns(tmp_path):
    update, trainer = sgd_step_update(
        tmp_path / "zero", loss_type="grpo", gradient_accumulation_steps=2, logging_steps=1
    )
    assert abs(trainer.state.log_history[0]["loss"]) < 1e-6
    assert all(d.abs().sum() > 0 for d in update.values())


@pytest.mark.slow
def test_resume_continues_the_same_sequence_of_prompts(tmp_path, tokenizer, prompt_dataset):
    def run(name, resume=None, steps=4):
        seen = []

        def spy(prompts, completions):
            seen.append(prompts[0])
            return [float(len(c)) for c in completions]

        args = GRPOConfig(
            output_dir=str(tmp_path / name), **{**TINY, "max_steps": steps, "save_strategy": "steps", "save_steps": 2}
        )
        trainer = GRPOTrainer(
            tiny_model(tokenizer), spy, args=args, train_dataset=prompt_dataset, processing_class=tokenizer
        )
        trainer.train(resume_from_checkpoint=resume)
        return seen

    full = run("full")
    resumed = run("full-again", resume=str(tmp_path / "full" / "checkpoint-2"))
    assert len(full) == 4 and resumed == full[2:]


@pytest.mark.slow
def test_padding_free_and_chunk_size_leave_the_update_unchanged(tmp_path):
    # Packing sequences and the projection's chunking change how the log-probs are computed, not what they are.
    reference, trainer = sgd_step_update(tmp_path / "ref", loss_type="dapo", beta=0.04, num_iterations=2)
    assert trainer.logprobs.padding_free is False  # sdpa on CPU: packing is off unless asked for
    packed, trainer = sgd_step_update(
        tmp_path / "packed", loss_type="dapo", beta=0.04, num_iterations=2, padding_free=True, logprobs_chunk_size=3
    )
    assert trainer.logprobs.padding_free is True
    assert sum(d.abs().sum() for d in reference.values()) > 0
    assert_same_update(packed, reference, dict(trainer.model.named_parameters()), what="padding-free")


def test_mixed_precision_samples_in_one_autocast_region(tmp_path, tiny_model_path, prompt_dataset, monkeypatch):
    """With bf16 (autocast over float32 weights) `model.generate` runs inside one autocast region: each weight is cast
    once per round and the cast kept until the region ends, rather than cast again by the autocast that accelerate
    wraps around every forward (at every generated token). The draws are the same either way."""
    from grpo.generation import TransformersGeneration

    generate = TransformersGeneration.generate
    seen = []  # per round: (autocast on around generate, accelerate's autocast around the forward, completions)

    def recorded(self, model, prompt_ids):
        region = torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
        completions = generate(self, model, prompt_ids)
        seen.append((region, hasattr(model.forward, "__wrapped__"), completions.ids))
        return completions

    monkeypatch.setattr(TransformersGeneration, "generate", recorded)
    runs = []
    for one_region in (True, False):
        args = make_config(tmp_path / str(one_region), bf16=True, use_cpu=True, max_steps=2, seed=3)
        trainer = GRPOTrainer(tiny_model_path, reward_len, args=args, train_dataset=prompt_dataset)
        assert trainer.accelerator.mixed_precision == "bf16"
        if not one_region:
            monkeypatch.setattr(trainer.accelerator, "autocast", contextlib.nullcontext)
        trainer.train()
        runs.append(seen[-2:])
    rounds, rounds_per_forward = runs
    assert [(region, wrapped) for region, wrapped, _ in rounds] == [(True, True)] * 2
    assert [(region, wrapped) for region, wrapped, _ in rounds_per_forward] == [(False, True)] * 2
    assert [ids for *_, ids in rounds] == [ids for *_, ids in rounds_per_forward]


class ClosableSampler(ScriptedGeneration):
    """Scripted completions from a sampler that holds something to release, and counts its closes."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.closed = 0

    def close(self):
        self.closed += 1


@pytest.mark.parametrize("async_generation", [False, True])
def test_the_sampler_is_closed_with_its_trainer(tmp_path, monkeypatch, async_generation):
    """A sampler with a `close` (a colocated vLLM engine: it puts back the environment variables it set) outlives
    `train()`, which evaluation after it needs, and is closed once when the trainer is collected; under async
    generation through the shared engine that wraps it."""
    tokenizer = tiny_tokenizer()
    args = GRPOConfig(output_dir=str(tmp_path), max_steps=1, async_generation=async_generation, **TINY)
    sampler = ClosableSampler(args.num_generations, args.max_completion_length)
    monkeypatch.setattr("grpo.training.rounds.make_generation_backend", lambda *args, **kwargs: sampler)
    dataset = Dataset.from_dict({"prompt": [f"Question {i}" for i in range(8)]})
    trainer = GRPOTrainer(
        tiny_model(tokenizer), reward_len, args=args, train_dataset=dataset, processing_class=tokenizer
    )
    trainer.train()
    assert sampler.closed == 0
    trainer.generation.generate(trainer.model, [[5, 6, 7]])  # still samples after training
    del trainer
    gc.collect()
    assert sampler.closed == 1
