"""Faults that must not lose a run or poison its weights: non-finite rewards, loss terms and gradients
(`nonfinite`), rounds whose rewards are mostly missing, a disk that fills while a checkpoint is written, resuming
from a wrong or half-written checkpoint, and a new run started over an earlier one. Exact resume after SIGKILL is in
tests/test_resume.py."""

import json
import math
import os
import shutil
import warnings

import pytest
import torch
from datasets import Dataset
from transformers import TrainerCallback

from grpo import GRPOConfig, GRPOTrainer
from grpo.data import InputError, conversation_turns, cut_prompt, encode_prompts, render_prompt
from grpo.testing import tiny_model
from grpo.training.checkpoints import CheckpointError, newest_checkpoint, resolve_resume
from grpo.training.metrics import MetricsWindow, add_round_metrics
from grpo.training.nonfinite import (
    GradientGuard,
    LossRecord,
    NonFiniteError,
    gradients_finite,
    infinite_rewards,
    nonfinite_findings,
    nonfinite_message,
    reward_overflow_message,
    terms_finite,
)
from tests.helpers.losses import loss_with
from tests.helpers.scripted import TINY, ScriptedGeneration, reward_len
from tests.test_cli import run_grpo, write_tiny_recipe


def make_trainer(tmp_path, tokenizer, dataset, rewards, **kwargs):
    settings = {**TINY, "max_steps": 3, "learning_rate": 1e-2, **kwargs}
    args = GRPOConfig(output_dir=str(tmp_path / "out"), **settings)
    return GRPOTrainer(tiny_model(tokenizer), rewards, args=args, train_dataset=dataset, processing_class=tokenizer)


def params_of(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def inf_at_step(step):
    """A reward that returns +inf for row 1 once the trainer is at `step` (0-based optimizer steps)."""

    def overflowing(completions, trainer_state, **kwargs):
        hit = trainer_state.global_step == step
        return [math.inf if hit and i == 1 else float(len(c)) for i, c in enumerate(completions)]

    return overflowing


class PoisonLogits(TrainerCallback):
    """Makes the policy's last hidden states NaN during optimizer step `step` (1-based), the way an fp16 overflow would, and
    records the parameters after every step."""

    def __init__(self, model, step):
        self.step, self.active, self.after = step, False, {}
        model.model.norm.register_forward_hook(lambda m, i, out: out * math.nan if self.active and m.training else out)

    def on_step_begin(self, args, state, control, **kwargs):
        self.active = state.global_step + 1 == self.step

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.after[state.global_step] = params_of(model)


# ---- Non-finite rewards ----


def test_infinite_reward_stops_before_any_update(tmp_path, tokenizer, prompt_dataset):
    trainer = make_trainer(tmp_path, tokenizer, prompt_dataset, [reward_len, inf_at_step(1)])
    before = params_of(trainer.model)
    with pytest.raises(NonFiniteError) as caught:
        trainer.train()
    message = str(caught.value)
    assert "Reward function 'overflowing' returned inf for row 1" in message
    assert "before optimizer step 2" in message and "return None" in message and "nonfinite='skip'" in message
    assert trainer.state.global_step == 1  # step 1 trained, step 2 never applied
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
    assert any(not torch.equal(before[n], p) for n, p in trainer.model.named_parameters())


def test_infinite_reward_skipped_rows_are_unscored_and_counted(tmp_path, tokenizer, prompt_dataset):
    trainer = make_trainer(tmp_path, tokenizer, prompt_dataset, [inf_at_step(0)], nonfinite="skip", max_steps=2)
    trainer.train()
    first, second = trainer.state.log_history[0], trainer.state.log_history[1]
    assert first["nonfinite/reward_rows"] == 1 and "nonfinite/reward_rows" not in second
    assert math.isfinite(first["reward"]) and math.isfinite(first["loss"])
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())


@pytest.mark.parametrize("nonfinite", ["error", "skip"])
def test_reward_spread_overflowing_float32_is_an_error(tmp_path, tokenizer, prompt_dataset, nonfinite):
    def huge(completions):
        return [1e30 * len(c) for c in completions]

    trainer = make_trainer(tmp_path, tokenizer, prompt_dataset, [huge], nonfinite=nonfinite)
    with pytest.raises(NonFiniteError, match=r"spread overflows float32.*rewards reach .*Rescale the reward"):
        trainer.train()
    assert trainer.state.global_step == 0


def test_reward_checks_by_hand():
    rewards = torch.tensor([[1.0, math.nan], [-math.inf, 2.0], [0.0, math.inf]])
    assert infinite_rewards(rewards) == [(1, 0, -math.inf), (2, 1, math.inf)]
    assert infinite_rewards(torch.tensor([[1.0, math.nan]])) == []  # NaN marks an unscored row
    assert reward_overflow_message(torch.tensor([1.0, 2.0, math.nan, 4.0]), 2, step=0) is None
    assert "weighted sum" in reward_overflow_message(torch.tensor([1.0, math.inf, 3.0, 4.0]), 2, step=0)
    assert "spread overflows" in reward_overflow_message(torch.tensor([0.0, 3e19, 1.0, 2.0]), 2, step=4)


