"""`use_liger_kernel=True` (grpo/objective/liger.py): Liger's fused linear GRPO loss against this library's
`policy_loss` on the chunked log-probs, loss and gradients, for every option Liger covers; the same update through the
trainer; what falls back to this library's path and the one line saying so; the refusals (an adapter on lm_head,
Liger's fused linear cross-entropy). Liger's GRPO loss is plain torch, so the comparisons run on a CPU; they skip
where liger-kernel is not installed (`make install` installs it). The last test, on the GPU tier, runs Liger compiled
with its layer kernels."""

import logging
import os

import pytest
import torch
from datasets import Dataset

from grpo import GRPOConfig, GRPOTrainer
from grpo.objective import liger
from grpo.objective.liger import LigerStepLoss, fused_policy_loss, loss_module
from grpo.objective.logprobs import chunked_logprobs
from grpo.objective.loss import policy_loss
from grpo.objective.settings import LossSettings
from grpo.objective.step_loss import StepContext, StepLoss
from grpo.rollout import MicroBatch
from grpo.testing import tiny_model, tiny_tokenizer
from tests.helpers.compare import assert_close_to_scale, assert_same_update
from tests.helpers.scripted import TINY, reward_len, sgd_step_update

needs_liger = pytest.mark.skipif(
    not liger.installed("liger_kernel"), reason="needs liger-kernel (`pip install --no-deps liger-kernel`)"
)


def micro_batch(rows=4, width=6, vocab=13, beta=0.0, seed=0):
    """A micro-batch with ragged completions, a loss mask narrower than the completion mask (a tool's output
    token), and pi_old and pi_ref log-probs far enough from the policy's that ratios leave the clipping range."""
    g = torch.Generator().manual_seed(seed)
    completion_mask = torch.ones(rows, width)
    completion_mask[1, 4:], completion_mask[3, 2:] = 0, 0
    loss_mask = completion_mask.clone()
    loss_mask[2, 1] = 0
    real = completion_mask.bool()
    return MicroBatch(
        prompt_ids=torch.zeros(rows, 1, dtype=torch.long),
        prompt_mask=torch.ones(rows, 1),
        completion_ids=torch.randint(0, vocab, (rows, width), generator=g),
        completion_mask=completion_mask,
        loss_mask=loss_mask,
        advantages=torch.randn(rows, generator=g),
        ref_logps=torch.where(real, -3 * torch.rand(rows, width, generator=g), 0.0) if beta else None,
        old_logps=torch.where(real, -3 * torch.rand(rows, width, generator=g), 0.0),
    )


# Every option Liger's loss covers, each in a case of its own (max_completion_length: dr_grpo's constant; cispo's cap
# is its epsilon_high).
CASES = [
    *[dict(loss_type=t, beta=b) for t in ("grpo", "bnpo", "dr_grpo", "dapo", "sapo", "vespo") for b in (0.0, 0.1)],
    dict(loss_type="cispo", epsilon_high=5.0),
    dict(loss_type="cispo", epsilon_high=5.0, beta=0.1),
    dict(loss_type="luspo", importance_sampling_level="sequence"),
    dict(loss_type="grpo", importance_sampling_level="sequence", beta=0.1),
    dict(loss_type="dapo", epsilon_low=0.1, epsilon_high=0.3, delta=1.5, beta=0.1, bias_correction_kl=True),
    dict(loss_type="sapo", term_knobs={"sapo_temperature_pos": 0.5, "sapo_temperature_neg": 2.0}),
    dict(loss_type="vespo", term_knobs={"vespo_k_pos": 1.0, "vespo_lambda_neg": 4.0}),
    dict(loss_type="dapo", normalizer=30.0),  # the step's tokens / P
    dict(loss_type="dapo", sampling=True),  # the sampler's correction weights (without a KL term)
    dict(loss_type="vespo", sampling=True),
]


