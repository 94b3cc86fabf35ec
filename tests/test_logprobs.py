import pytest
import torch

from grpo.data import pad
from grpo.objective.logprobs import (
    auto_chunk_size,
    chunked_logprobs,
    completion_logprobs,
    entropy_from_logits,
    selective_log_softmax,
)
from grpo.testing import tiny_config, tiny_model
from tests.helpers.compare import assert_close_to_scale


def test_selective_log_softmax_equals_full_log_softmax():
    logits = torch.randn(3, 5, 11)
    index = torch.randint(0, 11, (3, 5))
    expected = torch.log_softmax(logits, -1).gather(-1, index.unsqueeze(-1)).squeeze(-1)
    assert_close_to_scale(selective_log_softmax(logits, index), expected)


def test_entropy_from_logits():
    logits = torch.randn(2, 4, 7)
    p = torch.softmax(logits, -1)
    assert_close_to_scale(entropy_from_logits(logits), -(p * p.log()).sum(-1))
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
            assert_close_to_scale(logps[i, : len(c)], expected)
    assert_close_to_scale(chunked, logps)
    assert entropy.shape == logps.shape and (entropy >= 0).all()


def test_completion_logprobs_backpropagate(tokenizer):
    model = tiny_model(tokenizer)
    prompt_ids, prompt_mask = pad([[5, 6]], 256, "left")
    completion_ids, completion_mask = pad([[7, 8]], 256, "right")
    logps, _ = completion_logprobs(model, prompt_ids, prompt_mask, completion_ids, completion_mask)
    logps.sum().backward()
    assert model.lm_head.weight.grad is not None and model.lm_head.weight.grad.abs().sum() > 0


# --- chunked projection (docs/method.md, "Log-probs") -----------------------------------------------------------------


def _naive_chunk_reference(hidden, weight, targets, bias=None, temperature=1.0, scale=1.0, softcap=None):
    """The full (N, V) logits and an ordinary log-softmax: what `chunked_logprobs` must equal."""
    z = torch.nn.functional.linear(hidden, weight, bias).float() * scale
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    z = z / temperature
    logps = torch.log_softmax(z, -1).gather(-1, targets[:, None]).squeeze(-1)
    p = torch.softmax(z, -1)
    return logps, -(p * torch.log_softmax(z, -1)).sum(-1)


@pytest.mark.parametrize(
    "settings",
    [
        dict(),
        dict(temperature=0.7),
        dict(bias=True, temperature=1.3),
        dict(scale=0.25, softcap=3.0, temperature=0.9),
    ],
    ids=["plain", "temperature", "bias", "scale+softcap"],
)
def test_chunked_logprobs_equal_full_logits_values_and_gradients(settings):
    torch.manual_seed(0)
    num_rows, hidden_size, vocab = 23, 16, 97  # 23 rows in chunks of 5: the last chunk is ragged
    settings = dict(settings)
    use_bias = settings.pop("bias", False)
    hidden = torch.randn(num_rows, hidden_size, requires_grad=True)
    weight = torch.randn(vocab, hidden_size, requires_grad=True)
    bias = torch.randn(vocab, requires_grad=True) if use_bias else None
    targets = torch.randint(0, vocab, (num_rows,))
    # A weighted sum with one row weighted 0 (a masked row) and negative weights, like a policy-gradient loss.
    row_weights = torch.randn(num_rows)
    row_weights[4] = 0.0

    logps, entropy = chunked_logprobs(hidden, weight, targets, bias=bias, chunk_size=5, with_entropy=True, **settings)
    grads = torch.autograd.grad((logps * row_weights).sum(), [hidden, weight] + ([bias] if use_bias else []))
    expected, expected_entropy = _naive_chunk_reference(hidden, weight, targets, bias=bias, **settings)
    expected_grads = torch.autograd.grad(
        (expected * row_weights).sum(), [hidden, weight] + ([bias] if use_bias else [])
    )

    assert_close_to_scale(logps, expected)
    assert_close_to_scale(entropy, expected_entropy.detach())
    for got, want in zip(grads, expected_grads):
        assert_close_to_scale(got, want)
    assert grads[0][4].abs().max() == 0  # the masked row gets no gradient


