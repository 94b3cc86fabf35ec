"""Running one turn's tool calls for many episodes at once (`ToolExecutor`), and what came of them (`ToolAnswer`,
`ToolCounts`). The tools themselves, and the environments they may be bound to, are tools.py's.

One turn runs as (`ToolExecutor.run`): the calls of every episode at once, each episode's own calls one after the
other in the order the model wrote them (they may act on one environment, and order matters there: "move up, then
left"). `async def` tools run on one event loop kept across turns (`ToolLoop`: a tool may hold a client, an HTTP
session, bound to it), sync ones in daemon threads (at most `max_workers` at once), each call under `timeout`
seconds counted from its start. The turn itself runs on a second loop that only ever waits, so no tool can keep
a timeout from firing. A failure (an exception, `SystemExit` and `KeyboardInterrupt` included, a timeout, a call
that could not be parsed, arguments that do not fit the tool's schema: tool_arguments.py) becomes the answer the
model sees, `"Error: ..."`, and is counted, unless `errors="raise"` (which never raises for the model's mistakes:
a call that could not be parsed or whose arguments do not fit). A tool gets a deep copy of the call's arguments,
and its answer is made text (`str`) within the call, under its timeout and guard. A sync call that times out cannot
be stopped: its thread keeps running until the function returns (a daemon thread, so it never holds up the
interpreter's exit), and frees its place among the `max_workers` at the timeout. What the call started outside the process is stopped, though: each call runs in a
`CallScope` (call_scope.py), abandoned at the timeout, which kills the sandboxes of the `python` tool
(grpo/rewards/code_tool.py) and refuses new ones. An `async def` tool that times out is cancelled at its next `await`; one that blocks
without awaiting (`time.sleep` in an `async def`) holds the whole tools' loop, so at its timeout that loop is
left to it, to stop once the call returns, and the next async call starts a new one (a client bound to the old
loop is lost with it: blocking work belongs in sync tools). Threads left running past a timeout, of either kind,
are counted: with `max_hung` of them, the next call raises `HungToolsError` instead of leaking more.

Where this departs from TRL: TRL calls an episode's sync tools in the trainer's thread, episodes one after another,
with no timeout; a failed call's answer is `str({"error": message})`; a malformed call is read as plain text (the
episode ends) and not counted.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import re
import threading
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

from grpo.generation.call_scope import CallScope
from grpo.generation.tool_arguments import ArgumentError, checked_arguments
from grpo.generation.tool_calls import ParseFailure, ToolCall
from grpo.generation.tools import Tool


class ToolCallError(RuntimeError):
    """A tool call failed and the executor was asked to raise (`errors="raise"`)."""


@dataclass(frozen=True)
class ToolAnswer:
    """What one call (or one unreadable attempt) answers: the tool's name, the text the model is shown, and how it
    went: `"ok"`, `"error"` (the tool raised), `"timeout"`, `"malformed"` or `"unknown_tool"` (parse failures)."""

    name: str
    content: str
    status: Literal["ok", "error", "timeout", "malformed", "unknown_tool"]

    def as_message(self) -> dict:
        """The answer as a `tool` message of a conversation."""
        return {"role": "tool", "name": self.name, "content": self.content}


@dataclass
class ToolCounts:
    """What a turn's calls did. `calls` counts the calls of a tool the episode offers (whatever came of them: one
    whose arguments do not fit the schema is an error); the parse failures, `malformed` calls and calls of
    `unknown_tools`, reached none. TRL's `tools/failure_frequency` is
    (errors + timeouts + unknown_tools) / (calls + unknown_tools): TRL counts a call of an unknown tool as a failed
    call and does not see malformed ones."""

    calls: int = 0
    errors: int = 0
    timeouts: int = 0
    malformed: int = 0
    unknown_tools: int = 0

    @property
    def parse_failures(self) -> int:
        return self.malformed + self.unknown_tools

    def add(self, status: str) -> None:
        """Count one answer of `status` (a `ToolAnswer.status`)."""
        if status in ("ok", "error", "timeout"):
            self.calls += 1
        if status == "error":
            self.errors += 1
        elif status == "timeout":
            self.timeouts += 1
        elif status == "malformed":
            self.malformed += 1
        elif status == "unknown_tool":
            self.unknown_tools += 1

    def __add__(self, other: ToolCounts) -> ToolCounts:
        return ToolCounts(*(getattr(self, f) + getattr(other, f) for f in _COUNT_FIELDS))


_COUNT_FIELDS = ("calls", "errors", "timeouts", "malformed", "unknown_tools")


# Lone surrogates: what `os.fsdecode` (and any `errors="surrogateescape"` decoding) makes of bytes that are not UTF-8.
# A Python string may hold them; a tokenizer cannot encode them, so one in a tool answer would end the run there.
_LONE_SURROGATES = re.compile("[\ud800-\udfff]")


def encodable(answer: ToolAnswer) -> ToolAnswer:
    """`answer` with each lone surrogate in its text replaced by U+FFFD (the Unicode replacement character), and a
    warning naming the tool (once per tool): its text can then be tokenized."""
    content, replaced = _LONE_SURROGATES.subn("\ufffd", answer.content)
    if not replaced:
        return answer
    warnings.warn(
        f"The tool '{answer.name}' answered text holding lone surrogates (what os.fsdecode makes of bytes that are "
        "not UTF-8), which no tokenizer encodes: the model is shown U+FFFD in their place. To choose the "
        "replacement yourself, decode such bytes in the tool with errors='replace' or 'backslashreplace'.",
        stacklevel=2,
    )
    return replace(answer, content=content)


class ToolLoop:
    """The event loop `async def` tools run on, in a daemon thread of its own, kept across turns (a tool may hold a
    client bound to it). `busy` names the call whose code the loop is running, None while every call awaits: a call
    that times out while the loop is busy has blocked it."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.busy: str | None = None
        self.thread = threading.Thread(target=self._serve, daemon=True, name="grpo-tool-loop")
        self.thread.start()

    def _serve(self) -> None:
        try:
            self.loop.run_forever()
        finally:
            self.loop.close()

    def submit(self, name: str, coroutine) -> asyncio.Future:
        """Run `coroutine` (a call of tool `name`) on this loop; the returned future, of the running loop, settles
        with (its answer's text, None) or (None, what it raised), a `SystemExit` or `KeyboardInterrupt` included."""
        return asyncio.wrap_future(asyncio.run_coroutine_threadsafe(self._guarded(name, coroutine), self.loop))

    async def _guarded(self, name: str, coroutine) -> tuple[str | None, BaseException | None]:
        try:
            value = await Steps(coroutine, self, name)
            self.busy = name  # the answer's `__str__` is the tool's code too: one that blocks, blocks this loop
            try:
                return answer_text(name, value), None
            finally:
                self.busy = None
        except asyncio.CancelledError:  # the executor's cancel at the timeout
            raise
        except BaseException as error:  # a task that raises SystemExit would otherwise stop the loop
            return None, error

    def stop(self) -> None:
        """Stop the loop (at once when it is idle; when it is blocked, once the blocking call returns) and close it."""
        try:
            self.loop.call_soon_threadsafe(self.loop.stop)
        except RuntimeError:  # already closed
            pass


