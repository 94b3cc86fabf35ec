"""Checkpoints that are either complete or absent, and the trainer state an exact resume needs.

`transformers.Trainer` writes `checkpoint-N/` file by file in place: a run killed (or a disk that fills) in the
middle leaves a directory that looks like a checkpoint, and `resume_from_checkpoint=True` then picks it. Here a
checkpoint is written under `OUTPUT_DIR/tmp-checkpoint-N/checkpoint-N/`, every file is fsynced, and only then is
it renamed to `OUTPUT_DIR/checkpoint-N` (a rename within one file system is atomic), so any `checkpoint-N` is
whole. `newest_checkpoint` takes the newest complete one; `tmp-checkpoint-*` leftovers are deleted at the next save.

Beside Trainer's files (weights as safetensors, optimizer, scheduler, RNG state of every process), each process
writes `grpo_state_{process}.pt`: the part of a generation round it has not trained on yet (the buffer), its
micro-step counter, the metrics not yet logged, and the dynamic-sampling prompt stream's position. With these a
run resumed at any optimizer step continues with the same batches, generations and updates as one never stopped
(docs/reliability.md). When the reference moves (`sync_ref_model`, `ref_model_reset_steps`), the main process also
writes it, as `reference_model.safetensors`. The file holds only tensors, numbers, strings, lists and dicts, and is read with
`torch.load(weights_only=True)`: nothing is unpickled.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import math
import os
import re
import shutil
import signal
import sys
import time
import warnings
from collections.abc import Iterator

import torch
from accelerate.utils import gather_object
from transformers import Trainer, TrainerState
from transformers.trainer_utils import TrainOutput, rotate_checkpoints

from grpo.data import InputError
from grpo.training.checkpoint_checks import (
    RUN_SETTINGS_FILE,
    WEIGHT_FILES,
    changed_settings,
    check_checkpoint,
    continue_schedule,
    finished_run_message,
    inexact_resume_message,
    run_settings,
    schedule_message,
)
from grpo.training.output_dir import FINAL_STAGING, RunLock, final_save_message, fsync, publish_files
from grpo.training.preemption import Preempted, PreemptionCallback, StopOnSignal, resume_message

STATE_FILE = "grpo_state_{}.pt"
REFERENCE_FILE = "reference_model.safetensors"  # only when the reference moves (sync_ref_model, ref_model_reset_steps)
_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")
_STAGING_PREFIX = "tmp-checkpoint-"

# Settings that fix the shape of a generation round and how micro-steps walk through it: a saved buffer is only
# valid for a run with the same values.
ROUND_SETTINGS = (
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "steps_per_generation",
    "num_iterations",
    "num_generations",
    "loss_type",
)


class CheckpointError(RuntimeError):
    """A checkpoint could not be written; the message says what is intact and what to do. (A wrong checkpoint to
    resume from, or a new run over an old one, is bad input: `grpo.data.InputError`.)"""


def checkpoints(output_dir: str) -> list[tuple[int, str]]:
    """(step, path) of every complete checkpoint in `output_dir`, oldest first."""
    if not os.path.isdir(output_dir):
        return []
    found = []
    for name in os.listdir(output_dir):
        match = _CHECKPOINT.match(name)
        path = os.path.join(output_dir, name)
        if match and os.path.isfile(os.path.join(path, "trainer_state.json")):
            found.append((int(match.group(1)), path))
    return sorted(found)


def newest_checkpoint(output_dir: str) -> str | None:
    """The newest complete checkpoint in `output_dir` (None when there is none)."""
    found = checkpoints(output_dir)
    return found[-1][1] if found else None


def resolve_resume(resume_from_checkpoint, output_dir: str, check: bool = True) -> str | None:
    """The checkpoint directory to resume from: `True` (or "true") means the newest complete one in `output_dir`;
    a path must be a complete checkpoint, and with `check` every file of it whole (`check_checkpoint`: `grpo train`
    calls this before any weight loads). Errors name what was looked for and what to do."""
    path = _resume_path(resume_from_checkpoint, output_dir)
    if path is not None and check:
        check_checkpoint(path, checkpoints(os.path.dirname(os.path.abspath(path))))
    return path


def _resume_path(resume_from_checkpoint, output_dir: str) -> str | None:
    if resume_from_checkpoint is None or resume_from_checkpoint is False:
        return None
    if isinstance(resume_from_checkpoint, str) and resume_from_checkpoint.lower() in ("true", "false"):
        resume_from_checkpoint = resume_from_checkpoint.lower() == "true"
        if not resume_from_checkpoint:
            return None
    if resume_from_checkpoint is True:
        path = newest_checkpoint(output_dir)
        if path is None:
            raise InputError(
                f"resume_from_checkpoint=True, but {output_dir!r} holds no complete checkpoint (checkpoint-N with a "
                "trainer_state.json). Point output_dir at the earlier run, or start without resume_from_checkpoint."
            )
        return path
    path = os.fspath(resume_from_checkpoint)
    if not os.path.isdir(path):
        raise InputError(f"resume_from_checkpoint={path!r} is not a directory. Give a checkpoint-N directory.")
    if not os.path.isfile(os.path.join(path, "trainer_state.json")):
        newest = newest_checkpoint(os.path.dirname(os.path.abspath(path)))
        hint = f" The newest complete checkpoint beside it is {newest}." if newest else ""
        raise InputError(
            f"{path!r} is not a complete checkpoint (no trainer_state.json): it was cut short or is not a "
            f"checkpoint-N directory.{hint}"
        )
    return path


def check_fresh_output_dir(output_dir: str) -> None:
    """Refuse to start a new run over an earlier run's checkpoints (its saves would interleave with, and rotation
    would delete, the earlier ones) or over its saved model (the new one would replace it)."""
    found = checkpoints(output_dir)
    model = [name for name in WEIGHT_FILES if os.path.isfile(os.path.join(output_dir, name))]
    if model and not found:
        raise InputError(
            f"output_dir {output_dir!r} already holds the model of an earlier run ({model[0]}), which a new run "
            "would replace. Use a new output_dir, or move that model away."
        )
    if found:
        names = ", ".join(os.path.basename(p) for _, p in found[-3:])
        raise InputError(
            f"output_dir {output_dir!r} already holds checkpoints of an earlier run ({names}). Resume it with "
            "resume_from_checkpoint=True (grpo train ... --resume_from_checkpoint true), or use a new output_dir, "
            "or delete those checkpoints."
        )


def staging_dir(output_dir: str, step: int) -> str:
    """Where checkpoint `step` is written before it is published."""
    return os.path.join(output_dir, f"{_STAGING_PREFIX}{step}")


def remove_stale_staging(output_dir: str, keep: str | None = None) -> None:
    """Delete what saves that never finished left behind."""
    if not os.path.isdir(output_dir):
        return
    for name in os.listdir(output_dir):
        path = os.path.join(output_dir, name)
        if name.startswith(_STAGING_PREFIX) and path != keep:
            shutil.rmtree(path, ignore_errors=True)


def publish(staged: str, final: str) -> None:
    """fsync every file of `staged`, then rename it to `final` (replacing an older `final`) and fsync the parent,
    so that `final` exists only once all its bytes are on disk."""
    for root, _, files in os.walk(staged):
        for name in files:
            fsync(os.path.join(root, name))
        fsync(root, directory=True)
    old = None
    if os.path.exists(final):  # the same step saved twice (e.g. at the end of training): keep the newer
        old = final + ".replaced"
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
    os.rename(staged, final)
    fsync(os.path.dirname(os.path.abspath(final)), directory=True)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def write_failure_cause(error: BaseException, output_dir: str) -> str:
    """Why a write failed, a full disk said plainly (where torch would say 'basic_ios::clear'), and the space left."""
    try:
        free_mb = shutil.disk_usage(output_dir).free / 2**20
        space = f"{free_mb:.0f} MiB free on that disk"
    except OSError:
        space = "free space unknown"
    code = getattr(error, "errno", None)
    if code == errno.ENOSPC or "No space left" in str(error):
        cause = "the disk is full"
    elif code == errno.EFBIG:  # the process's file-size limit, not the disk
        cause = f"a file reached the file-size limit (ulimit -f), not a full disk ({error})"
    elif code in (errno.EACCES, errno.EPERM, errno.EROFS):
        cause = f"the directory is not writable ({error})"
    elif "basic_ios" in str(error):  # how torch.save reports a write that failed, most often for lack of space
        cause = "a write error, most likely a full disk (torch says 'basic_ios::clear')"
    else:
        cause = f"{type(error).__name__}: {error}"
    return f"{cause} ({space})"


def write_failure_remedy(error: BaseException | None) -> str:
    """What to do about a failed write (`write_failure_cause`): free space, unless the directory is not writable or
    the process's file-size limit stopped it, where free space would not help."""
    code = getattr(error, "errno", None)
    if code in (errno.EACCES, errno.EPERM, errno.EROFS):
        return "make the output directory writable (or use another output_dir)"
    if code == errno.EFBIG:
        return "raise the file-size limit (ulimit -f unlimited)"
    return "free space (or lower save_total_limit)"