def test_chunked_logprobs_under_autocast_compute_like_the_models_own_head():
    """Inside a bf16 autocast region (the trainer's, under mixed precision) float32 inputs are projected in bf16, as
    an `nn.Linear` head would be: log-probs and gradients equal those of full logits computed under the same
    autocast, the gradients come back float32; outside it the float32 result is unchanged."""
    torch.manual_seed(2)
    hidden = torch.randn(23, 16, requires_grad=True)
    weight = torch.randn(97, 16, requires_grad=True)
    targets = torch.randint(0, 97, (23,))
    row_weights = torch.randn(23)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logps, _ = chunked_logprobs(hidden, weight, targets, chunk_size=5, temperature=0.7)
        logits = torch.nn.functional.linear(hidden, weight)  # bf16, as the model's own head under autocast
    grads = torch.autograd.grad((logps * row_weights).sum(), [hidden, weight])
    expected = torch.log_softmax(logits.float() / 0.7, -1).gather(-1, targets[:, None]).squeeze(-1)
    expected_grads = torch.autograd.grad((expected * row_weights).sum(), [hidden, weight])
    assert logits.dtype == torch.bfloat16 and logps.dtype == torch.float32
    torch.testing.assert_close(logps, expected, rtol=0, atol=1e-4)
    for got, want in zip(grads, expected_grads):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
    plain, _ = chunked_logprobs(hidden, weight, targets, chunk_size=5, temperature=0.7)
    exact = torch.log_softmax(hidden @ weight.T / 0.7, -1).gather(-1, targets[:, None]).squeeze(-1)
    assert_close_to_scale(plain, exact)
    assert (plain - logps).abs().max() > 1e-3  # bf16 inputs really changed the numbers: the check above can fail


