"""Every mistake a user can make at the command line is one line on stderr and exit status 2, with no traceback,
before any weight loads where possible (issue 30, "The first hour"; issue 38's messages that gave a wrong remedy).

Each row of MISTAKES is (files written into an empty working directory, the command's arguments, environment
variables, a distinctive part of the one line). The command runs in this process (`grpo.cli.main`), which takes
milliseconds for the rows that fail before the model; the rows that need a process of their own (a file-size limit)
or a training step (a reward function's bug) are below the table.
"""

import errno
import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from grpo.cli import main

ROOT = Path(__file__).parent.parent

DATA = "".join(f'{{"prompt": "What is {i} + 1?", "answer": "{i + 1}"}}\n' for i in range(8))
REWARDS = "def short(completions, **kwargs):\n    return [-float(len(str(c))) for c in completions]\n"
# Small on purpose: 2 completions of 4 tokens per prompt; nothing in the table gets as far as generating.
RECIPE = """model: smollm2-135m-instruct
dataset: {path: data.jsonl}
rewards: [my_rewards:short]
output_dir: out
max_steps: 2
num_generations: 2
per_device_train_batch_size: 2
max_completion_length: 4
"""
BASE = {"data.jsonl": DATA, "my_rewards.py": REWARDS, "r.yaml": RECIPE}
# The answers under another name, and a reward that reads them as `answer` (issue 52: the fix is a column mapping).
SOLUTIONS = DATA.replace('"answer"', '"solution"')
NEEDS_ANSWER = (
    "def short(completions, answer, **kwargs):\n    return [float(a in c) for c, a in zip(completions, answer)]\n"
)


def recipe(**replace) -> dict:
    """BASE with lines of the recipe replaced: recipe(rewards="rewards: [x]") swaps the line starting 'rewards:'."""
    lines = [replace.get(line.split(":")[0], line) for line in RECIPE.splitlines()]
    return {**BASE, "r.yaml": "\n".join(lines) + "\n"}


# Environments for the `environment:` rows: a good one, an object of it, and one of each mistake.
ENVIRONMENTS = """
class Counter:
    def reset(self, **row):
        return None

    def increment(self, by: int) -> int:
        \"\"\"Add to the counter.

        Args:
            by: how much to add
        \"\"\"
        return by


COUNTER = Counter()


class NoReset:
    def increment(self, by: int) -> int:
        \"\"\"Add.

        Args:
            by: how much to add
        \"\"\"
        return by


class Broken:
    def __init__(self):
        raise ConnectionRefusedError("no server at 127.0.0.1:8000")


class Sized:
    def __init__(self, size):
        self.size = size
"""


def environment(value: str, key: str = "environment") -> dict:
    """BASE with chat prompts, ENVIRONMENTS as my_env.py and the line `key: value` added to the recipe."""
    files = recipe(dataset="dataset: {path: data.jsonl, chat: true}")
    return {**files, "my_env.py": ENVIRONMENTS, "r.yaml": files["r.yaml"] + f"{key}: {value}\n"}


