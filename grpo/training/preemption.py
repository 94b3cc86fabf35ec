"""Preemption: SIGTERM (what SLURM, Kubernetes and spot instances send before they kill a job) stops a run at the
next safe point, the end of the optimizer step in progress, with a checkpoint there, instead of losing the steps
since the last one.

    trainer.train()        # SIGTERM arrives during step 7
    # step 7 ends, checkpoint-7 is written, train() raises Preempted (a SystemExit): "... resume with
    # trainer.train(resume_from_checkpoint=True)"; `grpo train` prints the same line with its own command.

How it works (docs/reliability.md#preemption):
  1. `StopOnSignal` handles SIGTERM only while `train()` runs, and puts the previous handler back afterwards (the
     library changes no process-wide state beyond its own run). The first SIGTERM only sets a flag and starts a
     timer; a second SIGTERM, or `preemption_timeout` seconds without the stop finishing, ends the process at once
     (exit status 143, the status of a process SIGTERM ended), leaving the newest complete checkpoint as it was.
  2. `PreemptionCallback.on_step_end` asks every process whether one was signalled (one small collective per
     optimizer step, only with several processes): all processes stop after the same step, so that their
     checkpoint shares agree, whether the launcher signals every rank (torchrun, srun) or only one.
  3. It then sets `should_save` and `should_training_stop`: `Trainer` writes the checkpoint (atomically, with the
     round's state, like any other) and leaves its loop; `train()` raises `Preempted`. A SIGTERM that arrives while
     a checkpoint is being written (after the step's end was asked) is seen when that save ends (`on_save`): that
     checkpoint is the stop's, and no further step trains.

Python runs a signal handler in the main thread between two bytecodes, so a stop requested during one long call
into C (a collective waiting on another process) is seen when that call returns; the timeout covers a call that
never does. `train()` called from another thread cannot install a handler (Python allows that only in the main
thread) and runs without this.
"""

from __future__ import annotations

import os
import signal
import sys
import threading

from transformers import TrainerCallback

EXIT_STATUS = 128 + signal.SIGTERM  # what a shell reports for a process that SIGTERM ended


class Preempted(SystemExit):
    """`train()` stopped on SIGTERM after writing a checkpoint. A `SystemExit`, so that a script ends without a
    traceback, printing the message (exit status 1); catch it to do something else. `step` and `checkpoint` say
    where the run stopped; on processes other than the main one, the exit is silent."""

    def __init__(self, message: str, step: int, checkpoint: str | None, main: bool = True):
        super().__init__(message if main else 1)
        self.message, self.step, self.checkpoint, self.main = message, step, checkpoint, main

    def __str__(self) -> str:
        return self.message


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


class StopOnSignal:
    """A context manager: while inside, the first SIGTERM sets `requested` (a stop is asked for), a second one or
    `timeout` seconds after the first ends the process at once. Outside, SIGTERM does what it did before."""

    def __init__(self, timeout: float, main: bool = True):
        self.timeout = timeout
        self.main = main  # only the main process says that a stop is coming (every process hears the signal)
        self.requested = False
        self._previous = None
        self._installed = False
        self._timer: threading.Timer | None = None

    def __enter__(self) -> StopOnSignal:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._handle)
            self._installed = True
        return self

    def __exit__(self, *exc) -> None:
        if self._timer is not None:
            self._timer.cancel()
        if self._installed:
            # None: the handler was set outside Python; the default is the best we can put back.
            signal.signal(signal.SIGTERM, self._previous if self._previous is not None else signal.SIG_DFL)
            self._installed = False

    def _handle(self, signum, frame) -> None:
        if self.requested:
            _say("SIGTERM again: stopping now, without a checkpoint of this step; the newest complete one is kept.")
            os._exit(EXIT_STATUS)
        self.requested = True
        if self.main:
            _say(
                "SIGTERM: the run stops after the current optimizer step and writes a checkpoint there; a second "
                f"SIGTERM, or {self.timeout:g} s without the checkpoint (preemption_timeout), stops it at once."
            )
        self._timer = threading.Timer(self.timeout, self._expire)
        self._timer.daemon = True
        self._timer.start()

    def _expire(self) -> None:
        _say(
            f"No checkpoint within {self.timeout:g} s of SIGTERM (preemption_timeout): stopping now; the newest "
            "complete checkpoint is kept."
        )
        os._exit(EXIT_STATUS)


class PreemptionCallback(TrainerCallback):
    """Turns a requested stop into a checkpoint and the end of training at the end of an optimizer step, on every
    process at the same step. `any_process(flag)` is True on every process when `flag` is on any."""

    def __init__(self, stop: StopOnSignal, any_process):
        self.stop = stop
        self.any_process = any_process
        self.stopped_at: int | None = None

    def on_step_end(self, args, state, control, **kwargs):
        if self.any_process(self.stop.requested):
            self.stopped_at = state.global_step
            control.should_save = True
            control.should_training_stop = True
        return control

    def on_save(self, args, state, control, **kwargs):
        # A SIGTERM that came while a checkpoint was written (after this step's end was asked): that checkpoint is
        # the stop's, so training ends here rather than after one more step. Every process saves at the same step.
        if self.stopped_at is None and state.global_step < state.max_steps and self.any_process(self.stop.requested):
            self.stopped_at = state.global_step
            control.should_training_stop = True
        return control


def resume_message(step: int, checkpoint: str | None, output_dir: str) -> str:
    """The one line a preempted `train()` ends with."""
    where = checkpoint or f"the newest checkpoint in {output_dir}"
    return (
        f"Stopped on SIGTERM after step {step}; checkpoint written: {where}. Resume with "
        f"`trainer.train(resume_from_checkpoint=True)` (the same output_dir), or `grpo train RECIPE "
        "--resume_from_checkpoint true`."
    )