def describe_write_failure(error: BaseException, step: int, output_dir: str) -> str:
    """The message for a checkpoint that could not be written: the cause (`write_failure_cause`) and the newest
    checkpoint that is intact."""
    cause = write_failure_cause(error, output_dir)
    newest = newest_checkpoint(output_dir)
    intact = f"The newest complete checkpoint, {newest}, is intact" if newest else "No earlier checkpoint exists"
    return (
        f"Writing checkpoint-{step} in {output_dir} failed: {cause}. Nothing of it was kept. {intact}. "
        f"{write_failure_remedy(error).capitalize()}, then resume with resume_from_checkpoint=True."
    )


@contextlib.contextmanager
def atomic_checkpoint(run_dir: str, step: int, accelerator, is_writer: bool) -> Iterator[str]:
    """Write a checkpoint under a temporary name and publish it only once every process wrote its part.

    Yields the staging directory (`tmp-checkpoint-N`, whose `checkpoint-N` the body fills); then the writer
    (`is_writer`: the process that saves) fsyncs and renames it to `run_dir/checkpoint-N`. A failure on any
    process removes what was staged and raises `CheckpointError` on every process, naming the cause."""
    staged = staging_dir(run_dir, step)
    if is_writer:
        remove_stale_staging(run_dir)
    accelerator.wait_for_everyone()
    failure = None
    try:
        yield staged
    except Exception as e:  # noqa: BLE001 - reported on every process below
        failure = e
    if any(gather_object([failure is not None])):
        if is_writer:
            shutil.rmtree(staged, ignore_errors=True)
        message = describe_write_failure(failure or OSError("another process failed"), step, run_dir)
        raise CheckpointError(message) from failure
    if is_writer:
        name = f"checkpoint-{step}"
        publish(os.path.join(staged, name), os.path.join(run_dir, name))
        os.rmdir(staged)
    accelerator.wait_for_everyone()


