"""The learning-signal watch (grpo/training/signal_watch.py): one warning line, once, when a sign holds on WINDOW
logged steps in a row; nothing for fewer, for evaluation lines, or when it is turned off."""

import logging
from types import SimpleNamespace

import pytest

from grpo import GRPOConfig, GRPOTrainer
from grpo.training.signal_watch import WINDOW, SignalWatch
from tests.helpers.scripted import reward_len


def feed(watch, lines):
    for step, logs in enumerate(lines, start=1):
        watch.on_log(None, SimpleNamespace(is_world_process_zero=True, global_step=step), None, logs=logs)


@pytest.mark.parametrize(
    ("metric", "bad", "fine", "fix"),
    [
        ("completions/clipped_ratio", 1.0, 0.5, "raise max_completion_length"),
        ("frac_reward_zero_std", 1.0, 0.5, "finer-grained"),
        ("clip_ratio/region_mean", 0.95, 0.1, "lower learning_rate or num_iterations"),
    ],
)
def test_a_sign_held_for_the_window_warns_once(caplog, metric, bad, fine, fix):
    watch = SignalWatch()
    with caplog.at_level(logging.WARNING, logger="grpo.training.signal_watch"):
        feed(watch, [{metric: bad}] * (WINDOW - 1) + [{metric: fine}] + [{metric: bad}] * (WINDOW - 1))
        assert not caplog.records  # never WINDOW bad lines in a row
        feed(watch, [{metric: bad}] * (2 * WINDOW))
    assert len(caplog.records) == 1
    line = caplog.records[0].getMessage()
    assert metric in line and fix in line and "learning_signal_warnings=False" in line and "\n" not in line


def test_entropy_collapse_is_relative_to_its_first_value(caplog):
    with caplog.at_level(logging.WARNING, logger="grpo.training.signal_watch"):
        feed(SignalWatch(), [{"entropy": 0.04}] * 5)  # low from the start: a peaked model, not a collapse
        assert not caplog.records
        feed(SignalWatch(), [{"entropy": 2.0}] + [{"entropy": 0.05}] * WINDOW)
    assert len(caplog.records) == 1 and "entropy collapsed" in caplog.records[0].getMessage()


def test_evaluation_lines_and_other_processes_are_ignored(caplog):
    watch = SignalWatch()
    with caplog.at_level(logging.WARNING, logger="grpo.training.signal_watch"):
        feed(watch, [{"eval_completions/clipped_ratio": 1.0}] * 5)
        for _ in range(5):
            state = SimpleNamespace(is_world_process_zero=False, global_step=1)
            watch.on_log(None, state, None, logs={"completions/clipped_ratio": 1.0})
    assert not caplog.records


@pytest.mark.parametrize("on", [True, False])
def test_the_trainer_watches_unless_turned_off(tmp_path, tiny_model_path, prompt_dataset, on):
    args = GRPOConfig(
        output_dir=str(tmp_path),
        num_generations=2,
        per_device_train_batch_size=2,
        max_completion_length=4,
        report_to=[],
        learning_signal_warnings=on,
    )
    trainer = GRPOTrainer(tiny_model_path, reward_len, args=args, train_dataset=prompt_dataset)
    assert any(isinstance(c, SignalWatch) for c in trainer.callback_handler.callbacks) == on