def test_a_round_with_mostly_missing_rewards_is_reported_by_name():
    """NaN marks an unscored row, not an error; but a round in which most rows are unscored by a function (or by
    every one) warns with the function's name and the fraction, and the fractions are logged every round."""
    lengths, truncated = torch.tensor([2, 4, 6, 8]), torch.zeros(4)
    columns = torch.tensor([[1.0, math.nan], [0.0, math.nan], [math.nan, math.nan], [math.nan, 2.0]])
    rewards = torch.tensor([1.0, 0.0, math.nan, 2.0])
    window = MetricsWindow()
    with pytest.warns(
        UserWarning,
        match=r"round of 4 rows are missing\. Rows unscored: by reward function 'fmt' 75%; by every function 25%",
    ):
        add_round_metrics(window, lengths, truncated, columns, rewards, ["acc", "fmt"], num_generations=2)
    logged = window.pop()
    assert logged["rewards/acc/unscored_ratio"] == 0.5 and logged["rewards/fmt/unscored_ratio"] == 0.75
    assert logged["frac_reward_unscored"] == 0.25
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # half is not most: no warning
        add_round_metrics(window, lengths, truncated, columns[:, :1], rewards, ["acc"], num_generations=2)


def test_mostly_unscored_rewards_warn_during_training(tmp_path, tokenizer, prompt_dataset):
    def rarely(completions):  # scores one row in four
        return [1.0 if i % 4 == 0 else None for i in range(len(completions))]

    trainer = make_trainer(tmp_path, tokenizer, prompt_dataset, [reward_len, rarely], max_steps=1)
    with pytest.warns(UserWarning, match=r"by reward function 'rarely' 75%; by every function 0%"):
        trainer.train()
    logged = trainer.state.log_history[0]
    assert logged["rewards/rarely/unscored_ratio"] == 0.75 and logged["rewards/reward_len/unscored_ratio"] == 0.0
    assert logged["frac_reward_unscored"] == 0.0


# ---- Non-finite gradients ----


def test_nonfinite_gradient_stops_with_weights_and_checkpoint_intact(tmp_path, tokenizer, prompt_dataset):
    trainer = make_trainer(tmp_path, tokenizer, prompt_dataset, [reward_len], save_strategy="steps", save_steps=1)
    poison = PoisonLogits(trainer.model, step=2)
    trainer.add_callback(poison)
    with pytest.raises(NonFiniteError) as caught:
        trainer.train()
    message = str(caught.value)
    assert "Non-finite gradients at optimizer step 2" in message and "logps" in message
    assert "weights and the last checkpoint are unchanged" in message and "nonfinite='skip'" in message
    for name, value in params_of(trainer.model).items():  # still the weights of step 1
        assert torch.equal(value, poison.after[1][name]), name
    assert newest_checkpoint(str(tmp_path / "out")).endswith("checkpoint-1")
    assert not (tmp_path / "out" / "checkpoint-2").exists()


def assert_step_2_skipped(trainer, after: dict[int, dict[str, torch.Tensor]]) -> None:
    """Of three steps, step 2 made no update and step 3 did (`after`: the parameters after each step)."""
    assert trainer.state.global_step == 3
    for name, value in after[2].items():
        assert torch.equal(value, after[1][name]), name
    assert any(not torch.equal(after[3][n], v) for n, v in after[2].items())


def test_nonfinite_gradient_step_is_skipped_and_counted(tmp_path, tokenizer, prompt_dataset):
    trainer = make_trainer(tmp_path, tokenizer, prompt_dataset, [reward_len], nonfinite="skip")
    poison = PoisonLogits(trainer.model, step=2)
    trainer.add_callback(poison)
    trainer.train()
    assert_step_2_skipped(trainer, poison.after)
    logged = {entry["step"]: entry for entry in trainer.state.log_history if "loss" in entry}
    assert logged[2]["nonfinite/skipped_steps"] == 1 and "nonfinite/skipped_steps" not in logged[3]


# ---- A non-finite loss with finite gradients (issue 37) ----


class InfiniteReference(TrainerCallback):
    """Makes the reference log-prob of one loss token (round row `row`, first completion token) -inf in the round
    generated for optimizer step `step` (1-based), as for a token the reference cannot produce: the KL term is then
    inf while its gradient, 1 - exp(ref - logp), stays finite. Records the parameters after every step."""

    def __init__(self, trainer, step, row):
        self.after = {}
        logprobs = trainer.rounds.logprobs  # the round maker's log-prob pass: it makes the reference's

        def with_minus_inf(model, batch, **kwargs):
            logps, entropy = logprobs(model, batch, **kwargs)
            if model is trainer.ref_model and trainer.state.global_step + 1 == step:
                logps = logps.clone()
                logps[row, 0] = -math.inf
            return logps, entropy

        trainer.rounds.logprobs = with_minus_inf
        trainer.add_callback(self)

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.after[state.global_step] = params_of(model)


