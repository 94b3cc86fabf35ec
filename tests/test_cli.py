"""`grpo train` and `grpo plot` through the command line, as a user runs them (subprocesses)."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.helpers.net import launch_two_processes

ROOT = Path(__file__).parent.parent


def run_grpo(*args, cwd):
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return subprocess.run([sys.executable, "-m", "grpo", *args], cwd=cwd, env=env, capture_output=True, text=True)


def write_tiny_recipe(tmp_path, model_path):
    rows = [{"question": f"What is {i} + 1?", "solution": str(i + 1)} for i in range(12)]
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "my_rewards.py").write_text(
        "def has_digit(completions, **kwargs):\n"
        "    return [float(any(ch.isdigit() for ch in c[-1]['content'])) for c in completions]\n"
    )
    recipe = {
        "model": str(model_path),
        "dataset": {
            "path": "data.jsonl",
            "prompt_column": "question",
            "columns": {"solution": "answer"},
            "chat": True,
            "eval_size": 4,
        },
        "rewards": [{"name": "accuracy", "weight": 1.0}, {"name": "my_rewards:has_digit", "weight": 0.5}],
        "output_dir": "out",
        # Tiny on purpose: 2 steps of one prompt x 4 completions of at most 8 tokens keep the run to seconds.
        "num_generations": 4,
        "per_device_train_batch_size": 4,
        "per_device_eval_batch_size": 4,
        "max_completion_length": 8,
        "max_steps": 10,
        "logging_steps": 1,
        "log_completions": True,
        "num_completions_to_print": 2,
        "save_strategy": "no",
        "report_to": ["tensorboard"],
        "run": {"sample_completions": 2},
    }
    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump(recipe))


@pytest.mark.slow
def test_grpo_train_tiny_recipe_then_plot(tmp_path, tiny_model_path):
    write_tiny_recipe(tmp_path, tiny_model_path)
    result = run_grpo("train", "tiny.yaml", "--max_steps", "2", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    out = tmp_path / "out"
    state = json.loads((out / "trainer_state.json").read_text())
    assert state["global_step"] == 2  # the command-line override won over the file's max_steps
    first_step = next(h for h in state["log_history"] if h["step"] == 1)
    assert "rewards/has_digit/mean" in first_step
    assert (out / "model.safetensors").is_file()
    assert "eval_reward" in result.stdout and "before" in result.stdout and "prompt: " in result.stdout
    assert "eval_greedy_accuracy" in result.stdout
    # A CPU run is quiet: no pin_memory warning from the data loader, no DeepSpeed accelerator guess (DeepSpeed's
    # logger writes to stdout).
    assert "pin_memory" not in result.stderr and "Setting accelerator to CPU" not in result.stdout + result.stderr
    # The metrics as one short line of numbers per step, not Trainer's dict of quoted strings.
    assert "step 1/2 | loss " in result.stdout and "{'loss'" not in result.stdout
    # Greedy accuracy before (step 0) and after (step 2), in the saved log beside eval_reward.
    assert [h["step"] for h in state["log_history"] if "eval_greedy_accuracy" in h] == [0, 2]
    records = [json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines()]
    assert {r["step"] for r in records} == {1, 2} and set(records[0]["rewards"]) == {"accuracy", "has_digit"}
    # Every line names the train() call that wrote it (a resumed run's lines are told apart from the killed run's).
    assert len({r["run"] for r in records}) == 1
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", records[0]["run"])
    assert (out / "training.png").read_bytes()[:4] == b"\x89PNG"
    assert list((out / "runs").rglob("events.out.tfevents.*"))  # report_to: [tensorboard]

    (out / "training.png").unlink()
    plotted = run_grpo("plot", "out", cwd=tmp_path)
    assert plotted.returncode == 0, plotted.stderr[-3000:]
    assert plotted.stdout.strip().endswith("training.png") and (out / "training.png").is_file()


@pytest.mark.slow
def test_grpo_train_unknown_key_fails_before_loading_anything(tmp_path):
    (tmp_path / "bad.yaml").write_text(
        "dataset: {reasoning_gym: chain_sum}\nrewards: [reasoning_gym]\nlearning_rat: 0.1\n"
    )
    result = run_grpo("train", "bad.yaml", cwd=tmp_path)
    assert result.returncode == 2
    assert "Unknown key 'learning_rat'" in result.stderr and "Did you mean 'learning_rate'?" in result.stderr


@pytest.mark.distributed
def test_grpo_train_under_accelerate_launch(tmp_path, tiny_model_path):
    """The same command under `accelerate launch -m grpo train`, two CPU processes (gloo)."""
    write_tiny_recipe(tmp_path, tiny_model_path)
    result = launch_two_processes("-m", "grpo", "train", "tiny.yaml", "--max_steps", "2", cwd=tmp_path)
    records = [json.loads(line) for line in (tmp_path / "out" / "completions.jsonl").read_text().splitlines()]
    # Each logged round holds the gathered rows of both processes: 2 x 4 completions (one process logs 4).
    assert [sum(r["step"] == step for r in records) for step in (1, 2)] == [8, 8]
    assert result.stdout.count("held-out metric") == 1  # only the main process prints the report


def test_accelerate_configs_load():
    from accelerate.commands.config.config_args import load_config_from_file

    configs = sorted((ROOT / "examples" / "accelerate_configs").glob("*.yaml"))
    kinds = {load_config_from_file(str(path)).distributed_type.value for path in configs}
    assert kinds == {"NO", "MULTI_GPU", "DEEPSPEED", "FSDP"}
    for path in configs:
        assert path.read_text().startswith(
            "# accelerate launch --config_file examples/accelerate_configs/" + path.name
        )