@needs_liger
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_liger_loss_and_gradients_equal_ours(case):
    case = dict(case)
    normalizer, sampling, temperature = case.pop("normalizer", None), case.pop("sampling", False), 0.7
    settings = LossSettings(max_completion_length=6, **case)
    batch = micro_batch(beta=settings.beta)
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(int(batch.completion_mask.sum()), 8, generator=g).requires_grad_()  # (N, H)
    weight = (0.5 * torch.randn(13, 8, generator=g)).requires_grad_()  # (V, H)
    weights = 0.5 + torch.rand(4, 6, generator=g) if sampling else None

    # Ours: the chunked log-probs of the same hidden states, then policy_loss.
    mask = batch.completion_mask.bool()
    values, _ = chunked_logprobs(hidden, weight, batch.completion_ids[mask], temperature=temperature)
    logps = values.new_zeros(mask.shape).masked_scatter(mask, values)
    want, _ = policy_loss(
        logps, batch.old_logps, batch.ref_logps, batch.advantages, batch.loss_mask, settings,
        sampling_weights=weights, normalizer=normalizer,
    )  # fmt: skip
    want_grads = torch.autograd.grad(want, [hidden, weight])

    module = loss_module(settings, temperature)
    got = fused_policy_loss(module, hidden, weight, None, batch, batch.old_logps, weights, normalizer)
    got_grads = torch.autograd.grad(got, [hidden, weight])
    assert all(g.abs().max() > 1e-5 for g in want_grads)  # a loss that trains something
    assert_close_to_scale(got, want, "loss")
    assert_close_to_scale(got_grads[0], want_grads[0], "hidden states' gradient")
    assert_close_to_scale(got_grads[1], want_grads[1], "head's gradient")


def count_liger_calls(monkeypatch) -> list:
    """The Liger loss modules the trainers built from now on make, each counting its calls in `calls` (so that a
    test knows Liger's loss trained, not the plain path)."""
    built, make = [], liger.loss_module

    def counted_module(*args, **kwargs):
        module = make(*args, **kwargs)
        module.calls, forward = 0, module.forward

        def counted(*inputs, **options):
            module.calls += 1
            return forward(*inputs, **options)

        module.forward = counted
        built.append(module)
        return module

    monkeypatch.setattr(liger, "loss_module", counted_module)
    return built


@needs_liger
@pytest.mark.parametrize(
    "config",
    [
        # dapo normalised over a step of two micro-batches, with a KL term
        dict(loss_type="dapo", beta=0.04, per_device_train_batch_size=2, gradient_accumulation_steps=2),
        # replays: the first pass records pi_old for the second (from Liger's pass, which returns no log-probs)
        pytest.param(
            dict(
                loss_type="grpo",
                num_iterations=2,
                steps_per_generation=4,
                per_device_train_batch_size=2,
                gradient_accumulation_steps=2,
                max_steps=2,
            ),  # fmt: skip
            marks=pytest.mark.slow,
        ),
    ],
    ids=["dapo-accumulated", "grpo-replayed"],
)
def test_a_liger_run_makes_the_same_updates_and_logs_the_same_metrics(tmp_path, monkeypatch, config):
    want, reference = sgd_step_update(tmp_path / "ours", **config)
    built = count_liger_calls(monkeypatch)
    got, trainer = sgd_step_update(tmp_path / "liger", use_liger_kernel=True, **config)
    assert isinstance(trainer.step_loss, LigerStepLoss)
    assert len(built) == 1 and built[0].calls == trainer.state.global_step * config["gradient_accumulation_steps"]
    steps = config.get("max_steps", 1)
    assert_same_update(got, want, dict(reference.model.named_parameters()), steps=steps, what="liger")
    for got_logs, want_logs in zip(trainer.state.log_history[:steps], reference.state.log_history[:steps]):
        for name in ("entropy", "clip_ratio/region_mean", "clip_ratio/low_mean", "clip_ratio/high_mean", "kl"):
            assert (name in got_logs) == (name in want_logs), name
            if name in want_logs:
                assert got_logs[name] == pytest.approx(want_logs[name], rel=1e-4, abs=1e-6), name


def liger_args(tmp_path, **config):
    return GRPOConfig(output_dir=str(tmp_path / "out"), use_liger_kernel=True, **{**TINY, **config})