def test_head_fp32_projects_in_float32_under_autocast_and_from_half_precision_weights():
    """`cast_lm_head_to_fp32`: the product h W^T in float32 whatever autocast and the inputs' dtypes say, so the
    log-probs equal float64 ones to float32 rounding, where the bf16 product of the default is off by 1e-3 or more;
    gradients come back in each input's own dtype."""
    torch.manual_seed(3)
    hidden = torch.randn(23, 16, requires_grad=True)
    weight = torch.randn(97, 16, requires_grad=True)
    targets = torch.randint(0, 97, (23,))
    exact = torch.log_softmax(hidden.double() @ weight.double().T / 0.7, -1).gather(-1, targets[:, None]).squeeze(-1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fp32, _ = chunked_logprobs(hidden, weight, targets, chunk_size=5, temperature=0.7, head_fp32=True)
        bf16, _ = chunked_logprobs(hidden, weight, targets, chunk_size=5, temperature=0.7)
    assert fp32.dtype == torch.float32
    assert (fp32.double() - exact).abs().max() < 1e-5  # float32 rounding of logits of size ~10
    assert (bf16.double() - exact).abs().max() > 1e-3  # the check above fails if the flag is ignored
    grads = torch.autograd.grad(fp32.sum(), [hidden, weight])
    expected_grads = torch.autograd.grad(exact.sum(), [hidden, weight])
    for got, want in zip(grads, expected_grads):
        assert got.dtype == torch.float32
        assert_close_to_scale(got, want.float())
    # Weights stored in bf16 (a model loaded in bf16): the product of their values in float32, gradients in bf16.
    half_hidden = hidden.detach().bfloat16().requires_grad_(True)
    half_weight = weight.detach().bfloat16().requires_grad_(True)
    logps, _ = chunked_logprobs(half_hidden, half_weight, targets, chunk_size=5, temperature=0.7, head_fp32=True)
    widened = half_hidden.double() @ half_weight.double().T / 0.7
    exact = torch.log_softmax(widened, -1).gather(-1, targets[:, None]).squeeze(-1)
    assert (logps.double() - exact.detach()).abs().max() < 1e-5
    grad_hidden, grad_weight = torch.autograd.grad(logps.sum(), [half_hidden, half_weight])
    assert grad_hidden.dtype == grad_weight.dtype == torch.bfloat16


def test_head_fp32_reaches_the_models_own_head(tokenizer):
    """Through `completion_logprobs` under bf16 autocast: the log-probs with `head_fp32` are the backbone's final
    hidden states (captured from its last norm) projected in float64, to float32 rounding; those without it carry
    bf16's."""
    torch.manual_seed(0)
    model = tiny_model(tokenizer).eval()
    _, _, (prompt_ids, prompt_mask, completion_ids, completion_mask) = _batch()
    captured = []
    hook = model.model.norm.register_forward_hook(lambda module, args, out: captured.append(out))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        fp32, _ = completion_logprobs(model, *_batch()[2], temperature=0.7, head_fp32=True)
        bf16, _ = completion_logprobs(model, *_batch()[2], temperature=0.7)
    hook.remove()
    # Position j predicts token j + 1: the P - 1 .. P + T - 2 positions predict the T completion tokens.
    hidden = captured[0][:, prompt_ids.shape[1] - 1 : -1].double()  # (B, T, H)
    logits = hidden @ model.lm_head.weight.double().T / 0.7
    exact = torch.log_softmax(logits, -1).gather(-1, completion_ids[..., None]).squeeze(-1)
    mask = completion_mask.bool()
    errors = {
        name: (logps.double() - exact)[mask].abs().max().item() for name, logps in (("fp32", fp32), ("bf16", bf16))
    }
    assert errors["fp32"] < 2e-6, errors  # float32 rounding of log-probs of size ~6
    assert errors["bf16"] > 10 * errors["fp32"], errors  # bf16's: the check above fails if the flag is ignored


def test_head_fp32_refuses_an_adapter_on_the_head(tokenizer):
    peft = pytest.importorskip("peft", reason="the peft extra is not installed")
    model = peft.get_peft_model(tiny_model(tokenizer), peft.LoraConfig(r=4, target_modules=["q_proj", "lm_head"]))
    _, _, batch = _batch()
    with pytest.raises(ValueError, match="Remove lm_head from the adapter's target_modules"):
        completion_logprobs(model, *batch, head_fp32=True)


def test_an_adapter_on_the_head_is_in_the_logprobs(tokenizer):
    """LoRA on lm_head: its update lives in the wrapper's forward, not in `head.weight`. The chunked projection with
    the head's weight alone missed it (log-probs of -5.6 against -6.7 on this model); the model's own logits count."""
    peft = pytest.importorskip("peft", reason="the peft extra is not installed")
    torch.manual_seed(0)
    config = peft.LoraConfig(r=4, target_modules=["lm_head"], init_lora_weights=False)  # B != 0: the adapter acts
    model = peft.get_peft_model(tiny_model(tokenizer), config)
    prompts, completions, batch = _batch()
    logps, _ = completion_logprobs(model, *batch, temperature=0.7)
    expected = _naive_model_logps(model, prompts, completions, 0.7)
    for row, want in enumerate(expected):
        assert_close_to_scale(logps[row, : len(want)], want)
    with model.disable_adapter():  # the adapter-disabled reference: the base head again
        base, _ = completion_logprobs(model, *batch, temperature=0.7)
    assert (base - logps).abs().max() > 1e-2


def test_chunked_logprobs_chunk_size_does_not_change_results():
    torch.manual_seed(1)
    hidden, weight = torch.randn(10, 8), torch.randn(50, 8)
    targets = torch.randint(0, 50, (10,))
    one, _ = chunked_logprobs(hidden, weight, targets, chunk_size=1)
    whole, _ = chunked_logprobs(hidden, weight, targets, chunk_size=64)
    assert_close_to_scale(one, whole)


def test_auto_chunk_size_scales_with_vocabulary():
    assert auto_chunk_size(151_936) == 128  # 128 MiB / (4 B x 151,936) = 220 rows, rounded down to a power of 2
    assert auto_chunk_size(49_152) == 512
    assert auto_chunk_size(10**9) == 16  # never below 16 rows


def test_chunked_logprobs_rejects_misshapen_inputs():
    with pytest.raises(ValueError, match=r"hidden \(N, H\)"):
        chunked_logprobs(torch.randn(2, 3, 4), torch.randn(5, 4), torch.zeros(2, 3, dtype=torch.long))


def _batch():
    prompts = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14]]
    completions = [[20, 21, 258], [30, 31, 32, 33, 34], [40]]
    prompt_ids, prompt_mask = pad(prompts, 256, "left")
    completion_ids, completion_mask = pad(completions, 256, "right")
    return prompts, completions, (prompt_ids, prompt_mask, completion_ids, completion_mask)


