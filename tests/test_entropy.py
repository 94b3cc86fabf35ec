"""Entropy regularisation (docs/method.md, "Entropy regularisation"): the entropy's gradient through the chunked
projection (grpo/objective/logprobs.py), the bonus in `policy_loss` against the naive loop, Skywork-OR1's adaptive
coefficient (grpo/objective/regularizers.py), and the trainer logging and applying it."""

import math

import pytest
import torch
from datasets import Dataset

from grpo import GRPOConfig, GRPOTrainer
from grpo.objective.logprobs import chunked_logprobs, completion_logprobs
from grpo.objective.loss import spans_the_step
from grpo.objective.loss_types import LOSS_TYPES
from grpo.objective.regularizers import EntropyControl, adaptive_entropy_coef
from grpo.testing import tiny_model
from tests.helpers.compare import assert_close_to_scale
from tests.helpers.losses import loss_with
from tests.helpers.naive import naive_policy_loss

F64 = dict(rtol=0, atol=1e-11)
LEVEL_ERRORS = {("luspo", "token"), ("vespo", "sequence")}  # combinations GRPOConfig refuses


# ---- The entropy's gradient through the chunked projection ----


def _full_logits(hidden, weight, targets, bias=None, temperature=1.0, scale=1.0, softcap=None):
    """The full (N, V) logits, then log-softmax and H = -sum_v p_v log p_v by the textbook formula."""
    z = torch.nn.functional.linear(hidden, weight, bias) * scale
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    log_p = torch.log_softmax(z / temperature, -1)
    return log_p.gather(-1, targets[:, None]).squeeze(-1), -(log_p.exp() * log_p).sum(-1)


def _projection_case(dtype, use_bias):
    g = torch.Generator().manual_seed(0)
    num_rows, hidden_size, vocab = 23, 16, 97  # 23 rows in chunks of 5: the last chunk is ragged
    hidden = torch.randn(num_rows, hidden_size, generator=g, dtype=dtype).requires_grad_(True)
    weight = torch.randn(vocab, hidden_size, generator=g, dtype=dtype).requires_grad_(True)
    bias = torch.randn(vocab, generator=g, dtype=dtype).requires_grad_(True) if use_bias else None
    targets = torch.randint(0, vocab, (num_rows,), generator=g)
    # A loss reading both outputs, as policy_loss with a bonus does: weights of either sign, a masked row (4).
    logp_weights, entropy_weights = torch.randn(num_rows, generator=g), torch.randn(num_rows, generator=g)
    logp_weights[4] = entropy_weights[4] = 0.0
    return hidden, weight, bias, targets, logp_weights.to(dtype), entropy_weights.to(dtype)


SETTINGS = [dict(), dict(temperature=0.7, bias=True), dict(scale=0.25, softcap=3.0, temperature=0.9)]


@pytest.mark.parametrize("settings", SETTINGS, ids=["plain", "temperature+bias", "scale+softcap"])
def test_chunked_entropy_gradient_equals_full_logits_in_float64(settings):
    settings = dict(settings)
    hidden, weight, bias, targets, a, b = _projection_case(torch.float64, settings.pop("bias", False))
    inputs = [hidden, weight] + ([bias] if bias is not None else [])
    logps, entropy = chunked_logprobs(
        hidden, weight, targets, bias=bias, chunk_size=5, with_entropy=True, entropy_grad=True, **settings
    )
    grads = torch.autograd.grad((a * logps + b * entropy).sum(), inputs)
    want_logps, want_entropy = _full_logits(hidden, weight, targets, bias=bias, **settings)
    want_grads = torch.autograd.grad((a * want_logps + b * want_entropy).sum(), inputs, retain_graph=True)

    assert logps.dtype == entropy.dtype == torch.float64
    torch.testing.assert_close(logps, want_logps, rtol=0, atol=1e-12)
    torch.testing.assert_close(entropy, want_entropy, rtol=0, atol=1e-12)
    for got, want in zip(grads, want_grads):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-10)
    assert grads[0][4].abs().max() == 0  # the masked row gets no gradient
    # A loss of the entropy alone (the log-probs unread): the backward gets no log-prob gradient and still agrees.
    _, entropy = chunked_logprobs(
        hidden, weight, targets, bias=bias, chunk_size=5, with_entropy=True, entropy_grad=True, **settings
    )
    (alone,) = torch.autograd.grad((b * entropy).sum(), [hidden])
    (want_alone,) = torch.autograd.grad((b * want_entropy).sum(), [hidden])
    torch.testing.assert_close(alone, want_alone, rtol=0, atol=1e-10)
    assert alone.abs().max() > 1e-3