def make_trainer(args, model=None, **kwargs):
    tokenizer = tiny_tokenizer()
    model = tiny_model(tokenizer) if model is None else model
    dataset = Dataset.from_dict({"prompt": [f"Question {i}: count to three." for i in range(4)]})
    return GRPOTrainer(model, reward_len, args=args, train_dataset=dataset, processing_class=tokenizer, **kwargs)


@needs_liger
def test_where_the_layer_kernels_cannot_run_trainer_gets_a_copy_without_them(tmp_path, caplog):
    args = liger_args(tmp_path)
    with caplog.at_level(logging.WARNING, logger="grpo.objective.liger"):
        trainer = make_trainer(args)
    kernels = liger.layer_kernels_reason(trainer.accelerator.device)
    lines = [r.getMessage() for r in caplog.records if r.name == "grpo.objective.liger"]
    assert len(lines) == 1 and "through Liger's fused linear GRPO loss" in lines[0], lines
    assert args.use_liger_kernel is True  # the caller's config is left as it is
    assert trainer.args.use_liger_kernel is (kernels is None)  # Trainer would fail importing kernels that cannot run
    if kernels is not None:
        assert trainer.args is not args and f"layer kernels are not applied, since {kernels}" in lines[0]
    assert isinstance(trainer.step_loss, LigerStepLoss)


@pytest.mark.parametrize(
    "config, lacks",
    [
        (dict(top_entropy_quantile=0.5), "top_entropy_quantile=0.5"),
        (dict(off_policy_mask_threshold=0.5), "off_policy_mask_threshold"),
        (dict(entropy_coef=0.01), "entropy bonus"),
        (dict(loss_type="luspo", importance_sampling_level="sequence", beta=0.1), "luspo"),
        (dict(cast_lm_head_to_fp32=True), "cast_lm_head_to_fp32"),
    ],
)
def test_an_option_liger_lacks_runs_our_path_with_one_line_naming_it(tmp_path, caplog, config, lacks):
    if not liger.installed("liger_kernel"):
        pytest.skip("without liger-kernel the line names the package instead (the next test)")
    with caplog.at_level(logging.WARNING, logger="grpo.objective.liger"):
        trainer = make_trainer(liger_args(tmp_path, **config))
    lines = [r.getMessage() for r in caplog.records if r.name == "grpo.objective.liger"]
    assert len(lines) == 1 and lacks in lines[0] and "this library's chunked log-probs" in lines[0], lines
    assert type(trainer.step_loss) is StepLoss


def test_without_the_package_one_line_says_what_runs_and_training_works(tmp_path, caplog, monkeypatch):
    monkeypatch.setattr(liger, "installed", lambda package: False)
    args = liger_args(tmp_path, max_steps=1)
    with caplog.at_level(logging.WARNING, logger="grpo.objective.liger"):
        trainer = make_trainer(args)
    lines = [r.getMessage() for r in caplog.records if r.name == "grpo.objective.liger"]
    assert len(lines) == 1, lines
    assert "liger-kernel is not installed (pip install 'grpo[liger]')" in lines[0]
    assert "this library's chunked log-probs" in lines[0] and "layer kernels are not applied" in lines[0]
    assert type(trainer.step_loss) is StepLoss and trainer.args.use_liger_kernel is False
    trainer.train()  # Trainer, given use_liger_kernel=True, would stop at train() on the missing package
    assert trainer.state.global_step == 1


