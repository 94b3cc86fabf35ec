"""Exact resume: a run SIGKILLed and resumed logs the same losses and rewards and ends with bit-identical weights as
one never stopped (CPU, same seed). Each run is a process of its own (tests/helpers/resume_run.py), with real
sampling."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from grpo.training.checkpoints import newest_checkpoint
from tests.helpers.net import launch_two_processes

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = Path(__file__).parent / "helpers" / "resume_run.py"

# Each scenario kills the run inside a generation round, so the resumed run must take the rest of that round from
# the checkpoint rather than generate it again.
SCENARIOS = {
    # One round feeds two optimizer steps (steps_per_generation > gradient_accumulation_steps); killed in step 2.
    "mid_round": dict(
        settings=dict(per_device_train_batch_size=4, steps_per_generation=2, max_steps=4),
        kill=["--kill-after-micro-step", "2"],
    ),
    # Each round is trained on twice (num_iterations=2), with gradient accumulation; killed after the first micro-step
    # of step 2, that is inside the round's second pass, whose old log-probs come from the checkpoint.
    "replayed_round": dict(
        settings=dict(
            per_device_train_batch_size=4,
            gradient_accumulation_steps=2,
            steps_per_generation=2,
            num_iterations=2,
            beta=0.04,
            max_steps=4,
        ),
        kill=["--kill-after-micro-step", "3"],
    ),
    # Killed while checkpoint 3 is written (all files written, not yet published), with dynamic sampling, whose
    # stream of extra prompts must continue where it was; the resume must take checkpoint 2.
    "killed_save": dict(
        settings=dict(
            per_device_train_batch_size=8,
            steps_per_generation=2,
            loss_type="dapo",
            dynamic_sampling=True,
            max_dynamic_sampling_rounds=2,
            max_steps=5,
        ),
        kill=["--kill-in-save", "3"],
    ),
    # Async generation at max_staleness=0 (model.generate on a copy of the policy, in the producer thread): the
    # producer starts again at the next round after the resume and draws what the uninterrupted run drew.
    "async_generation": dict(
        settings=dict(
            per_device_train_batch_size=4, steps_per_generation=2, max_steps=4, async_generation=True, max_staleness=0
        ),
        kill=["--kill-after-micro-step", "2"],
    ),
    # Epochs of 8 micro-steps (4 prompts, rounds of 2 replayed once) in optimizer steps of 3: each epoch ends with a
    # short step of 2. Killed in the first micro-step after it, so the resume starts a new epoch from checkpoint-3
    # and pi_old's accounting must follow the short step (a replayed round's first pass is recorded).
    "short_step": dict(
        settings=dict(
            per_device_train_batch_size=4,
            loss_type="grpo",  # dapo needs rounds of whole optimizer steps
            gradient_accumulation_steps=3,
            steps_per_generation=2,
            num_iterations=2,
            beta=0.04,
            max_steps=6,
        ),
        kill=["--kill-after-micro-step", "9"],
        flags=["--prompts", "4"],
    ),
    # Skywork-OR1's adaptive entropy coefficient is training state: its value and the last step's entropy come from
    # the checkpoint. The tiny model's entropy (about 5.6 nats) is below the target, so the coefficient rises every
    # step and the bonus applies from step 2 on; a resume that started it afresh would apply 0 in step 2.
    "adaptive_entropy": dict(
        settings=dict(
            per_device_train_batch_size=4,
            steps_per_generation=2,
            max_steps=4,
            use_adaptive_entropy=True,
            entropy_target=10.0,
            entropy_coef_delta=0.05,
        ),
        kill=["--kill-after-micro-step", "2"],
    ),
    # A LoRA adapter (only it is in the checkpoint, adapter_model.safetensors) with the KL term, whose reference is
    # the adapter disabled; killed in the middle of a round, after checkpoint 1.
    "lora": dict(
        settings=dict(per_device_train_batch_size=4, steps_per_generation=2, beta=0.04, max_steps=4),
        kill=["--kill-after-micro-step", "2"],
        flags=["--lora"],
    ),
    # Multi-turn episodes with a tool, sampled by the model (turns, calls and tool answers depend on the draw); one
    # round feeds two optimizer steps and the run dies in step 2, so the resume trains the rest of the round's
    # episodes (their tool answers masked out of the loss) from checkpoint-1.
    "agent_episodes": dict(
        settings=dict(
            per_device_train_batch_size=4,
            steps_per_generation=2,
            max_steps=4,
            max_completion_length=256,  # room for three turns and their tool answers (byte tokens)
            max_prompt_length=None,  # the tools' schemas make a long prompt; keep it whole
            max_tool_calling_iterations=3,
        ),
        kill=["--kill-after-micro-step", "2"],
        flags=["--agent"],
    ),
}


def run(settings, output_dir, *extra, killed=False):
    process = subprocess.run(
        [sys.executable, str(SCRIPT), json.dumps(settings), str(output_dir), *extra],
        capture_output=True,
        text=True,
        timeout=300,
    )
    if killed:
        assert process.returncode == -9, process.stderr[-3000:]
        return None
    assert process.returncode == 0, process.stderr[-3000:]
    return torch.load(Path(output_dir) / "result.pt", weights_only=True)


def step_logs(history):
    """step -> the logged training values of that step (the final summary entry left out)."""
    return {entry["step"]: entry for entry in history if "loss" in entry}


def comparable(entry):
    """A logged entry without wall-clock timings, NaN (nothing measured) made comparable with ==."""
    return {k: "nan" if v != v else v for k, v in entry.items() if not k.startswith("timing/")}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_killed_run_resumes_exactly(tmp_path, name):
    scenario = SCENARIOS[name]
    flags = scenario.get("flags", [])
    if name == "lora":
        pytest.importorskip("peft", reason="the LoRA scenario needs `pip install peft`")
    full = run(scenario["settings"], tmp_path / "full", *flags)
    if name == "agent_episodes":  # the episodes did call the tool, so rows hold tool answers between turns
        assert any(entry.get("tools/call_frequency", 0) > 0 for entry in full["log_history"])
    if name == "adaptive_entropy":  # the coefficient moved: 0.05 after step 1, 0.2 after step 4
        assert [entry["entropy_coef"] for entry in step_logs(full["log_history"]).values()] == pytest.approx(
            [0.05, 0.1, 0.15, 0.2]
        )

    out = tmp_path / "killed"
    run(scenario["settings"], out, *scenario["kill"], *flags, killed=True)
    resume_point = newest_checkpoint(str(out))
    assert resume_point is not None
    resume_step = int(resume_point.rsplit("-", 1)[1])
    if name == "killed_save":
        # The checkpoint being written when the process died is not visible as one; the previous one is taken.
        assert resume_step == 2 and (out / "tmp-checkpoint-3" / "checkpoint-3").is_dir()
        assert not (out / "checkpoint-3").exists()
    if name == "short_step":  # the newest checkpoint is the one written after the epoch's short step
        assert resume_step == 3
    if name == "lora":  # the checkpoint holds the adapter, not the whole model
        assert (Path(resume_point) / "adapter_model.safetensors").is_file()
        assert not (Path(resume_point) / "model.safetensors").exists()
    resumed = run(scenario["settings"], out, "--resume", *flags)

    expected, got = step_logs(full["log_history"]), step_logs(resumed["log_history"])
    after = [step for step in expected if step > resume_step]
    assert after, "the kill must leave steps to train after the resume point"
    for step in after:
        assert "loss" in got[step] and "grad_norm" in got[step]
        assert comparable(got[step]) == comparable(expected[step]), step
    for param, value in full["params"].items():
        assert torch.equal(resumed["params"][param], value), param
    if name == "killed_save":  # the next save cleared what the killed one left
        assert not (out / "tmp-checkpoint-3").exists()


@pytest.mark.distributed
def test_two_processes_resume_exactly_in_the_middle_of_a_round(tmp_path):
    """Under `accelerate launch` (2 gloo processes) every process saves and restores its own share of the round and
    its own RNG state: resumed from checkpoint-1 (the middle of a round) the run ends as the uninterrupted one."""
    settings = dict(per_device_train_batch_size=4, steps_per_generation=2, max_steps=4)

    def launch(output_dir, *extra):
        launch_two_processes(SCRIPT, json.dumps(settings), output_dir, *extra)
        return torch.load(Path(output_dir) / "result.pt", weights_only=True)

    full = launch(tmp_path / "full")
    assert sorted(p.name for p in (tmp_path / "full" / "checkpoint-1").glob("grpo_state_*.pt")) == [
        "grpo_state_0.pt",
        "grpo_state_1.pt",
    ]
    # The run as if it had died during step 2: only checkpoint-1 survives.
    interrupted = tmp_path / "interrupted"
    interrupted.mkdir()
    shutil.copytree(tmp_path / "full" / "checkpoint-1", interrupted / "checkpoint-1")
    resumed = launch(interrupted, "--resume")
    expected, got = step_logs(full["log_history"]), step_logs(resumed["log_history"])
    for step in (2, 3, 4):
        assert comparable(got[step]) == comparable(expected[step]), step
    for param, value in full["params"].items():
        assert torch.equal(resumed["params"][param], value), param