def test_chunked_entropy_gradient_in_float32_against_float64():
    hidden, weight, _, targets, a, b = _projection_case(torch.float64, False)
    h32, w32 = hidden.detach().float().requires_grad_(True), weight.detach().float().requires_grad_(True)
    logps, entropy = chunked_logprobs(h32, w32, targets, chunk_size=5, with_entropy=True, entropy_grad=True)
    grads = torch.autograd.grad((a.float() * logps + b.float() * entropy).sum(), [h32, w32])
    want_logps, want_entropy = _full_logits(hidden, weight, targets)
    want_grads = torch.autograd.grad((a * want_logps + b * want_entropy).sum(), [hidden, weight])
    for got, want in zip(grads, want_grads):
        assert_close_to_scale(got, want.float())


def test_entropy_has_no_gradient_unless_asked():
    hidden, weight, _, targets, _, _ = _projection_case(torch.float32, False)
    _, entropy = chunked_logprobs(hidden, weight, targets, chunk_size=5, with_entropy=True)
    assert not entropy.requires_grad
    _, entropy = chunked_logprobs(hidden, weight, targets, chunk_size=5, with_entropy=True, entropy_grad=True)
    assert entropy.requires_grad


@pytest.mark.parametrize("path", ["chunked", "padding_free", "full_logits"])
def test_completion_entropy_gradient_reaches_the_model_as_through_full_logits(tokenizer, path, monkeypatch):
    """Through the model, padded rows and all: the bonus's gradient on every parameter equals the one of the model's
    own full logits, on the chunked path, the packed one, and the full-logits fallback (ZeRO-3, adapted heads)."""
    import grpo.objective.logprobs

    torch.manual_seed(0)
    model = tiny_model(tokenizer).double()
    prompt_ids = torch.tensor([[256, 5, 6, 7], [8, 9, 10, 11]])
    prompt_mask = (prompt_ids != 256).long()
    completion_ids = torch.tensor([[20, 21, 22], [30, 256, 256]])
    completion_mask = (completion_ids != 256).long()
    if path == "full_logits":
        monkeypatch.setattr(grpo.objective.logprobs, "_is_sharded", lambda weight: True)
    logps, entropy = completion_logprobs(
        model, prompt_ids, prompt_mask, completion_ids, completion_mask, temperature=0.7, with_entropy=True,
        entropy_grad=True, padding_free=path == "padding_free",
    )  # fmt: skip
    (0.3 * logps.sum() + entropy.sum()).backward()
    got = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()

    ids = torch.cat([prompt_ids, completion_ids], 1)
    mask = torch.cat([prompt_mask, completion_mask], 1)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(1) - 1).clamp(min=0)).logits
    log_p = torch.log_softmax(logits[:, 3:-1] / 0.7, -1)  # positions predicting the completion tokens
    want_logps = log_p.gather(-1, completion_ids[..., None]).squeeze(-1) * completion_mask
    want_entropy = -(log_p.exp() * log_p).sum(-1) * completion_mask
    (0.3 * want_logps.sum() + want_entropy.sum()).backward()
    for name, param in [("entropy", entropy), *model.named_parameters()]:
        want = want_entropy if name == "entropy" else param.grad
        have = entropy if name == "entropy" else got[name]
        if path == "full_logits":  # the fallback's log-softmax runs in float32 whatever the model's dtype
            assert_close_to_scale(have.float(), want.float(), name)
        else:
            torch.testing.assert_close(have, want, rtol=0, atol=1e-9, msg=name)


