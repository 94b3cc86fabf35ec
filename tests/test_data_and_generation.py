import pytest

from grpo.data import decode_completions, is_conversational, pad, render_prompt, tokenize_prompts
from grpo.generation import TransformersGeneration, cut_at_eos
from grpo.testing import tiny_model

EOS, PAD = 258, 256


def test_cut_at_eos_keeps_eos_and_flags_truncation():
    cut, truncated = cut_at_eos([[5, 7, EOS, 9, PAD], [5, 7, 9], [EOS, PAD, PAD], [1, 2, 3, 4, 5]], [EOS], 4)
    assert cut == [[5, 7, EOS], [5, 7, 9], [EOS], [1, 2, 3, 4]]
    assert truncated == [False, True, False, True]


def test_cut_at_eos_any_of_several_eos_ids():
    cut, truncated = cut_at_eos([[1, 300, 2, EOS]], [EOS, 300], 10)
    assert cut == [[1, 300]] and truncated == [False]


def test_pad_left_and_right():
    ids, mask = pad([[1, 2, 3], [4]], 0, side="left")
    assert ids.tolist() == [[1, 2, 3], [0, 0, 4]] and mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    ids, mask = pad([[1, 2, 3], [4]], 0, side="right")
    assert ids.tolist() == [[1, 2, 3], [4, 0, 0]] and mask.tolist() == [[1, 1, 1], [1, 0, 0]]


def test_render_and_tokenize_prompts(tokenizer):
    chat = [{"role": "user", "content": "hi"}]
    assert is_conversational(chat) and not is_conversational("hi")
    assert render_prompt(chat, tokenizer) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert render_prompt("plain", tokenizer) == "plain"
    ids = tokenize_prompts(["abcdef", "xy"], tokenizer, max_prompt_length=3)
    assert [tokenizer.decode(i) for i in ids] == ["def", "xy"]  # left truncation keeps the end


def test_prefill_prompt_is_continued_and_prepended(tokenizer):
    prompt = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "The answer is"}]
    assert render_prompt(prompt, tokenizer).endswith("<|im_start|>assistant\nThe answer is")
    ids = tokenizer(" 4<|im_end|>", add_special_tokens=False)["input_ids"]
    completions = decode_completions([ids], [prompt], tokenizer)
    assert completions == [[{"role": "assistant", "content": "The answer is 4"}]]


def test_bad_prompts_raise_clear_errors(tokenizer):
    with pytest.raises(ValueError, match="string or a list"):
        render_prompt({"text": "hi"}, tokenizer)
    tokenizer = tokenizer.__class__(tokenizer_object=tokenizer.backend_tokenizer)
    tokenizer.chat_template = None
    with pytest.raises(ValueError, match="chat template"):
        render_prompt([{"role": "user", "content": "hi"}], tokenizer)


def test_transformers_generation_samples_and_restores_mode(tokenizer):
    model = tiny_model(tokenizer)
    model.train()
    backend = TransformersGeneration(max_completion_length=6, pad_token_id=PAD, eos_token_ids=[EOS], top_k=0)
    prompts = tokenize_prompts(["hello", "a longer prompt"], tokenizer, None)
    out = backend.generate(model, prompts).ids
    assert len(out) == 2 and all(1 <= len(o) <= 6 for o in out)
    assert model.training
    assert backend.generation_config.top_k == 0  # top-k off unless asked for


# ---- SamplingSettings: one value, from the config, for every backend ----

# Settings unlike every default, so that a field read from the wrong place (or left at its default) shows.
SAMPLING = dict(max_completion_length=7, temperature=0.7, top_p=0.9, top_k=5, min_p=0.05)


def _config(tmp_path, **kwargs):
    from grpo import GRPOConfig

    return GRPOConfig(output_dir=str(tmp_path), report_to=[], **{**SAMPLING, **kwargs})


