"""`TransformersGeneration` prefills each run of identical prompts once (grpo/generation/model_generate.py): the
outputs must be those of prefilling every row, and the model must see fewer prompt tokens."""

import pytest
import torch

from grpo.data import pad, tokenize_prompts
from grpo.generation import TransformersGeneration
from grpo.testing import tiny_model

EOS, PAD = 258, 256


def _generate(model, prompts, share, greedy, length=12):
    """The sampler's completions (`share`), or those of `generate` alone on the same left-padded rows, which
    prefills every row: the sampler's path without the shared cache, with its settings and the same seed."""
    backend = TransformersGeneration(
        max_completion_length=length, pad_token_id=PAD, eos_token_ids=[EOS], greedy=greedy
    )
    torch.manual_seed(1)
    if share:
        return backend.generate(model, prompts).ids
    input_ids, attention_mask = pad(prompts, PAD, side="left")
    model.eval()
    with torch.no_grad():
        output = model.generate(
            input_ids=input_ids, attention_mask=attention_mask, generation_config=backend.generation_config
        )
    return output.sequences[:, input_ids.shape[1] :].tolist()


@pytest.fixture
def grouped_prompts(tokenizer):
    # Runs of 4, 3, 2 and 1 rows with prompts of different lengths (left padding in the shared prefill), the first
    # prompt again at the end: it is not a neighbour of its first run, so it is prefilled on its own.
    texts = ["hi"] * 4 + ["a much longer prompt"] * 3 + ["mid prompt"] * 2 + ["hi"]
    return tokenize_prompts(texts, tokenizer, None)


@pytest.mark.parametrize("greedy", [True, False])
def test_shared_prefill_gives_the_outputs_of_prefilling_every_row(tokenizer, grouped_prompts, greedy):
    model = tiny_model(tokenizer, seed=3)
    every_row = _generate(model, grouped_prompts, False, greedy)
    shared = _generate(model, grouped_prompts, True, greedy)
    # Greedy: the same tokens. Sampled with the same seed: the prefill draws no random numbers, so the same draws
    # meet the same distributions row by row, and the samples agree too.
    assert shared == every_row
    if not greedy:
        assert len({tuple(ids) for ids in shared[:4]}) > 1  # a real sample: one prompt's rows differ


def test_shared_prefill_embeds_each_distinct_prompt_once(tokenizer, grouped_prompts):
    model = tiny_model(tokenizer)
    seen = []
    model.model.embed_tokens.register_forward_hook(lambda module, args, out: seen.append(args[0].shape))
    _generate(model, grouped_prompts, True, True, length=1)
    rows, width = len(grouped_prompts), max(len(p) for p in grouped_prompts)
    # 4 runs x (P - 1) tokens once, then every row's last prompt token: one forward each.
    assert seen == [torch.Size([4, width - 1]), torch.Size([rows, 1])]
    seen.clear()
    _generate(model, grouped_prompts, False, True, length=1)
    assert seen == [torch.Size([rows, width])]


def test_distinct_prompts_take_the_plain_path(tokenizer):
    model = tiny_model(tokenizer)
    seen = []
    model.model.embed_tokens.register_forward_hook(lambda module, args, out: seen.append(args[0].shape))
    prompts = tokenize_prompts(["one", "two", "three"], tokenizer, None)
    _generate(model, prompts, True, True, length=1)
    assert seen == [torch.Size([3, 5])]  # no extra prefill when nothing repeats
