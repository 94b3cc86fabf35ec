"""Recipes: parsing, validation with suggestions, overrides, rewards by name, data sources and column mapping."""

import doctest
import json
import re
import sys
from pathlib import Path

import pytest
import torch
import yaml

from grpo.cli import main
from grpo.cli.datasets import load_prompt_datasets
from grpo.cli.plot import plot_run
from grpo.cli.recipe import (
    DatasetSection,
    RecipeError,
    RewardSpec,
    load_recipe,
    parse_overrides,
    resolve_agent,
    resolve_environment,
    resolve_reward,
    resolve_tool,
)
from grpo.data import InputError
from grpo.generation.episodes import CHATML_TOOLS_TEMPLATE
from grpo.testing import tiny_tokenizer
from tests.helpers.scripted import TINY
from tests.test_openenv import needs_openenv, settled

RECIPES = sorted((Path(__file__).parent.parent / "examples" / "recipes").glob("*.yaml"))


def write_recipe(tmp_path, **content):
    base = {"dataset": {"reasoning_gym": "basic_arithmetic", "size": 8}, "rewards": ["reasoning_gym"]}
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump({**base, **content}))
    return path


def test_recipe_fields_and_overrides(tmp_path):
    path = write_recipe(tmp_path, learning_rate="1e-5", max_steps=3, model="some/model")
    recipe = load_recipe(path, ["--max_steps", "7", "--dataset.size=20", "--num-generations", "4"])
    assert recipe.model.name_or_path == "some/model"
    assert recipe.dataset.size == 20
    # YAML reads 1e-5 as text; the field's type turns it into a float.
    assert recipe.config == {
        "learning_rate": 1e-5,
        "max_steps": 7,
        "num_generations": 4,
        "output_dir": "outputs/recipe",
    }
    config = recipe.grpo_config()
    assert config.max_steps == 7 and config.learning_rate == 1e-5


def test_unknown_top_level_key_names_it_and_suggests(tmp_path):
    path = write_recipe(tmp_path, learning_rat=1e-5)
    with pytest.raises(RecipeError, match=r"Unknown key 'learning_rat'.*Did you mean 'learning_rate'\?"):
        load_recipe(path)


def test_unknown_keys_in_sections_and_overrides(tmp_path):
    path = write_recipe(tmp_path)
    with pytest.raises(RecipeError, match=r"'promt_column' in the 'dataset' section.*'prompt_column'"):
        load_recipe(path, ["--dataset.promt_column", "question"])
    with pytest.raises(RecipeError, match=r"Unknown key 'datset'.*'dataset'"):
        load_recipe(path, ["--datset.size", "3"])
    with pytest.raises(RecipeError, match=r"rewards\[0\]: Unknown reward 'acuracy'.*Did you mean 'accuracy'\?"):
        load_recipe(write_recipe(tmp_path, rewards=["acuracy"]))
    with pytest.raises(RecipeError, match="needs a value"):
        parse_overrides(["--max_steps"])


def test_cli_reports_unknown_key_and_exits_2(tmp_path, capsys):
    path = write_recipe(tmp_path, num_generation=4)
    assert main(["train", str(path)]) == 2
    err = capsys.readouterr().err
    assert "Unknown key 'num_generation'" in err and "Did you mean 'num_generations'?" in err


def test_weights_go_to_reward_weights(tmp_path):
    path = write_recipe(tmp_path, rewards=[{"name": "reasoning_gym", "weight": 2.0}, "accuracy"])
    assert load_recipe(path).grpo_config().reward_weights == [2.0, 1.0]
    both = write_recipe(tmp_path, rewards=[{"name": "accuracy", "weight": 2.0}], reward_weights=[1.0])
    with pytest.raises(RecipeError, match="both"):
        load_recipe(both).grpo_config()


def test_dataset_needs_one_source(tmp_path):
    with pytest.raises(RecipeError, match="exactly one source"):
        load_recipe(write_recipe(tmp_path, dataset={"size": 3}))


def test_resolve_rewards():
    from grpo.rewards import accuracy

    assert resolve_reward(RewardSpec("accuracy")) is accuracy
    fmt = resolve_reward(RewardSpec("format_reward", kwargs={"pattern": r"\d+"}))
    assert fmt(["12", "x"]) == [1.0, 0.0]
    digit = resolve_reward(RewardSpec("tests.helpers.reward_module:contains_digit"))
    assert digit(["a1", "b"]) == [1.0, 0.0]
    short = resolve_reward(RewardSpec("tests.helpers.reward_module:length_at_most", kwargs={"limit": 2}))
    assert short(["ab", "abc"]) == [1.0, 0.0]
    with pytest.raises(RecipeError, match="cannot import module 'no_such_module'"):
        resolve_reward(RewardSpec("no_such_module:f"))


