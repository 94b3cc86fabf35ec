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
