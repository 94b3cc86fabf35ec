"""A reference that moves: the soft update (`sync_ref_model`), the iterative scheme's reset (`ref_model_reset_steps`)
with its `on_reference_reset` hook, their errors, and exact resume with a moved reference."""

import pytest
import torch
from torch import nn
from transformers import TrainerCallback

from grpo import GRPOConfig, GRPOTrainer
from grpo.objective.reference import ReferenceResetCallback, mix_into
from grpo.testing import tiny_model
from tests.helpers.scripted import TINY, reward_len
from tests.test_resume import comparable, run, step_logs


def make_trainer(tmp_path, tokenizer, dataset, callbacks=None, model=None, **kwargs):
    settings = {**TINY, "max_steps": 3, "learning_rate": 1e-2, "beta": 0.1, **kwargs}
    args = GRPOConfig(output_dir=str(tmp_path / "out"), **settings)
    return GRPOTrainer(
        model or tiny_model(tokenizer),
        [reward_len],
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=callbacks,
    )


def snapshot(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


class Snapshots(TrainerCallback):
    """Policy and reference parameters at the end of every step, before the reference update of that step (callbacks
    given to the trainer run before the one it adds itself)."""

    def __init__(self):
        self.policy, self.reference, self.trainer = {}, {}, None

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.policy[state.global_step] = snapshot(model)
        self.reference[state.global_step] = snapshot(self.trainer.ref_model)


def test_mix_into_by_hand():
    class Tied(nn.Module):
        def __init__(self, value):
            super().__init__()
            self.a = nn.Linear(2, 2, bias=False)
            self.b = nn.Linear(2, 2, bias=False)
            self.b.weight = self.a.weight  # one tensor under two names, as tied embeddings
            self.register_buffer("count", torch.tensor(value))
            nn.init.constant_(self.a.weight, float(value))

    reference, policy = Tied(1), Tied(5)
    mix_into(reference, policy, 0.25)
    # 0.25 * 5 + 0.75 * 1 = 2, applied once to the shared tensor (twice would give 2.75); integer buffers copied.
    assert torch.equal(reference.a.weight, torch.full((2, 2), 2.0)) and reference.b.weight is reference.a.weight
    assert reference.count.item() == 5
    mix_into(reference, policy, 1.0)
    assert torch.equal(reference.a.weight, policy.a.weight)
    with pytest.raises(ValueError, match="different tensors"):
        mix_into(nn.Linear(2, 2), nn.Linear(2, 2, bias=False), 0.5)


def test_soft_sync_moves_the_reference_by_the_mixup_formula(tmp_path, tokenizer, prompt_dataset):
    snapshots = Snapshots()
    trainer = make_trainer(
        tmp_path,
        tokenizer,
        prompt_dataset,
        callbacks=[snapshots],
        sync_ref_model=True,
        ref_model_mixup_alpha=0.3,
        ref_model_sync_steps=2,
    )
    snapshots.trainer = trainer
    initial = snapshot(trainer.ref_model)
    trainer.train()
    # Step 1: no update. Step 2: ref = 0.3 * policy_2 + 0.7 * ref. Step 3: no update.
    for name, value in snapshots.reference[2].items():
        assert torch.equal(value, initial[name]), name
    for name, value in trainer.ref_model.named_parameters():
        expected = 0.3 * snapshots.policy[2][name] + 0.7 * initial[name]
        torch.testing.assert_close(value, expected, rtol=1e-6, atol=1e-7)  # lerp and this formula round apart
        assert not torch.equal(value, initial[name]) or torch.equal(snapshots.policy[2][name], initial[name])
    assert any(not torch.equal(snapshots.policy[2][n], initial[n]) for n in initial)


def test_reset_makes_the_reference_the_policy_and_calls_the_hook(tmp_path, tokenizer, prompt_dataset):
    class Refresh(ReferenceResetCallback):
        def __init__(self):
            self.calls = []

        def on_reference_reset(self, args, state, control, trainer=None, **kwargs):
            self.calls.append((state.global_step, trainer))

    refresh, snapshots = Refresh(), Snapshots()
    trainer = make_trainer(
        tmp_path, tokenizer, prompt_dataset, callbacks=[refresh, snapshots], ref_model_reset_steps=2, max_steps=4
    )
    snapshots.trainer = trainer
    trainer.train()
    assert refresh.calls == [(2, trainer), (4, trainer)]
    for name, value in snapshots.reference[3].items():  # reset at the end of step 2
        assert torch.equal(value, snapshots.policy[2][name]), name
    kl = {entry["step"]: entry["kl"] for entry in trainer.state.log_history if "kl" in entry}
    # The round of step 3 is generated and scored right after the reset: its reference is its policy, exactly.
    assert kl[2] > 0 and kl[3] == 0.0 and kl[4] > 0


def test_a_moving_reference_needs_a_reference_copy(tmp_path, tokenizer, prompt_dataset):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(tiny_model(tokenizer), LoraConfig(r=2, target_modules=["q_proj"]))
    with pytest.raises(ValueError, match=r"with a PEFT model the reference is the base model .*merge_and_unload"):
        make_trainer(tmp_path, tokenizer, prompt_dataset, model=model, sync_ref_model=True)
    with pytest.raises(ValueError, match=r"beta=0 means there is none"):
        GRPOConfig(output_dir=str(tmp_path), report_to="none", ref_model_reset_steps=4)
    with pytest.raises(ValueError, match=r"pick one"):
        GRPOConfig(output_dir=str(tmp_path), report_to="none", beta=0.1, sync_ref_model=True, ref_model_reset_steps=2)


def test_a_zero3_partitioned_model_needs_a_path_for_its_reference(tmp_path, tokenizer):
    """A model whose parameters ZeRO-3 partitioned as it was loaded (marked here as DeepSpeed marks them, `ds_id`)
    cannot be copied: the reference must be loaded from the path, and it cannot move yet. Refused at construction,
    with the fix; a model that is not partitioned still gets its copy. (The real ZeRO-3 run: tests/test_deepspeed.py.)"""
    from grpo.objective.reference import make_reference

    model = tiny_model(tokenizer)
    fixed = GRPOConfig(output_dir=str(tmp_path), report_to="none", beta=0.1)
    reference, moves = make_reference(model, fixed, source=model)
    assert not moves and reference is not model and not reference.training
    for i, param in enumerate(model.parameters()):
        param.ds_id = i
    with pytest.raises(ValueError, match=r"ZeRO-3 .*cannot be copied .*Pass the model as a path or hub id"):
        make_reference(model, fixed, source=model)
    moving = GRPOConfig(output_dir=str(tmp_path), report_to="none", beta=0.1, sync_ref_model=True)
    with pytest.raises(ValueError, match=r"not supported under DeepSpeed ZeRO-3 yet.*Use ZeRO-2"):
        make_reference(model, moving, source="some/model")
    no_kl = GRPOConfig(output_dir=str(tmp_path), report_to="none", beta=0.0)
    assert make_reference(model, no_kl, source=model) == (None, False)


@pytest.mark.slow
@pytest.mark.parametrize(
    "moving",
    [dict(ref_model_reset_steps=2), dict(sync_ref_model=True, ref_model_sync_steps=1, ref_model_mixup_alpha=0.5)],
    ids=["reset", "soft"],
)
def test_moved_reference_resumes_exactly(tmp_path, moving):
    """Killed after step 3 (checkpoint-2 holds a reference moved at step 2), resumed: the same KL and weights."""
    settings = dict(per_device_train_batch_size=4, beta=0.1, max_steps=4, **moving)
    full = run(settings, tmp_path / "full")
    out = tmp_path / "killed"
    run(settings, out, "--kill-after-micro-step", "3", killed=True)
    assert (out / "checkpoint-2" / "reference_model.safetensors").is_file()
    resumed = run(settings, out, "--resume")
    expected, got = step_logs(full["log_history"]), step_logs(resumed["log_history"])
    for step in (3, 4):
        assert comparable(got[step]) == comparable(expected[step]), step
    for param, value in full["params"].items():
        assert torch.equal(resumed["params"][param], value), param


@pytest.mark.slow
def test_iterative_reward_model_example_refreshes_between_iterations():
    import re
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    result = subprocess.run(
        [sys.executable, str(root / "examples" / "iterative_reward_model.py"), "--steps", "4", "--reset-every", "2"],
        capture_output=True,
        text=True,
        timeout=600,
        env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    refreshes = re.findall(
        r"iteration ending at step (\d+): .* on (\d+) new samples \(error on them (\S+) -> (\S+)\)", result.stdout
    )
    assert [int(step) for step, *_ in refreshes] == [2, 4]
    for _, count, before, after in refreshes:
        assert int(count) == 16 and float(after) <= float(before)  # 2 steps x 8 completions, fitted