def test_a_micro_batch_liger_cannot_take_runs_our_path_said_once(caplog):
    """Per-token advantages (process rewards, turn credit): the plain pass and loss, one line for the run."""
    settings = LossSettings(loss_type="grpo")

    class Processes:
        num_processes, sync_gradients, is_main_process = 1, True, True

        def gather(self, tensor):
            return tensor

        def reduce(self, tensor, reduction="sum"):
            return tensor

    step = LigerStepLoss(settings, Processes(), 0.0, module=None, logprobs=None)  # Liger's module is never reached
    batch = micro_batch()
    batch.advantages = torch.randn(4, 6)  # (B, T)
    logps = -torch.rand(4, 6, requires_grad=True)

    def pass_(model, batch, with_entropy, **extra):
        return logps, torch.zeros(4, 6)

    context = StepContext(True, 1, 0)
    with caplog.at_level(logging.WARNING, logger="grpo.objective.liger"):
        for _ in range(2):
            got_logps, result = step.run(pass_, None, batch, context)
    lines = [r.getMessage() for r in caplog.records if r.name == "grpo.objective.liger"]
    assert lines == ["use_liger_kernel=True: a micro-batch with per-token advantages (process rewards, turn credit) "
                     "runs this library's loss path."]  # fmt: skip
    want = StepLoss(settings, Processes())(logps, torch.zeros(4, 6), None, batch, context)
    assert got_logps is logps and torch.equal(result.loss, want.loss)


def test_fused_linear_cross_entropy_is_refused_and_turned_off(tmp_path):
    with pytest.raises(
        ValueError, match=r"fused_linear_cross_entropy.*GRPO has none.*Leave fused_linear_cross_entropy"
    ):
        liger_args(tmp_path, liger_kernel_config={"fused_linear_cross_entropy": True})
    with pytest.raises(ValueError, match="must be a dict of Liger kernel names"):
        liger_args(tmp_path, liger_kernel_config=["rms_norm"])
    # Liger's default turns it on: off here, as in TRL 1.16; the other kernels as the user set them.
    args = liger_args(tmp_path, liger_kernel_config={"rms_norm": False})
    assert args.liger_kernel_config == {"rms_norm": False, "fused_linear_cross_entropy": False}
    plain = GRPOConfig(output_dir=str(tmp_path / "out"), **TINY)
    assert plain.liger_kernel_config is None  # nothing changes without use_liger_kernel


def test_a_lora_adapter_on_lm_head_is_refused_at_construction(tmp_path):
    peft = pytest.importorskip("peft", reason="needs peft")
    config = peft.LoraConfig(r=4, target_modules=["q_proj", "lm_head"], task_type="CAUSAL_LM")
    with pytest.raises(ValueError, match="a PEFT adapter targets the head.*Remove lm_head from the adapter's"):
        make_trainer(liger_args(tmp_path), peft_config=config)
    # Without lm_head among its targets, the adapter and Liger go together.
    make_trainer(liger_args(tmp_path), peft_config=peft.LoraConfig(r=4, target_modules=["q_proj"]))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.skipif(not liger.installed("triton"), reason="needs Triton (liger-kernel's layer kernels)")
@needs_liger
def test_on_a_gpu_liger_runs_compiled_with_its_layer_kernels(tmp_path):
    # float32 and Liger's layer kernels off for the comparison, so the loss is all that differs.
    config = dict(use_cpu=False, bf16=False, loss_type="dapo", beta=0.04, per_device_train_batch_size=2,
                  gradient_accumulation_steps=2)  # fmt: skip
    want, reference = sgd_step_update(tmp_path / "ours", **config)
    kernels_off = {"rope": False, "rms_norm": False, "swiglu": False, "cross_entropy": False}
    got, trainer = sgd_step_update(
        tmp_path / "liger", use_liger_kernel=True, liger_kernel_config=kernels_off, **config
    )
    assert isinstance(trainer.step_loss, LigerStepLoss) and trainer.step_loss.module.compiled
    assert_same_update(got, want, dict(reference.model.named_parameters()), what="liger on cuda")
    # With its layer kernels (Trainer applies them at train()), a step trains every parameter, finite.
    update, trainer = sgd_step_update(tmp_path / "kernels", use_liger_kernel=True, **config)
    assert trainer.args.use_liger_kernel is True
    assert all(torch.isfinite(u).all() and u.abs().sum() > 0 for u in update.values())


def test_ci_has_liger():
    # Without this, a CI whose install lost liger-kernel would skip the comparisons above and still go green.
    if not os.environ.get("CI"):
        pytest.skip("only enforced under CI=1; locally the comparisons skip when liger-kernel is missing")
    assert liger.installed("liger_kernel"), "CI must have liger-kernel: `make install` installs it"