def test_sampling_settings_are_the_configs_fields_and_frozen(tmp_path):
    from dataclasses import FrozenInstanceError, fields

    from grpo.generation import SamplingSettings

    args = _config(tmp_path, repetition_penalty=1.2, generation_kwargs={"typical_p": 0.8})
    settings = SamplingSettings.from_config(args)
    renamed = {"structured_outputs_regex": "vllm_structured_outputs_regex"}  # the config's name for it
    for field in fields(SamplingSettings):
        assert getattr(settings, field.name) == getattr(args, renamed.get(field.name, field.name)), field.name
    with pytest.raises(FrozenInstanceError):
        settings.temperature = 1.0
    args.generation_kwargs["typical_p"] = 0.5  # the settings hold a copy: a later change to the config stays out
    assert settings.generation_kwargs == {"typical_p": 0.8}
    assert settings.vllm_params() == {
        "max_tokens": 7, "temperature": 0.7, "top_p": 0.9, "top_k": 5, "min_p": 0.05, "repetition_penalty": 1.2
    }  # fmt: skip
    assert SamplingSettings(max_completion_length=7).vllm_params()["min_p"] == 0.0  # None: off, as vLLM spells it


def _count_builds(monkeypatch) -> list:
    """Every `SamplingSettings` that `from_config` builds, recorded."""
    from grpo.generation import SamplingSettings

    built, original = [], SamplingSettings.from_config.__func__

    def recording(cls, args, **kwargs):
        built.append(original(cls, args, **kwargs))
        return built[-1]

    monkeypatch.setattr(SamplingSettings, "from_config", classmethod(recording))
    return built


@pytest.mark.parametrize("backend", ["generate", "continuous_batching", "vllm_server", "vllm_colocate"])
def test_every_backend_reads_the_one_value_built_from_the_config(tmp_path, tokenizer, monkeypatch, backend):
    import importlib.util
    import types
    import warnings

    from accelerate import Accelerator

    from grpo.generation import make_generation_backend
    from grpo.generation.vllm.client import VLLMClient

    kwargs = {
        "generate": {"generation_kwargs": {"typical_p": 0.8}},
        # The deprecated alias warns when the config is built, and only then: the factory does not check again.
        "continuous_batching": {"use_transformers_paged": True},
        "vllm_server": {"use_vllm": True, "vllm_structured_outputs_regex": "(yes|no)"},
        "vllm_colocate": {"use_vllm": True, "vllm_mode": "colocate"},
    }[backend]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the config's own warnings; the factory must give none
        args = _config(tmp_path, **kwargs)
    monkeypatch.setattr(VLLMClient, "wait_until_ready", lambda self: {})  # no server
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object())  # vLLM "installed"; never imported
    built = _count_builds(monkeypatch)
    accelerator = Accelerator() if backend == "vllm_server" else types.SimpleNamespace(distributed_type="NO")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sampler = make_generation_backend(args, accelerator, tokenizer, [tokenizer.eos_token_id])
    assert len(built) == 1 and sampler.sampling_settings is built[0]
    settings = built[0]
    assert (settings.temperature, settings.top_k, settings.max_completion_length) == (0.7, 5, 7)
    if backend.startswith("vllm"):  # what goes to vLLM with every request
        assert {k: sampler.sampling[k] for k in settings.vllm_params()} == settings.vllm_params()
        if backend == "vllm_server":
            assert sampler.sampling["structured_outputs_regex"] == "(yes|no)"
    else:
        config = sampler.generation_config
        assert (config.max_new_tokens, config.temperature, config.top_p) == (7, 0.7, 0.9)
        assert (config.top_k, config.min_p) == (5, 0.05)
        assert config.typical_p == (0.8 if backend == "generate" else None)


def test_a_backend_takes_the_settings_or_their_fields_not_both():
    from grpo.generation import SamplingSettings

    settings = SamplingSettings(max_completion_length=6, temperature=0.7, top_k=3)
    given = TransformersGeneration(pad_token_id=PAD, eos_token_ids=[EOS], sampling=settings)
    spelled = TransformersGeneration(
        pad_token_id=PAD, eos_token_ids=[EOS], max_completion_length=6, temperature=0.7, top_k=3
    )
    assert spelled.sampling_settings == settings and given.sampling_settings is settings
    assert given.generation_config.to_dict() == spelled.generation_config.to_dict()
    with pytest.raises(TypeError, match="not both"):
        TransformersGeneration(pad_token_id=PAD, eos_token_ids=[EOS], sampling=settings, temperature=0.5)
    with pytest.raises(TypeError, match="temprature"):
        TransformersGeneration(pad_token_id=PAD, eos_token_ids=[EOS], max_completion_length=6, temprature=0.5)