@pytest.mark.parametrize("suffix", ["jsonl", "csv", "parquet"])
def test_local_files_with_column_mapping(tmp_path, suffix):
    import pandas as pd

    frame = pd.DataFrame(
        {"question": [f"What is {i} + 1?" for i in range(10)], "solution": [str(i + 1) for i in range(10)]}
    )
    path = tmp_path / f"data.{suffix}"
    {
        "jsonl": lambda: frame.to_json(path, orient="records", lines=True),
        "csv": lambda: frame.to_csv(path, index=False),
        "parquet": lambda: frame.to_parquet(path),
    }[suffix]()
    section = DatasetSection(
        path=str(path),
        prompt_column="question",
        columns={"solution": "answer"},
        chat=True,
        system_prompt="Be brief.",
        eval_size=3,
    )
    train, held_out = load_prompt_datasets(section)
    assert len(train) == 7 and len(held_out) == 3
    assert set(train.column_names) == {"prompt", "answer"}
    row = train[0]
    assert row["prompt"][0] == {"role": "system", "content": "Be brief."}
    number = int(row["prompt"][1]["content"].split()[2])
    assert str(row["answer"]) == str(number + 1)  # the mapping kept each row's answer with its prompt
    assert {r["prompt"][1]["content"] for r in train}.isdisjoint({r["prompt"][1]["content"] for r in held_out})


def test_a_reward_module_of_the_same_name_in_another_folder_is_imported_afresh(tmp_path):
    """Two runs in one process, from two folders, each with its own agent_rewards_twin.py: the second gets its own
    file, not the module the first imported (and a syntax error in it is reported, not hidden by the cache)."""
    for name, value in (("a", 1.0), ("b", 2.0)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "agent_rewards_twin.py").write_text(
            f"def score(completions, **kwargs):\n    return [{value}] * len(completions)\n"
        )
    first = resolve_reward(RewardSpec("agent_rewards_twin:score"), [tmp_path / "a"])
    second = resolve_reward(RewardSpec("agent_rewards_twin:score"), [tmp_path / "b"])
    assert (first(["x"]), second(["x"])) == ([1.0], [2.0])
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "agent_rewards_twin.py").write_text("def score(:\n")
    with pytest.raises(InputError, match="has a syntax error"):
        resolve_reward(RewardSpec("agent_rewards_twin:score"), [tmp_path / "c"])