def _naive_model_logps(model, prompts, completions, temperature):
    """Per sequence, unpadded: the model's own logits (with its soft cap / scaling), log-softmax, pick."""
    return [_naive_logps(model, p, c, temperature) for p, c in zip(prompts, completions)]


def _tiny_variant(kind, tokenizer):
    """Tiny causal LMs whose output projections differ: tied, with a bias, soft-capped, scaled."""
    import transformers

    base = tiny_config(tokenizer)  # the same sizes as the tiny Llama, in other architectures
    names = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    common = {name: getattr(base, name) for name in names + ("num_key_value_heads", "head_dim")}
    if kind == "tied":
        return tiny_model(tokenizer, tie_word_embeddings=True)
    if kind == "bias":  # Phi's lm_head has a bias
        config = transformers.PhiConfig(**{k: v for k, v in common.items() if k != "head_dim"})
        return transformers.PhiForCausalLM(config)
    if kind == "softcap":
        config = transformers.Gemma2Config(**common, final_logit_softcapping=2.0)
        return transformers.Gemma2ForCausalLM(config)
    if kind == "scale":
        return transformers.GraniteForCausalLM(transformers.GraniteConfig(**common, logits_scaling=4.0))
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["tied", "bias", "softcap", "scale"])
def test_completion_logprobs_follow_the_models_own_output_projection(tokenizer, kind):
    torch.manual_seed(0)
    model = _tiny_variant(kind, tokenizer).eval()
    if kind == "bias":
        torch.nn.init.normal_(model.lm_head.bias)  # a zero bias would not test anything
    prompts, completions, batch = _batch()
    logps, _ = completion_logprobs(model, *batch, temperature=0.8, chunk_size=3)
    expected = _naive_model_logps(model, prompts, completions, 0.8)

    weights = torch.randn(logps.shape)
    (logps * weights).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    sum((e * weights[i, : len(e)]).sum() for i, e in enumerate(expected)).backward()
    for i, e in enumerate(expected):
        assert_close_to_scale(logps[i, : len(e)], e)
        assert (logps[i, len(e) :] == 0).all()
    assert grads, "no parameter received a gradient"
    for name, param in model.named_parameters():
        assert_close_to_scale(grads[name], param.grad, name)


def test_padding_free_equals_padded(tokenizer):
    model = tiny_model(tokenizer).eval()
    _, _, batch = _batch()
    padded, padded_entropy = completion_logprobs(model, *batch, with_entropy=True)
    packed, packed_entropy = completion_logprobs(model, *batch, with_entropy=True, padding_free=True)
    assert_close_to_scale(packed, padded)
    assert_close_to_scale(packed_entropy, padded_entropy)


