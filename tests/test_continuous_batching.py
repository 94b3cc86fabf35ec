"""`use_transformers_continuous_batching`: sampling through transformers' continuous-batching engine
(grpo/generation/continuous_batching.py), checked against `model.generate` on the tiny model, alone and in agent
episodes, synchronous and asynchronous."""

import warnings

import pytest
import torch

from grpo import GRPOConfig, GRPOTrainer
from grpo.data import tokenize_prompts
from grpo.generation import ContinuousBatchingGeneration, SamplingRNG, TransformersGeneration, cut_at_eos
from grpo.testing import tiny_model
from tests.helpers.agents import talkative_add_trainer
from tests.helpers.scripted import TINY, reward_len

EOS, PAD = 258, 256


def prompts_of(tokenizer, texts, copies):
    """Each text's token ids `copies` times, consecutively (a round's groups)."""
    return [ids for ids in tokenize_prompts(texts, tokenizer, None) for _ in range(copies)]


def likely_eos_model(tokenizer, dtype=torch.float64):
    """The tiny model with EOS's output row raised, so completions end after a few tokens, at different lengths."""
    model = tiny_model(tokenizer).to(dtype)
    with torch.no_grad():
        model.lm_head.weight[EOS] += 0.6 * model.lm_head.weight.abs().max()
    return model


def test_greedy_completions_equal_model_generate(tokenizer):
    # float64: the engine's paged attention and `generate`'s padded attention sum in different orders, which in
    # float32 could flip the argmax of a random model's near-tied logits.
    model = likely_eos_model(tokenizer)
    prompts = prompts_of(tokenizer, ["hello", "a longer prompt here", "x"], copies=2)
    common = dict(max_completion_length=12, pad_token_id=PAD, eos_token_ids=[EOS], greedy=True)
    expected = TransformersGeneration(**common).generate(model, prompts).ids
    got = ContinuousBatchingGeneration(**common).generate(model, prompts).ids
    # `generate` pads finished rows to the longest; the engine stops each row at its EOS (kept).
    assert cut_at_eos(got, [EOS], 12) == cut_at_eos(expected, [EOS], 12)
    cut, truncated = cut_at_eos(got, [EOS], 12)
    assert got == cut, "the engine returns nothing past a row's first EOS"
    assert len(set(map(len, cut))) > 1 and not all(truncated), "rows of several lengths, some ending in EOS"


def test_sampled_tokens_follow_the_sampling_settings(tokenizer):
    # Every sampled token must be among the policy's top-2 at its position (top_k=2 reached the engine), and the
    # returned ids are the tokens the model was fed: recomputing the logits along them gives the same top-2 sets.
    model = tiny_model(tokenizer)
    prompts = prompts_of(tokenizer, ["hello", "abc"], copies=8)
    backend = ContinuousBatchingGeneration(
        max_completion_length=6, pad_token_id=PAD, eos_token_ids=[EOS], top_k=2, temperature=0.7, rng=SamplingRNG(1)
    )
    completions = backend.generate(model, prompts).ids
    assert len({tuple(c) for c in completions}) > 2, "sampling, not greedy"
    for prompt, completion in zip(prompts, completions):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + completion])).logits[0]  # (P + T, V)
        top2 = logits[len(prompt) - 1 : -1].topk(2).indices  # (T, 2) the positions predicting the completion
        assert all(token in row for token, row in zip(completion, top2.tolist()))


def test_the_sampling_stream_seeds_it_and_the_process_keeps_its_generators(tokenizer):
    model = tiny_model(tokenizer)
    model.train()
    prompts = prompts_of(tokenizer, ["hello", "abc"], copies=4)
    common = dict(max_completion_length=8, pad_token_id=PAD, eos_token_ids=[EOS], top_k=0)
    first, second = ContinuousBatchingGeneration(rng=SamplingRNG(3), **common), None
    torch.manual_seed(5)
    process_state = torch.get_rng_state()
    a = first.generate(model, prompts).ids
    assert torch.equal(torch.get_rng_state(), process_state), "the engine's torch.manual_seed leaked out"
    assert model.training, "the training mode is put back"
    torch.manual_seed(9)  # user code reseeding torch between rounds changes nothing
    second = ContinuousBatchingGeneration(rng=SamplingRNG(3), **common)
    assert second.generate(model, prompts).ids == a
    assert first.generate(model, prompts).ids != a, "the next round draws new numbers"
    other = ContinuousBatchingGeneration(rng=SamplingRNG(4), **common)
    assert other.generate(model, prompts).ids != a


def test_a_processor_the_engine_cannot_apply_is_refused(tokenizer):
    model = tiny_model(tokenizer)
    prompts = prompts_of(tokenizer, ["hello"], copies=2)
    common = dict(max_completion_length=4, pad_token_id=PAD, eos_token_ids=[EOS])
    # Marked unsupported by transformers (it would drop it), and one it does not know about (it would run it on the
    # last token only).
    for kwargs, name in [
        ({"repetition_penalty": 1.2}, "RepetitionPenaltyLogitsProcessor"),
        ({"generation_kwargs": {"no_repeat_ngram_size": 2}}, "NoRepeatNGramLogitsProcessor"),
    ]:
        with pytest.raises(ValueError, match=name):
            ContinuousBatchingGeneration(**common, **kwargs).generate(model, prompts)
    # min-p reads only a row's own scores: kept.
    assert len(ContinuousBatchingGeneration(**common, min_p=0.05).generate(model, prompts).ids) == 2