MISTAKES = [
    # The recipe file and its syntax.
    ("no recipe named", BASE, ["train"], {}, "Name a recipe: grpo train RECIPE.yaml"),
    ("recipe file missing", BASE, ["check", "nope.yaml"], {}, "Recipe file 'nope.yaml' not found."),
    ("empty recipe", {**BASE, "r.yaml": "# nothing yet\n"}, ["check", "r.yaml"], {}, "r.yaml is empty"),
    ("yaml syntax", {**BASE, "r.yaml": "dataset: {path: data.jsonl\n"}, ["check", "r.yaml"], {}, "YAML syntax error"),
    ("key twice", {**BASE, "r.yaml": RECIPE + "max_steps: 3\n"}, ["check", "r.yaml"], {}, "max_steps"),
    ("unknown key", BASE, ["check", "r.yaml", "--learning_rat", "1e-5"], {}, "Did you mean 'learning_rate'?"),
    ("unknown section key", BASE, ["check", "r.yaml", "--dataset.sise", "5"], {}, "Did you mean 'size'?"),
    ("unknown section", BASE, ["check", "r.yaml", "--datset.size", "5"], {}, "Did you mean 'dataset'?"),
    ("override without value", BASE, ["check", "r.yaml", "--max_steps"], {}, "The override --max_steps needs a value"),
    ("bare word override", BASE, ["check", "r.yaml", "max_steps=3"], {}, "Expected an override like --field value"),
    (
        "wrong type",
        BASE,
        ["check", "r.yaml", "--dataset.size", "many"],
        {},
        "dataset.size: 'many' (str) is not of type",
    ),
    # TRL's names.
    ("trl model_name_or_path", BASE, ["check", "r.yaml", "--model_name_or_path", "x"], {}, "Did you mean 'model'?"),
    ("trl dataset_name", BASE, ["check", "r.yaml", "--dataset_name", "x"], {}, "Did you mean 'dataset.path'?"),
    ("trl reward_funcs", BASE, ["check", "r.yaml", "--reward_funcs", "x"], {}, "Did you mean 'rewards'?"),
    ("trl lora_r", BASE, ["check", "r.yaml", "--lora_r", "8"], {}, "Did you mean 'peft.r'?"),
    (
        "trl dotted reward",
        recipe(rewards="rewards: [my_rewards.short]"),
        ["check", "r.yaml"],
        {},
        "Did you mean 'my_rewards:short'?",
    ),
    # GRPOConfig's values.
    ("max_steps 0", BASE, ["train", "r.yaml", "--max_steps", "0"], {}, "max_steps=0 would train for num_train_epochs"),
    ("huge learning rate", BASE, ["check", "r.yaml", "--learning_rate", "1e5"], {}, "allow_large_learning_rate"),
    ("bad loss_type", BASE, ["check", "r.yaml", "--loss_type", "nonsense"], {}, "loss_type"),
    ("loss_type misspelt", BASE, ["check", "r.yaml", "--loss_type", "dr_gpro"], {}, "Did you mean 'dr_grpo'?"),
    (
        "fp16 with use_cpu",
        BASE,
        ["check", "r.yaml", "--use_cpu", "true", "--fp16", "true"],
        {},
        "fp16: true asks for float16 mixed precision, which runs on a GPU only, and use_cpu is set",
    ),
    pytest.param(
        BASE,
        ["train", "r.yaml", "--bf16", "true"],
        {},
        "bf16: true asks for bfloat16 mixed precision, but this machine has no GPU. Leave bf16 out",
        id="bf16 without a GPU",
        marks=pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without a GPU's mistake"),
    ),
    ("batch not a multiple of G", BASE, ["check", "r.yaml", "--num_generations", "3"], {}, "num_generations"),
    (
        "weights twice",
        recipe(rewards="rewards: [{name: 'my_rewards:short', weight: 2}]"),
        ["check", "r.yaml", "--reward_weights", "[1.0]"],
        {},
        "Weights are given both in `rewards` and as",
    ),
    (
        "weights miscounted",
        BASE,
        ["check", "r.yaml", "--reward_weights", "[1.0, 2.0]"],
        {},
        "reward_weights has 2 entries",
    ),
    (
        "report_to wandb missing",
        BASE,
        ["train", "r.yaml", "--report_to", "[wandb]"],
        {},
        "report_to names 'wandb', but the wandb package is not installed",
    ),
    # The environment.
    (
        "LOCAL_RANK not a number",
        BASE,
        ["train", "r.yaml"],
        {"LOCAL_RANK": "abc"},
        "The environment variable LOCAL_RANK='abc' is not an integer",
    ),
    (
        "HF_HOME a file",
        {**BASE, "hf_home": "a file"},
        ["train", "r.yaml"],
        {"HF_HOME": "hf_home"},
        "The Hugging Face cache folder HF_HOME='hf_home' cannot be used",
    ),
    pytest.param(
        BASE,
        ["train", "r.yaml"],
        {"WORLD_SIZE": "2"},
        "This process is one of 2 that a launcher started (WORLD_SIZE=2), but it would train alone",
        id="WORLD_SIZE without a launch",
        # With GPUs the process would join a launch and wait for the second one: the case is a CPU machine's.
        marks=pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU machine's mistake"),
    ),
    # The output directory.
    ("output_dir a file", {**BASE, "out": "a file"}, ["train", "r.yaml"], {}, "output_dir 'out' is a file"),
    (
        "output_dir inside a file",
        {**BASE, "f": "a file"},
        ["train", "r.yaml", "--output_dir", "f/run"],
        {},
        "'f' is a file, not a folder",
    ),
    (
        "output_dir name too long",
        BASE,
        ["train", "r.yaml", "--output_dir", "x" * 300],
        {},
        "bytes long, over this file system's limit",
    ),
    (
        "output_dir holds a model",
        {**BASE, "out/model.safetensors": "x"},
        ["train", "r.yaml"],
        {},
        "already holds the model of an earlier run",
    ),
    (
        "output_dir holds checkpoints",
        {**BASE, "out/checkpoint-2/trainer_state.json": "{}"},
        ["train", "r.yaml"],
        {},
        "already holds checkpoints of an earlier run",
    ),
    (
        "resume with nothing to resume",
        BASE,
        ["check", "r.yaml", "--resume_from_checkpoint", "true"],
        {},
        "holds no complete checkpoint",
    ),
    # The model.
    (
        "model path missing",
        BASE,
        ["check", "r.yaml", "--model", "./no_model"],
        {},
        "model: './no_model' does not exist",
    ),
    (
        "model not a hub id",
        BASE,
        ["check", "r.yaml", "--model", "'a b c'"],
        {},
        "is neither a local folder nor a hub id",
    ),
    (
        "hub model offline",
        BASE,
        ["train", "r.yaml", "--model", "grpo-tests/not-cached"],
        {"HF_HUB_OFFLINE": "1"},
        "'grpo-tests/not-cached' is a hub id that is not in the local cache, and HF_HUB_OFFLINE=1",
    ),
    (
        "chat template misspelt",
        BASE,
        ["check", "r.yaml", "--model.chat_template", "chatml_tool"],
        {},
        "Did you mean 'chatml_tools'?",
    ),
    ("peft rank 0", BASE, ["check", "r.yaml", "--peft.r", "0"], {}, "peft.r must be a positive rank"),
    # The data.
    (
        "data file missing",
        BASE,
        ["check", "r.yaml", "--dataset.path", "missing.jsonl"],
        {},
        "dataset.path: 'missing.jsonl' not found",
    ),
    (
        "two data sources",
        BASE,
        ["check", "r.yaml", "--dataset.reasoning_gym", "basic_arithmetic"],
        {},
        "needs exactly one source",
    ),
    (
        "no prompt column",
        {**BASE, "data.jsonl": DATA.replace('"prompt"', '"question"')},
        ["check", "r.yaml"],
        {},
        "The data has no 'prompt' column",
    ),
    (
        "image URL in the data",
        {**BASE, "data.jsonl": DATA.replace('"answer"', '"image": "https://example.org/1.png", "answer"')},
        ["check", "r.yaml"],
        {},
        "train_dataset row 0, column 'image': 'https://example.org/1.png' is a URL, and images are not fetched",
    ),
    (
        "image file missing",
        {**BASE, "data.jsonl": DATA.replace('"answer"', '"image": "pictures/1.png", "answer"')},
        ["check", "r.yaml"],
        {},
        "train_dataset row 0, column 'image': the file 'pictures/1.png' does not exist",
    ),
    ("eval_size too big", BASE, ["check", "r.yaml", "--dataset.eval_size", "8"], {}, "leaves no training rows"),
    (
        "eval split and size",
        BASE,
        ["check", "r.yaml", "--dataset.eval_size", "2", "--dataset.eval_split", "test"],
        {},
        "not both",
    ),
    # The rewards.
    ("no rewards", recipe(rewards="rewards: []"), ["check", "r.yaml"], {}, "reward_funcs is empty"),
    ("reward misspelt", recipe(rewards="rewards: [acuracy]"), ["check", "r.yaml"], {}, "Did you mean 'accuracy'?"),
    (
        "reward path missing",
        recipe(rewards="rewards: [./my_rm]"),
        ["check", "r.yaml"],
        {},
        "looks like a local reward-model path, but it does not exist",
    ),
    (
        "reward module missing",
        recipe(rewards="rewards: ['nothere:f']"),
        ["check", "r.yaml"],
        {},
        "cannot import module 'nothere'",
    ),
    (
        "reward function missing",
        recipe(rewards="rewards: ['my_rewards:long']"),
        ["check", "r.yaml"],
        {},
        "module 'my_rewards' has no attribute 'long'",
    ),
    (
        "reward module syntax error",
        {**BASE, "my_rewards.py": "def short(:\n"},
        ["train", "r.yaml"],
        {},
        "module 'my_rewards' has a syntax error",
    ),
    (
        "reward module raises on import",
        {**BASE, "my_rewards.py": "raise RuntimeError('no key')\n" + REWARDS},
        ["train", "r.yaml"],
        {},
        "importing module 'my_rewards' raised RuntimeError: no key",
    ),
    (
        "reward dependency missing",
        {**BASE, "my_rewards.py": "import grpo_no_such_dep\n" + REWARDS},
        ["train", "r.yaml"],
        {},
        "imports 'grpo_no_such_dep', which is not installed",
    ),
    (
        "reward signature",
        {**BASE, "my_rewards.py": "def short(*args):\n    return []\n"},
        ["check", "r.yaml"],
        {},
        "cannot receive its arguments",
    ),
    (
        "reward needs a column the data lacks",
        {**BASE, "data.jsonl": SOLUTIONS, "my_rewards.py": NEEDS_ANSWER},
        ["check", "r.yaml"],
        {},
        "Map a column to it in the recipe: `dataset: {columns: {solution: answer}}`",
    ),
    (
        "built-in reward needs a column the data lacks",
        {**recipe(rewards="rewards: [accuracy]"), "data.jsonl": SOLUTIONS},
        ["train", "r.yaml"],
        {},
        "Reward 'accuracy' takes `answer`, but the data has no such column",
    ),
    (
        "reward parameter misspelt",
        {**BASE, "my_rewards.py": REWARDS.replace("(completions,", "(completion,")},
        ["train", "r.yaml"],
        {},
        "takes `completion`, which the trainer does not pass",
    ),
    (
        "reward module misspelt",
        recipe(rewards="rewards: ['my_reward:short']"),
        ["check", "r.yaml"],
        {},
        "cannot import module 'my_reward' (No module named 'my_reward'). Did you mean 'my_rewards'?",
    ),
    (
        "reward function misspelt",
        recipe(rewards="rewards: ['my_rewards:shrt']"),
        ["check", "r.yaml"],
        {},
        "module 'my_rewards' has no attribute 'shrt'. Did you mean 'short'?",
    ),
    (
        "reward kwargs for a plain builtin",
        recipe(rewards="rewards: [{name: accuracy, kwargs: {x: 1}}]"),
        ["check", "r.yaml"],
        {},
        "takes no settings",
    ),
    # Tools.
    (
        "tool path malformed",
        {**BASE, "r.yaml": RECIPE + "tools: [nocolon]\n"},
        ["check", "r.yaml"],
        {},
        "is not a 'module:function' path",
    ),
    (
        "tools with string prompts",
        {**BASE, "r.yaml": RECIPE + "tools: ['my_rewards:short']\n"},
        ["check", "r.yaml"],
        {},
        "tools need conversational prompts",
    ),
    # The environment (an environment_factory named in the recipe).
    (
        "environment path malformed",
        environment("Counter"),
        ["check", "r.yaml"],
        {},
        "environment: 'Counter' is not a 'module:attr' path",
    ),
    (
        "environment module missing",
        environment("no_such_env:Counter"),
        ["check", "r.yaml"],
        {},
        "environment 'no_such_env:Counter': cannot import module 'no_such_env'",
    ),
    ("environment class missing", environment("my_env:Countr"), ["check", "r.yaml"], {}, "has no attribute 'Countr'"),
    ("environment is an object", environment("my_env:COUNTER"), ["check", "r.yaml"], {}, "is not callable"),
    ("environment needs arguments", environment("my_env:Sized"), ["check", "r.yaml"], {}, "without arguments"),
    ("environment name not a string", environment("{1: my_env:Counter}"), ["check", "r.yaml"], {}, "is not a string"),
    ("environment without reset", environment("my_env:NoReset"), ["check", "r.yaml"], {}, "has no `reset` method"),
    ("environment constructor fails", environment("my_env:Broken"), ["check", "r.yaml"], {}, "failed with Connection"),
    (
        "environment mapping without a column",
        environment("{counter: my_env:Counter}"),
        ["check", "r.yaml"],
        {},
        "the training rows have no `environment` column",
    ),
    (
        "environment with string prompts",
        {**BASE, "my_env.py": ENVIRONMENTS, "r.yaml": RECIPE + "environment: my_env:Counter\n"},
        ["check", "r.yaml"],
        {},
        "environment needs conversational prompts",
    ),
    (
        "TRL's environment_factory key",
        environment("my_env:Counter", "environment_factory"),
        ["check", "r.yaml"],
        {},
        "Did you mean 'environment'?",
    ),
    # Other commands.
    ("plot without a run", BASE, ["plot", "nowhere"], {}, "nowhere"),
]


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """An empty working directory; the modules a row imports (its own my_rewards.py) are forgotten afterwards."""
    monkeypatch.chdir(tmp_path)
    modules, path = set(sys.modules), list(sys.path)
    yield tmp_path
    for name in set(sys.modules) - modules:
        del sys.modules[name]
    sys.path[:] = path