# ---- The bonus in the loss, against the naive loop ----


def _random_case(seed, B=6, T=7):
    g = torch.Generator().manual_seed(seed)
    f64 = dict(generator=g, dtype=torch.float64)
    logps = (-torch.rand(B, T, **f64) * 3).requires_grad_(True)
    old = logps.detach() + torch.randn(B, T, **f64) * 0.3
    ref = logps.detach() + torch.randn(B, T, **f64) * 0.5
    entropy = (torch.rand(B, T, **f64) * 4).requires_grad_(True)
    advantages = torch.randn(B, **f64)  # rows 0-1, 2-3, 4-5: three groups of two
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    lengths[2] = 0  # a row with no loss tokens
    mask = (torch.arange(T)[None, :] < lengths[:, None]).long()  # right padding
    return logps, old, ref, entropy, advantages, mask


def _knobs(loss_type):
    return dict(
        epsilon_high=1.2 if loss_type == "cispo" else 0.28,
        importance_sampling_level="sequence" if loss_type == "luspo" else "token",
    )


# Every loss type at the levels it is defined at (luspo: sequence only, vespo: token only).
LEVELS = [(t, level) for t in LOSS_TYPES for level in ("token", "sequence") if (t, level) not in LEVEL_ERRORS]


@pytest.mark.parametrize("loss_type, level", LEVELS)
@pytest.mark.parametrize("masked", [False, True])
def test_entropy_bonus_matches_naive_loop(loss_type, level, masked):
    for seed in range(3):
        logps, old, ref, entropy, advantages, mask = _random_case(seed)
        keep = torch.rand(mask.shape, generator=torch.Generator().manual_seed(seed)) < 0.6 if masked else None
        knobs = _knobs(loss_type)
        expected = naive_policy_loss(
            logps, old, ref, advantages, mask, loss_type, 0.04, 0.2, knobs["epsilon_high"], max_len=9,
            normalizer=17.0, level=level, policy_mask=keep, bias_correction_kl=True, entropy=entropy,
            entropy_coef=0.03,
        )  # fmt: skip
        want = torch.autograd.grad(expected, [logps, entropy])
        loss, _ = loss_with(
            logps, old, ref, advantages, mask, loss_type=loss_type, beta=0.04, epsilon_high=knobs["epsilon_high"],
            importance_sampling_level=level, policy_mask=keep, max_completion_length=9, normalizer=17.0,
            bias_correction_kl=True, entropy=entropy, entropy_coef=0.03,
        )  # fmt: skip
        got = torch.autograd.grad(loss, [logps, entropy])
        torch.testing.assert_close(loss, expected, **F64)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, **F64)
        assert got[1].abs().max() > 1e-4  # the bonus does reach the entropy


def test_entropy_bonus_hand_worked():
    # One row of two loss tokens and a padding token, on-policy, A = 0: only the bonus is left.
    # H = [1.0, 3.0, 9.0 (padding)], c = 0.1: grpo's loss = -c * (1 + 3) / 2 = -0.2, dL/dH = [-0.05, -0.05, 0];
    # dr_grpo over B * L = 1 * 4: -c * 4 / 4 = -0.1; luspo's row sum: -c * 4 = -0.4.
    logps = torch.tensor([[-1.0, -2.0, -3.0]], dtype=torch.float64)
    entropy = torch.tensor([[1.0, 3.0, 9.0]], dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[1, 1, 0]])
    zero = torch.zeros(1, dtype=torch.float64)
    for loss_type, expected in (("grpo", -0.2), ("dr_grpo", -0.1), ("luspo", -0.4)):
        level = "sequence" if loss_type == "luspo" else "token"
        loss, _ = loss_with(
            logps, None, None, zero, mask, loss_type=loss_type, entropy=entropy, entropy_coef=0.1,
            max_completion_length=4, importance_sampling_level=level,
        )  # fmt: skip
        assert loss.item() == pytest.approx(expected, abs=1e-15)
    (grad,) = torch.autograd.grad(loss_with(logps, None, None, zero, mask, loss_type="grpo", entropy=entropy,
                                              entropy_coef=0.1)[0], entropy)  # fmt: skip
    assert grad[0].tolist() == pytest.approx([-0.05, -0.05, 0.0], abs=1e-15)


