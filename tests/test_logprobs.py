import pytest
import torch

from grpo.data import pad
from grpo.logprobs import completion_logprobs, entropy_from_logits, selective_log_softmax
from grpo.testing import tiny_model


def test_selective_log_softmax_equals_full_log_softmax():
    logits = torch.randn(3, 5, 11)
    index = torch.randint(0, 11, (3, 5))
    expected = torch.log_softmax(logits, -1).gather(-1, index.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(selective_log_softmax(logits, index), expected)


def test_entropy_from_logits():
    logits = torch.randn(2, 4, 7)
    p = torch.softmax(logits, -1)
    torch.testing.assert_close(entropy_from_logits(logits), -(p * p.log()).sum(-1))
    assert entropy_from_logits(torch.zeros(1, 1, 8)).item() == pytest.approx(torch.log(torch.tensor(8.0)).item())


def _naive_logps(model, prompt, completion, temperature):
    """Unpadded single sequence: logits of the whole sequence, log-softmax, pick the completion tokens."""
    ids = torch.tensor([prompt + completion])
    logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1] / temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion).unsqueeze(-1)).squeeze(-1)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_completion_logprobs_match_unpadded_computation(tokenizer, temperature):
    model = tiny_model(tokenizer).eval()
    prompts = [[5, 6, 7, 8, 9], [10, 11]]
    completions = [[20, 21, 258], [30, 31, 32, 33, 34]]
    prompt_ids, prompt_mask = pad(prompts, 256, "left")
    completion_ids, completion_mask = pad(completions, 256, "right")
    with torch.no_grad():
        logps, entropy = completion_logprobs(
            model,
            prompt_ids,
            prompt_mask,
            completion_ids,
            completion_mask,
            temperature=temperature,
            with_entropy=True,
        )
        chunked, _ = completion_logprobs(
            model, prompt_ids, prompt_mask, completion_ids, completion_mask, temperature=temperature, batch_size=1
        )
        for i, (p, c) in enumerate(zip(prompts, completions)):
            expected = _naive_logps(model, p, c, temperature)
            torch.testing.assert_close(logps[i, : len(c)], expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(chunked, logps, rtol=1e-5, atol=1e-5)
    assert entropy.shape == logps.shape and (entropy >= 0).all()


def test_completion_logprobs_backpropagate(tokenizer):
    model = tiny_model(tokenizer)
    prompt_ids, prompt_mask = pad([[5, 6]], 256, "left")
    completion_ids, completion_mask = pad([[7, 8]], 256, "right")
    logps, _ = completion_logprobs(model, prompt_ids, prompt_mask, completion_ids, completion_mask)
    logps.sum().backward()
    assert model.lm_head.weight.grad is not None and model.lm_head.weight.grad.abs().sum() > 0