def config(tmp_path, **kwargs):
    return GRPOConfig(output_dir=str(tmp_path), **{**TINY, **kwargs})


def test_config_fields_and_the_deprecated_alias(tmp_path):
    assert config(tmp_path).use_transformers_continuous_batching is False
    with pytest.warns(FutureWarning, match="use_transformers_paged is deprecated"):
        args = config(tmp_path, use_transformers_paged=True)
    assert args.use_transformers_continuous_batching
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        args = config(
            tmp_path,
            use_transformers_continuous_batching=True,
            transformers_continuous_batching_config='{"page_size": 64}',
        )
    assert args.transformers_continuous_batching_config == {"page_size": 64}


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"transformers_continuous_batching_config": {"seed": 1}}, "every round would then draw the same"),
        ({"transformers_continuous_batching_config": {"page_sise": 64}}, "Did you mean 'page_size'"),
        ({"transformers_continuous_batching_config": "{page_size: 64}"}, "not valid JSON"),
        ({"use_vllm": True}, "pick one"),
        ({"repetition_penalty": 1.1}, "cannot apply a repetition_penalty"),
        ({"generation_kwargs": {"min_new_tokens": 2}}, "engine ignores"),
        ({"cache_implementation": "static"}, "whose cache is paged"),
        (
            {
                "use_transformers_continuous_batching": False,
                "transformers_continuous_batching_config": {"page_size": 64},
            },
            "nothing would read it",
        ),
    ],
)
def test_bad_settings_are_refused_at_construction(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        config(tmp_path, **{"use_transformers_continuous_batching": True, **kwargs})


def test_the_trainer_samples_with_it(tmp_path, tiny_model_path, prompt_dataset):
    args = config(tmp_path, max_steps=1, use_transformers_continuous_batching=True)
    trainer = GRPOTrainer(tiny_model_path, reward_len, args=args, train_dataset=prompt_dataset)
    assert isinstance(trainer.generation, ContinuousBatchingGeneration)
    trainer.train()
    logs = trainer.state.log_history[0]
    assert 1 <= logs["completions/mean_length"] <= 8 and "loss" in logs


def _agent_trainer(tmp_path, **kwargs):
    """Episodes of three policy turns and two tool answers (`talkative_add_trainer`), sampled by the engine."""
    settings = dict(
        use_transformers_continuous_batching=True,
        max_completion_length=240,
        max_prompt_length=None,
        max_tool_calling_iterations=2,
        num_generations=2,
        per_device_train_batch_size=4,
    )
    return talkative_add_trainer(tmp_path, config(tmp_path / "out", **{**settings, **kwargs}))


@pytest.mark.slow  # whole episodes through the engine: several seconds
def test_multi_turn_episodes_equal_those_of_model_generate(tmp_path):
    # Each turn of an episode is one engine call on the conversation so far (the earlier turns and the tool
    # answers); `model.generate` instead carries its KV cache from turn to turn. Greedy and in float64 (as above),
    # the two give the same episodes, token for token, with the same masks.
    trainer = _agent_trainer(tmp_path)
    assert isinstance(trainer.generation, ContinuousBatchingGeneration)
    trainer.model.to(torch.float64)  # in place: sample_round samples with trainer.model
    common = dict(max_completion_length=240, pad_token_id=trainer.processing_class.pad_token_id, greedy=True)
    rows = [trainer.train_dataset[i] for i in range(4)]
    results = []
    for kind in (ContinuousBatchingGeneration, TransformersGeneration):
        rollout, _ = trainer.sample_round(rows, kind(eos_token_ids=trainer.eos_token_ids, **common))
        results.append(rollout)
    engine, generate = results
    assert engine.episode_stats["turns"] == 3 * len(rows) and engine.episode_stats["tool_calls"] == 2 * len(rows)
    for field in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "sampled_mask", "loss_mask"):
        assert torch.equal(getattr(engine, field), getattr(generate, field)), field
    assert engine.completions == generate.completions


@pytest.mark.slow  # whole episodes through the engine: several seconds
def test_async_generation_samples_the_episodes_with_the_engine(tmp_path):
    # The engine in the producer thread of async generation, episodes and all: each round's rows are full episodes.
    trainer = _agent_trainer(tmp_path, async_generation=True, max_staleness=0, max_steps=2)
    # The shared engine's sampler: the engine on a copy of the policy, which the trainer updates meanwhile.
    assert isinstance(trainer.generation.backend.sampler, ContinuousBatchingGeneration)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 2
    assert all(h["tools/turns"] == 3 and h["tools/call_frequency"] == 2 for h in logs)