def test_entropy_bonus_is_weighted_by_the_sampler_correction():
    logps, old, ref, entropy, advantages, mask = _random_case(4)
    weights = 0.5 + torch.rand(mask.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    expected = naive_policy_loss(logps, old, ref, advantages, mask, "dapo", 0.04, 0.2, 0.2, sampling_weights=weights,
                                 entropy=entropy, entropy_coef=0.05)  # fmt: skip
    loss, _ = loss_with(logps, old, ref, advantages, mask, beta=0.04, sampling_weights=weights, entropy=entropy,
                          entropy_coef=0.05)  # fmt: skip
    torch.testing.assert_close(loss, expected, **F64)
    torch.testing.assert_close(torch.autograd.grad(loss, entropy)[0], torch.autograd.grad(expected, entropy)[0], **F64)


def _accumulated(loss_type, logps, old, ref, entropy, advantages, mask, num_micro):
    """Loss and gradients as the trainer accumulates them over `num_micro` micro-batches of one optimizer step."""
    rows, total = logps.shape[0] // num_micro, 0
    for k in range(num_micro):
        s = slice(k * rows, (k + 1) * rows)
        loss, _ = loss_with(
            logps[s], old[s], ref[s], advantages[s], mask[s], loss_type=loss_type, beta=0.04,
            max_completion_length=7, normalizer=mask.sum(), entropy=entropy[s], entropy_coef=0.02,
            **_knobs(loss_type),
        )  # fmt: skip
        total = total + (loss if spans_the_step(loss_type) else loss / num_micro)
    return total.detach(), torch.autograd.grad(total, [logps, entropy])


@pytest.mark.parametrize("loss_type", [t for t in LOSS_TYPES if t != "bnpo"])  # bnpo: not invariant by design
def test_entropy_bonus_is_accumulation_invariant(loss_type):
    case = _random_case(3, B=8)
    one_loss, one_grads = _accumulated(loss_type, *case, 1)
    for num_micro in (2, 4, 8):
        loss, grads = _accumulated(loss_type, *case, num_micro)
        torch.testing.assert_close(loss, one_loss, **F64)
        for g, w in zip(grads, one_grads):
            torch.testing.assert_close(g, w, **F64)


def test_entropy_bonus_needs_the_entropy():
    logps, old, ref, _, advantages, mask = _random_case(0)
    with pytest.raises(ValueError, match="entropy_coef != 0 needs the per-token entropy"):
        loss_with(logps, old, ref, advantages, mask, entropy_coef=0.1)


# ---- Adaptive control (Skywork-OR1) ----


def naive_adaptive_coefficients(entropies, coef, target, delta, low, high):
    """The coefficient each step applies, and the coefficient after it, step by step from the rule in
    docs/method.md: applied only after a step whose entropy was at or below the target."""
    applied, after, last = [], [], math.inf
    for h in entropies:
        applied.append(coef if last <= target else 0.0)
        coef = min(coef + delta, high) if h <= target else max(coef - delta, low)
        after.append(coef)
        last = h
    return applied, after


def test_adaptive_entropy_coef_hand_worked():
    rule = dict(target=0.2, delta=0.005, minimum=0.0, maximum=0.012)
    assert adaptive_entropy_coef(0.01, 0.1, **rule) == pytest.approx(0.012)  # 0.015 capped at the maximum
    assert adaptive_entropy_coef(0.01, 0.2, **rule) == pytest.approx(0.012)  # at the target: up
    assert adaptive_entropy_coef(0.01, 0.3, **rule) == pytest.approx(0.005)
    assert adaptive_entropy_coef(0.003, 0.3, **rule) == 0.0  # floored at the minimum


def _micro_batch(seed, B=4, T=5):
    g = torch.Generator().manual_seed(seed)
    entropy = torch.rand(B, T, generator=g) * 0.4
    mask = (torch.rand(B, T, generator=g) < 0.7).long()
    return entropy, mask


class FakeAccelerator:
    """What `EntropyControl.observe` reads of an accelerator: whether this micro-batch ends the optimizer step, and
    the sum over processes (here `processes` of them, each with the same sums)."""

    def __init__(self, processes=1):
        self.processes, self.sync_gradients, self.reductions = processes, True, 0

    def reduce(self, tensor, reduction):
        assert reduction == "sum"
        self.reductions += 1
        return self.processes * tensor


def test_adaptive_control_follows_the_rule_over_micro_batches_and_processes():
    """Steps of 3 micro-batches: H_k is the token mean over all of them (a mean of means would differ), and a
    `reduce` that adds another process's equal sums leaves it unchanged; the coefficients are the naive loop's."""
    control = EntropyControl(0.01, True, target=0.2, delta=0.004, minimum=0.002, maximum=0.02)
    accelerator = FakeAccelerator(processes=2)
    step_entropies, applied = [], []
    for step in range(6):
        applied.append(control.coefficient)
        total, tokens = 0.0, 0
        for k in range(3):
            entropy, mask = _micro_batch(10 * step + k)
            entropy = entropy + (0.15 if step % 3 == 0 else 0.0)  # some steps above the target
            total, tokens = total + (entropy * mask).sum().item(), tokens + mask.sum().item()
            accelerator.sync_gradients = k == 2
            logged = control.observe(entropy, mask, None, accelerator)
            assert logged == (control.coef if k == 2 else None)
        step_entropies.append(total / tokens)
        assert control.last_entropy == pytest.approx(step_entropies[-1], rel=1e-6)
    want_applied, want_after = naive_adaptive_coefficients(step_entropies, 0.01, 0.2, 0.004, 0.002, 0.02)
    assert applied == pytest.approx(want_applied, abs=1e-15)
    assert control.coef == pytest.approx(want_after[-1], abs=1e-15)
    assert any(h > 0.2 for h in step_entropies) and any(h <= 0.2 for h in step_entropies)
    assert applied[0] == 0.0 and any(a > 0 for a in applied)


def test_adaptive_control_measures_only_the_tokens_the_policy_term_trains():
    entropy = torch.tensor([[0.1, 5.0, 0.3]])
    control = EntropyControl(0.0, True, target=0.2)
    control.observe(entropy, torch.tensor([[1, 1, 1]]), torch.tensor([[True, False, True]]), FakeAccelerator())
    assert control.last_entropy == pytest.approx(0.2)


def test_fixed_coefficient_and_state():
    fixed = EntropyControl(0.05)
    accelerator = FakeAccelerator()
    assert fixed.observe(torch.ones(1, 2), torch.ones(1, 2), None, accelerator) == 0.05
    assert accelerator.reductions == 0  # a fixed coefficient needs no measurement
    assert EntropyControl(0.0).observe(torch.ones(1, 2), torch.ones(1, 2), None, accelerator) is None
    assert fixed.enabled and fixed.coefficient == 0.05 and fixed.coef == 0.05
    assert not EntropyControl(0.0).enabled and EntropyControl(0.0, True).enabled
    control = EntropyControl(0.01, True, target=0.5)
    control.observe(torch.full((1, 2), 0.25), torch.ones(1, 2), None, FakeAccelerator())
    restored = EntropyControl(0.01, True, target=0.5)
    restored.load_state_dict(control.state_dict())
    assert restored.state_dict() == control.state_dict() == {"coef": 0.015, "last_entropy": 0.25}
    assert restored.coefficient == 0.015
    # A fixed coefficient is the config's on resume, whatever a checkpoint holds: it saves nothing and loads nothing.
    assert fixed.state_dict() is None
    fixed.load_state_dict({"coef": 0.2, "last_entropy": 0.1})
    assert fixed.coef == 0.05


# ---- Configuration ----


@pytest.mark.parametrize(
    "settings, message",
    [
        (dict(entropy_coef=-0.1), "entropy_coef=-0.1 must be >= 0"),
        (dict(entropy_coef_min=0.5, entropy_coef_max=0.1), "entropy_coef_min=0.5 is above entropy_coef_max=0.1"),
        (dict(entropy_coef_delta=0.0), "entropy_coef_delta=0.0 must be > 0"),
        (dict(entropy_target=-1.0), "entropy_target=-1.0 must be >= 0"),
        (dict(use_adaptive_entropy=True, entropy_coef=2.0), "outside \\[entropy_coef_min, entropy_coef_max\\]"),
        (dict(router_aux_loss_coef=-0.01), "router_aux_loss_coef=-0.01 must be >= 0"),
    ],
)
def test_misuse_is_refused_at_construction(tmp_path, settings, message):
    with pytest.raises(ValueError, match=message):
        GRPOConfig(output_dir=str(tmp_path), **settings)


# ---- In the trainer ----


def _train(tokenizer, tmp_path, **settings):
    torch.manual_seed(0)
    args = GRPOConfig(
        output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none", logging_steps=1, save_strategy="no",
        per_device_train_batch_size=4, num_generations=4, max_completion_length=6, max_steps=3, learning_rate=1e-2,
        seed=3, disable_tqdm=True, **settings,
    )  # fmt: skip
    dataset = Dataset.from_dict({"prompt": [f"Count {i}." for i in range(8)]})
    trainer = GRPOTrainer(
        tiny_model(tokenizer), lambda completions: [float(len(c) % 3) for c in completions], args=args,
        train_dataset=dataset, processing_class=tokenizer,
    )  # fmt: skip
    trainer.train()
    return trainer, [entry for entry in trainer.state.log_history if "loss" in entry]


@pytest.mark.slow
def test_trainer_logs_and_moves_the_adaptive_coefficient(tokenizer, tmp_path):
    # The tiny random model's entropy is about log(V) = 5.6 nats: a target of 10 is above it, so the coefficient
    # rises by delta every step, from the second step on the bonus applies.
    trainer, logs = _train(
        tokenizer, tmp_path, use_adaptive_entropy=True, entropy_coef=0.0, entropy_target=10.0, entropy_coef_delta=0.1
    )
    assert [entry["entropy_coef"] for entry in logs] == pytest.approx([0.1, 0.2, 0.3])
    assert trainer.step_loss.entropy_control.last_entropy == pytest.approx(logs[-1]["entropy"], rel=1e-5)


@pytest.mark.slow
def test_trainer_without_the_bonus_logs_no_coefficient(tokenizer, tmp_path):
    _, logs = _train(tokenizer, tmp_path)
    assert logs and all("entropy_coef" not in entry for entry in logs)


@pytest.mark.slow
def test_the_bonus_changes_the_update(tokenizer, tmp_path):
    plain, _ = _train(tokenizer, tmp_path / "plain")
    bonus, logs = _train(tokenizer, tmp_path / "bonus", entropy_coef=0.5)
    assert [entry["entropy_coef"] for entry in logs] == [0.5, 0.5, 0.5]
    moved = [not torch.equal(a, b) for a, b in zip(plain.model.parameters(), bonus.model.parameters())]
    assert all(moved)  # every parameter, the head included, gets the bonus's gradient
