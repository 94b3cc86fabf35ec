"""verifiers environments trained as they are (grpo/generation/verifiers_env.py): environments built with the
package's own classes (vf.SingleTurnEnv with a rubric, vf.ToolEnv with two tools), offline, on data sets made here;
the scripted sampler of tests/helpers/agents.py answers, so the tool calls happen the same way every run."""

import importlib.util
import json
import os

import pytest
import torch
from datasets import Dataset

from grpo import GRPOConfig, GRPOTrainer
from grpo.data import InputError
from grpo.generation.verifiers_env import from_verifiers, load_verifiers, rubric_weights
from grpo.testing import save_tiny_model
from tests.helpers.agents import SCRIPT, WRONG, ScriptedTurns, add, multiply, tool_tokenizer

try:
    import verifiers as vf
except ImportError:
    vf = None
needs_verifiers = pytest.mark.skipif(
    vf is None or not hasattr(vf, "Environment"),
    reason="needs verifiers<0.4 (its classic environments; make install installs it)",
)

G = 4
RIGHT = ["The answer is 25."]


def questions(n: int) -> Dataset:
    return Dataset.from_dict({"question": [f"row={i} What is (2 + 3) * 5?" for i in range(n)], "answer": ["25"] * n})


def correct(completion, answer, **kwargs) -> float:
    """The rubric's reward: the last message contains the answer."""
    return float(answer in (completion[-1].content or ""))


def says_answer(completion, **kwargs) -> float:
    """A second scored function: the last message says "answer"."""
    return float("answer" in (completion[-1].content or ""))


def turns(completion, **kwargs) -> float:
    """A metric (weight 0): the number of messages after the prompt."""
    return float(len(completion))


def rubric():
    return vf.Rubric(funcs=[correct, says_answer, turns], weights=[1.0, 0.5, 0.0])


def single_turn_env():
    return vf.SingleTurnEnv(dataset=questions(2), rubric=rubric())


def tool_env():
    return vf.ToolEnv(dataset=questions(2), tools=[add, multiply], max_turns=5, rubric=rubric())


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("model")
    save_tiny_model(path, max_position_embeddings=4096)  # prompts with the tools' schemas in bytes run long
    tool_tokenizer().save_pretrained(path)
    return str(path)


def make_trainer(tmp_path, model_path, env, scripts, per_function=False, **overrides):
    settings = dict(
        output_dir=str(tmp_path / "out"),
        use_cpu=True,
        bf16=False,
        report_to="none",
        max_completion_length=1000,
        max_prompt_length=None,
        num_generations=G,
        per_device_train_batch_size=G,
        max_steps=2,
        learning_rate=1e-2,
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        loss_type="grpo",
    )
    if per_function:
        settings["reward_weights"] = rubric_weights(env)
    tokenizer = tool_tokenizer()
    trainer = GRPOTrainer(
        model_path,
        args=GRPOConfig(**{**settings, **overrides}),
        processing_class=tokenizer,
        **from_verifiers(env, per_function=per_function),
    )
    trainer.generation = ScriptedTurns(tokenizer, scripts)
    trainer.agent.batch_window = 3600.0  # batches form only when every running episode waits: no timing in tests
    return trainer


def by_hand(completion, tools=()) -> tuple[dict[str, float], float]:
    """The rubric's scores of a rollout's messages, worked out here, and its total: 1 * correct + 0.5 * says_answer
    + 0 * turns; the metrics (weight 0) verifiers adds: `num_turns` (assistant turns) in multi-turn environments,
    `<tool>_calls` and `total_tool_calls` in tool environments."""
    text = completion[-1].content
    scores = {"correct": float("25" in text), "says_answer": float("answer" in text), "turns": float(len(completion))}
    scores["num_turns"] = float(sum(m.role == "assistant" for m in completion))
    called = [c.name for m in completion if m.role == "assistant" for c in m.tool_calls or ()]
    if tools:
        scores |= {f"{t}_calls": float(called.count(t)) for t in tools} | {"total_tool_calls": float(len(called))}
    return scores, scores["correct"] + 0.5 * scores["says_answer"]


