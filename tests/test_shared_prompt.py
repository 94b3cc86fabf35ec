"""Each distinct prompt of a micro-batch runs through the backbone once (grpo/objective/shared_prompt.py): the
log-probs, entropies and gradients must be those of the plain padded forward, which runs every row whole."""

import pytest
import torch

from grpo.data import pad
from grpo.objective import shared_prompt
from grpo.objective.logprobs import completion_logprobs
from grpo.objective.shared_prompt import prompt_groups
from grpo.testing import tiny_model
from tests.helpers.compare import assert_close_to_scale

PAD, EOS = 256, 258


def test_prompt_groups_merges_consecutive_identical_rows():
    ids, mask = pad([[1, 2], [1, 2], [3], [3], [3], [1, 2]], PAD, "left")
    assert prompt_groups(ids, mask) == ([0, 2, 5], [2, 3, 1])


def _batch():
    # Runs of 3, 2 and 1 copies with prompts of different lengths (left padding), completions of different
    # lengths (right padding after EOS), one of a single token.
    prompts = [[5, 6, 7, 8, 9]] * 3 + [[10, 11]] * 2 + [[12, 13, 14]]
    completions = [[20, 21, EOS], [22, 23, 24, 25], [26], [30, 31, 32, 33, 34], [35, 36], [40, 41, 42]]
    return (*pad(prompts, PAD, "left"), *pad(completions, PAD, "right"))


def _run(model, batch, share, monkeypatch):
    """Log-probs and entropies of the batch, and the gradient of a weighted sum of the log-probs."""
    if not share:  # the plain forward: sharing reports that it does not apply
        monkeypatch.setattr(shared_prompt, "can_share", lambda *a: False)
    calls = []
    model.model.embed_tokens.register_forward_hook(lambda m, a, out: calls.append(tuple(a[0].shape)))
    model.zero_grad()
    logps, entropy = completion_logprobs(model, *batch, temperature=0.7, with_entropy=True)
    weights = torch.arange(1.0, 1.0 + logps.numel()).view_as(logps)
    (logps * weights).sum().backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    monkeypatch.undo()
    model.model.embed_tokens._forward_hooks.clear()
    return logps.detach(), entropy, grads, calls


def test_shared_prompt_forward_equals_the_plain_forward(tokenizer, monkeypatch):
    model = tiny_model(tokenizer, seed=2)
    batch = _batch()
    plain = _run(model, batch, False, monkeypatch)
    shared = _run(model, batch, True, monkeypatch)
    assert plain[3] == [(6, 5 + 5)]  # every row whole: prompt width 5, completion width 5
    assert shared[3] == [(3, 5), (6, 4)]  # 3 distinct prompts, then tokens 0..3 of every completion
    assert_close_to_scale(shared[0], plain[0], "log-probs")
    assert_close_to_scale(shared[1], plain[1], "entropies")
    assert (shared[0][batch[3] == 0] == 0).all()  # padding after EOS: zero
    for name, grad in plain[2].items():
        assert_close_to_scale(shared[2][name], grad, name)


def test_no_repeated_prompt_runs_the_plain_forward(tokenizer):
    model = tiny_model(tokenizer)
    prompt_ids, prompt_mask = pad([[5, 6], [7, 8, 9]], PAD, "left")
    completion_ids, completion_mask = pad([[20, 21], [22]], PAD, "right")
    calls = []
    model.model.embed_tokens.register_forward_hook(lambda m, a, out: calls.append(tuple(a[0].shape)))
    with torch.no_grad():
        completion_logprobs(model, prompt_ids, prompt_mask, completion_ids, completion_mask)
    assert calls == [(2, 5)]


@pytest.mark.parametrize("grad", [True, False])
def test_a_checkpointed_model_in_training_mode_keeps_the_plain_forward(tokenizer, grad):
    model = tiny_model(tokenizer)
    batch = _batch()
    with torch.no_grad():
        expected, _ = completion_logprobs(model.eval(), *batch)
    model.gradient_checkpointing_enable()
    calls = []
    model.model.embed_tokens.register_forward_hook(lambda m, a, out: calls.append(tuple(a[0].shape)))
    with torch.set_grad_enabled(grad):
        logps, _ = completion_logprobs(model.train(), *batch)
        # Checkpointed layers in training mode drop the cache, also without gradients (a reference pass): one
        # plain forward. In eval mode the cache is kept and the prompts are shared.
        assert calls == [(6, 10)]
        assert_close_to_scale(logps, expected, "checkpointed")
        calls.clear()
        completion_logprobs(model.eval(), *batch)
        assert calls == [(3, 5), (6, 4)]
