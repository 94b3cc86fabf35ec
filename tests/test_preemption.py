"""Preemption and Ctrl-C: SIGTERM stops a run after the optimizer step in progress with a checkpoint there and one
line saying how to resume, and the resumed run ends bit-identical to one never stopped; a second SIGTERM or
`preemption_timeout` stops it at once; the handler exists only while `train()` runs. Ctrl-C ends sandboxed code at
once. Real signals, sent to real processes (tests/helpers/resume_run.py)."""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import yaml
from transformers import TrainerControl, TrainerState

from grpo.training.checkpoints import newest_checkpoint
from grpo.training.preemption import EXIT_STATUS, Preempted, PreemptionCallback, StopOnSignal
from tests.helpers.net import launch_two_processes
from tests.test_resume import SCRIPT, comparable, step_logs

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def _ctrl_c_reaches_children():
    """A shell starts background jobs with SIGINT ignored, and an ignored signal stays ignored across exec: then a
    `grpo train` this file starts never sees the Ctrl-C it sends (it finished with status 0 when the suite ran as
    `make test &`). Any handler but SIG_IGN in this process gives the children the default again."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_sigterm_is_handled_only_inside_and_asks_for_a_stop():
    def before(signum, frame):
        raise AssertionError("the handler from before the run must not run during it")

    previous = signal.signal(signal.SIGTERM, before)
    try:
        with StopOnSignal(timeout=60, main=False) as stop:
            assert signal.getsignal(signal.SIGTERM) == stop._handle
            os.kill(os.getpid(), signal.SIGTERM)  # a real signal: the process lives on, a stop is asked for
            time.sleep(0.01)  # the handler runs in the main thread between bytecodes
            assert stop.requested
        assert signal.getsignal(signal.SIGTERM) is before
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_train_in_another_thread_installs_no_handler():
    previous, seen = signal.getsignal(signal.SIGTERM), []

    def inside():
        with StopOnSignal(timeout=60):
            seen.append(signal.getsignal(signal.SIGTERM))

    thread = threading.Thread(target=inside)
    thread.start()
    thread.join()
    assert seen == [previous] and signal.getsignal(signal.SIGTERM) == previous


def test_a_requested_stop_saves_and_ends_training_on_every_process_at_once():
    stop, asked = StopOnSignal(timeout=60), []

    def any_process(flag):  # as if another process had been signalled
        asked.append(flag)
        return True

    callback = PreemptionCallback(stop, any_process)
    control = callback.on_step_end(None, TrainerState(global_step=3), TrainerControl())
    assert asked == [False]  # this process was not signalled, and still asks the others at every step's end
    assert control.should_save and control.should_training_stop and callback.stopped_at == 3
    quiet = PreemptionCallback(stop, lambda flag: flag)
    control = quiet.on_step_end(None, TrainerState(global_step=3), TrainerControl())
    assert not control.should_save and not control.should_training_stop and quiet.stopped_at is None


def test_a_stop_requested_during_a_save_ends_training_at_that_save():
    # Issue 50: a SIGTERM that came while checkpoint 3 was written (after step 3's end was asked) trained step 4 and
    # wrote checkpoint 4 before stopping. Now the save that was under way is the stop's.
    stop, asked = StopOnSignal(timeout=60), []

    def any_process(flag):
        asked.append(flag)
        return flag

    callback = PreemptionCallback(stop, any_process)
    control = callback.on_save(None, TrainerState(global_step=3, max_steps=8), TrainerControl())
    assert not control.should_training_stop and callback.stopped_at is None  # no signal: train on
    stop.requested = True
    control = callback.on_save(None, TrainerState(global_step=3, max_steps=8), TrainerControl())
    assert control.should_training_stop and callback.stopped_at == 3 and asked == [False, True]
    # The final step's save ends training anyway: no stop of its own (train() then hands the signal on).
    last = PreemptionCallback(stop, any_process)
    control = last.on_save(None, TrainerState(global_step=8, max_steps=8), TrainerControl())
    assert not control.should_training_stop and last.stopped_at is None


def test_preempted_ends_a_script_with_its_message_and_other_processes_silently():
    error = Preempted("Stopped on SIGTERM after step 2", 2, "out/checkpoint-2")
    assert isinstance(error, SystemExit) and error.code == str(error) == "Stopped on SIGTERM after step 2"
    assert Preempted("Stopped", 2, None, main=False).code == 1


def test_ctrl_c_while_sandboxed_code_runs_stops_at_once(tmp_path):
    # Four rows of code that never ends, two at a time, with a 120 s limit: Ctrl-C used to wait for the limit of each
    # run in progress and then start the others (minutes); now the runs are killed and the rest never start.
    script = tmp_path / "interrupt.py"
    script.write_text(
        "import os, signal, sys, threading, time\n"
        f"sys.path.insert(0, {str(ROOT)!r})\n"
        "from grpo.rewards.builtin import code_execution\n"
        "reward = code_execution(wall_seconds=120, cpu_seconds=120, isolation='process', max_parallel=2)\n"
        "sent = []\n"
        "def interrupt():\n"
        "    sent.append(time.monotonic())\n"
        "    os.kill(os.getpid(), signal.SIGINT)\n"
        "threading.Timer(3.0, interrupt).start()\n"
        "try:\n"
        "    reward(['while True: pass'] * 4, tests=[['assert True']] * 4)\n"
        "except KeyboardInterrupt:\n"
        "    print(f'stopped {time.monotonic() - sent[0]:.3f}', flush=True)\n"
    )
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=400)
    lines = [line for line in result.stdout.splitlines() if line.startswith("stopped ")]
    assert lines, result.stderr[-2000:]
    # A bound against waiting for the sandbox's limit (120 s), not a timing: the kill itself takes milliseconds.
    assert float(lines[0].split()[1]) < 30


def _run(settings, output_dir, *extra):
    return subprocess.run(
        [sys.executable, str(SCRIPT), json.dumps(settings), str(output_dir), *extra],
        capture_output=True,
        text=True,
        timeout=300,
    )


# Optimizer steps of two micro-steps (gradient accumulation) over rounds replayed twice; no checkpoint but the one
# the stop writes (save_strategy "no"), so that it is the preemption's.
SETTINGS = dict(
    per_device_train_batch_size=4,
    gradient_accumulation_steps=2,
    steps_per_generation=2,
    num_iterations=2,
    beta=0.04,
    max_steps=4,
    save_strategy="no",
)


@pytest.mark.slow
def test_sigterm_mid_step_checkpoints_that_step_and_the_resume_is_exact(tmp_path):
    full = _run(SETTINGS, tmp_path / "full")
    assert full.returncode == 0, full.stderr[-3000:]
    full = torch.load(tmp_path / "full" / "result.pt", weights_only=True)

    out = tmp_path / "stopped"
    # Micro-step 3 is the first half of optimizer step 2: the run finishes step 2, then stops.
    stopped = _run(SETTINGS, out, "--sigterm-after-micro-step", "3")
    assert stopped.returncode == 1, stopped.stderr[-3000:]
    assert newest_checkpoint(str(out)) == str(out / "checkpoint-2") and not (out / "result.pt").exists()
    last = stopped.stderr.strip().splitlines()[-1]
    assert last == (
        f"Stopped on SIGTERM after step 2; checkpoint written: {out / 'checkpoint-2'}. Resume with "
        "`trainer.train(resume_from_checkpoint=True)` (the same output_dir), or `grpo train RECIPE "
        "--resume_from_checkpoint true`."
    )
    assert "Traceback" not in stopped.stderr

    resumed = _run(SETTINGS, out, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    resumed = torch.load(out / "result.pt", weights_only=True)
    expected, got = step_logs(full["log_history"]), step_logs(resumed["log_history"])
    for step in (3, 4):
        assert comparable(got[step]) == comparable(expected[step]), step
    for param, value in full["params"].items():
        assert torch.equal(resumed["params"][param], value), param


@pytest.mark.slow
def test_sigterm_during_a_checkpoint_save_stops_at_that_checkpoint(tmp_path):
    # Checkpoints every 2 steps; SIGTERM arrives while checkpoint-2 is written (its files staged, not yet renamed).
    # The save completes, the run stops there, and step 3 never trains (it used to: checkpoint-3 was the stop's).
    settings = {**SETTINGS, "save_strategy": "steps", "save_steps": 2}
    full = _run(settings, tmp_path / "full")
    assert full.returncode == 0, full.stderr[-3000:]
    full = torch.load(tmp_path / "full" / "result.pt", weights_only=True)

    out = tmp_path / "stopped"
    stopped = _run(settings, out, "--sigterm-in-save", "2")
    assert stopped.returncode == 1, stopped.stderr[-3000:]
    # No step after the save: the stop at step 3's end would have written checkpoint-3.
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("checkpoint")) == ["checkpoint-2"]
    assert json.loads((out / "checkpoint-2" / "trainer_state.json").read_text())["global_step"] == 2
    assert (
        stopped.stderr.strip()
        .splitlines()[-1]
        .startswith(f"Stopped on SIGTERM after step 2; checkpoint written: {out / 'checkpoint-2'}.")
    )

    # The checkpoint is whole: the resumed run ends as the one never stopped.
    resumed = _run(settings, out, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    resumed = torch.load(out / "result.pt", weights_only=True)
    expected, got = step_logs(full["log_history"]), step_logs(resumed["log_history"])
    for step in (3, 4):
        assert comparable(got[step]) == comparable(expected[step]), step
    for param, value in full["params"].items():
        assert torch.equal(resumed["params"][param], value), param


@pytest.mark.slow
@pytest.mark.parametrize("how", ["second_sigterm", "timeout"])
def test_a_second_sigterm_or_the_timeout_stops_at_once_without_a_checkpoint(tmp_path, how):
    # The step after the signal never ends in time: a second SIGTERM (with a timeout too long to come first), or a
    # sleep of an hour, past preemption_timeout (1 s).
    if how == "second_sigterm":
        settings, extra = {**SETTINGS, "preemption_timeout": 600.0}, ["--sigterm-again"]
    else:
        settings, extra = {**SETTINGS, "preemption_timeout": 1.0}, ["--sleep-after-sigterm", "3600"]
    # _run's own timeout (300 s) is the bound against waiting out the sleep.
    stopped = _run(settings, tmp_path, "--sigterm-after-micro-step", "3", *extra)
    assert stopped.returncode == EXIT_STATUS, stopped.stderr[-3000:]
    assert newest_checkpoint(str(tmp_path)) is None
    said = "SIGTERM again: stopping now" if how == "second_sigterm" else "No checkpoint within 1 s of SIGTERM"
    assert said in stopped.stderr


def _signalling_recipe(tmp_path, model_path, signum):
    """The tiny recipe of tests/test_cli.py, without held-out prompts, plus a reward that sends this process
    `signum` while step 2 is scored, once (a marker file keeps the resumed run from sending it again)."""
    from tests.test_cli import write_tiny_recipe

    write_tiny_recipe(tmp_path, model_path)
    (tmp_path / "signals.py").write_text(
        "import os, pathlib\n"
        "calls = []\n"
        "def send(completions, **kwargs):\n"
        "    calls.append(1)\n"
        "    if len(calls) == 2 and not pathlib.Path('sent').exists():\n"
        "        pathlib.Path('sent').touch()\n"
        f"        os.kill(os.getpid(), {int(signum)})\n"
        "    return [0.0] * len(completions)\n"
    )
    recipe = yaml.safe_load((tmp_path / "tiny.yaml").read_text())
    recipe["dataset"].pop("eval_size")  # no evaluation before training: the reward's calls are the steps'
    recipe["rewards"].append({"name": "signals:send", "weight": 0.0})
    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump(recipe))


@pytest.mark.slow
def test_grpo_train_stopped_by_sigterm_says_how_to_resume_and_resumes(tmp_path, tiny_model_path):
    from tests.test_cli import run_grpo

    _signalling_recipe(tmp_path, tiny_model_path, signal.SIGTERM)
    stopped = run_grpo("train", "tiny.yaml", "--max_steps", "4", cwd=tmp_path)
    assert stopped.returncode == EXIT_STATUS, stopped.stderr[-3000:]
    assert stopped.stderr.strip().splitlines()[-1] == (
        f"grpo train: stopped on SIGTERM after step 2; checkpoint written: {tmp_path / 'out' / 'checkpoint-2'}. "
        "Resume with: grpo train tiny.yaml --max_steps 4 --resume_from_checkpoint true"
    )
    assert "Traceback" not in stopped.stderr and not (tmp_path / "out" / "model.safetensors").exists()
    resumed = run_grpo("train", "tiny.yaml", "--max_steps", "4", "--resume_from_checkpoint", "true", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert json.loads((tmp_path / "out" / "trainer_state.json").read_text())["global_step"] == 4


@pytest.mark.slow
def test_ctrl_c_in_grpo_train_is_one_line_with_the_way_back(tmp_path, tiny_model_path):
    from tests.test_cli import run_grpo

    _signalling_recipe(tmp_path, tiny_model_path, signal.SIGINT)
    args = ("--max_steps", "4", "--save_strategy", "steps", "--save_steps", "1")
    stopped = run_grpo("train", "tiny.yaml", *args, cwd=tmp_path)
    assert stopped.returncode == 130, stopped.stderr[-3000:]
    assert stopped.stderr.strip().splitlines()[-1] == (
        f"grpo train: interrupted (Ctrl-C). The newest checkpoint is {tmp_path / 'out' / 'checkpoint-1'}: resume "
        "with: grpo train tiny.yaml --max_steps 4 --save_strategy steps --save_steps 1 --resume_from_checkpoint true"
    )
    assert "Traceback" not in stopped.stderr


@pytest.mark.distributed
def test_one_process_signalled_stops_both_at_the_same_step_and_the_resume_is_exact(tmp_path):
    """Under `accelerate launch` (2 gloo processes), SIGTERM to rank 1 only: both processes stop after the same step
    with their shares of the round in one checkpoint, and the resumed run ends as the uninterrupted one."""
    settings = dict(per_device_train_batch_size=4, steps_per_generation=2, max_steps=4, save_strategy="no")

    def launch(output_dir, *extra, check=True):
        return launch_two_processes(SCRIPT, json.dumps(settings), output_dir, *extra, check=check)

    launch(tmp_path / "full")
    full = torch.load(tmp_path / "full" / "result.pt", weights_only=True)
    out = tmp_path / "stopped"
    # Micro-step 1 ends step 1, in the middle of a round of two steps.
    stopped = launch(out, "--sigterm-after-micro-step", "1", "--sigterm-rank", "1", check=False)
    assert stopped.returncode != 0 and "Stopped on SIGTERM after step 1" in stopped.stderr, stopped.stderr[-3000:]
    assert newest_checkpoint(str(out)) == str(out / "checkpoint-1")
    assert sorted(p.name for p in (out / "checkpoint-1").glob("grpo_state_*.pt")) == [
        "grpo_state_0.pt",
        "grpo_state_1.pt",
    ]
    launch(out, "--resume")
    resumed = torch.load(out / "result.pt", weights_only=True)
    expected, got = step_logs(full["log_history"]), step_logs(resumed["log_history"])
    for step in (2, 3, 4):
        assert comparable(got[step]) == comparable(expected[step]), step
    for param, value in full["params"].items():
        assert torch.equal(resumed["params"][param], value), param