def check_rollouts(trainer, rollout, columns, scripts, tools=()):
    """Each episode's rubric scores and total against `by_hand`, its trained tokens against the script its first
    answer took (the sampler hands scripts out by batch position, which the episodes' request order decides)."""
    assert columns["agent_error"] == [None] * G
    tokenizer = trainer.processing_class
    taken = []
    for row, state in enumerate(columns["vf_state"]):
        scores, total = by_hand(state["completion"], tools)
        assert columns["vf_metrics"][row] == scores and columns["vf_reward"][row] == total
        script = next(s for s in scripts if s[-1] == state["completion"][-1].content)
        taken.append(scripts.index(script))
        # The policy's turns, exactly as sampled, are trained; the tools' answers are context.
        ids, trained = rollout.completion_ids[row], rollout.loss_mask[row].bool()
        answers = [tokenizer(t, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] for t in script]
        assert ids[trained].tolist() == [t for turn in answers for t in turn]
        context = tokenizer.decode(ids[~trained & rollout.completion_mask[row].bool()])
        assert context.count("<tool_response>") == len(script) - 1
    assert sorted(taken) == [0, 0, 1, 1]  # G = 4 episodes, two of each script


@needs_verifiers
@pytest.mark.parametrize("per_function", [False, True])
def test_a_single_turn_env_trains_with_its_rubric_s_rewards(tmp_path, model_path, per_function):
    env = single_turn_env()
    trainer = make_trainer(tmp_path, model_path, env, (RIGHT, ["It is 7."]), per_function=per_function)
    assert trainer.train_dataset["prompt"][0] == [{"role": "user", "content": "row=0 What is (2 + 3) * 5?"}]
    rollout, columns = trainer.sample_round([trainer.train_dataset[0]] * G, trainer.generation)
    check_rollouts(trainer, rollout, columns, [RIGHT, ["It is 7."]])
    assert sorted(columns["vf_reward"]) == [0.0, 0.0, 1.5, 1.5]
    trainer.train()
    assert trainer.state.global_step == 2
    logged = trainer.state.log_history[0]
    if per_function:
        means = [logged[f"rewards/{n}/mean"] for n in ("correct", "says_answer", "turns", "num_turns")]
        assert means == [0.5, 0.5, 1.0, 1.0]
    assert logged["reward"] == pytest.approx(0.75)  # the rubric's total, weights applied either way


@needs_verifiers
def test_a_tool_env_runs_its_tools_through_the_endpoint_and_trains(tmp_path, model_path):
    env = tool_env()
    trainer = make_trainer(tmp_path, model_path, env, (SCRIPT, WRONG))
    rollout, columns = trainer.sample_round([trainer.train_dataset[0]] * G, trainer.generation)
    check_rollouts(trainer, rollout, columns, [SCRIPT, WRONG], tools=("add", "multiply"))
    # SCRIPT: add(2, 3), multiply(5, 5), then the answer; the environment ran the tools.
    state = next(s for s in columns["vf_state"] if len(s["completion"]) == 5)
    assert [m.content for m in state["completion"] if m.role == "tool"] == ["5", "25"]
    assert sorted(columns["vf_reward"]) == [0.5, 0.5, 1.5, 1.5]
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    assert trainer.state.global_step == 2
    assert any(not torch.equal(before[n], p) for n, p in trainer.model.named_parameters())


@needs_verifiers
def test_a_failed_verifiers_rollout_is_a_scored_failure(tmp_path, model_path):
    env = vf.SingleTurnEnv(dataset=questions(2), rubric=rubric(), sampling_args={"temperature": 0.3})
    trainer = make_trainer(tmp_path, model_path, env, (RIGHT,))
    _, columns = trainer.sample_round([trainer.train_dataset[0]] * 2, trainer.generation)
    # The environment asks for another temperature than the run's: the endpoint refuses, the episode fails.
    assert all("temperature" in e for e in columns["agent_error"])