def write_files(folder: Path, files: dict) -> None:
    for name, text in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(text)


def assert_one_line(code: int, err: str, expected: str, command: str) -> None:
    assert "Traceback" not in err, err
    assert code == 2, err
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"grpo {command}: error: ") and expected in last, last
    assert err.count("grpo ") == 1 or err.count(f"grpo {command}: error:") == 1, err


# Rows are (name, files, argv, env, expected), or a pytest.param of the last four when a row needs a mark.
ROWS = [m if hasattr(m, "marks") else pytest.param(*m[1:], id=m[0]) for m in MISTAKES]


@pytest.mark.parametrize(("files", "argv", "env", "expected"), ROWS)
def test_mistake_is_one_line_exit_2(workdir, capsys, monkeypatch, files, argv, env, expected):
    write_files(workdir, files)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    code = main(list(argv))
    assert_one_line(code, capsys.readouterr().err, expected, argv[0])


def test_the_table_is_long_enough():
    assert len(ROWS) >= 40 and len({row.id for row in ROWS}) == len(ROWS)


def test_debug_shows_the_traceback(workdir, capsys, monkeypatch):
    """--debug (anywhere on the line) and GRPO_DEBUG=1 raise the error instead of printing one line."""
    write_files(workdir, BASE)
    with pytest.raises(Exception, match="Did you mean 'learning_rate'"):
        main(["check", "r.yaml", "--learning_rat", "1", "--debug"])
    monkeypatch.setenv("GRPO_DEBUG", "1")
    with pytest.raises(Exception, match="Did you mean 'learning_rate'"):
        main(["check", "r.yaml", "--learning_rat", "1"])


