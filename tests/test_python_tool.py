"""The `python` tool (grpo/rewards/code_tool.py): the model's code runs in the code sandbox and the tool answers
what it printed, bounded, or the error or timeout as text; and an episode that calls it, end to end through the
trainer. Limits are shrunk (2 s wall, 1 s CPU, 256 MB) so that a call that must time out does so quickly."""

import doctest

import pytest
from transformers.utils import get_json_schema

import grpo.rewards.code_tool as code_tool
import grpo.rewards.sandbox as sandbox
from grpo import GRPOTrainer
from grpo.generation.tools import make_tool
from grpo.rewards import python_tool
from grpo.rewards.sandbox import OUTPUT_BYTES, Limits, SandboxUnavailable
from grpo.testing import save_tiny_model
from tests.helpers.agents import ScriptedTurns, call, chat_prompts, tool_tokenizer
from tests.test_agents import config
from tests.test_sandbox import needs_bwrap

LIMITS = Limits(wall_seconds=2.0, cpu_seconds=1, memory_mb=256)


@pytest.fixture(scope="module")
def python():
    return python_tool(LIMITS)


@needs_bwrap
def test_docstring_examples_run():
    assert doctest.testmod(code_tool).failed == 0


def test_its_schema_is_a_tool_named_python_with_one_code_argument():
    tool = python_tool(LIMITS, isolation="process")  # the schema does not depend on the isolation
    schema = get_json_schema(tool)["function"]
    assert schema["name"] == "python"
    assert schema["parameters"] == {
        "type": "object",
        "properties": {"code": {"type": "string", "description": "The Python source code to run."}},
        "required": ["code"],
    }
    assert make_tool(tool).name == "python"  # what GRPOTrainer(tools=[...]) does with it


@needs_bwrap
def test_the_code_runs_in_the_sandbox(python):
    # bubblewrap's user namespace (uid 65534) and host name: the code did not run in the trainer's process.
    assert python("import os\nprint(os.getuid(), os.uname().nodename)") == "65534 sandbox\n"
    answer = python("print(open('/etc/passwd').read())")
    assert answer.startswith("Error: ") and "root:" not in answer


@needs_bwrap
def test_an_exception_is_answered_after_what_was_printed(python):
    assert python("print('before')\n1 / 0") == "before\nError: the code raised ZeroDivisionError: division by zero"
    assert python("def f(:\n").startswith("Error: the code raised SyntaxError")


@needs_bwrap
def test_a_timeout_is_answered():
    python = python_tool(Limits(wall_seconds=2.0, cpu_seconds=5, memory_mb=256))  # CPU limit beyond the wall clock
    assert python("import time\ntime.sleep(60)") == "Error: timed out after 2.0 s"
    assert python("while True:\n    pass").startswith("Error: timed out")


@needs_bwrap
def test_the_output_is_bounded(python):
    # 10,001 bytes printed (10,000 x and a newline), 100 shown: the rest is counted.
    answer = python_tool(LIMITS, max_output_chars=100)("print('x' * 10_000)")
    assert answer == "x" * 100 + "\n[... 9901 more bytes of output not shown]"
    # Beyond what the sandbox keeps (OUTPUT_BYTES), the count is still of every byte printed.
    answer = python_tool(LIMITS, max_output_chars=10 * OUTPUT_BYTES)("print('y' * 100_000)")
    assert answer == "y" * OUTPUT_BYTES + f"\n[... {100_001 - OUTPUT_BYTES} more bytes of output not shown]"
    # stdout and stderr interleave as printed.
    assert python("import sys\nprint(1)\nprint(2, file=sys.stderr)\nprint(3)") == "1\n2\n3\n"


def test_bad_arguments_fail_when_the_tool_is_built(monkeypatch):
    with pytest.raises(TypeError, match="Limits"):
        python_tool({"wall_seconds": 5}, isolation="process")
    with pytest.raises(ValueError, match="max_output_chars"):
        python_tool(isolation="process", max_output_chars=0)
    with pytest.raises(ValueError, match="isolation='docker'"):
        python_tool(isolation="docker")
    sandbox._bwrap_problem.cache_clear()
    monkeypatch.setattr(sandbox.shutil, "which", lambda name: None)
    try:
        with pytest.raises(SandboxUnavailable, match="apt-get install bubblewrap"):
            python_tool()
    finally:
        sandbox._bwrap_problem.cache_clear()


@needs_bwrap
def test_an_episode_calls_it_through_the_trainer(tmp_path):
    path = tmp_path / "model"
    save_tiny_model(path)
    tokenizer = tool_tokenizer()
    seen = {}

    def answered_42(prompts, completions, **kwargs):
        seen["completions"] = completions
        return [float("42" in c[-1]["content"]) for c in completions]

    trainer = GRPOTrainer(
        str(path),
        answered_42,
        args=config(tmp_path),
        train_dataset=chat_prompts(2),
        processing_class=tokenizer,
        tools=[python_tool(LIMITS)],
    )
    trainer.generation = ScriptedTurns(tokenizer, [[call("python", code="print(6 * 7)"), "It prints 42."]])
    trainer.train()
    conversation = seen["completions"][0]
    assert [m["role"] for m in conversation] == ["assistant", "tool", "assistant"]
    assert conversation[1] == {"role": "tool", "name": "python", "content": "42\n"}
    logged = trainer.state.log_history[0]
    assert logged["tools/call_frequency"] == 1.0 and logged["tools/errors"] == 0.0
    assert logged["reward"] == 1.0
    # The tool's schema reached the prompt the policy saw.
    assert '"name": "python"' in tokenizer.decode(trainer.generation.calls[0][0])
