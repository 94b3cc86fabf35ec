"""What `grpo train` draws while it runs: labelled progress bars, one per stage (`LabelledProgress`, put in place of
`Trainer`'s own by `label_progress`), and one short line of metrics per logged step (`metrics_line`) in place of
`Trainer`'s printed dict. Only the screen changes: every metric is still logged, to `trainer_state.json` and to the
`report_to` trackers, as before. While the bars are drawn, warnings and log lines from any library are written above
them (`lines_above_bars`)."""

from __future__ import annotations

import contextlib
import logging
import math
import sys
import time
import warnings

from transformers.trainer_callback import ProgressCallback
from transformers.trainer_utils import has_length


def _number(value) -> str:
    """A metric as a person reads it: whole numbers bare, four significant digits, no exponent for ordinary sizes."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return str(value)
    size = abs(value)
    if value == int(value) and size < 1e15:
        return str(int(value))
    if size >= 1000:
        return f"{value:.0f}"
    return f"{value:.4g}"  # an exponent only below 1e-4


def _pairs(logs: dict, keys: list[tuple[str, str]]) -> list[str]:
    return [f"{label} {_number(logs[key])}" for key, label in keys if key in logs]


def metrics_line(logs: dict, step: int, max_steps: int, seconds_per_step: float | None = None) -> str:
    """The screen's line for one `Trainer.log` call (`logs` as logged). A training step: the step, then the
    metrics that say whether the run learns (loss, reward with its spread across the group, each reward function's
    mean when there are several, completion length, the share cut at `max_completion_length`, kl when beta > 0),
    then seconds per step. An evaluation: the same names, from its `eval_` keys. The end of training: its time.
    Anything else (a log of your own): every entry, numbers as numbers."""
    prefix = "eval_" if any(k.startswith("eval_") for k in logs) else ""
    functions = [k for k in logs if k.startswith(f"{prefix}rewards/") and k.endswith("/mean")]
    keys = [("loss", "loss")] if not prefix else []
    keys += [(f"{prefix}reward", "reward"), (f"{prefix}reward_std", "reward_std")]
    keys += [(k, k[len(f"{prefix}rewards/") : -len("/mean")]) for k in functions if len(functions) > 1]
    keys += [(f"{prefix}completions/mean_length", "length"), (f"{prefix}completions/clipped_ratio", "clipped")]
    keys += [(f"{prefix}kl", "kl"), (f"{prefix}tools/call_frequency", "tool_calls")]
    head = f"step {step}/{max_steps}" if max_steps > 0 else f"step {step}"
    if prefix:
        return " | ".join([f"evaluation at {head}", *_pairs(logs, keys)])
    if "loss" in logs:
        rate = [] if seconds_per_step is None else [f"{seconds_per_step:.3g} s/step"]
        return " | ".join([head, *_pairs(logs, keys), *rate])
    if "train_runtime" in logs:
        return f"training done: {step} steps in {logs['train_runtime']:.0f} s"
    return " | ".join(f"{k} {_number(v)}" for k, v in logs.items() if k != "total_flos")


class LabelledProgress(ProgressCallback):
    """`Trainer`'s progress bars, named ("training", "evaluating"), drawn from the start of their stage, with
    `metrics_line` for the logs. transformers opens the evaluation bar only when the first batch has finished: an
    evaluation of two batches showed nothing, then 50% at tens of thousands of batches a second, then sat through
    the second. Here the bar opens when the evaluation starts (`open_evaluation`, or dated back to the end of the
    last step for one `Trainer` starts itself), so it says 0 of N and its rate is true."""

    def __init__(self):
        super().__init__()
        self._since = time.time()  # when the latest stage ended: where an evaluation that follows it starts
        self._logged = (0, time.time())  # (global step, time) of the latest log line: seconds per step since

    def on_train_begin(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            self.training_bar = self._bar("training", state.max_steps, "step", leave=True)
        self.current_step = 0
        self._logged = (state.global_step, time.time())

    def on_step_end(self, args, state, control, **kwargs):
        super().on_step_end(args, state, control, **kwargs)
        self._since = time.time()

    def on_train_end(self, args, state, control, **kwargs):
        super().on_train_end(args, state, control, **kwargs)
        self._since = time.time()

    def open_evaluation(self, total: int, description: str = "evaluating") -> None:
        """Open the evaluation bar at 0 of `total` batches before the evaluation starts (`grpo train` does, before
        `trainer.evaluate()`); the next `on_prediction_step`s advance it."""
        if self.prediction_bar is None:
            self.prediction_bar = self._bar(description, total, "batch", leave=self.training_bar is None)

    def on_prediction_step(self, args, state, control, eval_dataloader=None, **kwargs):
        if state.is_world_process_zero and self.prediction_bar is None and has_length(eval_dataloader):
            self.open_evaluation(len(eval_dataloader))
            self.prediction_bar.start_t = self.prediction_bar.last_print_t = self._since  # it began back then
        super().on_prediction_step(args, state, control, eval_dataloader=eval_dataloader, **kwargs)

    def on_evaluate(self, args, state, control, **kwargs):
        super().on_evaluate(args, state, control, **kwargs)
        self._since = time.time()

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or self.training_bar is None:
            return
        rate = None
        if "loss" in logs and state.global_step > self._logged[0]:
            rate = (time.time() - self._logged[1]) / (state.global_step - self._logged[0])
            self._logged = (state.global_step, time.time())
        self.training_bar.write(metrics_line(logs, state.global_step, state.max_steps, rate))
        sys.stdout.flush()  # a log file sees each line as it is written, not a buffer's worth later

    @staticmethod
    def _bar(description: str, total: int, unit: str, leave: bool):
        from tqdm.auto import tqdm  # what transformers' own bars use

        return tqdm(total=total, desc=description, unit=unit, leave=leave, dynamic_ncols=True)


def label_progress(trainer) -> LabelledProgress | None:
    """Replace the trainer's `ProgressCallback` (when it has one: not with `disable_tqdm`) by `LabelledProgress`,
    and return it."""
    if any(isinstance(c, ProgressCallback) for c in trainer.callback_handler.callbacks):
        trainer.remove_callback(ProgressCallback)
        progress = LabelledProgress()
        trainer.add_callback(progress)
        return progress
    return None


def evaluation_bar(trainer) -> None:
    """Before `trainer.evaluate()`: open its bar at 0 of its batches, where the trainer draws `LabelledProgress`."""
    progress = [c for c in trainer.callback_handler.callbacks if isinstance(c, LabelledProgress)]
    if progress and trainer.is_world_process_zero():
        dataloader = trainer.get_eval_dataloader()
        if has_length(dataloader):
            progress[0].open_evaluation(len(dataloader))


# Libraries that write their log lines through handlers of their own (datasets' also passes them on to the root).
OWN_HANDLERS = ("transformers", "torch", "datasets")


@contextlib.contextmanager
def lines_above_bars():
    """For the length of the block: every log line (through the root logger, which grpo's and accelerate's reach,
    and through `OWN_HANDLERS`' own, which then pass nothing on to the root: one copy of each line) and every Python
    warning written with `tqdm.write`, which lifts the bars and draws them again below. Written on a bar's line, a
    warning left a torn copy of the bar on the screen and split a metrics line. Warning filters, handlers and
    `propagate` are as they were afterwards; enter it once those libraries are imported (a handler a library adds
    inside the block is not redirected)."""
    from tqdm.auto import tqdm
    from tqdm.contrib.logging import logging_redirect_tqdm

    def show(message, category, filename, lineno, file=None, line=None):
        text = warnings.formatwarning(message, category, filename, lineno, line).rstrip("\n")
        tqdm.write(text, file=file or sys.stderr)

    own = [logging.getLogger(name) for name in OWN_HANDLERS]
    passed_on = [logger.propagate for logger in own]
    try:
        for logger in own:
            logger.propagate = False
        with warnings.catch_warnings(), logging_redirect_tqdm(loggers=[logging.getLogger(), *own], tqdm_class=tqdm):
            warnings.showwarning = show
            yield
    finally:
        for logger, propagate in zip(own, passed_on):
            logger.propagate = propagate