def _moved(value, device):
    """`value` with every tensor inside its dicts and lists moved to `device`."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, dict):
        return {k: _moved(v, device) for k, v in value.items()}
    if isinstance(value, list):
        return [_moved(v, device) for v in value]
    return value


def save_state(path: str, state: dict) -> None:
    """Write `state` with its tensors on the CPU, so it loads on any device."""
    torch.save(_moved(state, "cpu"), path)


def save_reference(checkpoint_dir: str, reference) -> None:
    """The reference model's weights, as safetensors (shared tensors such as tied embeddings stored once)."""
    from safetensors.torch import save_model

    save_model(reference, os.path.join(checkpoint_dir, REFERENCE_FILE))


def load_reference(checkpoint: str, reference) -> None:
    """Load the reference saved by `save_reference` into `reference`, in place."""
    from safetensors.torch import load_model

    path = os.path.join(checkpoint, REFERENCE_FILE)
    if not os.path.isfile(path):
        raise InputError(
            f"{checkpoint} has no {REFERENCE_FILE}: it was written by a run whose reference did not move, so the "
            "moved reference this run needs is not there. Resume without sync_ref_model / ref_model_reset_steps, "
            "or start a new run."
        )
    load_model(reference, path, device=str(next(reference.parameters()).device))


def round_settings(args, num_processes: int) -> dict:
    """The values of `ROUND_SETTINGS` in `args`, and the process count: what a saved buffer depends on."""
    return {**{name: getattr(args, name) for name in ROUND_SETTINGS}, "num_processes": num_processes}


def load_state(checkpoint: str, process_index: int, settings: dict, device) -> dict | None:
    """This process's trainer state from `checkpoint`, checked against the current run's round settings; None,
    with a warning, for a checkpoint written without one (by another trainer)."""
    path = os.path.join(checkpoint, STATE_FILE.format(process_index))
    if not os.path.isfile(path):
        warnings.warn(
            f"{checkpoint} has no {os.path.basename(path)} (written by another trainer): a generation round in "
            "progress is generated again, so the run will not match one that was never stopped.",
            stacklevel=2,
        )
        return None
    state = _moved(torch.load(path, map_location="cpu", weights_only=True), device)
    changed = {k: (v, settings[k]) for k, v in state["settings"].items() if k in settings and settings[k] != v}
    if changed:
        listed = ", ".join(f"{k}={old!r} (now {new!r})" for k, (old, new) in changed.items())
        raise InputError(
            f"{checkpoint} was written with {listed}. A resumed run must keep the settings that shape a generation "
            "round; set them back, or start a new run in a new output_dir."
        )
    return state