def answer_text(name: str, value: Any) -> str:
    """The text the model is shown for `value`, what tool `name` returned: `str(value)`, run under the call's
    timeout and guard like the tool itself; a `__str__` that raises is a `TypeError` naming the tool and the type."""
    try:
        return str(value)
    except Exception as error:
        raise TypeError(
            f"'{name}' returned a {type(value).__name__} whose str() raised {type(error).__name__}: {error}"
        ) from error


class Steps:
    """Awaits `coroutine` as `await coroutine` would, marking `tool_loop.busy = name` while the coroutine's code runs
    (from a resume to its next suspension), so the executor can tell a blocked loop from a slow await."""

    def __init__(self, coroutine, tool_loop: ToolLoop, name: str):
        self.coroutine, self.tool_loop, self.name = coroutine, tool_loop, name

    def __await__(self):
        value, thrown = None, None
        while True:
            self.tool_loop.busy = self.name
            try:
                signal = self.coroutine.send(value) if thrown is None else self.coroutine.throw(thrown)
            except StopIteration as stop:
                return stop.value
            finally:
                self.tool_loop.busy = None
            try:
                value, thrown = (yield signal), None
            except GeneratorExit:  # the awaiting task is being closed
                self.coroutine.close()
                raise
            except BaseException as error:  # a cancellation, handed to the tool
                value, thrown = None, error


