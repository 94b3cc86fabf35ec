"""Tools whose work calls `os._exit(0)`, run by the tool executor (tests/test_tools.py runs this as a script,
`python -m tests.helpers.exiting_tool`): first `isolated`, which runs the work in a child process and answers an
error when the child writes no result, then `direct`, which does the work in this process. Each turn prints its
answer and then "after <tool>", when the process is still there to print it.

    python -m tests.helpers.exiting_tool work  # the work alone: exits with status 0, writing nothing
"""

import os
import subprocess
import sys

WORK = [sys.executable, "-m", "tests.helpers.exiting_tool", "work"]


def work() -> None:
    os._exit(0)  # no exception: the process ends here, with status 0


def direct(x: int) -> str:
    """Do the work in this process.

    Args:
        x: Anything.
    """
    work()
    return "done"


def isolated(x: int) -> str:
    """Do the work in a child process.

    Args:
        x: Anything.
    """
    done = subprocess.run(WORK, capture_output=True, text=True, timeout=60)
    if done.returncode != 0 or not done.stdout:  # os._exit(0) exits with 0: the missing result tells
        raise RuntimeError(f"the work ended with status {done.returncode} and no result: {done.stderr[-200:]}")
    return done.stdout


if __name__ == "__main__":
    if sys.argv[1:] == ["work"]:
        work()
    from grpo.generation.tool_calls import ToolCall
    from grpo.generation.tool_executor import ToolExecutor
    from grpo.generation.tools import make_tools

    with ToolExecutor(timeout=60) as executor:
        for tool in (isolated, direct):
            answers, _ = executor.run([[ToolCall(tool.__name__, {"x": 1})]], [make_tools([tool])])
            print(answers[0][0].status, answers[0][0].content, flush=True)
            print(f"after {tool.__name__}", flush=True)