def test_a_reward_import_leaves_the_import_path_as_it_was(tmp_path, monkeypatch):
    """The working directory and the recipe's folder are on sys.path only while the module imports: afterwards
    sys.path is what it was, and the module still works, with the sibling it imported at its top; a package's
    submodule imported at call time is found through the package, not through sys.path."""
    recipe = tmp_path / "recipe"
    (recipe / "path_probe_pkg").mkdir(parents=True)
    (recipe / "path_probe_limit.py").write_text("LIMIT = 2\n")
    (recipe / "path_probe_rewards.py").write_text(
        "import path_probe_limit\n\n\n"
        "def short(completions, **kwargs):\n"
        "    return [float(len(c) <= path_probe_limit.LIMIT) for c in completions]\n"
    )
    (recipe / "path_probe_pkg" / "__init__.py").write_text(
        "def short(completions, **kwargs):\n"
        "    from . import limit\n\n"
        "    return [float(len(c) <= limit.LIMIT) for c in completions]\n"
    )
    (recipe / "path_probe_pkg" / "limit.py").write_text("LIMIT = 1\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))  # the test's own sys.path is put back even when it fails
    before = list(sys.path)
    try:
        top = resolve_reward(RewardSpec("path_probe_rewards:short"), [recipe])
        package = resolve_reward(RewardSpec("path_probe_pkg:short"), [recipe])
        assert sys.path == before
        assert top(["ab", "abc"]) == [1.0, 0.0] and package(["a", "ab"]) == [1.0, 0.0]
    finally:
        for name in [name for name in sys.modules if name.startswith("path_probe_")]:
            del sys.modules[name]


def test_worked_examples_sit_between_the_system_prompt_and_each_question(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text(
        "".join(json.dumps({"prompt": f"Calculate {i} * 3.", "answer": str(3 * i)}) + "\n" for i in range(4))
    )
    examples = [
        {"role": "user", "content": "Calculate 12 * 34."},
        {
            "role": "assistant",
            "content": '<tool_call>\n{"name": "multiply", "arguments": {"a": 12, "b": 34}}\n</tool_call>',
        },
        {"role": "tool", "content": "408"},
        {"role": "assistant", "content": "408"},
    ]
    train, _ = load_prompt_datasets(DatasetSection(path=str(path), system_prompt="Use the tool.", examples=examples))
    roles = [m["role"] for m in train[2]["prompt"]]
    assert roles == ["system", "user", "assistant", "tool", "assistant", "user"]
    assert train[2]["prompt"][1:5] == examples and train[2]["prompt"][5]["content"] == "Calculate 2 * 3."
    # Without a system prompt the examples come first; `examples` alone implies chat.
    train, _ = load_prompt_datasets(DatasetSection(path=str(path), examples=examples))
    assert [m["role"] for m in train[0]["prompt"]] == ["user", "assistant", "tool", "assistant", "user"]


@pytest.mark.parametrize(
    "examples, message",
    [
        ([{"role": "system", "content": "x"}, {"role": "assistant", "content": "y"}], "the system prompt is"),
        ([{"role": "user", "content": "Calculate 1 * 2."}], "ends with a user turn"),
        ([{"role": "user", "content": 12}, {"role": "assistant", "content": "y"}], "content must be a string"),
        (["Calculate 1 * 2."], "exactly the keys role and content"),
    ],
)
def test_bad_worked_examples_are_named(tmp_path, examples, message):
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps({"prompt": "q", "answer": "a"}) + "\n")
    with pytest.raises(RecipeError, match=message):
        load_prompt_datasets(DatasetSection(path=str(path), examples=examples))


def test_missing_prompt_column_is_explained(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps({"question": "q", "answer": "a"}) + "\n")
    with pytest.raises(RecipeError, match="prompt_column"):
        load_prompt_datasets(DatasetSection(path=str(path)))


@pytest.mark.slow  # importing reasoning-gym takes about 3 s
def test_reasoning_gym_task_with_template_and_scorer():
    from grpo.rewards import reasoning_gym

    section = DatasetSection(
        reasoning_gym="chain_sum", size=6, eval_size=2, prompt_template="{prompt} Answer in <answer></answer>."
    )
    train, held_out = load_prompt_datasets(section)
    assert len(train) == 6 and len(held_out) == 2
    assert train[0]["prompt"].endswith("Answer in <answer></answer>.")
    gold = [f"<answer>{a}</answer>" for a in train["answer"]]
    assert reasoning_gym(gold, metadata=train["metadata"], answer=train["answer"]) == [1.0] * 6


@pytest.mark.parametrize("recipe", RECIPES, ids=[p.name for p in RECIPES])
def test_example_recipes_validate(recipe):
    """Every shipped recipe parses, makes a valid GRPOConfig, names rewards that resolve and opens with its command."""
    parsed = load_recipe(recipe)
    if not torch.cuda.is_available():  # GPU recipes ask for bf16, which TrainingArguments refuses without use_cpu
        parsed.config.setdefault("use_cpu", True)
    parsed.grpo_config()
    for spec in parsed.rewards:
        resolve_reward(spec, [recipe.parent])
    for path in parsed.tools:
        resolve_tool(path, [recipe.parent])
    if parsed.agent is not None:
        assert callable(resolve_agent(parsed.agent, [recipe.parent]))
    first = recipe.read_text().splitlines()[0]
    assert first.startswith("# ") and "grpo train " + str(recipe.relative_to(recipe.parent.parent.parent)) in first


@pytest.mark.slow  # importing matplotlib takes about 2 s
def test_plot_writes_png(tmp_path):
    history = [
        {
            "step": s,
            "reward": 0.1 * s,
            "rewards/accuracy/mean": 0.1 * s,
            "kl": 0.01 * s,
            "completions/mean_length": 20 - s,
            "clip_ratio/region_mean": 0.0,
        }
        for s in range(1, 6)
    ] + [{"step": 0, "eval_reward": 0.2}, {"step": 0, "eval_greedy_accuracy": 0.25}, {"step": 5, "eval_reward": 0.4}]
    (tmp_path / "trainer_state.json").write_text(json.dumps({"log_history": history}))
    out = plot_run(tmp_path)
    assert out == tmp_path / "training.png"
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(FileNotFoundError, match="trainer_state.json"):
        plot_run(tmp_path / "nowhere")


def test_demo_reward_does_not_pay_for_restating_the_question():
    recipe = RECIPES[0].parent / "demo.yaml"
    (spec,) = load_recipe(recipe).rewards
    reward = resolve_reward(spec, [recipe.parent])
    # A demo run with math-verify's `accuracy` learned the second reply, which evaluates "1 + 9" to the answer.
    assert reward(["1 + 9 = 10", "To calculate 1 + 9, you simply add them"], answer=["10", "10"]) == [1.0, 0.0]


def test_demo_reward_pays_a_reply_that_stops_at_its_answer_more():
    recipe = RECIPES[0].parent / "demo.yaml"
    (spec,) = load_recipe(recipe).rewards
    reward = resolve_reward(spec, [recipe.parent])
    # The trained demo answered "6 + 4 = 10" and kept talking until the 12-token cut; paid in full for that, it never
    # learned to stop, and a longer max_completion_length lost the answer to the talk that followed.
    stopped, talks_on, wrong = reward(["6 + 4 = 10.", "6 + 4 = 10\n\nThe answer", "6 + 4 = 11"], answer=["10"] * 3)
    assert stopped > talks_on > wrong
    assert doctest.testmod(sys.modules[reward.__module__]).failed == 0


def test_agent_demo_reward_pays_the_answer_not_the_call():
    recipe = RECIPES[0].parent / "agent_calculator.yaml"
    parsed = load_recipe(recipe)
    (multiply,) = [resolve_tool(path, [recipe.parent]) for path in parsed.tools]
    (spec,) = parsed.rewards
    reward = resolve_reward(spec, [recipe.parent])
    call = {
        "role": "assistant",
        "content": '<tool_call>{"name": "multiply", "arguments": {"a": 12, "b": 34}}</tool_call>',
    }
    call["tool_calls"] = [{"type": "function", "function": {"name": "multiply", "arguments": {"a": 12, "b": 34}}}]
    answered = [call, {"role": "tool", "content": str(multiply(12, 34))}, {"role": "assistant", "content": "408"}]
    # Right after the call, wrong in the head, and a call left unanswered (its JSON holds no 408: b=408 would not
    # pay either, since a turn with a call is no answer), and a tool turn last.
    cut = [{**call, "content": call["content"].replace("34", "408")}]
    tool_last = [call, {"role": "tool", "content": "408"}]
    episodes = [answered, [{"role": "assistant", "content": "12 * 34 = 418"}], cut, tool_last]
    assert reward(episodes, answer=["408"] * 4) == [1.0, 0.0, 0.0, 0.0]


def test_yes_no_on_off_stay_strings_as_in_yaml_1_2(tmp_path):
    # YAML 1.1 reads `no` as False, which made `--save_strategy no` fail as "False is not a valid SaveStrategy".
    path = tmp_path / "recipe.yaml"
    path.write_text(
        "dataset: {reasoning_gym: basic_arithmetic, size: 8}\nrewards: [reasoning_gym]\neval_strategy: no\n"
    )
    recipe = load_recipe(path, ["--save_strategy", "no", "--bf16", "false", "--use_cpu", "true"])
    assert recipe.config["save_strategy"] == "no" and recipe.config["eval_strategy"] == "no"
    assert recipe.config["bf16"] is False and recipe.config["use_cpu"] is True
    assert recipe.grpo_config().save_strategy == "no"
    with pytest.raises(RecipeError, match=r"bf16='yes' \(str\) must be True or False"):
        load_recipe(path, ["--bf16", "yes"]).grpo_config()


def test_tools_and_chat_template_resolve(tmp_path):
    (tmp_path / "my_tools.py").write_text(
        "def multiply(a: int, b: int) -> int:\n"
        '    """Multiply.\n\n    Args:\n        a: one\n        b: two\n    """\n'
        "    return a * b\n"
    )
    path = write_recipe(tmp_path, tools=["my_tools:multiply"], model={"chat_template": "chatml_tools"})
    recipe = load_recipe(path)
    assert recipe.tools == ["my_tools:multiply"]
    assert resolve_tool(recipe.tools[0], [tmp_path])(6, 7) == 42
    assert recipe.model.chat_template_text() == CHATML_TOOLS_TEMPLATE
    # A template's own text is kept as written; one string is a list of one, also as an override.
    jinja = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    recipe = load_recipe(write_recipe(tmp_path, model={"chat_template": jinja}), ["--tools", "my_tools:multiply"])
    assert recipe.tools == ["my_tools:multiply"] and recipe.model.chat_template_text() == jinja
    assert load_recipe(write_recipe(tmp_path)).tools == [] and recipe.grpo_config()  # not a GRPOConfig field


@pytest.mark.parametrize(
    "content, message",
    [
        ({"tools": ["multiply"]}, r"tools\[0\]: 'multiply' is not a 'module:function' path"),
        ({"tools": ["my_tools:multiply", 3]}, r"tools\[1\]: 3 is not a 'module:function' path"),
        ({"tools": {"name": "my_tools:multiply"}}, "tools must be a list of 'module:function' paths, got dict"),
        ({"model": {"chat_template": "chatml_tool"}}, r"'chatml_tool' is neither a built-in.*'chatml_tools'\?"),
    ],
)
def test_bad_tools_and_chat_templates_fail_when_loaded(tmp_path, content, message):
    with pytest.raises(RecipeError, match=message):
        load_recipe(write_recipe(tmp_path, **content))


def test_resolve_tool_names_what_is_missing(tmp_path):
    (tmp_path / "some_tools.py").write_text("VALUE = 3\n")
    with pytest.raises(RecipeError, match=r"Tool 'no_such_module:f': cannot import module 'no_such_module'"):
        resolve_tool("no_such_module:f", [tmp_path])
    with pytest.raises(RecipeError, match=r"module 'some_tools' has no function 'f'"):
        resolve_tool("some_tools:f", [tmp_path])
    with pytest.raises(RecipeError, match=r"module 'some_tools' has no function 'VALUE'"):
        resolve_tool("some_tools:VALUE", [tmp_path])  # not callable


MULTIPLY = (
    "def multiply(a: int, b: int) -> int:\n"
    '    """Multiply.\n\n    Args:\n        a: one\n        b: two\n    """\n'
    "    return a * b\n"
)


@pytest.mark.parametrize(
    "chat, template, message",
    [
        (False, None, "tools need conversational prompts.*Set `dataset.chat: true`"),
        (True, None, r"does not render the tools \['multiply'\].*`model: \{chat_template: chatml_tools\}`"),
    ],
)
def test_tools_need_chat_prompts_and_a_template_that_renders_them(tmp_path, capsys, chat, template, message):
    # A folder with the tokenizer and no weights: the run fails before any model is loaded.
    tiny_tokenizer().save_pretrained(tmp_path / "tokenizer-only")
    (tmp_path / "my_tools.py").write_text(MULTIPLY)
    dataset = {"reasoning_gym": "basic_arithmetic", "size": 8, "chat": chat}
    model = {"name_or_path": str(tmp_path / "tokenizer-only"), "chat_template": template}
    path = write_recipe(tmp_path, model=model, dataset=dataset, tools=["my_tools:multiply"], use_cpu=True)
    assert main(["train", str(path)]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("grpo train: error:")]
    assert len(errors) == 1 and re.search(message, errors[0]), errors


@pytest.mark.slow
def test_recipe_trains_with_tools_and_reports_tool_use(tmp_path, tiny_model_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my_tools.py").write_text(MULTIPLY)
    path = write_recipe(
        tmp_path,
        model={"name_or_path": str(tiny_model_path), "chat_template": "chatml_tools"},
        dataset={"reasoning_gym": "basic_arithmetic", "size": 4, "eval_size": 2, "chat": True},
        tools=["my_tools:multiply"],
        output_dir="out",
        max_steps=1,
        run={"plot": False, "save_model": False},
        # Tiny on purpose (seconds): one prompt x 4 episodes of at most 16 tokens.
        **{**TINY, "max_completion_length": 16, "per_device_eval_batch_size": 4},
    )
    assert main(["train", str(path)]) == 0
    out = capsys.readouterr().out
    assert "eval_tools/call_frequency" in out and "eval_greedy_tool_use" in out
    history = json.loads((tmp_path / "out" / "trainer_state.json").read_text())["log_history"]
    assert [h["step"] for h in history if "eval_greedy_tool_use" in h] == [0, 1]  # before and after
    assert any("tools/call_frequency" in h for h in history if "loss" in h)  # the training steps were episodes


# An environment whose objects log their life to a file beside the module: made, reset, closed (by id).
COUNTER_ENV = """import os

LOG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "events.log")


class Counter:
    def __init__(self):
        self.total = 0
        self._log("made")

    def _log(self, what):
        with open(LOG, "a") as log:
            log.write(f"{what} {id(self)}\\n")

    def reset(self, **row):
        self.total = 0
        self._log("reset")
        return " Count up."

    def increment(self, by: int) -> int:
        \"\"\"Add to the counter.

        Args:
            by: how much to add
        \"\"\"
        self.total += by
        return self.total

    def get_reward(self) -> float:
        return float(self.total)

    def close(self):
        self._log("closed")


def make_counter():
    return Counter()
"""


def test_environment_key_forms(tmp_path):
    """`environment:` is one `module:attr` path or a mapping of names to them (also as an override); not a GRPOConfig
    field. Each path resolves to the callable it names, the recipe's folder on the import path."""
    (tmp_path / "counter_env.py").write_text(COUNTER_ENV)
    recipe = load_recipe(write_recipe(tmp_path, environment="counter_env:Counter"))
    assert recipe.environment == "counter_env:Counter" and recipe.grpo_config()
    factory = resolve_environment(recipe.environment, [tmp_path])
    assert factory.__name__ == "Counter" and factory().increment(3) == 3
    spec = {"counter": "counter_env:Counter", "made": "counter_env:make_counter"}
    recipe = load_recipe(
        write_recipe(tmp_path), ["--environment", "{counter: counter_env:Counter, made: counter_env:make_counter}"]
    )
    assert recipe.environment == spec
    factories = resolve_environment(recipe.environment, [tmp_path])
    assert list(factories) == ["counter", "made"] and type(factories["made"]()).__name__ == "Counter"
    assert load_recipe(write_recipe(tmp_path)).environment is None
    assert resolve_environment(None) is None


@pytest.mark.parametrize(
    "value, message",
    [
        ("Counter", r"environment: 'Counter' is not a 'module:attr' path"),
        (["counter_env:Counter"], r"environment: \['counter_env:Counter'\] is not a 'module:attr' path"),
        ({"counter": "counter_env"}, r"environment.counter: 'counter_env' is not a 'module:attr' path"),
        ({"counter": 3}, r"environment.counter: 3 is not a 'module:attr' path"),
        ({1: "counter_env:Counter"}, r"environment: the name 1 \(int\) is not a string.*quote it"),
        ({}, r"environment: the mapping is empty"),
    ],
)
def test_bad_environment_forms_fail_when_loaded(tmp_path, value, message):
    with pytest.raises(RecipeError, match=message):
        load_recipe(write_recipe(tmp_path, environment=value))


def test_agent_key_names_an_agent_function(tmp_path):
    """`agent:` is one `module:function` path, resolved with the recipe's folder on the import path; beside tools,
    an environment or a verifiers environment it is refused, as is a path to nothing callable."""
    (tmp_path / "my_agent.py").write_text("def solve(row, endpoint):\n    return None\n\nNOT_A_FUNCTION = 3\n")
    recipe = load_recipe(write_recipe(tmp_path, agent="my_agent:solve"))
    assert recipe.agent == "my_agent:solve" and resolve_agent(recipe.agent, [tmp_path]).__name__ == "solve"
    assert load_recipe(write_recipe(tmp_path)).agent is None and resolve_agent(None) is None
    with pytest.raises(RecipeError, match=r"agent: 'my_agent' is not a 'module:function' path"):
        load_recipe(write_recipe(tmp_path, agent="my_agent"))
    with pytest.raises(RecipeError, match=r"so \['tools'\] cannot be given beside it"):
        load_recipe(write_recipe(tmp_path, agent="my_agent:solve", tools=["my_agent:solve"]))
    for missing in ("my_agent:nothing", "my_agent:NOT_A_FUNCTION"):
        with pytest.raises(RecipeError, match=rf"agent '{missing}': module 'my_agent' has no function"):
            resolve_agent(missing, [tmp_path])
    with pytest.raises(RecipeError, match=r"'agent_func'.*Did you mean 'agent'\?"):
        load_recipe(write_recipe(tmp_path, agent_func="my_agent:solve"))


def test_trls_environment_factory_key_points_to_environment(tmp_path):
    with pytest.raises(RecipeError, match=r"'environment_factory'.*Did you mean 'environment'\?"):
        load_recipe(write_recipe(tmp_path, environment_factory="counter_env:Counter"))


def test_resolve_environment_names_what_is_wrong(tmp_path):
    (tmp_path / "bad_env.py").write_text(
        "from counter_env import Counter\n\nCOUNTER = Counter()\nSIZE = 3\n\n\n"
        "class Sized:\n    def __init__(self, size):\n        self.size = size\n"
    )
    (tmp_path / "counter_env.py").write_text(COUNTER_ENV)
    with pytest.raises(RecipeError, match=r"environment 'no_such_env:Game': cannot import module 'no_such_env'"):
        resolve_environment("no_such_env:Game", [tmp_path])
    with pytest.raises(RecipeError, match=r"environment.game 'bad_env:Game': module 'bad_env' has no attribute"):
        resolve_environment({"game": "bad_env:Game"}, [tmp_path])
    with pytest.raises(RecipeError, match=r"'bad_env:COUNTER' is not callable \(a Counter object\): name the"):
        resolve_environment("bad_env:COUNTER", [tmp_path])
    with pytest.raises(RecipeError, match=r"'bad_env:SIZE' is not callable \(a int object\)"):
        resolve_environment("bad_env:SIZE", [tmp_path])
    with pytest.raises(RecipeError, match=r"'bad_env:Sized' cannot be called without arguments.*'size'"):
        resolve_environment("bad_env:Sized", [tmp_path])


def test_check_prints_the_environment_and_the_tools_it_offers(tmp_path, capsys, monkeypatch):
    """`grpo check` makes one object of each environment to read its tools, and closes it."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "counter_env.py").write_text(COUNTER_ENV)
    rows = [{"prompt": f"Count to {i}.", "environment": "counter"} for i in range(8)]
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    dataset = {"path": "data.jsonl", "chat": True}
    # The check reads the tokenizer too (its template must render the tools): a tiny one, with a template that does.
    tiny_tokenizer().save_pretrained(tmp_path / "tokenizer-only")
    model = {"name_or_path": str(tmp_path / "tokenizer-only"), "chat_template": "chatml_tools"}
    environment = {"counter": "counter_env:Counter"}
    path = write_recipe(tmp_path, model=model, dataset=dataset, rewards=[], environment=environment)
    assert main(["check", str(path)]) == 0
    out = capsys.readouterr().out
    assert "  environment:  counter=counter_env:Counter (its tools: increment)" in out, out
    events = (tmp_path / "events.log").read_text().split()[::2]
    assert events == ["made", "closed"]  # the probe object, closed
    # A row naming an environment the recipe does not have is refused before any weight loads.
    rows[3]["environment"] = "maze"
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["check", str(path)]) == 2
    assert (
        "`environment` column holds ['maze'], not among the recipe's environments (counter)" in capsys.readouterr().err
    )


def test_the_chat_template_check_covers_the_environments_tools(tmp_path, capsys):
    """With an environment and no `tools:`, a template that does not render its methods fails before the weights."""
    tiny_tokenizer().save_pretrained(tmp_path / "tokenizer-only")
    (tmp_path / "counter_env.py").write_text(COUNTER_ENV)
    dataset = {"reasoning_gym": "basic_arithmetic", "size": 8, "chat": True}
    model = {"name_or_path": str(tmp_path / "tokenizer-only")}
    path = write_recipe(tmp_path, model=model, dataset=dataset, environment="counter_env:Counter", use_cpu=True)
    assert main(["train", str(path)]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("grpo train: error:")]
    assert len(errors) == 1 and "does not render the tools ['increment']" in errors[0], errors


@pytest.mark.slow
def test_recipe_trains_with_an_environment_and_closes_every_object(tmp_path, tiny_model_path, capsys, monkeypatch):
    """`grpo train` of a recipe naming an environment class (and a tool beside it): one step of episodes in it,
    its `get_reward` scored as a reward, and every object it made, the check's probe included, closed."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "counter_env.py").write_text(COUNTER_ENV)
    (tmp_path / "my_tools.py").write_text(MULTIPLY)
    path = write_recipe(
        tmp_path,
        model={"name_or_path": str(tiny_model_path), "chat_template": "chatml_tools"},
        dataset={"reasoning_gym": "basic_arithmetic", "size": 4, "eval_size": 2, "chat": True},
        tools=["my_tools:multiply"],
        environment="counter_env:Counter",
        output_dir="out",
        max_steps=1,
        max_tool_calling_iterations=2,
        run={"plot": False, "save_model": False},
        **{**TINY, "max_completion_length": 16, "per_device_eval_batch_size": 4},
    )
    assert main(["train", str(path)]) == 0
    history = json.loads((tmp_path / "out" / "trainer_state.json").read_text())["log_history"]
    step = [h for h in history if "loss" in h]
    assert len(step) == 1 and "rewards/Counter/mean" in step[0] and "tools/call_frequency" in step[0], step
    events = [line.split() for line in (tmp_path / "events.log").read_text().splitlines()]
    made = [obj for what, obj in events if what == "made"]
    closed = [obj for what, obj in events if what == "closed"]
    assert sorted(made) == sorted(closed) and len(made) >= 2  # the check's probe, then the trainer's objects
    # Every episode started from reset: 4 of training, and 2 held-out prompts x (4 sampled + 1 greedy), before
    # and after training.
    assert sum(what == "reset" for what, _ in events) == 4 + 2 * 2 * (4 + 1)


# A user's module that names an OpenEnv environment in one line (its server here: the test's echo app, on loopback).
ECHO_ENV = """from grpo.generation.openenv import openenv_environment
from tests.helpers.openenv_echo import EchoClient, echo_app

app, server = echo_app()
Echo = openenv_environment(EchoClient, app=app, observation="heard")
"""


@pytest.mark.slow
@needs_openenv
def test_recipe_trains_against_an_openenv_environment_and_closes_its_sessions(tmp_path, tiny_model_path, monkeypatch):
    from tests.helpers.openenv_echo import EchoEnvironment

    monkeypatch.chdir(tmp_path)
    EchoEnvironment.forget()
    (tmp_path / "echo_env.py").write_text(ECHO_ENV)
    path = write_recipe(
        tmp_path,
        model={"name_or_path": str(tiny_model_path), "chat_template": "chatml_tools"},
        dataset={"reasoning_gym": "basic_arithmetic", "size": 4, "chat": True},
        rewards=[],  # the server's rewards only (get_reward)
        environment="echo_env:Echo",
        output_dir="out",
        max_steps=1,
        max_tool_calling_iterations=2,
        run={"plot": False, "save_model": False},
        **{**TINY, "max_completion_length": 16},
    )
    assert main(["train", str(path)]) == 0
    history = json.loads((tmp_path / "out" / "trainer_state.json").read_text())["log_history"]
    # The adapter's class is named after the client; its get_reward is the server's reward.
    assert any("rewards/EchoClient/mean" in h for h in history if "loss" in h), history
    server = sys.modules["echo_env"].server
    assert settled(lambda: server.active_sessions == 0), f"{server.active_sessions} sessions left open"
    assert EchoEnvironment.made >= 2 and settled(lambda: EchoEnvironment.closed == EchoEnvironment.made)


@pytest.mark.parametrize(
    "text, key, lines",
    [
        ("learning_rate: 1e-5\nmax_steps: 3\nlearning_rate: 1e-4\n", "learning_rate", (1, 3)),
        ("dataset:\n  reasoning_gym: basic_arithmetic\nmax_steps: 3\ndataset:\n  path: x.jsonl\n", "dataset", (1, 4)),
        ("dataset:\n  reasoning_gym: basic_arithmetic\n  size: 8\n  size: 80\n", "dataset.size", (3, 4)),
        ("rewards:\n  - name: accuracy\n    weight: 1\n    weight: 2\n", "rewards[0].weight", (3, 4)),
    ],
)
def test_a_key_given_twice_is_an_error_naming_both_lines(tmp_path, text, key, lines):
    # YAML loaders keep the last of two equal keys without a word; a recipe must not train with either silently.
    path = tmp_path / "recipe.yaml"
    path.write_text(text)
    with pytest.raises(
        RecipeError,
        match=rf"the key '{re.escape(key)}' is given twice, at line {lines[0]} and "
        rf"line {lines[1]}",
    ):
        load_recipe(path)


def test_an_empty_recipe_says_it_is_empty(tmp_path, capsys):
    path = tmp_path / "recipe.yaml"
    path.write_text("# nothing yet\n\n")
    with pytest.raises(RecipeError, match=r"recipe.yaml is empty: a recipe needs at least a `dataset:` section"):
        load_recipe(path)
    assert main(["train", str(path)]) == 2
    err = capsys.readouterr().err
    assert "is empty" in err and "dataset section needs" not in err


class _TwoToolScript:
    """A sampler playing the two-tool recipe's episodes on its real prompts, in the form of its worked examples: it
    reads `a * b + c` from the context's last question and, by the tool answers that follow it, writes the multiply
    call, then the product echoed and the add call, each time answering instead once `stop_after` tool answers are
    in: `<product> + c = <the last tool answer>` (the product itself when no add was called)."""

    def __init__(self, tokenizer, stop_after):
        self.tokenizer, self.stop_after = tokenizer, stop_after

    def sync_weights(self, model, version):
        pass

    def generate(self, model, prompt_ids):
        from grpo.generation import Completions
        from tests.helpers.agents import call

        out = []
        for ids in prompt_ids:
            context = self.tokenizer.decode(ids)
            question = context[context.rindex("Calculate ") :]
            a, b, c = (int(n) for n in re.findall(r"\d+", question.split(".")[0]))
            answers = re.findall(r"<tool_response>\n(-?\d+)\n", question)
            if len(answers) == self.stop_after:
                turn = f"{answers[0]} + {c} = {answers[-1]}"
            elif not answers:
                turn = call("multiply", a=a, b=b)
            else:  # the product echoed, then the call, as in the recipe's worked examples
                turn = f"{answers[0]} + {c}:\n" + call("add", a=int(answers[0]), b=c)
            out.append(self.tokenizer(turn, add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id])
        return Completions(out)


def test_two_tool_recipe_checks_and_pays_multiply_then_add(tmp_path, monkeypatch, capsys):
    """The two-tool recipe passes `grpo check`; its rows are its generator's and its docstrings' examples hold; played
    through a trainer on its own prompts, tools and reward, episodes that call multiply then add earn 1 and those
    that answer the product 0."""
    from grpo import GRPOConfig, GRPOTrainer
    from grpo.testing import tiny_model
    from tests.helpers.agents import AGENT, tool_tokenizer

    root = RECIPES[0].parent.parent.parent
    monkeypatch.chdir(root)  # the recipe names its rows relative to the repository's root
    recipe = Path("examples/recipes/agent_two_tools.yaml")
    assert main(["check", str(recipe), "--output_dir", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert "400 training prompts, 32 held out" in out and "agent_two_tools:multiply, agent_two_tools:add" in out
    parsed = load_recipe(recipe)
    tools = [resolve_tool(path, [recipe.parent]) for path in parsed.tools]
    rewards = [resolve_reward(name, [recipe.parent]) for name in parsed.rewards]  # final_answer, right_steps
    generator = sys.modules["agent_two_tools"]
    rows = [json.loads(line) for line in (recipe.parent / "agent_two_tools.jsonl").read_text().splitlines()]
    assert rows == generator.rows()  # the committed rows are what `python agent_two_tools.py` writes
    assert doctest.testmod(generator).failed == 0  # the reward's and the generator's examples
    train, held_out = load_prompt_datasets(parsed.dataset)
    questions = [{p[-1]["content"] for p in data["prompt"]} for data in (train, held_out)]
    assert len(questions[0]) == 400 and len(questions[1]) == 32 and not questions[0] & questions[1]  # kept apart

    tokenizer = tool_tokenizer()
    settings = {**AGENT, "max_tool_calling_iterations": 2, "turn_advantage": parsed.config["turn_advantage"]}
    args = GRPOConfig(output_dir=str(tmp_path / "out"), **settings)
    model = tiny_model(tokenizer, max_position_embeddings=2048)  # room for the recipe's long prompts
    trainer = GRPOTrainer(model, rewards, args=args, train_dataset=train, processing_class=tokenizer, tools=tools)
    episodes = [held_out[i] for i in range(4)]
    for stop_after, paid in ((2, 1.0), (1, 0.0)):
        rollout, columns = trainer.sample_round(episodes, _TwoToolScript(tokenizer, stop_after))
        rollout = trainer.rounds.score_round(rollout, columns, None, trainer.state)
        called = [
            [m["tool_calls"][0]["function"]["name"] for m in e if m.get("tool_calls")] for e in rollout.completions
        ]
        assert called == [["multiply", "add"][:stop_after]] * 4
        assert rollout.rewards_per_func[:, 0].tolist() == [paid] * 4
        # right_steps per turn: multiply(a, b), add(a * b, c), the sum; or multiply, then an answer where add belongs
        columns, _ = trainer.rewards.columns(rollout.rewards_per_func, rollout.step_rewards, rollout.turn_rewards)
        assert columns[:, 1].tolist() == [3.0 if stop_after == 2 else 1.0] * 4
