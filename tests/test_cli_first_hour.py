"""What a new user sees first (issue 30): `grpo check`, `grpo train --help`, `grpo --version`, `grpo env`, the
completions table and our own code paths without deprecation warnings. The mistakes are in test_cli_mistakes.py."""

import dataclasses
import warnings

import pytest
import torch

from grpo.cli import main
from grpo.config import GRPOConfig
from grpo.training.metrics import format_completions, printable
from tests.test_cli_mistakes import BASE, write_files


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_check_says_what_would_run_and_writes_nothing(workdir, capsys):
    write_files(workdir, BASE)
    assert main(["check", "r.yaml", "--max_steps", "7"]) == 0
    out = capsys.readouterr().out
    assert "r.yaml: valid (no weights were loaded)." in out
    assert "steps:        7 (max_steps)" in out
    assert "1 prompts x G=2 completions per process, at most 4 tokens each" in out
    assert "data:         8 training prompts" in out and "rewards:      my_rewards:short" in out
    assert "model.generate in this process" in out and "output_dir:   out" in out
    assert not (workdir / "out").exists()  # a check creates no output directory


def test_train_help_lists_every_key_with_default_and_help(capsys):
    assert main(["train", "--help"]) == 0
    out = capsys.readouterr().out
    for f in dataclasses.fields(GRPOConfig):
        if f.init:
            assert f"  --{f.name} (default " in out, f.name
    assert "  --num_generations (default 8)" in out
    assert "G, completions sampled per prompt" in out  # the field's own help text
    assert "dataset.eval_size (default 0)" in out and "peft.r (default 16)" in out
    assert main(["train", "r.yaml", "--help"]) == 0  # after a recipe too
    assert "--num_generations (default 8)" in capsys.readouterr().out


