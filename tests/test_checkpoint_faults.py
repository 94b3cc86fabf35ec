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


def make_trainer(output_dir, **kwargs):
    from datasets import Dataset

    tokenizer = tiny_tokenizer()
    settings = {**TINY, "max_steps": 2, "learning_rate": 1e-2, "save_strategy": "steps", "save_steps": 1, **kwargs}
    args = GRPOConfig(output_dir=str(output_dir), **settings)
    data = Dataset.from_dict(PROMPTS)
    return GRPOTrainer(tiny_model(tokenizer), reward_len, args=args, train_dataset=data, processing_class=tokenizer)


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