def test_infinite_kl_stops_before_the_update_naming_term_and_row(tmp_path, tokenizer, prompt_dataset):
    # Two micro-steps per optimizer step (a round of 8 rows): round row 5 is row 1 of the second micro-batch. The
    # plain k3 term: its gradient at a -inf reference log-prob is finite (1 - exp(ref - logp) = 1) while its value is
    # inf, the case the loss check exists for; the bias-corrected term's gradient (log(pi / ref) = inf) is not.
    trainer = make_trainer(
        tmp_path,
        tokenizer,
        prompt_dataset,
        [reward_len],
        beta=0.04,
        use_bias_correction_kl=False,
        gradient_accumulation_steps=2,
        save_strategy="steps",
        save_steps=1,
    )
    poison = InfiniteReference(trainer, step=2, row=5)
    with pytest.raises(NonFiniteError) as caught:
        trainer.train()
    message = str(caught.value)
    assert "Non-finite loss at optimizer step 2 (its gradients were finite)" in message
    assert "kl = inf at row 1 (token 0) of micro-step 2 of 2" in message
    assert "reference log-prob of -inf" in message and "nonfinite='skip'" in message
    assert "weights and the last checkpoint are unchanged" in message
    for name, value in params_of(trainer.model).items():  # still the weights of step 1
        assert torch.equal(value, poison.after[1][name]), name
    assert newest_checkpoint(str(tmp_path / "out")).endswith("checkpoint-1")
    assert not (tmp_path / "out" / "checkpoint-2").exists()


def test_infinite_kl_step_is_skipped_counted_and_logged_as_it_was(tmp_path, tokenizer, prompt_dataset):
    trainer = make_trainer(tmp_path, tokenizer, prompt_dataset, [reward_len], beta=0.04, nonfinite="skip")
    poison = InfiniteReference(trainer, step=2, row=1)
    trainer.train()
    assert_step_2_skipped(trainer, poison.after)
    logged = {entry["step"]: entry for entry in trainer.state.log_history if "loss" in entry}
    # Not Trainer's logging_nan_inf_filter stand-in (the average of earlier losses, 0 at a window's first step).
    assert logged[2]["loss"] == math.inf and logged[2]["kl"] == math.inf
    assert logged[2]["nonfinite/skipped_steps"] == 1 and "nonfinite/skipped_steps" not in logged[3]
    assert math.isfinite(logged[3]["loss"]) and math.isfinite(logged[3]["kl"])


def loss_record(logps, old_logps=None, ref_logps=None, advantages=None, **settings):
    """`policy_loss` on one micro-batch of hand-made log-probs (every token a loss token), recorded as the trainer
    does; returns the loss (with its graph) and the record."""
    mask = torch.ones_like(logps)
    advantages = torch.ones(logps.shape[0]) if advantages is None else advantages
    loss, stats = loss_with(logps, old_logps, ref_logps, advantages, mask, **settings)
    level = settings.get("importance_sampling_level", "token")
    record = LossRecord(
        {"loss": loss.detach(), **stats}, logps.detach(), old_logps, ref_logps, advantages, mask, level
    )
    return loss, record


def named(records):
    """`nonfinite_findings` as (term, micro-step, row, token, value as text, rows): NaN == NaN as text."""
    return [(f.term, f.micro_step, f.row, f.token, str(f.value), f.rows) for f in nonfinite_findings(records)]


def test_nonfinite_loss_terms_are_named_by_term_row_and_micro_step():
    finite = loss_record(torch.tensor([[-0.1, -0.2], [-0.3, -0.4]]), beta=0.04, ref_logps=torch.zeros(2, 2))[1]
    assert terms_finite([finite]) and named([finite]) == []

    # A ratio that overflows float32: logp - old = 99.7 > 88.7 at row 1, token 0. With A < 0 the loss is inf;
    # with A > 0 the min() picks the clipped term, the loss stays finite and the gradient is NaN (0 * inf).
    logps, old = torch.tensor([[-0.1, -0.2], [-0.3, -0.4]]), torch.tensor([[-0.1, -0.2], [-100.0, -0.4]])
    loss, overflow = loss_record(logps, old, advantages=torch.tensor([1.0, -1.0]))
    assert loss == math.inf and not terms_finite([finite, overflow])
    logps.requires_grad_(True)
    loss, clipped = loss_record(logps, old, advantages=torch.tensor([1.0, 1.0]))
    loss.backward()
    assert math.isfinite(loss) and terms_finite([clipped]) and torch.isnan(logps.grad[1, 0])
    assert named([finite, clipped]) == [("ratio", 1, 1, 0, "inf", [1])]
    message = nonfinite_message(4, nonfinite_findings([finite, overflow]), True, False, micro_steps=2)
    assert message.startswith(
        "Non-finite loss at optimizer step 5 (its gradients were finite), on process 0: ratio = inf at row 1 "
        "(token 0) of micro-step 2 of 2. The step was not applied"
    )
    assert "exp(logp - old) overflowed" in message and "nonfinite='skip'" in message

    # A sequence-level ratio (GSPO) is one per row, named without a token; a NaN advantage makes the loss NaN.
    old = torch.tensor([[-0.1, -0.2], [-100.0, -100.0]])  # row 1's mean log-ratio: 99.65
    sequence = loss_record(logps.detach(), old, importance_sampling_level="sequence")[1]
    assert named([sequence]) == [("ratio", 0, 1, None, "inf", [1])]
    loss, nan_advantage = loss_record(logps.detach(), advantages=torch.tensor([0.5, math.nan]))
    assert math.isnan(loss) and named([nan_advantage]) == [("advantages", 0, 1, None, "nan", [1])]

    # A -inf reference log-prob: kl is inf at that token; a NaN policy log-prob is named as logps, not also as kl.
    ref = torch.tensor([[0.0, -math.inf], [0.0, 0.0]])
    kl = loss_record(torch.tensor([[-0.1, -0.2], [-0.3, -0.4]]), ref_logps=ref, beta=0.04)[1]
    assert named([kl]) == [("kl", 0, 0, 1, "inf", [0])]
    nan_logps = loss_record(torch.tensor([[-0.1, math.nan], [-0.3, -0.4]]), ref_logps=torch.zeros(2, 2), beta=0.04)[1]
    assert named([nan_logps]) == [("logps", 0, 0, 1, "nan", [0])]
    message = nonfinite_message(0, [], False, False, micro_steps=1, process=1)
    assert "Non-finite gradients at optimizer step 1, in the loss of another process than process 1" in message