def test_version_and_env(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out.startswith("grpo ")
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    assert f"torch:         {torch.__version__}" in out
    for name in ("python:", "transformers:", "accelerate:", "peft:", "vllm:", "deepspeed:", "device:", "flags"):
        assert name in out, name


def test_completions_table_escapes_control_characters():
    samples = [{"prompt": "p\x1b[2J", "completion": "a\rb\tc\nd\x07", "rewards": [1.0], "advantage": 0.5}]
    table = format_completions(samples, ["r"])
    assert table.splitlines()[1] == "p\\x1b[2J | a\\rb\\tc\\nd\\x07 | 1.000 | +0.500"
    assert printable("é ü 7") == "é ü 7"  # printable text is left alone


def test_shared_prompt_pass_emits_no_deprecation_warning(tokenizer):
    """The log-prob pass over rows that share a prompt (the grouped layout, built with transformers' mask builder)
    calls nothing transformers has deprecated."""
    from grpo.data import pad
    from grpo.objective.logprobs import completion_logprobs
    from grpo.testing import tiny_model

    model = tiny_model(tokenizer, seed=0)
    prompts, prompt_mask = pad([[5, 6, 7]] * 2, 256, "left")
    completions, completion_mask = pad([[20, 21], [22, 23]], 256, "right")
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        warnings.simplefilter("error", DeprecationWarning)
        completion_logprobs(model, prompts, prompt_mask, completions, completion_mask, temperature=1.0)


def test_gradient_checkpointing_is_read_under_its_current_name(workdir):
    from grpo.cli.recipe import load_recipe

    write_files(workdir, BASE)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        args = load_recipe("r.yaml", ["--gradient_checkpointing", "true"]).grpo_config()
    assert args.activation_checkpointing is True


def test_plot_panels_for_loss_learning_rate_and_grad_norm_with_whole_steps(tmp_path):
    import json

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from grpo.cli import plot

    history = [
        {
            "step": s,
            "reward": 0.1 * s,
            "loss": 0.5 - 0.1 * s,
            "learning_rate": 1e-5 * (4 - s),
            "grad_norm": s,
            "entropy": 5.5 + 0.0001 * s,
        }
        for s in range(1, 4)
    ]
    chosen = dict(plot.panels(history, []))
    assert chosen["loss"] == ["loss"] and chosen["learning rate"] == ["learning_rate"]
    assert chosen["gradient norm (before clipping)"] == ["grad_norm"]
    # An entropy that moves by 0.0002 is drawn at a scale of 1% of 5.5: flat, not a cliff.
    fig, ax = plt.subplots()
    ax.plot([1, 2, 3], [h["entropy"] for h in history])
    plot._at_least_one_percent(ax, [h["entropy"] for h in history])
    low, high = ax.get_ylim()
    assert high - low >= 0.11 - 1e-9
    plt.close(fig)
    (tmp_path / "trainer_state.json").write_text(json.dumps({"log_history": history}))
    assert plot.plot_run(tmp_path).read_bytes()[:4] == b"\x89PNG"


def test_progress_bars_are_labelled_and_evaluation_opens_at_zero():
    from types import SimpleNamespace

    from grpo.cli.progress import LabelledProgress

    progress, state = LabelledProgress(), SimpleNamespace(is_world_process_zero=True, max_steps=3, global_step=0)
    progress.open_evaluation(2)  # grpo train opens it before the first batch: 0 of 2, not 1 of 2 after it
    assert progress.prediction_bar.n == 0 and progress.prediction_bar.total == 2
    progress.on_prediction_step(None, state, None, eval_dataloader=[1, 2])
    assert progress.prediction_bar.n == 1 and progress.prediction_bar.desc.startswith("evaluating")
    progress.on_evaluate(None, state, None)
    progress.on_train_begin(None, state, None)
    assert progress.training_bar.desc.startswith("training")
    # An evaluation Trainer starts itself (eval_steps) opens at its first batch, dated back to the last step's end.
    progress._since -= 100.0
    progress.on_prediction_step(None, state, None, eval_dataloader=[1, 2])
    assert progress.prediction_bar.n == 1 and progress.prediction_bar.start_t == progress._since
    progress.prediction_bar.close()
    progress.training_bar.close()


def test_metrics_line_reads_as_numbers_with_the_few_that_matter_first():
    from grpo.cli.progress import metrics_line

    logs = {
        "loss": -0.012264,
        "grad_norm": 2.274,
        "learning_rate": 3.333e-07,
        "completions/mean_length": 9.25,
        "completions/clipped_ratio": 0.125,
        "rewards/fmt/mean": 0.5,
        "rewards/acc/mean": 0.75,
        "reward": 1.25,
        "reward_std": 0.4821,
        "kl": 0.00123,
        "entropy": 5.544,
        "num_tokens": 598.0,
        "epoch": 0.25,
    }
    line = metrics_line(logs, 3, 25, 12.34)
    assert line == (
        "step 3/25 | loss -0.01226 | reward 1.25 | reward_std 0.4821 | fmt 0.5 | acc 0.75 | length 9.25 | clipped 0.125"
        " | kl 0.00123 | 12.3 s/step"
    )
    assert "'" not in line and "entropy" not in line and "learning_rate" not in line
    one = {k: v for k, v in logs.items() if k not in ("rewards/fmt/mean", "kl")}  # one function (its mean is
    assert metrics_line(one, 3, 25) == (  # the reward), beta = 0 (no kl)
        "step 3/25 | loss -0.01226 | reward 1.25 | reward_std 0.4821 | length 9.25 | clipped 0.125"
    )
    evaluation = {"eval_reward": 0.5, "eval_completions/clipped_ratio": 0.0, "eval_runtime": 3.2, "epoch": 1.0}
    assert metrics_line(evaluation, 10, 25) == "evaluation at step 10/25 | reward 0.5 | clipped 0"
    assert metrics_line({"train_runtime": 61.7, "train_loss": 0.0}, 25, 25) == "training done: 25 steps in 62 s"
    assert (
        metrics_line({"mine": 1234.567, "tiny": 0.000123, "tinier": 0.00001234}, 1, 0)
        == "mine 1235 | tiny 0.000123 | tinier 1.234e-05"
    )


def test_progress_writes_the_metrics_line_not_the_dict(capsys):
    from types import SimpleNamespace

    from grpo.cli.progress import LabelledProgress

    progress, state = LabelledProgress(), SimpleNamespace(is_world_process_zero=True, max_steps=2, global_step=0)
    progress.on_train_begin(None, state, None)
    state.global_step = 1
    progress.on_log(None, state, None, logs={"loss": 0.5, "reward": 0.25, "reward_std": 0.1, "entropy": 5.0})
    progress.training_bar.close()
    out = capsys.readouterr().out
    assert out.startswith("step 1/2 | loss 0.5 | reward 0.25 | reward_std 0.1 | ") and out.endswith(" s/step\n")
    assert "{" not in out and "entropy" not in out


def test_completions_table_shows_the_question():
    system = {"role": "system", "content": "You are a helpful assistant. Think step by step, then answer briefly."}
    question = {"role": "user", "content": "What is 17 * 23?"}
    earlier = [system, {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]
    samples = [
        {"prompt": [system, question], "completion": "391", "rewards": [1.0], "advantage": 0.5},
        {"prompt": [*earlier, question], "completion": "391", "rewards": [1.0], "advantage": 0.5},
        {
            "prompt": "Solve it and give the number alone. " * 3 + "What is 2 + 2?",
            "completion": "4",
            "rewards": [1.0],
            "advantage": 0.0,
        },
    ]
    rows = format_completions(samples, ["r"]).splitlines()[1:]
    assert rows[0].startswith("What is 17 * 23? | 391") and rows[1].startswith("What is 17 * 23? | 391")
    assert rows[2].startswith("...") and rows[2].split(" | ")[0].endswith("What is 2 + 2?")
    assert len(rows[2].split(" | ")[0]) == 40
