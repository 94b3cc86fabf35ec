"""Checkpoints and output directories that explain themselves: each file of a checkpoint checked before a resume,
settings the restored state overrides listed, one run per output_dir, and a final model saved whole or not at all.
The faults are those of a fault injector (issue 29): truncated or garbage files, bad JSON, missing weights, NaN
weights, a missing RNG state, two runs in one folder, a full disk at the final save."""

import errno
import os
import re
import shutil
import subprocess
import sys
import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import TrainerCallback

from grpo import GRPOConfig, GRPOTrainer
from grpo.data import InputError
from grpo.testing import tiny_model, tiny_tokenizer
from grpo.training.checkpoint_checks import CheckpointFileError, checkpoint_problem
from grpo.training.checkpoints import CheckpointError, resolve_resume
from grpo.training.output_dir import LOCK_FILE
from tests.helpers.scripted import TINY, reward_len

PROMPTS = {"prompt": [f"Question {i}: count to three." for i in range(16)]}


def prompts_data():
    from datasets import Dataset

    return Dataset.from_dict(PROMPTS)


def make_trainer(output_dir, **kwargs):

    tokenizer = tiny_tokenizer()
    settings = {**TINY, "max_steps": 2, "learning_rate": 1e-2, "save_strategy": "steps", "save_steps": 1, **kwargs}
    args = GRPOConfig(output_dir=str(output_dir), **settings)
    return GRPOTrainer(
        tiny_model(tokenizer), reward_len, args=args, train_dataset=prompts_data(), processing_class=tokenizer
    )


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A two-step run with checkpoint-1 and checkpoint-2 (each test copies it before damaging it)."""
    out = tmp_path_factory.mktemp("run") / "out"
    torch.manual_seed(0)
    make_trainer(out).train()
    return out


@pytest.fixture
def run_copy(finished_run, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(finished_run, out)
    return out


def truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def garbage(path):
    path.write_bytes(b"\x00\xffnot this file" * 37)


def nan_weights(path):
    weights = load_file(path)
    name = sorted(weights)[0]
    weights[name].view(-1)[0] = torch.nan
    save_file(weights, path)


FAULTS = [
    ("model.safetensors", truncate, r"model.safetensors is cut short or not a safetensors file"),
    ("model.safetensors", garbage, r"model.safetensors is cut short or not a safetensors file"),
    ("model.safetensors", os.remove, r"has no weights file \(model.safetensors or adapter_model.safetensors\)"),
    ("model.safetensors", nan_weights, r"model.safetensors holds non-finite weights \(1 NaN or inf values in "),
    ("optimizer.pt", truncate, r"optimizer.pt is cut short or not a file written by torch.save"),
    ("optimizer.pt", garbage, r"optimizer.pt is cut short"),
    ("grpo_state_0.pt", garbage, r"grpo_state_0.pt is cut short or not a file written by torch.save"),
    ("grpo_state_0.pt", truncate, r"grpo_state_0.pt is cut short"),
    ("trainer_state.json", lambda p: p.write_text('{"global_step": 2,'), r"trainer_state.json is not valid JSON"),
]


@pytest.mark.parametrize(
    "name, damage, problem", FAULTS, ids=[f"{name}-{getattr(d, '__name__', 'bad')}" for name, d, _ in FAULTS]
)
def test_a_damaged_checkpoint_file_is_named_with_the_intact_checkpoint(run_copy, name, damage, problem):
    damage(run_copy / "checkpoint-2" / name)
    trainer = make_trainer(run_copy, max_steps=3)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    with pytest.raises(CheckpointFileError) as caught:
        trainer.train(resume_from_checkpoint=True)
    message = str(caught.value)
    assert message.startswith(f"Cannot resume from {run_copy / 'checkpoint-2'}: ") and "\n" not in message
    assert re.search(problem, message), message
    assert f"The newest intact checkpoint is {run_copy / 'checkpoint-1'}: resume from it" in message
    assert all(torch.equal(p, before[n]) for n, p in trainer.model.named_parameters())  # nothing was loaded
    assert not (run_copy / LOCK_FILE).exists()  # the lock is released on the way out


def test_grpo_train_finds_a_damaged_checkpoint_before_any_weight_loads(run_copy):
    # `grpo train --resume_from_checkpoint true` resolves (and so checks) the checkpoint before loading the model.
    truncate(run_copy / "checkpoint-2" / "grpo_state_0.pt")
    with pytest.raises(CheckpointFileError, match=r"checkpoint-2: grpo_state_0.pt is cut short .*checkpoint-1"):
        resolve_resume("true", str(run_copy))
    assert resolve_resume("true", str(run_copy), check=False) == str(run_copy / "checkpoint-2")


def test_with_no_intact_checkpoint_the_error_says_to_start_again(run_copy):
    shutil.rmtree(run_copy / "checkpoint-1")
    garbage(run_copy / "checkpoint-2" / "optimizer.pt")
    with pytest.raises(CheckpointFileError, match=r"optimizer.pt .*No other checkpoint beside it is intact"):
        make_trainer(run_copy, max_steps=3).train(resume_from_checkpoint=str(run_copy / "checkpoint-2"))


def test_a_missing_rng_state_warns_that_resume_is_not_exact(run_copy):
    os.remove(run_copy / "checkpoint-2" / "rng_state.pth")
    trainer = make_trainer(run_copy, max_steps=3)
    with pytest.warns(UserWarning, match=r"checkpoint-2 has no rng_state.pth .* will not match a run that was never"):
        trainer.train(resume_from_checkpoint=True)
    assert trainer.state.global_step == 3


def test_settings_the_restored_state_overrides_are_listed(run_copy):
    trainer = make_trainer(run_copy, max_steps=3, learning_rate=1e-3, seed=7, lr_scheduler_type="cosine")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train(resume_from_checkpoint=True)
    changed = [str(w.message) for w in caught if "with changed settings" in str(w.message)]
    assert len(changed) == 1, [str(w.message) for w in caught]
    assert "learning_rate=0.01 (now 0.001): the restored optimizer and scheduler keep" in changed[0]
    assert "seed=42 (now 7): the data order of the epoch in progress changes" in changed[0]
    assert "lr_scheduler_type='linear' (now 'cosine')" in changed[0]
    assert "weight_decay" not in changed[0]  # unchanged settings are not listed
    # Resumed again (from checkpoint-3, which the run above wrote) with the same settings: nothing to list.
    unchanged = make_trainer(run_copy, max_steps=4, learning_rate=1e-3, seed=7, lr_scheduler_type="cosine")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        unchanged.train(resume_from_checkpoint=True)
    assert not [w for w in caught if "with changed settings" in str(w.message)]


# ---- One run per output_dir ----


class LockSeen(TrainerCallback):
    def __init__(self, path):
        self.path, self.owner = path, None

    def on_step_end(self, args, state, control, **kwargs):
        self.owner = self.path.read_text() if self.path.exists() else None


def test_a_second_run_into_a_running_runs_output_dir_is_refused(tmp_path):
    out = tmp_path / "out"
    running = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        out.mkdir()
        lock = f'{{"host": "{os.uname().nodename}", "pid": {running.pid}, "started": "2026-11-27 01:00:00"}}'
        (out / LOCK_FILE).write_text(lock)
        with pytest.raises(InputError) as caught:
            make_trainer(out).train()
        message = str(caught.value)
        assert f"is in use by another run (pid {running.pid} on " in message and "started 2026-11-27" in message
        assert "Wait for it to finish or use another output_dir" in message and "free space" not in message
        assert (out / LOCK_FILE).read_text() == lock  # the live run's lock is left alone
    finally:
        running.kill()
        running.wait()
    # Its process gone, the lock is stale: taken over with a warning, held while training, removed at the end.
    trainer = make_trainer(out, max_steps=1)
    seen = LockSeen(out / LOCK_FILE)
    trainer.add_callback(seen)
    with pytest.warns(UserWarning, match=rf"Taking over .*: the run that held it \(pid {running.pid}\) is no longer"):
        trainer.train()
    assert f'"pid": {os.getpid()}' in seen.owner
    assert not (out / LOCK_FILE).exists()


def test_a_new_run_over_a_finished_runs_model_is_refused(tmp_path):
    out = tmp_path / "out"
    first = make_trainer(out, max_steps=1, save_strategy="no")
    first.train()
    first.save_model()
    with pytest.raises(InputError, match=r"already holds the model of an earlier run \(model.safetensors\)"):
        make_trainer(out, max_steps=1, save_strategy="no").train()


# ---- The final save ----


def test_a_full_disk_at_the_final_save_writes_nothing_and_can_be_retried(tmp_path, monkeypatch):
    out = tmp_path / "out"
    trainer = make_trainer(out, max_steps=1, save_strategy="no")
    trainer.train()
    save = trainer._save

    def disk_fills(output_dir, state_dict=None):
        trainer.model.config.save_pretrained(output_dir)  # what save_pretrained writes before the weights
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(trainer, "_save", disk_fills)
    with pytest.raises(CheckpointError) as caught:
        trainer.save_model()
    message = str(caught.value)
    assert f"Saving the trained model to {out} failed: the disk is full (" in message and "MiB free" in message
    assert "Nothing was written there" in message and f"call trainer.save_model('{out}') again" in message
    assert "no checkpoint was kept (save_strategy)" in message
    assert sorted(os.listdir(out)) == []  # no config.json without weights, no staging folder

    monkeypatch.setattr(trainer, "_save", save)
    trainer.save_model()  # the weights were kept in memory: the same call succeeds once there is space
    assert {"config.json", "model.safetensors"} <= set(os.listdir(out)) and "tmp-final-model" not in os.listdir(out)
    saved = load_file(out / "model.safetensors")
    assert all(torch.equal(saved[n], p.detach()) for n, p in trainer.model.named_parameters() if n in saved)


@pytest.mark.parametrize("sharded", ["pytorch_model_fsdp_0", "global_step2"])
def test_fsdp_and_deepspeed_weights_are_not_taken_for_missing_ones(tmp_path, sharded):
    (tmp_path / "trainer_state.json").write_text("{}")
    (tmp_path / sharded).mkdir()  # the weights as FSDP (sharded state dict) or DeepSpeed keep them
    assert checkpoint_problem(str(tmp_path)) is None
    (tmp_path / sharded).rmdir()
    assert checkpoint_problem(str(tmp_path)).startswith("has no weights file")


# ---- Where a run writes, and resuming at or past the end (issue 38) ----


def test_an_output_dir_in_the_models_own_folder_is_refused_before_any_weight_loads(tiny_model_path, monkeypatch):
    import grpo.training.trainer as trainer_module

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded before output_dir was checked")

    monkeypatch.setattr(trainer_module, "load_policy", no_load)
    files = {name: (tiny_model_path / name).read_bytes() for name in os.listdir(tiny_model_path)}
    for output_dir, where in [(tiny_model_path, "is the folder"), (tiny_model_path / "out", "is inside the folder")]:
        args = GRPOConfig(output_dir=str(output_dir), **TINY)
        with pytest.raises(InputError) as caught:
            GRPOTrainer(str(tiny_model_path), reward_len, args=args, train_dataset=prompts_data())
        message = str(caught.value)
        assert f"output_dir '{output_dir}' {where} of the model being trained ({tiny_model_path})" in message
        assert f"Use an output_dir outside it, e.g. '{tiny_model_path}-GRPO'" in message
    monkeypatch.undo()
    # A model loaded from that folder is known by its path too.
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    args = GRPOConfig(output_dir=str(tiny_model_path), **TINY)
    with pytest.raises(InputError, match=r"is the folder of the model being trained"):
        GRPOTrainer(loaded, reward_len, args=args, train_dataset=prompts_data(), processing_class=tiny_tokenizer())
    assert {name: (tiny_model_path / name).read_bytes() for name in os.listdir(tiny_model_path)} == files


def test_a_reward_that_changes_the_working_directory_cannot_move_the_run(tmp_path, monkeypatch):
    # A reward that works in a scratch folder of its own (and never changes back), with a relative output_dir: every
    # checkpoint, the completions log and the final model stay in the folder output_dir named when the run began.
    monkeypatch.chdir(tmp_path)
    calls = []

    def wandering(completions, **kwargs):
        scratch = tmp_path / "scratch" / str(len(calls))
        scratch.mkdir(parents=True)
        os.chdir(scratch)
        calls.append(scratch)
        return [float(len(c)) for c in completions]

    tokenizer = tiny_tokenizer()
    settings = {**TINY, "max_steps": 3, "save_strategy": "steps", "save_steps": 1, "log_completions": True}
    args = GRPOConfig(output_dir="out", **settings)
    trainer = GRPOTrainer(
        tiny_model(tokenizer), wandering, args=args, train_dataset=prompts_data(), processing_class=tokenizer
    )
    assert trainer.args.output_dir == str(tmp_path / "out")
    trainer.train()
    trainer.save_model()
    assert len(calls) == 3 and os.getcwd() == str(calls[-1])  # the reward did move the process
    out = set(os.listdir(tmp_path / "out"))
    assert {"checkpoint-1", "checkpoint-2", "checkpoint-3", "completions.jsonl", "model.safetensors"} <= out
    assert [p for p in (tmp_path / "scratch").rglob("*") if p.is_file()] == []


class LearningRates(TrainerCallback):
    """The learning rate of each optimizer step, read from the optimizer as it steps."""

    def __init__(self):
        self.rates = {}

    def on_pre_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        self.rates[state.global_step + 1] = optimizer.param_groups[0]["lr"]


def test_a_finished_run_resumed_again_trains_nothing_and_writes_nothing(run_copy):
    # A re-queued job: the same settings (max_steps=2) and resume_from_checkpoint=True on a finished run.
    listing = sorted(os.listdir(run_copy))
    trainer = make_trainer(run_copy)
    rates = LearningRates()
    trainer.add_callback(rates)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = trainer.train(resume_from_checkpoint=True)
    messages = [str(w.message) for w in caught if "Nothing to train" in str(w.message)]
    assert messages == [
        f"Nothing to train: {run_copy / 'checkpoint-2'} is at step 2, the last step of this run (max_steps=2), so "
        "the run is finished; its model and checkpoints are left as they are. Raise max_steps to train further."
    ]
    assert rates.rates == {} and result.global_step == 2 and trainer.state.global_step == 2
    assert sorted(os.listdir(run_copy)) == listing  # no checkpoint-3, no lock left behind
    # The trainer holds the finished weights, so a save_model() after it writes them, not the base model's.
    saved = load_file(run_copy / "checkpoint-2" / "model.safetensors")
    assert all(torch.equal(saved[n], p.detach()) for n, p in trainer.model.named_parameters() if n in saved)


def test_resuming_with_a_max_steps_below_the_checkpoints_step_is_an_error(run_copy):
    with pytest.raises(InputError) as caught:
        make_trainer(run_copy, max_steps=1).train(resume_from_checkpoint=True)
    assert str(caught.value) == (
        f"Cannot resume from {run_copy / 'checkpoint-2'}: it is at step 2, past this run's last step (max_steps=1). "
        "Set max_steps above 2 to train further, or resume from the checkpoint of an earlier step "
        "(resume_from_checkpoint='.../checkpoint-N')."
    )
    assert sorted(os.listdir(run_copy)) == ["checkpoint-1", "checkpoint-2"]


def test_extending_a_finished_linear_run_continues_the_schedule_of_the_new_max_steps(run_copy):
    # The 2-step run decayed linearly from 1e-2 to 0 at step 2. Extended to 4 steps, steps 3 and 4 train at the
    # rates of a 4-step linear schedule, 1e-2 x (4 - 2) / 4 and 1e-2 x (4 - 3) / 4 (they used to be 0, then 2.5e-3).
    trainer = make_trainer(run_copy, max_steps=4)
    rates = LearningRates()
    trainer.add_callback(rates)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train(resume_from_checkpoint=True)
    assert rates.rates == {3: pytest.approx(5e-3, rel=1e-12), 4: pytest.approx(2.5e-3, rel=1e-12)}
    said = [str(w.message) for w in caught if "the learning rate follows" in str(w.message)]
    assert said == [
        f"Resuming {run_copy / 'checkpoint-2'} at step 2 (its run was 2 steps long): the learning rate follows this "
        "run's schedule (linear, 4 steps) from step 2 on, as a run started with these settings would, so step 3 "
        "trains at 0.005 instead of the checkpoint's 0."
    ]


def test_a_plain_resume_leaves_the_learning_rate_alone(run_copy):
    # Unchanged settings: the restored optimizer already holds the schedule's rate, and nothing is said.
    shutil.rmtree(run_copy / "checkpoint-2")
    trainer = make_trainer(run_copy)
    rates = LearningRates()
    trainer.add_callback(rates)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train(resume_from_checkpoint=True)
    assert rates.rates == {2: pytest.approx(5e-3, rel=1e-12)}
    assert not [w for w in caught if "learning rate" in str(w.message) or "not match" in str(w.message)]


def test_a_checkpoint_saved_without_optimizer_state_says_the_resume_is_not_exact(tmp_path):
    out = tmp_path / "out"
    make_trainer(out, save_only_model=True).train()
    assert not [n for n in os.listdir(out / "checkpoint-2") if n.startswith(("optimizer", "scheduler", "rng"))]
    trainer = make_trainer(out, max_steps=3, save_only_model=True)
    rates = LearningRates()
    trainer.add_callback(rates)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train(resume_from_checkpoint=True)
    inexact = [str(w.message) for w in caught if "not match" in str(w.message)]
    assert inexact == [
        f"{out / 'checkpoint-2'} holds no optimizer state (it was written with save_only_model=True, which saves the "
        "weights alone): the resumed run starts Adam's moments from zero and draws other random numbers, so it will "
        "not match a run that was never stopped (the learning rate does continue its schedule). Keep "
        "save_only_model=False for checkpoints that resume exactly."
    ]
    # Step 3 of a 3-step linear schedule from 1e-2 (a fresh scheduler would have started again at 1e-2).
    assert rates.rates == {3: pytest.approx(1e-2 / 3, rel=1e-12)}