@needs_verifiers
def test_what_cannot_train_is_refused_with_the_fix(tmp_path):
    with pytest.raises(InputError, match="needs a verifiers environment"):
        from_verifiers(object())

    def pair_reward(completions, **kwargs):  # a group-level reward function (verifiers: a plural argument)
        return [0.0] * len(completions)

    env = vf.SingleTurnEnv(dataset=questions(2), rubric=vf.Rubric(funcs=[pair_reward]))
    with pytest.raises(InputError, match="group-level reward functions"):
        from_verifiers(env)
    with pytest.raises(InputError, match="cannot be imported"):
        load_verifiers("tests.test_verifiers:no_such_env")
    assert isinstance(load_verifiers("tests.test_verifiers:tool_env"), vf.ToolEnv)


def test_ci_has_verifiers():
    # Without this, a CI whose install lost verifiers would skip every test above and still go green.
    if not os.environ.get("CI"):
        pytest.skip("only enforced under CI=1; locally the verifiers tests skip when verifiers is missing")
    assert importlib.util.find_spec("verifiers") is not None, "CI must have verifiers: `make install` installs it"


VF_ENV = """
import verifiers as vf
from datasets import Dataset


def correct(completion, answer, **kwargs):
    return float(answer in (completion[-1].content or ""))


def load_environment(rows=3):
    data = Dataset.from_dict({"question": [f"{i} + 1?" for i in range(rows)], "answer": [str(i + 1) for i in range(rows)]})
    return vf.SingleTurnEnv(dataset=data, rubric=vf.Rubric(funcs=[correct]))
"""


@needs_verifiers
def test_a_recipe_names_a_verifiers_environment_by_module(tmp_path, model_path, capsys, monkeypatch):
    import yaml

    from grpo.cli import main
    from grpo.cli.recipe import RecipeError, load_recipe

    monkeypatch.chdir(tmp_path)
    (tmp_path / "vf_env.py").write_text(VF_ENV)
    path = tmp_path / "recipe.yaml"
    recipe = {"model": model_path, "verifiers": {"env": "vf_env:load_environment", "args": {"rows": 5}}}
    path.write_text(yaml.safe_dump({**recipe, "num_generations": 2, "per_device_train_batch_size": 2}))
    assert main(["check", str(path)]) == 0
    out = capsys.readouterr().out
    # No dataset: section: the environment's 5 rows; its rubric's total as the one reward.
    assert "5 training prompts" in out and "verifiers:    vf_env:load_environment (its rollouts, rubric: " in out, out
    # ... and `grpo train` trains a step on it, the real model.generate answering through the endpoint.
    short = {"max_steps": 1, "max_completion_length": 8, "use_cpu": True, "report_to": "none"}  # a tiny model's words
    path.write_text(yaml.safe_dump({**recipe, "num_generations": 2, "per_device_train_batch_size": 2, **short}))
    assert main(["train", str(path)]) == 0, capsys.readouterr().err
    logged = json.loads((tmp_path / "outputs" / "recipe" / "trainer_state.json").read_text())["log_history"]
    assert "rewards/SingleTurnEnv/mean" in logged[0], logged  # the rubric's total, named after the environment
    capsys.readouterr()
    for bad, message in (
        ({"verifiers": "vf_env:load_environment", "rewards": ["accuracy"]}, r"\['rewards'\] cannot be given beside"),
        ({"verifiers": {"env": "vf_env:load_environment", "arg": {}}}, r"unknown keys \['arg'\]"),
        ({"verifiers": {"env": "vf_env:load_environment", "args": [1]}}, "verifiers.args must be a mapping"),
    ):
        path.write_text(yaml.safe_dump({"model": model_path, **bad}))
        with pytest.raises(RecipeError, match=message):
            load_recipe(path)
    path.write_text(yaml.safe_dump({"model": model_path, "verifiers": "vf_env:no_such", "output_dir": "other"}))
    assert main(["check", str(path)]) == 2
    assert "no attribute 'no_such'" in capsys.readouterr().err