@pytest.mark.parametrize("path", ["padded", "padding_free", "shared_prompt"])
def test_the_models_own_head_runs_on_no_position(tokenizer, path):
    """The passes read the decoder's hidden states; the model's head, whose logits nobody reads, projects nothing
    (on a CPU its last-position product under autograd cost 80 ms a pass on SmolLM2), and is itself again after."""
    model = tiny_model(tokenizer)
    _, _, batch = _batch()
    if path == "shared_prompt":  # rows 0-1 share a prompt: the grouped layout
        batch = tuple(torch.cat([t[:1], t]) for t in batch)
    projected = []
    model.lm_head.register_forward_hook(lambda module, args, output: projected.append(args[0].shape[-2]))
    logps, _ = completion_logprobs(model, *batch, padding_free=path == "padding_free")
    assert projected and set(projected) == {0}
    logps.sum().backward()
    assert model.lm_head.weight.grad.abs().sum() > 0  # the chunked projection still trains the head
    hidden = torch.randn(2, 3, model.config.hidden_size)
    assert model.lm_head(hidden).shape == (2, 3, model.config.vocab_size)
    assert len(projected) == 1 + 1  # one forward call, then the direct call above


def test_extra_padding_columns_change_nothing(tokenizer):
    model = tiny_model(tokenizer).eval()
    _, _, (prompt_ids, prompt_mask, completion_ids, completion_mask) = _batch()
    logps, _ = completion_logprobs(model, prompt_ids, prompt_mask, completion_ids, completion_mask)
    widened, _ = completion_logprobs(
        model,
        torch.nn.functional.pad(prompt_ids, (3, 0), value=256),
        torch.nn.functional.pad(prompt_mask, (3, 0)),
        torch.nn.functional.pad(completion_ids, (0, 4), value=256),
        torch.nn.functional.pad(completion_mask, (0, 4)),
    )
    assert widened.shape == (3, completion_ids.shape[1] + 4)
    assert_close_to_scale(widened[:, : completion_ids.shape[1]], logps)
    assert (widened[:, completion_ids.shape[1] :] == 0).all()


def test_sharded_projection_falls_back_to_the_models_logits(tokenizer, monkeypatch):
    import grpo.objective.logprobs

    model = tiny_model(tokenizer).eval()
    _, _, batch = _batch()
    chunked, chunked_entropy = completion_logprobs(model, *batch, with_entropy=True)
    monkeypatch.setattr(grpo.objective.logprobs, "_is_sharded", lambda weight: True)
    full, full_entropy = completion_logprobs(model, *batch, with_entropy=True)
    assert_close_to_scale(full, chunked)
    assert_close_to_scale(full_entropy, chunked_entropy)


def test_lora_adapters_get_the_same_gradients_as_through_full_logits(tokenizer):
    peft = pytest.importorskip("peft", reason="the peft extra is not installed")
    torch.manual_seed(0)
    model = peft.get_peft_model(
        tiny_model(tokenizer), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    )
    prompts, completions, batch = _batch()
    logps, _ = completion_logprobs(model, *batch, temperature=0.7)
    logps.sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad()
    sum(e.sum() for e in _naive_model_logps(model, prompts, completions, 0.7)).backward()
    assert grads and all(g.abs().sum() > 0 for g in grads.values())
    for name, param in model.named_parameters():
        if param.requires_grad:
            assert_close_to_scale(grads[name], param.grad, name)


def test_unwrap_parallel_answers_as_accelerate_does(tokenizer):
    """The trainer unwraps its model several times a step with `unwrap_parallel`, which skips accelerate's package
    metadata lookups on a model that is not wrapped: the same answer as `extract_model_from_parallel` for a plain
    model, a PEFT model and a `torch.compile` wrapper (which accelerate keeps)."""
    from accelerate.utils import extract_model_from_parallel
    from peft import LoraConfig, get_peft_model

    from grpo.models import unwrap_parallel

    model = tiny_model(tokenizer)
    peft_model = get_peft_model(tiny_model(tokenizer), LoraConfig(r=2, target_modules=["q_proj"]))
    for candidate in (model, peft_model, torch.compile(model)):
        assert unwrap_parallel(candidate) is extract_model_from_parallel(candidate)
    assert unwrap_parallel(model) is model and unwrap_parallel(peft_model) is peft_model