class OneProcess:
    device, num_processes, process_index = torch.device("cpu"), 1, 0

    def reduce(self, tensor, reduction):
        return tensor


def test_the_loss_check_adds_no_device_read_per_micro_step():
    """On the good path the guard reads the device the same number of times however many micro-steps and terms it
    recorded: the loss terms' flag is read with the gradients' (on a GPU, each read is a wait for the device)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Reads(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Reads.count += func is torch.ops.aten._local_scalar_dense.default
            return func(*args, **(kwargs or {}))

    model = torch.nn.Linear(2, 2)
    model(torch.ones(1, 2)).sum().backward()
    record = loss_record(torch.tensor([[-0.1, -0.2]]), ref_logps=torch.zeros(1, 2), beta=0.04)[1]
    reads = []
    for micro_steps in (1, 8):
        guard = GradientGuard(OneProcess(), "error", metrics=None)
        for _ in range(micro_steps):
            guard.record(record)
        Reads.count = 0
        with Reads():
            guard.on_pre_optimizer_step(None, None, None, model=model)
        reads.append(Reads.count)
    assert reads[0] == reads[1] <= 2


# ---- Checkpoints ----


def test_full_disk_while_saving_keeps_the_previous_checkpoint(tmp_path, tokenizer, prompt_dataset, monkeypatch):
    trainer = make_trainer(tmp_path, tokenizer, prompt_dataset, [reward_len], save_strategy="steps", save_steps=1)
    save = trainer._save_optimizer_and_scheduler

    def fill_disk(output_dir):
        if output_dir.endswith("checkpoint-2"):
            # What torch.save reports when the disk fills up mid-write.
            raise RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 512 vs 0 basic_ios::clear")
        save(output_dir)

    monkeypatch.setattr(trainer, "_save_optimizer_and_scheduler", fill_disk)
    with pytest.raises(CheckpointError) as caught:
        trainer.train()
    message = str(caught.value)
    assert "Writing checkpoint-2" in message and "most likely a full disk" in message and "MiB free" in message
    assert "checkpoint-1, is intact" in message and "resume_from_checkpoint=True" in message
    out = tmp_path / "out"
    assert sorted(os.listdir(out)) == ["checkpoint-1"]  # nothing of checkpoint 2 left behind

    monkeypatch.undo()
    resumed = make_trainer(tmp_path, tokenizer, prompt_dataset, [reward_len], save_strategy="steps", save_steps=1)
    resumed.train(resume_from_checkpoint=True)
    assert resumed.state.global_step == 3 and newest_checkpoint(str(out)).endswith("checkpoint-3")


def test_new_run_over_an_earlier_runs_checkpoints_is_refused(tmp_path, tokenizer, prompt_dataset):
    make_trainer(tmp_path, tokenizer, prompt_dataset, [reward_len], save_strategy="steps", save_steps=1).train()
    again = make_trainer(tmp_path, tokenizer, prompt_dataset, [reward_len], save_strategy="steps", save_steps=1)
    with pytest.raises(InputError, match=r"already holds checkpoints .*checkpoint-3.*resume_from_checkpoint=True"):
        again.train()
    assert sorted(os.listdir(tmp_path / "out")) == ["checkpoint-1", "checkpoint-2", "checkpoint-3"]


def test_resume_arguments(tmp_path):
    out = tmp_path / "out"
    (out / "checkpoint-2").mkdir(parents=True)
    (out / "checkpoint-2" / "trainer_state.json").write_text("{}")
    (out / "checkpoint-5").mkdir()  # cut short: no trainer_state.json
    (out / "tmp-checkpoint-6" / "checkpoint-6").mkdir(parents=True)
    (out / "tmp-checkpoint-6" / "checkpoint-6" / "trainer_state.json").write_text("{}")
    # check=False: these directories only look like checkpoints (their files: tests/test_checkpoint_faults.py)
    assert resolve_resume(True, str(out), check=False) == str(out / "checkpoint-2")
    assert resolve_resume("true", str(out), check=False) == str(out / "checkpoint-2")
    assert resolve_resume("false", str(out)) is None and resolve_resume(None, str(out)) is None
    with pytest.raises(InputError, match=r"not a complete checkpoint .*newest complete checkpoint beside it is"):
        resolve_resume(str(out / "checkpoint-5"), str(out))
    with pytest.raises(InputError, match=r"is not a directory"):
        resolve_resume(str(out / "checkpoint-9"), str(out))
    with pytest.raises(InputError, match=r"holds no complete checkpoint.*start without resume_from_checkpoint"):
        resolve_resume(True, str(tmp_path / "empty"))


# ---- The command line ----


@pytest.mark.slow
def test_grpo_train_resumes_and_refuses_to_overwrite(tmp_path, tiny_model_path):
    write_tiny_recipe(tmp_path, tiny_model_path)
    saving = ["--save_strategy", "steps", "--save_steps", "1"]
    first = run_grpo("train", "tiny.yaml", "--max_steps", "2", *saving, cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]

    again = run_grpo("train", "tiny.yaml", "--max_steps", "4", *saving, cwd=tmp_path)
    assert again.returncode == 2
    assert "already holds checkpoints of an earlier run (checkpoint-1, checkpoint-2)" in again.stderr
    assert "--resume_from_checkpoint true" in again.stderr

    resumed = run_grpo(
        "train", "tiny.yaml", "--max_steps", "4", *saving, "--resume_from_checkpoint", "true", cwd=tmp_path
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resuming from {os.path.join('out', 'checkpoint-2')}" in resumed.stdout
    state = json.loads((tmp_path / "out" / "trainer_state.json").read_text())
    assert state["global_step"] == 4
    assert [e["step"] for e in state["log_history"] if "loss" in e] == [1, 2, 3, 4]  # steps 1-2 from the first run

    # The same job queued again: a finished run, left as it is (it used to train step 5 and replace the model).
    files = {p: p.read_bytes() for p in (tmp_path / "out").rglob("*") if p.is_file()}
    again = run_grpo(
        "train", "tiny.yaml", "--max_steps", "4", *saving, "--resume_from_checkpoint", "true", cwd=tmp_path
    )
    assert again.returncode == 0, again.stderr[-3000:]
    assert (
        again.stdout.strip()
        .splitlines()[-1]
        .startswith(
            f"grpo train: Nothing to train: {os.path.join('out', 'checkpoint-4')} is at step 4, the last step of this run"
        )
    )
    assert {p: p.read_bytes() for p in (tmp_path / "out").rglob("*") if p.is_file()} == files
    fewer = run_grpo(
        "train", "tiny.yaml", "--max_steps", "3", *saving, "--resume_from_checkpoint", "true", cwd=tmp_path
    )
    assert fewer.returncode == 2 and "it is at step 4, past this run's last step (max_steps=3)" in fewer.stderr


def test_grpo_train_refuses_the_models_own_folder_as_output_dir(tmp_path, tiny_model_path):
    # A copy of the model: a regression would write over it.
    model = tmp_path / "mymodel"
    shutil.copytree(tiny_model_path, model)
    write_tiny_recipe(tmp_path, model)
    files = {p.name: p.read_bytes() for p in model.iterdir()}
    for output_dir, where in [("mymodel", "is the folder"), (os.path.join("mymodel", "out"), "is inside the folder")]:
        result = run_grpo("train", "tiny.yaml", "--output_dir", output_dir, cwd=tmp_path)
        assert result.returncode == 2, result.stderr[-3000:]
        assert f"grpo train: error: output_dir '{output_dir}' {where} of the model being trained ({model})" in (
            result.stderr
        )
    assert {p.name: p.read_bytes() for p in model.iterdir()} == files


@pytest.mark.slow
def test_grpo_train_with_an_infinite_reward_saves_no_model(tmp_path, tiny_model_path):
    write_tiny_recipe(tmp_path, tiny_model_path)
    (tmp_path / "my_rewards.py").write_text(
        "def has_digit(completions, **kwargs):\n    return [1e308 * 10] * len(completions)\n"
    )
    result = run_grpo("train", "tiny.yaml", "--max_steps", "2", cwd=tmp_path)
    assert result.returncode == 1
    assert "grpo train: error: Reward function 'has_digit' returned inf for row 0" in result.stderr
    assert "model saved" not in result.stdout and not (tmp_path / "out" / "model.safetensors").exists()


def test_grpo_train_with_a_reward_that_exits_fails_naming_it(tmp_path, tiny_model_path):
    # sys.exit(0) in a reward function used to end `grpo train` with exit status 0, nothing saved or printed.
    write_tiny_recipe(tmp_path, tiny_model_path)
    (tmp_path / "my_rewards.py").write_text("import sys\n\ndef has_digit(completions, **kwargs):\n    sys.exit(0)\n")
    result = run_grpo("train", "tiny.yaml", "--max_steps", "2", cwd=tmp_path)
    assert result.returncode == 2  # a bug in the user's reward: one line, the exit status of every user mistake
    assert "Reward function 'has_digit' failed on row 0" in result.stderr and "Traceback" not in result.stderr
    assert "SystemExit: 0 (a reward function cannot end the run" in result.stderr
    assert "model saved" not in result.stdout and not (tmp_path / "out" / "model.safetensors").exists()


def test_gradients_finite_by_hand():
    finite, nan, inf = torch.tensor([1.0, -3e38]), torch.tensor([1.0, math.nan]), torch.tensor([-math.inf, 0.0])
    params = [torch.nn.Parameter(torch.zeros(2)) for _ in range(3)]
    assert gradients_finite(params)  # no gradients yet
    for p, g in zip(params, (finite, finite, finite)):
        p.grad = g
    assert gradients_finite(params)
    for bad in (nan, inf):
        params[1].grad = bad
        assert not gradients_finite(params)
    params[0].grad, params[2].grad = torch.tensor([math.inf, 0.0]), torch.tensor([-math.inf, 0.0])  # sum: NaN
    params[1].grad = finite
    assert not gradients_finite(params)


def test_gradients_finite_takes_the_exact_check_only_when_the_sum_is_not_finite(monkeypatch):
    """The cheap sum decides for ordinary gradients; the per-gradient max-norm runs only when the sum overflowed or
    is non-finite, and then decides exactly (finite float16 gradients whose sum overflows float16 stay finite)."""
    calls = []
    norm = torch.linalg.vector_norm
    monkeypatch.setattr(torch.linalg, "vector_norm", lambda *a, **k: calls.append(1) or norm(*a, **k))
    params = [torch.nn.Parameter(torch.zeros(4, dtype=torch.float16)) for _ in range(2)]
    for p in params:
        p.grad = torch.full((4,), 60000.0, dtype=torch.float16)  # their sum overflows float16, not float32
    assert gradients_finite(params) and not calls
    big = [torch.nn.Parameter(torch.zeros(2)) for _ in range(3)]
    for p in big:
        p.grad = torch.tensor([3e38, 3e38])  # finite, but their float32 sum overflows
    assert gradients_finite(big) and calls


# ---- Long prompts: cut on a chosen side, counted and warned about ----


def test_cut_prompt_by_hand():
    ids = list(range(10))
    assert cut_prompt(ids, 4, "left") == [6, 7, 8, 9]  # the end: the question
    assert cut_prompt(ids, 4, "right") == [0, 1, 2, 3]
    assert cut_prompt(ids, 10, "left") == ids  # not too long: untouched


SYSTEM = {"role": "system", "content": "Answer in one word."}


def few_shot(question: str, shots: int = 3) -> list[dict]:
    """A system message, `shots` worked examples as user/assistant turns, then the question."""
    turns = []
    for k in range(shots):
        turns += [{"role": "user", "content": f"Example {k}: " + "x" * 40}, {"role": "assistant", "content": f"{k}"}]
    return [SYSTEM, *turns, {"role": "user", "content": question}]


def test_conversation_turns_by_hand():
    user, answer, tool = ({"role": r, "content": r[0]} for r in ("user", "assistant", "tool"))
    assert conversation_turns([SYSTEM, user, answer, tool, answer, user]) == (
        [SYSTEM],
        [[user, answer, tool, answer], [user]],
    )
    assert conversation_turns([answer, user, answer]) == ([], [[answer], [user, answer]])  # a leading answer alone


def test_a_long_conversation_loses_whole_oldest_turns_never_part_of_one(tokenizer):
    prompt = few_shot("What is 2 + 2?")

    def length(messages):
        return len(tokenizer(render_prompt(messages, tokenizer), add_special_tokens=False)["input_ids"])

    for dropped in (1, 2, 3):
        kept = [SYSTEM, *prompt[1 + 2 * dropped :]]  # the system message and the turns after the dropped ones
        limit = length(kept)  # fits exactly, while one turn more does not
        (ids, short), cut = encode_prompts([prompt, "short"], tokenizer, limit, "left")
        assert cut == [dropped, 0]
        assert ids == tokenizer(render_prompt(kept, tokenizer), add_special_tokens=False)["input_ids"]
        assert short == tokenizer("short", add_special_tokens=False)["input_ids"]
        # truncation_side is for strings: a conversation loses its oldest turns on either side.
        assert encode_prompts([prompt], tokenizer, limit, "right") == ([ids], [dropped])
    whole = encode_prompts([prompt], tokenizer, None)[0][0]
    assert encode_prompts([prompt], tokenizer, len(whole)) == ([whole], [0])
    # The system message and the question alone do not fit: refused, named, with the fixes.
    too_short = length([SYSTEM, prompt[-1]]) - 1
    with pytest.raises(InputError, match=r"row 5: .*alone are \d+ tokens.*max_prompt_length=None") as caught:
        encode_prompts([prompt], tokenizer, too_short, names=["train_dataset row 5"])
    assert f"Raise max_prompt_length to at least {too_short + 1}" in str(caught.value)
    with pytest.raises(InputError, match=r"The prompt whose last message begins 'What is 2 \+ 2\?'"):
        encode_prompts([prompt], tokenizer, too_short)


def test_by_default_prompts_are_kept_whole_as_in_trl(tmp_path, tokenizer):
    # About 700 tokens of worked examples (byte-level tokenizer): the default used to cut them at 512.
    prompts = [few_shot(f"Question {i}: count to three.", shots=12) for i in range(4)]
    trainer = make_trainer(tmp_path, tokenizer, Dataset.from_dict({"prompt": prompts}), [reward_len])
    assert trainer.args.max_prompt_length is None
    rollout, _ = trainer.sample_round([trainer.train_dataset[0]] * 4, trainer.generation)
    whole = encode_prompts(prompts[:1], tokenizer, None)[0][0]
    assert len(whole) > 512
    assert rollout.prompt_ids[0][rollout.prompt_mask[0].bool()].tolist() == whole
    assert rollout.prompt_truncated.tolist() == [0] * 4


def test_a_conversation_no_cut_of_whole_turns_fits_is_refused_when_the_trainer_is_built(tmp_path, tokenizer):
    prompts = [few_shot("Short question?") for _ in range(4)]
    prompts[2] = few_shot("A long question: " + "y" * 300)  # its last turn alone is longer than the limit
    data = Dataset.from_dict({"prompt": prompts})
    with pytest.raises(InputError, match=r"train_dataset row 2: .*longer than max_prompt_length=200"):
        make_trainer(tmp_path, tokenizer, data, [reward_len], max_prompt_length=200)


def test_turns_cut_from_conversations_are_counted_and_warned_about_once(tmp_path, tokenizer):
    prompts = [few_shot(f"Question {i}: count to three.") for i in range(8)]
    limit = len(encode_prompts([[SYSTEM, *prompts[0][3:]]], tokenizer, None)[0][0])  # room for all but one turn
    data = Dataset.from_dict({"prompt": prompts})
    trainer = make_trainer(tmp_path, tokenizer, data, [reward_len], max_steps=2, max_prompt_length=limit)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    cut = [w for w in caught if f"longer than max_prompt_length={limit}" in str(w.message)]
    assert len(cut) == 1, [str(w.message) for w in caught]
    assert "lost their oldest whole turns (4 turns in all" in str(cut[0].message)  # 4 prompts a round, 1 turn each
    assert [e["prompts/turns_cut"] for e in trainer.state.log_history if "prompts/turns_cut" in e] == [1.0, 1.0]
    assert [e["prompts/truncated"] for e in trainer.state.log_history if "prompts/truncated" in e] == [1.0, 1.0]


def test_truncated_prompts_are_counted_and_warned_about_once(tmp_path, tokenizer):
    data = Dataset.from_dict({"prompt": [f"{'x' * 300} Question {i}: count to three." for i in range(8)]})
    trainer = make_trainer(tmp_path, tokenizer, data, [reward_len], max_steps=2, max_prompt_length=16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    cut = [w for w in caught if "longer than max_prompt_length=16" in str(w.message)]
    assert len(cut) == 1, [str(w.message) for w in caught]
    assert "were cut on the left" in str(cut[0].message) and "truncation_side" in str(cut[0].message)
    logged = [e["prompts/truncated"] for e in trainer.state.log_history if "prompts/truncated" in e]
    assert logged == [1.0, 1.0]  # every prompt of both rounds, though warned about only in the first


# ---- Evaluation sets (issue 38) ----


def test_an_empty_evaluation_set_is_refused_before_the_model_loads(tmp_path, prompt_dataset, monkeypatch):
    import grpo.training.trainer as trainer_module

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded before the evaluation set was checked")

    monkeypatch.setattr(trainer_module, "load_policy", no_load)
    args = GRPOConfig(output_dir=str(tmp_path / "out"), **TINY, eval_strategy="steps", eval_steps=2)
    with pytest.raises(InputError, match=r"The evaluation set is empty.*eval_dataset=None"):
        GRPOTrainer(
            "unused", [reward_len], args=args, train_dataset=prompt_dataset, eval_dataset=prompt_dataset.select([])
        )


def test_an_evaluation_set_smaller_than_one_batch_is_evaluated_as_in_trl(tmp_path, tokenizer, prompt_dataset):
    # TRL 1.16 trains and evaluates with 2 evaluation prompts, an evaluation batch of 3 and num_generations_eval=1;
    # this trainer used to refuse it when built.
    seen = []

    def recorded(prompts, completions, trainer_state, **kwargs):
        seen.append((trainer_state.global_step, sorted(p for p in prompts if p.startswith("Held"))))
        return [float(len(c)) for c in completions]

    held_out = Dataset.from_dict({"prompt": ["Held out 0", "Held out 1"]})
    settings = dict(per_device_eval_batch_size=3, num_generations_eval=1, eval_strategy="steps", eval_steps=1)
    args = GRPOConfig(output_dir=str(tmp_path / "out"), **{**TINY, "max_steps": 2, **settings})
    with pytest.warns(UserWarning, match=r"2 prompts make 0 evaluation batch\(es\) of 3 prompts .* shorter one of 2"):
        trainer = GRPOTrainer(
            tiny_model(tokenizer),
            recorded,
            args=args,
            train_dataset=prompt_dataset,
            eval_dataset=held_out,
            processing_class=tokenizer,
        )
    trainer.train()
    evaluated = [e for e in trainer.state.log_history if "eval_reward" in e]
    assert len(evaluated) == 2 and all(math.isfinite(e["eval_reward"]) for e in evaluated)
    assert [names for _, names in seen if names] == [["Held out 0", "Held out 1"]] * 2  # both, once each time


def test_an_uneven_last_evaluation_batch_counts_by_its_rows(tmp_path, tokenizer, prompt_dataset):
    # 5 prompts, 2 completions each, 4 rows a batch: batches of 4, 4 and 2 rows (the last prompt used to be dropped).
    batches = []

    def recorded(prompts, completions, **kwargs):
        # Different rewards within a group (its completions' lengths), so the policy loss of a batch is not 0.
        rewards = [10.0 * int(p.split()[-1]) + len(c) for p, c in zip(prompts, completions)]
        batches.append(rewards)
        return rewards

    held_out = Dataset.from_dict({"prompt": [f"Held out {i}" for i in range(5)]})
    args = GRPOConfig(output_dir=str(tmp_path / "out"), **TINY, num_generations_eval=2, per_device_eval_batch_size=4)
    with pytest.warns(UserWarning, match=r"last, shorter one of 1"):
        trainer = GRPOTrainer(
            tiny_model(tokenizer),
            recorded,
            args=args,
            train_dataset=prompt_dataset,
            eval_dataset=held_out,
            processing_class=tokenizer,
        )
    trainer.generation = ScriptedGeneration(2, 8)  # ragged lengths: a group's token-mean advantage is not 0
    losses = []
    compute_loss = trainer.compute_loss

    def recording_loss(model, inputs, *args, **kwargs):
        loss = compute_loss(model, inputs, *args, **kwargs)
        losses.append((float(loss), inputs.loss_mask.shape[0]))
        return loss

    trainer.compute_loss = recording_loss
    metrics = trainer.evaluate()
    assert [len(b) for b in batches] == [4, 4, 2]
    rewards = [r for b in batches for r in b]
    assert metrics["eval_reward"] == pytest.approx(sum(rewards) / len(rewards))  # every row counts once
    assert metrics["eval_reward"] != pytest.approx(sum(sum(b) / len(b) for b in batches) / 3)  # not per batch
    assert [rows for _, rows in losses] == [4, 4, 2]
    assert any(loss != 0 for loss, _ in losses)
    weighted = sum(loss * rows for loss, rows in losses) / sum(rows for _, rows in losses)
    assert metrics["eval_loss"] == pytest.approx(weighted, rel=1e-5, abs=1e-7)


def test_evaluation_batches_by_hand():
    from types import SimpleNamespace

    from grpo.data.sampler import eval_batches

    def args(per_device, generations, drop_last=False):
        return SimpleNamespace(
            per_device_eval_batch_size=per_device,
            eval_generations=generations,
            eval_name="num_generations_eval",
            dataloader_drop_last=drop_last,
        )

    # 2 processes x 2 rows a round; the last round (3 rows) split 1 / 2: nothing given twice, nothing left out.
    assert eval_batches(args(2, 1), 7, 0, 2) == [[0, 1], [4]]
    assert eval_batches(args(2, 1), 7, 1, 2) == [[2, 3], [5, 6]]
    assert eval_batches(args(3, 1), 2, 0, 1) == [[0, 1]]  # fewer prompts than one batch: one shorter batch
    assert eval_batches(args(2, 2), 3, 0, 2) == [[0, 0], [2]]  # a group of the last round spans the processes
    assert eval_batches(args(2, 2), 3, 1, 2) == [[1, 1], [2]]
    with pytest.raises(InputError, match=r"last batch holds 1 prompt\(s\) x num_generations_eval=1 = 1 rows for 2"):
        eval_batches(args(2, 1), 5, 0, 2)  # one row cannot feed two processes
    # dataloader_drop_last (TrainingArguments'): the last, shorter batch is dropped, as it asks.
    assert eval_batches(args(2, 1, drop_last=True), 7, 1, 2) == [[2, 3]]
    assert eval_batches(args(2, 1, drop_last=True), 5, 0, 2) == [[0, 1]]
    with pytest.raises(InputError, match=r"dataloader_drop_last=True drops that shorter batch, leaving nothing"):
        eval_batches(args(3, 1, drop_last=True), 2, 0, 1)


def test_num_generations_eval_samples_that_many_completions_per_evaluation_prompt(tmp_path, tokenizer, prompt_dataset):
    seen = []

    def recorded(prompts, completions, **kwargs):
        seen.append(list(prompts))
        return [float(len(c)) for c in completions]

    held_out = Dataset.from_dict({"prompt": [f"Held out {i}" for i in range(4)]})
    # G = 4 in training; 2 per prompt in evaluation, 4 rows a batch: 2 prompts a batch, 2 batches.
    args = GRPOConfig(output_dir=str(tmp_path / "out"), **TINY, num_generations_eval=2, per_device_eval_batch_size=4)
    trainer = GRPOTrainer(
        tiny_model(tokenizer),
        recorded,
        args=args,
        train_dataset=prompt_dataset,
        eval_dataset=held_out,
        processing_class=tokenizer,
    )
    metrics = trainer.evaluate()
    assert [[p.split()[-1] for p in batch] for batch in seen] == [["0", "0", "1", "1"], ["2", "2", "3", "3"]]
    assert math.isfinite(metrics["eval_reward"]) and "eval_reward_std" in metrics
    # An evaluation batch that cannot hold whole groups of num_generations_eval is refused with the config.
    with pytest.raises(ValueError, match=r"is not a multiple of num_generations_eval=3: .*Change "):
        GRPOConfig(output_dir=str(tmp_path / "o"), **TINY, num_generations_eval=3, eval_strategy="steps")
