"""Other libraries' output during `grpo train` (grpo/cli/progress.py `lines_above_bars`, grpo/cli/datasets.py):
warnings and log lines are written above the progress bars, not on their line, and datasets draws no bars."""

import logging
import re
import warnings

import datasets
import pytest
import yaml
from tqdm.auto import tqdm

from grpo.cli import main
from grpo.cli.datasets import load_prompt_datasets
from grpo.cli.progress import lines_above_bars
from grpo.cli.recipe import DatasetSection
from tests.helpers.scripted import TINY


def test_warnings_and_log_lines_go_through_tqdm_once_each_and_everything_is_restored(monkeypatch):
    written = []
    monkeypatch.setattr(tqdm, "write", classmethod(lambda cls, text, file=None, **kw: written.append(text)))
    show, own = warnings.showwarning, logging.getLogger("datasets")
    handlers = {name: list(logging.getLogger(name).handlers) for name in ("", "transformers", "torch", "datasets")}
    propagate = own.propagate
    with lines_above_bars(), warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.warn("a library's warning", UserWarning, stacklevel=1)
        logging.getLogger("transformers.generation").warning("a transformers line")
        logging.getLogger("datasets.arrow_dataset").warning("a datasets line")
        logging.getLogger("grpo.training").warning("a grpo line")
        logging.getLogger("accelerate.utils").warning("an accelerate line")
    assert [w for w in written if "UserWarning: a library's warning" in w] != []
    for line in ("a transformers line", "a datasets line", "a grpo line", "an accelerate line"):
        assert sum(line in w for w in written) == 1, (line, written)  # once: no second copy through the root
    assert warnings.showwarning is show and own.propagate is propagate
    assert {name: list(logging.getLogger(name).handlers) for name in handlers} == handlers


def test_loading_prompts_for_the_command_line_turns_datasets_bars_off(tmp_path):
    (tmp_path / "p.jsonl").write_text('{"question": "1 + 1", "answer": "2"}\n' * 4)
    datasets.enable_progress_bars()
    try:
        load_prompt_datasets(DatasetSection(path=str(tmp_path / "p.jsonl"), prompt_column="question", chat=True))
        assert datasets.are_progress_bars_disabled()  # no "Map:" bar above the plan or an error line
    finally:
        datasets.enable_progress_bars()


NOISY = """
import logging
import warnings


def noisy(completions, **kwargs):
    warnings.warn("noisy reward: its own warning")
    logging.getLogger("transformers.noisy").warning("noisy reward: a transformers line")
    return [0.0 for _ in completions]
"""


@pytest.mark.slow
def test_a_warning_during_training_starts_a_line_of_its_own(tmp_path, tiny_model_path, capfd, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "noisy.py").write_text(NOISY)
    recipe = {
        "model": str(tiny_model_path),
        "dataset": {"reasoning_gym": "basic_arithmetic", "size": 8},
        "rewards": ["noisy:noisy"],
        "output_dir": "out",
        "max_steps": 1,
        "run": {"plot": False, "save_model": False},
        **TINY,
        "disable_tqdm": False,  # the bars are what a warning used to land on
    }
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(recipe))
    assert main(["train", "r.yaml"]) == 0
    err = capfd.readouterr().err
    assert "training:" in err  # the bar was drawn
    for message in ("UserWarning: noisy reward: its own warning", "noisy reward: a transformers line"):
        (line,) = [line for line in err.split("\n") if message in line]
        # What the terminal shows of the line: the text after its last carriage return. Written on the bar's line,
        # the warning followed "training:   0%| ... [00:00<?, ?step/s]" with no return between.
        shown = line.split("\r")[-1]
        assert "%|" not in shown and re.search(r"step/s\]\S", line) is None, repr(line)