class HungToolsError(RuntimeError):
    """Too many tool calls are running past their timeout in threads that cannot be stopped."""


class ToolExecutor:
    """Runs one turn's tool calls for many episodes at once (see the module docstring for the concurrency rules).

    `timeout`: seconds one call may run (None: no limit). `errors`: `"answer"` turns an exception or a timeout into
    the answer `"Error: ..."` and counts it; `"raise"` raises `ToolCallError` for the first one (in episode order),
    once every episode's calls up to its first failure have run. `max_workers`: sync calls running at once.
    `max_hung`: threads of calls still running past their timeout (sync calls, and event loops an `async def` tool
    blocked) that may exist; with that many, the next call raises `HungToolsError`.
    `answer_parse_failures`: whether a malformed call or an unknown tool gets an `"Error: ..."` answer (so the
    model can correct itself) or none (as in TRL, where a malformed call ends the episode); either way it is
    counted, and it never raises: it is the model's mistake, not the tool's.

    The executor owns two event loops in daemon threads, started on first use: its own, which runs the turn (only
    the executor's code: it never blocks), and the tools' (`ToolLoop`), kept across turns; `close()` stops both. Use
    it as a context manager to close it.
    """

    def __init__(
        self,
        *,
        timeout: float | None = None,
        errors: Literal["answer", "raise"] = "answer",
        max_workers: int = 32,
        max_hung: int = 32,
        answer_parse_failures: bool = True,
    ):
        if errors not in ("answer", "raise"):
            raise ValueError(f"errors={errors!r}: use 'answer' (a failed call answers 'Error: ...') or 'raise'.")
        if timeout is not None and timeout <= 0:
            raise ValueError(f"timeout={timeout}: give a number of seconds > 0, or None for no limit.")
        if max_workers < 1:
            raise ValueError(f"max_workers={max_workers}: at least one sync tool call must be able to run.")
        if max_hung < 1:
            raise ValueError(f"max_hung={max_hung}: allow at least one call running past its timeout.")
        self.timeout = timeout
        self.errors = errors
        self.max_workers = max_workers
        self.max_hung = max_hung
        self.answer_parse_failures = answer_parse_failures
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._workers: asyncio.Semaphore | None = None
        self._tool_loop: ToolLoop | None = None
        self._hung: dict[threading.Thread, str] = {}  # threads running past a timeout -> the tool that holds them

    def __enter__(self) -> ToolExecutor:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    @property
    def hung(self) -> dict[threading.Thread, str]:
        """The threads of calls still running past their timeout, and the tool each is in."""
        with self._lock:
            self._hung = {thread: name for thread, name in self._hung.items() if thread.is_alive()}
            return dict(self._hung)

    def run(
        self, turns: Sequence[Sequence[ToolCall | ParseFailure]], tools: Sequence[Mapping[str, Tool]]
    ) -> tuple[list[list[ToolAnswer]], ToolCounts]:
        """Answer each episode's parsed turn (`turns[i]`, what a parser returned) with its tools (`tools[i]`).

        Returns the answers per episode, in the order of its calls (empty: the episode called nothing, or only
        unanswered parse failures), their texts made encodable (`encodable`), and the counts of the whole turn.
        Raises `HungToolsError` when `max_hung` calls run past their timeout.
        """
        if len(turns) != len(tools):
            raise ValueError(f"{len(turns)} parsed turns but {len(tools)} episodes' tools: give one of each.")
        # The turn runs on the executor's own loop, which only waits: every call ends within `timeout` of its start,
        # and the calls start one after another at worst, so the turn ends within this bound.
        # (The minute on top is for a loaded machine's scheduling, not for the tools.)
        bound = None if self.timeout is None else self.timeout * (sum(map(len, turns)) + 1) + 60.0
        work = asyncio.run_coroutine_threadsafe(self._run_all(turns, tools), self._event_loop())
        try:
            outcomes = work.result(bound)
        except concurrent.futures.TimeoutError:
            raise RuntimeError(f"A turn of tool calls did not end within {bound:.0f} s (a bug of grpo).") from None
        counts = ToolCounts()
        for answer, _ in (outcome for episode in outcomes for outcome in episode):
            counts.add(answer.status)
        failure = next((error for episode in outcomes for _, error in episode if error is not None), None)
        if failure is not None:
            raise failure
        answers = [
            [
                encodable(a)
                for a, _ in episode
                if self.answer_parse_failures or a.status not in ("malformed", "unknown_tool")
            ]
            for episode in outcomes
        ]
        return answers, counts

    def close(self) -> None:
        """Stop the event loops. Calls still running past their timeout go on in their daemon threads."""
        with self._lock:
            loop, thread, self._loop, self._thread, self._workers = self._loop, self._thread, None, None, None
            tool_loop, self._tool_loop = self._tool_loop, None
        if tool_loop is not None:
            tool_loop.stop()
            tool_loop.thread.join(self.timeout)  # at once, unless a call blocks it (then it is left, as a daemon)
        if loop is not None:
            loop.call_soon_threadsafe(loop.stop)
            thread.join()
            loop.close()

    def _event_loop(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None:
                self._loop = asyncio.new_event_loop()
                self._thread = threading.Thread(target=self._loop.run_forever, daemon=True, name="grpo-tool-turns")
                self._thread.start()
            return self._loop

    def _tools_loop(self) -> ToolLoop:
        with self._lock:
            if self._tool_loop is None:
                self._tool_loop = ToolLoop()
            return self._tool_loop

    async def _run_all(self, turns, tools) -> list[list[tuple[ToolAnswer, BaseException | None]]]:
        if self._workers is None:  # made here: an asyncio semaphore belongs to the loop it is first used in
            self._workers = asyncio.Semaphore(self.max_workers)
        return await asyncio.gather(*(self._run_episode(i, turn, tools[i]) for i, turn in enumerate(turns)))

    async def _run_episode(self, episode: int, turn, tools: Mapping[str, Tool]) -> list[tuple[ToolAnswer, Any]]:
        """An episode's calls one after the other, in the order written, each with None or, under errors="raise",
        the `ToolCallError` of its failure (the episode's calls stop there)."""
        outcomes = []
        for item in turn:
            if isinstance(item, ParseFailure):
                outcomes.append((ToolAnswer(item.name or "unknown", f"Error: {item.reason}", item.kind), None))
                continue
            if item.name not in tools:
                offered = ", ".join(sorted(tools)) or "none"
                reason = f"Error: there is no tool '{item.name}' (the tools are: {offered})"
                outcomes.append((ToolAnswer(item.name, reason, "unknown_tool"), None))
                continue
            answer, error = await self._call(item, tools[item.name])
            if error is None or self.errors == "answer":
                outcomes.append((answer, None))
                continue
            failure = ToolCallError(
                f"Tool '{item.name}' failed in episode {episode} with arguments {item.arguments}: "
                f"{answer.content.removeprefix('Error: ')} (with errors='answer' the model is shown the error instead)"
            )
            failure.__cause__ = error
            outcomes.append((answer, failure))
            break
        return outcomes

    async def _call(self, call: ToolCall, tool: Tool) -> tuple[ToolAnswer, BaseException | None]:
        """One call under the timeout, in a `CallScope` of its own: an `async def` tool on the tools' loop, a sync one
        in a daemon thread. The tool gets a deep copy of the arguments (the call's record, which the rewards read in
        `tool_calls`, stays what the model wrote), checked against its schema first: arguments that do not fit are
        answered as an error, never raised (the model's mistake, not the tool's)."""
        self._check_hung(call.name)
        try:
            arguments = checked_arguments(copy.deepcopy(call.arguments), tool.schema["function"].get("parameters", {}))
        except ArgumentError as problems:
            return ToolAnswer(
                call.name, f"Error: the call of '{call.name}' has invalid arguments: {problems}", "error"
            ), None
        scope = CallScope()
        if tool.is_async:
            try:
                coroutine = tool.function(**arguments)
            except Exception as error:  # bad arguments fail when the coroutine is made
                return ToolAnswer(call.name, f"Error: {type(error).__name__}: {error}", "error"), error
            tool_loop = self._tools_loop()
            return await self._settle(call, scope.run(tool_loop.submit, call.name, coroutine), tool_loop, scope)
        async with self._workers:  # freed at the timeout even if the thread runs on
            work, thread = self._in_daemon_thread(
                lambda: answer_text(call.name, scope.run(tool.function, **arguments))
            )
            return await self._settle(call, work, thread, scope)

    def _in_daemon_thread(self, function: Callable[[], str]) -> tuple[asyncio.Future, threading.Thread]:
        """Run `function` in a new daemon thread; (its text, None) or (None, what it raised) settles the returned
        future, unless that was abandoned at the timeout."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()

        def settle(outcome: tuple) -> None:
            if not future.done():  # done: the call timed out and the future was cancelled
                future.set_result(outcome)

        def target() -> None:
            try:
                outcome = function(), None
            except BaseException as error:  # SystemExit included: it is the tool's answer, not the thread's end
                outcome = None, error
            try:
                loop.call_soon_threadsafe(settle, outcome)
            except RuntimeError:  # the executor's loop was closed while this call ran past its timeout
                pass

        thread = threading.Thread(target=target, daemon=True, name="grpo-tool")
        thread.start()
        return future, thread

    async def _settle(
        self, call: ToolCall, work: asyncio.Future, runner: threading.Thread | ToolLoop, scope: CallScope
    ) -> tuple[ToolAnswer, BaseException | None]:
        """`asyncio.wait` rather than `wait_for`: a TimeoutError the tool itself raises is then the tool's error, not
        a timeout. At the timeout, the call's `scope` is abandoned (what it started outside the process is killed);
        a coroutine is cancelled at its next await; a thread, or a tools' loop the call blocks, cannot be stopped:
        it is left running, counted among the hung ones, and the next async call gets a new loop."""
        done, _ = await asyncio.wait({work}, timeout=self.timeout)
        if not done:
            scope.abandon()
            work.cancel()
            self._abandon(runner, call.name)
            error = TimeoutError(f"the call of '{call.name}' took longer than {self.timeout} s")
            return ToolAnswer(call.name, f"Error: {error}", "timeout"), error
        if work.cancelled():  # the tool cancelled itself
            error = asyncio.CancelledError(f"the call of '{call.name}' was cancelled")
            return ToolAnswer(call.name, f"Error: {error}", "error"), error
        text, error = work.result()
        if error is not None:
            return ToolAnswer(call.name, f"Error: {type(error).__name__}: {error}", "error"), error
        return ToolAnswer(call.name, text, "ok"), None

    def _abandon(self, runner: threading.Thread | ToolLoop, name: str) -> None:
        """Count a thread left running past a timeout: a sync call's, or the tools' loop when a call blocks it
        (`busy`); that loop is stopped once the call returns, and replaced now."""
        with self._lock:
            if isinstance(runner, threading.Thread):
                self._hung[runner] = name
            elif runner.busy is not None:
                self._hung[runner.thread] = runner.busy
                if self._tool_loop is runner:
                    self._tool_loop = None
                runner.stop()

    def _check_hung(self, name: str) -> None:
        hung = list(self.hung.values())
        if len(hung) < self.max_hung:
            return
        by_tool = ", ".join(f"'{tool}': {hung.count(tool)}" for tool in dict.fromkeys(hung))
        raise HungToolsError(
            f"Cannot call '{name}': {len(hung)} tool calls are still running past tool_timeout={self.timeout} s, in "
            f"threads that cannot be stopped ({by_tool}), the most allowed (tool_max_hung_calls={self.max_hung}). "
            "Make those tools return within tool_timeout (give their own waits, such as network calls, a shorter "
            "timeout; an `async def` tool must await rather than block), or raise tool_max_hung_calls if they do end."
        )
