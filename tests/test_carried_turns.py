"""`CarriedTurns` (grpo/generation/model_generate.py): the turns of a batch of episodes keep their KV cache from one
turn to the next. Each turn must sample what a fresh `generate` over the whole context samples (same seed: the same
tokens, greedy and sampled, in float64 where rounding cannot flip a draw), while the model sees only the tokens a turn
adds."""

import pytest
import torch

from grpo.data import pad, tokenize_prompts
from grpo.generation import TransformersGeneration
from grpo.generation.base import cut_at_eos
from grpo.generation.model_generate import cache_keyword
from grpo.testing import tiny_model

PAD = 256
# Many end-of-turn ids, so that the random model's rows end at different lengths: tokens sampled after a row's EOS
# are in the carried cache and must be masked out at the next turn.
EOS = [258, *range(97, 123)]


def sampler(greedy, length=10):
    return TransformersGeneration(max_completion_length=length, pad_token_id=PAD, eos_token_ids=EOS, greedy=greedy)


def answer(tokenizer, row, turn):
    """A stand-in tool answer: its length differs between rows, so the new chunks are left-padded."""
    return tokenizer("<tool>" + "7" * (row % 3 + turn) + "</tool>", add_special_tokens=False)["input_ids"]


def play(model, tokenizer, turns_sampler, greedy, going_after=(None, [0, 2, 3, 5], None)):
    """Three turns of six episodes (three prompts, two rows each). After turn 1 only the rows `going_after[1]`
    go on. Each turn's context is the last one's, the sampled tokens cut after their EOS, and a tool answer.
    `turns_sampler` is the function that samples a turn. Returns every turn's raw completions."""
    prompts = tokenize_prompts(["hi"] * 2 + ["a longer prompt"] * 2 + ["mid"] * 2, tokenizer, None)
    contexts, rows, out = {r: p for r, p in enumerate(prompts)}, list(range(6)), []
    for turn in range(3):
        if turn and going_after[turn] is not None:
            rows = going_after[turn]
        torch.manual_seed(10 + turn)
        raw = turns_sampler(model, [contexts[r] for r in rows]).ids
        out.append(raw)
        cut, _ = cut_at_eos(raw, EOS, len(raw[0]))
        for r, ids in zip(rows, cut):
            contexts[r] = contexts[r] + ids + answer(tokenizer, r, turn)
    return out


@pytest.mark.parametrize("greedy", [True, False])
def test_carried_turns_sample_what_a_fresh_prefill_samples(tokenizer, greedy):
    model = tiny_model(tokenizer, seed=4).double()  # float64: no rounding difference can flip a draw
    fresh = play(model, tokenizer, sampler(greedy).generate, greedy)
    carried = play(model, tokenizer, sampler(greedy).turns().generate, greedy)
    assert carried == fresh
    lengths = [len(cut) for cut in cut_at_eos(fresh[0], EOS, 10)[0]]
    assert len(set(lengths)) > 1  # rows ended at different lengths: the junk after an EOS was masked out


def test_a_context_that_continues_no_row_starts_afresh(tokenizer):
    model = tiny_model(tokenizer, seed=4).double()
    turns = sampler(True).turns()
    first = turns.generate(model, tokenize_prompts(["hi", "mid"], tokenizer, None)).ids
    other = tokenize_prompts(["something else"], tokenizer, None)
    assert turns.generate(model, other).ids == sampler(True).generate(model, other).ids
    assert first  # the first turn ran


def test_only_the_new_tokens_are_prefilled(tokenizer):
    model = tiny_model(tokenizer, seed=4)
    seen = []
    model.model.embed_tokens.register_forward_hook(lambda module, args, out: seen.append(args[0].shape))
    turns = sampler(True, length=3).turns()
    prompts = tokenize_prompts(["a longer prompt", "mid"], tokenizer, None)
    first = turns.generate(model, prompts).ids
    seen.clear()
    tool = [answer(tokenizer, 0, 0), answer(tokenizer, 1, 0)]
    contexts = [p + cut + t for p, cut, t in zip(prompts, cut_at_eos(first, EOS, 3)[0], tool)]
    turns.generate(model, contexts)
    # The first forward of turn 2 feeds the last column of turn 1 (never fed: it was the last token sampled) and
    # the left-padded tool answers, not the whole contexts; then one token per step.
    assert seen[0] == torch.Size([2, 1 + max(len(t) for t in tool)])
    assert seen[0][1] < max(len(c) for c in contexts)
    assert all(shape[1] == 1 for shape in seen[1:])


def test_the_carried_state_gives_the_logits_of_a_fresh_prefill(tokenizer):
    """The next-token logits from the kept cache and the fed tokens equal those of a forward over the whole
    contexts (float64), whatever the rows sampled after their EOS: the sharpest check of what `_continuation`
    keeps, masks and feeds."""
    model = tiny_model(tokenizer, seed=4).double().eval()
    turns = sampler(False).turns()
    prompts = tokenize_prompts(["hi"] * 2 + ["a longer prompt"] * 2 + ["mid"] * 2, tokenizer, None)
    torch.manual_seed(0)
    first = turns.generate(model, prompts).ids
    cut = cut_at_eos(first, EOS, 10)[0]
    assert len({len(c) for c in cut}) > 1  # some rows sampled junk after their EOS
    rows = [0, 2, 3, 5]
    contexts = [prompts[r] + cut[r] + answer(tokenizer, r, 0) for r in rows]
    input_ids, attention_mask, cache = turns._continuation(contexts)
    cached = cache.get_seq_length()
    positions = (attention_mask.cumsum(1) - 1).clamp(min=0)
    with torch.no_grad():
        carried = model(
            input_ids=input_ids[:, cached:],
            attention_mask=attention_mask,
            position_ids=positions[:, cached:],
            **{cache_keyword(model.forward): cache},
        ).logits[:, -1]
        ids, mask = pad(contexts, PAD, side="left")
        fresh = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(1) - 1).clamp(min=0)).logits[:, -1]
    torch.testing.assert_close(carried, fresh, rtol=0, atol=1e-10)


def test_a_static_cache_is_not_carried(tokenizer):
    """A cache that does not keep every column (here `cache_implementation="static"`) is never cut and extended:
    each turn prefills its whole context, as a plain `generate` does."""
    model = tiny_model(tokenizer, seed=4)
    backend = TransformersGeneration(
        max_completion_length=3,
        pad_token_id=PAD,
        eos_token_ids=EOS,
        greedy=True,
        generation_kwargs={"cache_implementation": "static"},
    )
    turns = backend.turns()
    prompts = tokenize_prompts(["a longer prompt", "mid"], tokenizer, None)
    first = turns.generate(model, prompts).ids
    assert turns.cache is None
    contexts = [p + cut + answer(tokenizer, 0, 0) for p, cut in zip(prompts, cut_at_eos(first, EOS, 3)[0])]
    seen = []
    model.model.embed_tokens.register_forward_hook(lambda module, args, out: seen.append(args[0].shape))
    turns.generate(model, contexts)
    assert seen[0][1] == max(len(c) for c in contexts)  # the whole context, prefilled again