def test_read_only_output_dir(workdir, capsys):
    """A folder no one may write to (sysfs refuses even root) is named as such, not blamed on free space."""
    write_files(workdir, BASE)
    if os.access("/sys", os.W_OK) and not Path("/sys/class").is_dir():
        pytest.skip("no sysfs here")
    code = main(["train", "r.yaml", "--output_dir", "/sys/grpo-test-run"])
    assert_one_line(code, capsys.readouterr().err, "output_dir '/sys/grpo-test-run' cannot be written", "train")


def run_grpo(args, cwd, limit_bytes=None, **extra_env):
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", **extra_env}

    def limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit_bytes, resource.RLIM_INFINITY))

    return subprocess.run(
        [sys.executable, "-m", "grpo", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        preexec_fn=limit if limit_bytes else None,
    )


def test_file_size_limit_is_named(workdir):
    """`ulimit -f` below the size of the weights: said before anything loads, not reported later as a full disk."""
    write_files(workdir, {**BASE, "model/config.json": "{}"})
    (workdir / "model" / "model.safetensors").write_bytes(b"\0" * (2 * 2**20))
    result = run_grpo(["check", "r.yaml", "--model", "./model"], workdir, limit_bytes=2**20)
    assert_one_line(result.returncode, result.stderr, "The file-size limit (ulimit -f) is 1.0 MiB", "check")


TOOLS = '''
def add(a: int, b: int) -> int:
    """Add two numbers.

    Args:
        a: the first
        b: the second
    """
    return a + b
'''


@pytest.mark.parametrize("command", ["check", "train"])
def test_tools_with_a_template_that_ignores_them_is_one_line(workdir, capsys, tiny_model_path, command):
    """tools= with a chat template that does not render them (the tiny model's plain ChatML, like SmolLM2's): one
    line naming the template to use, from `grpo check` too, with no weight loaded (issue 52: TRL's tool example)."""
    files = recipe(dataset="dataset: {path: data.jsonl, chat: true}")
    write_files(workdir, {**files, "my_tools.py": TOOLS, "r.yaml": files["r.yaml"] + "tools: ['my_tools:add']\n"})
    code = main([command, "r.yaml", "--model", str(tiny_model_path)])
    assert_one_line(code, capsys.readouterr().err, "In a recipe: `model: {chat_template: chatml_tools}`", command)
    code = main(["check", "r.yaml", "--model", str(tiny_model_path), "--model.chat_template", "chatml_tools"])
    assert code == 0, capsys.readouterr().err  # the fix it names works


def test_a_missing_column_is_not_sent_to_reward_errors(workdir, capsys):
    """The column a reward needs is missing from the data: the fix is the recipe's column mapping, not
    reward_errors='skip' (which would train on nothing), and `grpo train` says so before any weight loads."""
    write_files(workdir, {**BASE, "data.jsonl": SOLUTIONS, "my_rewards.py": NEEDS_ANSWER})
    assert main(["train", "r.yaml"]) == 2
    err = capsys.readouterr().err
    assert "dataset: {columns: {solution: answer}}" in err and "reward_errors" not in err, err
    write_files(workdir, {"r.yaml": RECIPE.replace("data.jsonl}", "data.jsonl, columns: {solution: answer}}")})
    assert main(["check", "r.yaml"]) == 0, capsys.readouterr().err  # the mapping it names is the fix


BROKEN_REWARDS = {
    "raises": (
        "def short(completions, **kwargs):\n    raise KeyError('answer')\n",
        "Reward function 'short' failed on",
    ),
    "wrong count": (
        "def short(completions, **kwargs):\n    return [1.0]\n",
        "Reward function 'short' must return a list of",
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(BROKEN_REWARDS))
def test_reward_function_bug_is_one_line(workdir, capsys, tiny_model_path, kind):
    """A reward function's bug shows at the first step: one line naming the function, not 40 lines of traceback."""
    source, expected = BROKEN_REWARDS[kind]
    write_files(workdir, {**BASE, "my_rewards.py": source})
    code = main(
        [
            "train",
            "r.yaml",
            "--model",
            str(tiny_model_path),
            "--max_steps",
            "1",
            "--save_strategy",
            "no",
            "--run.plot",
            "false",
            "--run.save_model",
            "false",
        ]
    )
    assert_one_line(code, capsys.readouterr().err, expected, "train")


@pytest.mark.parametrize(
    ("code", "cause", "remedy"),
    [
        (
            errno.EACCES,
            "the directory is not writable",
            "Make the output directory writable (or use another output_dir)",
        ),
        (
            errno.EROFS,
            "the directory is not writable",
            "Make the output directory writable (or use another output_dir)",
        ),
        (
            errno.EFBIG,
            "the file-size limit (ulimit -f), not a full disk",
            "Raise the file-size limit (ulimit -f unlimited)",
        ),
        (errno.ENOSPC, "the disk is full", "Free space (or lower save_total_limit)"),
    ],
)
def test_a_failed_write_names_its_own_remedy(tmp_path, code, cause, remedy):
    """A checkpoint or final save that cannot be written says why and what helps; only a full disk says free space."""
    from grpo.training.checkpoints import describe_write_failure, write_failure_cause, write_failure_remedy
    from grpo.training.output_dir import final_save_message

    error = OSError(code, os.strerror(code))
    message = describe_write_failure(error, 3, str(tmp_path))
    assert cause in message and f"{remedy}, then resume" in message
    assert ("Free space" in message) == (code == errno.ENOSPC)
    final = final_save_message(
        str(tmp_path), write_failure_cause(error, str(tmp_path)), None, write_failure_remedy(error)
    )
    assert f"still in memory: {remedy[0].lower()}{remedy[1:]}, then call" in final


def test_hub_data_set_offline_is_one_line(workdir):
    """A hub data set that is not cached, with HF_HUB_OFFLINE=1 (set before datasets is imported: a subprocess):
    one line naming it, and nothing tries the network."""
    write_files(workdir, BASE)
    result = run_grpo(["check", "r.yaml", "--dataset.path", "grpo-tests/not-cached"], workdir, HF_HUB_OFFLINE="1")
    assert_one_line(
        result.returncode,
        result.stderr,
        "dataset.path 'grpo-tests/not-cached' names a hub data set that could not be fetched",
        "check",
    )


def test_unreachable_vllm_server_is_one_line(workdir, capsys, tiny_model_path):
    """use_vllm with no server at the address: one line naming the server, not a traceback."""
    import socket

    with socket.socket() as probe:  # a port nothing listens on: bound, then closed
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    write_files(workdir, BASE)
    code = main(
        [
            "train",
            "r.yaml",
            "--model",
            str(tiny_model_path),
            "--use_vllm",
            "true",
            "--vllm_server_port",
            str(port),
            "--vllm_server_timeout",
            "1",
        ]
    )
    assert_one_line(code, capsys.readouterr().err, f"127.0.0.1:{port}", "train")


@pytest.mark.slow
def test_resume_into_a_model_of_another_width_is_one_line(workdir, capsys, tiny_model_path):
    """A checkpoint resumed with a model of another shape: one line before any weight loads, not a page of size
    mismatches from load_state_dict."""
    from grpo.testing import save_tiny_model

    write_files(workdir, BASE)
    # One step with a checkpoint (the smallest run that leaves one), then the same run resumed with a wider model.
    first = [
        "train",
        "r.yaml",
        "--model",
        str(tiny_model_path),
        "--max_steps",
        "1",
        "--save_strategy",
        "steps",
        "--save_steps",
        "1",
        "--run.plot",
        "false",
        "--run.save_model",
        "false",
    ]
    assert main(first) == 0, capsys.readouterr().err
    capsys.readouterr()
    wider = save_tiny_model(workdir / "wider", hidden_size=128, intermediate_size=256)
    code = main(["train", "r.yaml", "--model", str(wider), "--max_steps", "2", "--resume_from_checkpoint", "true"])
    assert_one_line(code, capsys.readouterr().err, "holds a model of another shape than", "train")