def stop_sandboxes() -> None:
    """End the sandboxed code (grpo/rewards/sandbox) still running in this process, if the sandbox was ever used: on
    Ctrl-C, a reward's worker threads would otherwise wait for each run's wall-clock limit before the process can
    exit; when `train()` returns, none may be left (a call abandoned at its timeout killed its own already)."""
    sandbox = sys.modules.get("grpo.rewards.sandbox")  # never imported here: a run without code rewards loads none
    if sandbox is not None:
        sandbox.stop_running()


def any_process(accelerator, flag: bool) -> bool:
    """`flag` of any process, on every process (one small all-reduce; none with one process)."""
    if accelerator.num_processes == 1:
        return flag
    flags = accelerator.reduce(torch.tensor(int(flag), device=accelerator.device), reduction="sum")
    return bool(flags.item())


class ResumableTrainer(Trainer):
    """`transformers.Trainer` whose checkpoints are complete or absent (`atomic_checkpoint`), resumable from the
    newest complete one (`resume_from_checkpoint=True`) once every file of it was checked (`check_checkpoint`, and a
    warning for settings the restored state overrides), refusing a new run over an earlier run's checkpoints or
    model and a second run while one holds the output_dir (`RunLock`), saving the final model whole or not at all
    (`save_model`), and carrying state of the subclass's own: `_save_state(checkpoint_dir)` writes it (on every
    process, into the checkpoint being staged) and `_restore_state(checkpoint)` reads it back before training
    resumes."""

    _staging_run_dir: str | None = None  # set while a checkpoint is written: where Trainer's files go

    def _save_state(self, checkpoint_dir: str) -> None:
        """Write this trainer's own state into `checkpoint_dir` (every process)."""

    def _restore_state(self, checkpoint: str) -> None:
        """Read back what `_save_state` wrote."""

    def train(self, resume_from_checkpoint: str | bool | None = None, trial=None, **kwargs):
        lock = RunLock(self.args.output_dir)
        self._on_main_process(lock.acquire)  # a second run into this output_dir stops here
        # Marks this call's lines in completions.jsonl apart from an earlier call's (a resume appends to the file).
        self.run_started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        try:
            checkpoint = resolve_resume(resume_from_checkpoint, self.args.output_dir, check=False)
            if checkpoint is None:
                check_fresh_output_dir(self.args.output_dir)
            else:
                checkpoint = os.path.abspath(checkpoint)  # read again at the first step, whatever the folder then
                others = checkpoints(os.path.dirname(checkpoint))
                self._on_main_process(lambda: check_checkpoint(checkpoint, others))  # read once, not per process
                finished = self.finished_run(checkpoint)
                if finished is not None:
                    return self._leave_finished_run(checkpoint, finished)
                inexact = inexact_resume_message(checkpoint)
                if inexact and self.args.should_save:
                    warnings.warn(inexact, stacklevel=2)
                changed = changed_settings(checkpoint, self.args)
                if changed and self.args.should_save:
                    warnings.warn(changed, stacklevel=2)
                self._restore_state(checkpoint)
            # SIGTERM stops at the end of the optimizer step with a checkpoint, only while this runs (preemption.py).
            stop = StopOnSignal(self.args.preemption_timeout, main=self.args.should_save)
            preemption = PreemptionCallback(stop, functools.partial(any_process, self.accelerator))
            self.add_callback(preemption)
            try:
                with stop:
                    output = super().train(resume_from_checkpoint=checkpoint, trial=trial, **kwargs)
            except KeyboardInterrupt:
                stop_sandboxes()  # Ctrl-C: code still running in a sandbox (in a reward's threads) ends now
                raise
            finally:
                self.remove_callback(preemption)
                self._end_training()
                stop_sandboxes()  # however train() ends, no sandboxed code outlives it (a hung tool's thread's, say)
            if preemption.stopped_at is not None:
                newest = newest_checkpoint(self.args.output_dir)
                message = resume_message(preemption.stopped_at, newest, self.args.output_dir)
                raise Preempted(message, preemption.stopped_at, newest, main=self.args.should_save)
            if stop.requested:  # it came after the last step's end: the handler before ours decides what it does
                signal.raise_signal(signal.SIGTERM)
            return output
        finally:
            lock.release()

    def planned_steps(self) -> int | None:
        """The optimizer steps this run trains in all (what Trainer will take as `max_steps`); None where that is
        known only once training starts."""
        return self.args.max_steps if self.args.max_steps > 0 else None

    def finished_run(self, checkpoint: str) -> str | None:
        """The line saying that resuming from `checkpoint` trains nothing (it is at this run's last step), or None;
        an `InputError` when it is past the last step (`finished_run_message`)."""
        total = self.planned_steps()
        return None if total is None else finished_run_message(checkpoint, total, self.args)

    def _leave_finished_run(self, checkpoint: str, message: str) -> TrainOutput:
        """Resuming a run already at its last step (a re-queued job): no step trained, nothing written. The trainer
        takes the checkpoint's weights and state, so that a `save_model()` after it writes the finished weights, not
        the base model's (under DeepSpeed or FSDP the weights load only when training starts, so they are not)."""
        if self.args.should_save:
            warnings.warn(message, stacklevel=3)
        if not (self.is_deepspeed_enabled or self.is_fsdp_enabled):
            self._load_from_checkpoint(checkpoint)
        self.state = TrainerState.load_from_json(os.path.join(checkpoint, "trainer_state.json"))
        self._end_training()
        return TrainOutput(self.state.global_step, math.nan, {})

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        """Trainer's, then the learning rate put on this run's schedule at the restored step (`continue_schedule`):
        a longer max_steps continues the new schedule instead of training a step at the old one's last rate."""
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is None or self.lr_scheduler is None:
            return
        step = self.state.global_step
        moved = continue_schedule(self.optimizer, self.lr_scheduler, step)
        if moved is not None and self.args.should_save:
            warnings.warn(schedule_message(checkpoint, self.args, step, self.state.max_steps, moved), stacklevel=2)

    def _on_main_process(self, check) -> None:
        """Run `check` on the process that saves; if it raises, raise on every process (the others with a pointer
        to the main process's error), so that none waits at a collective call for one that stopped."""
        failure = None
        if self.args.should_save:
            try:
                check()
            except Exception as e:  # noqa: BLE001 - raised again below, on every process
                failure = e
        if any(gather_object([failure is not None])):
            raise failure or InputError("The main process refused this run; its error says why.")

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """`Trainer.save_model`; called by the user (the final model), written like a checkpoint: staged in
        `output_dir/tmp-final-model`, fsynced, then renamed into `output_dir`. A failure leaves `output_dir` as it
        was and raises `CheckpointError` saying how to save again (grpo/training/output_dir.py)."""
        if _internal_call or self._staging_run_dir is not None:  # a checkpoint, already staged
            return super().save_model(output_dir, _internal_call)
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        staged = os.path.join(output_dir, FINAL_STAGING)
        if self.args.should_save:
            shutil.rmtree(staged, ignore_errors=True)
        failure = None
        try:
            super().save_model(staged, _internal_call=True)  # True: no push to the hub of what is not published
        except Exception as e:  # noqa: BLE001 - reported on every process below
            failure = e
        if any(gather_object([failure is not None])):
            if self.args.should_save:
                shutil.rmtree(staged, ignore_errors=True)
            cause = write_failure_cause(failure or OSError("another process failed"), output_dir)
            newest = newest_checkpoint(output_dir)
            remedy = write_failure_remedy(failure)
            raise CheckpointError(final_save_message(output_dir, cause, newest, remedy)) from failure
        if self.args.should_save:
            publish_files(staged, output_dir)
        self.accelerator.wait_for_everyone()
        if self.args.push_to_hub:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _end_training(self) -> None:
        """Release what training started (also when it fails)."""

    def _get_output_dir(self, trial) -> str:
        return self._staging_run_dir or super()._get_output_dir(trial)

    def _save_checkpoint(self, model, trial) -> None:
        run_dir, step = self._get_output_dir(trial), self.state.global_step
        final = os.path.join(run_dir, f"checkpoint-{step}")
        with atomic_checkpoint(run_dir, step, self.accelerator, self.args.should_save) as staged:
            self._staging_run_dir = staged
            try:
                super()._save_checkpoint(model, trial)
            finally:
                self._staging_run_dir = None
            checkpoint = os.path.join(staged, os.path.basename(final))
            self._save_state(checkpoint)
            if self.args.should_save:  # what a resumed run compares its settings with (`changed_settings`)
                with open(os.path.join(checkpoint, RUN_SETTINGS_FILE), "w") as f:
                    json.dump(run_settings(self.args), f)
            if self.args.should_save and self.state.best_model_checkpoint == checkpoint:
                self.state.best_model_checkpoint = final
                self.state.save_to_json(os.path.join(checkpoint, "trainer_state.json"))
        if self.args.should_save:
            rotate_checkpoints(run_dir, self.args.save_total_limit, self.state.best_model_checkpoint, use_mtime=True)
        self.accelerator.wait_for_everyone()
