"""A `python` tool for multi-turn episodes: the model's code runs in the code sandbox (grpo/rewards/sandbox/) and
the tool answers what it printed (docs/agents.md, "The python tool").

    from grpo.rewards import python_tool
    from grpo.rewards.sandbox import Limits

    trainer = GRPOTrainer(model, reward, args=args, train_dataset=dataset,
                          tools=[python_tool(Limits(wall_seconds=5), isolation="bwrap")])

It lives with the rewards because it runs model output in the same sandbox as `code_execution`, and the generation
stage, where tools are called, imports nothing of the rewards (the layout test): the tool is a plain function the
user builds and passes in, like any other.
"""

from __future__ import annotations

from collections.abc import Callable


def python_tool(limits=None, isolation: str = "bwrap", max_output_chars: int = 4000) -> Callable[[str], str]:
    """A tool named `python` that runs the code it is given in the sandbox and answers what it printed.

    `limits` (a `grpo.rewards.sandbox.Limits`; default `Limits()`: 10 s wall clock, 10 s CPU, 512 MB) bound each
    call; `isolation` is the sandbox's ("bwrap", or "process" for the weaker mode, by name). Each call is a fresh
    interpreter with the standard library only: nothing carries over from one call to the next.

    The answer is the code's stdout and stderr, interleaved as printed, cut to its first `max_output_chars`
    characters with a line saying how many more there were; if the code raised, timed out, hit a limit or was
    refused an action, a last line `Error: ...` says so. Those are answers, not tool failures: they do not count in
    `tools/errors` (a sandbox that cannot run does, and so does the executor's `tool_timeout`, which should be longer
    than `limits.wall_seconds`: the trainer warns when it is not, and a call past `tool_timeout` has its sandbox
    killed). The sandbox ends at its wall limit, or with the trainer, whatever becomes of the call.

    Building the tool checks the sandbox: without bubblewrap it raises `SandboxUnavailable`, with the fix.

    >>> python = python_tool()
    >>> python("print(6 * 7)")
    '42\\n'
    >>> python("1 / 0")
    'Error: the code raised ZeroDivisionError: division by zero'
    """
    # Imported here, not at the top: the sandbox (and ctypes, for its seccomp filters) loads only when asked for.
    from grpo.rewards.sandbox import Limits, check_isolation, run_python

    limits = Limits() if limits is None else limits
    if not isinstance(limits, Limits):
        raise TypeError(
            f"python_tool(limits=...) takes a grpo.rewards.sandbox.Limits, got {type(limits).__name__}: "
            "write limits=Limits(wall_seconds=5, memory_mb=256)."
        )
    if type(max_output_chars) is not int or max_output_chars < 1:
        raise ValueError(f"python_tool(max_output_chars={max_output_chars!r}) must be an integer >= 1.")
    check_isolation(isolation)  # fail when the tool is built, not at the first episode

    def python(code: str) -> str:
        """Run Python code and return what it prints (stdout and stderr). Each call starts a fresh interpreter
        with the standard library only, no network, and an empty temporary directory: nothing is kept between
        calls, so print what you need to see.

        Args:
            code: The Python source code to run.
        """
        result = run_python(code, [], limits, isolation=isolation)
        return tool_answer(result.output, result.output_bytes, result.error, max_output_chars)

    python.wall_seconds = limits.wall_seconds  # the trainer warns when tool_timeout is not longer
    return python


def tool_answer(output: str, output_bytes: int, error: str | None, max_chars: int) -> str:
    """The tool's answer: `output` cut to `max_chars` characters, a line saying how much more was printed when
    anything was cut (here or by the sandbox, which keeps its first OUTPUT_BYTES), then `Error: ...` if any.

    >>> tool_answer("a" * 10, 10, None, 4)
    'aaaa\\n[... 6 more bytes of output not shown]'
    >>> tool_answer("1\\n", 2, "timed out after 5.0 s", 100)
    '1\\nError: timed out after 5.0 s'
    """
    text = output[:max_chars]
    more = output_bytes - len(text.encode())  # bytes: what the sandbox counted; about chars for ASCII output
    notes = [f"[... {more} more bytes of output not shown]"] if more > 0 else []
    notes += [f"Error: {error}"] if error is not None else []
    for note in notes:  # each on a line of its own
        text += ("\n" if text and not text.endswith("\n") else "") + note
    return text
