"""Tools for multi-turn episodes: their JSON schemas, one environment per episode, and running a turn's calls.

The protocol is TRL's (`GRPOTrainer(tools=..., environment_factory=...)`), so the same functions and environment
classes work here:
  - a *tool* is a plain function, sync or `async def`, with type hints and a Google-style docstring describing each
    argument; its JSON schema, the one chat templates render, comes from `transformers.utils.get_json_schema`.
  - an *environment factory* is a zero-argument callable (usually a class). Each episode gets its own object, on
    which `reset(**row)` is called with the episode's dataset row (every column, `prompt` included; with a dict of
    factories, the `environment` column picks the factory and is not passed on). When `reset` returns a string, it
    is appended to the content of the prompt's last message (`with_observation`). Its public methods, those not
    starting with `_`, other than `reset` and `get_reward`, become that episode's tools, bound to its object.
    `get_reward()`, when defined, lets the environment score its episode (TRL adds it as a reward function).

One turn runs as (`ToolExecutor.run`): the calls of every episode at once, each episode's own calls one after the
other in the order the model wrote them (they may act on one environment, and order matters there: "move up, then
left"). `async def` tools run on the executor's event loop, sync ones in daemon threads (at most `max_workers` at
once), each call under `timeout` seconds counted from its start. A failure (an exception, a timeout, a call that
could not be parsed) becomes the answer the model sees, `"Error: ..."`, and is counted, unless `errors="raise"`.
A sync call that times out cannot be stopped: its thread keeps running until the function returns (it is a daemon
thread, so it never holds up the interpreter's exit), and frees its place among the `max_workers` at the timeout.
An `async def` tool that times out is cancelled at its next `await`; one that blocks without awaiting stalls the
whole loop, so blocking work belongs in sync tools.

Where this departs from TRL: TRL calls an episode's sync tools in the trainer's thread, episodes one after another,
with no timeout; a failed call's answer is `str({"error": message})`; a malformed call is read as plain text (the
episode ends) and not counted. TRL also reuses environment objects across batches (reset between episodes); here
`start_episodes` builds a new one per episode, after the first, which the construction-time check built.
"""

from __future__ import annotations

import asyncio
import inspect
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

from transformers.utils import DocstringParsingException, TypeHintParsingException, get_json_schema

from grpo.generation.tool_calls import ParseFailure, ToolCall

# Methods of an environment that are part of the protocol, never offered to the model as tools (`get_turn_rewards`:
# turn-level credit, grpo/rewards/turns.py).
RESERVED_METHODS = ("reset", "get_reward", "get_turn_rewards")


class ToolDefinitionError(ValueError):
    """A tool or environment that cannot be offered to the model; the message names it and the fix."""


class ToolCallError(RuntimeError):
    """A tool call failed and the executor was asked to raise (`errors="raise"`)."""


@dataclass(frozen=True)
class Tool:
    """A function the model may call: its name, the callable, whether it is `async def`, and its JSON schema."""

    name: str
    function: Callable
    schema: dict
    is_async: bool


def make_tool(function: Callable, owner: str | None = None) -> Tool:
    """`function` (a plain function or a bound method) as a `Tool`, its schema from `get_json_schema`.

    Raises `ToolDefinitionError`, naming the function (`owner.name` for a method) and the fix, when it has no
    docstring, an argument without a type hint or without a description, or `*args` / `**kwargs` (a JSON schema
    can only describe named arguments).
    """
    label = f"{owner}.{getattr(function, '__name__', '?')}" if owner else getattr(function, "__name__", repr(function))
    if not (inspect.isfunction(function) or inspect.ismethod(function)) or function.__name__ == "<lambda>":
        raise ToolDefinitionError(
            f"Tool {label} must be a function defined with `def` or `async def` (or a method of an environment), "
            f"not a {type(function).__name__}: the model calls it by its name and reads its signature and docstring."
        )
    stars = {inspect.Parameter.VAR_POSITIONAL: "*", inspect.Parameter.VAR_KEYWORD: "**"}
    variadic = [stars[p.kind] + p.name for p in inspect.signature(function).parameters.values() if p.kind in stars]
    if variadic:
        raise ToolDefinitionError(
            f"Tool {label} takes {variadic[0]}: a tool's arguments must each be named, typed and described, since "
            "the model is shown them as a JSON schema. Replace it with named arguments."
        )
    try:
        schema = get_json_schema(function)
    except (DocstringParsingException, TypeHintParsingException) as error:
        raise ToolDefinitionError(
            f"Cannot describe tool {label} to the model: {error}. Give every argument a type hint and write a "
            "Google-style docstring: a summary line, then an `Args:` section with one `name: description` line per "
            "argument (see transformers' `get_json_schema`)."
        ) from error
    return Tool(function.__name__, function, schema, inspect.iscoroutinefunction(function))


def make_tools(functions: Iterable[Callable], owner: str | None = None) -> dict[str, Tool]:
    """Each function as a `Tool`, by name, in the given order; two tools of one name are an error."""
    tools: dict[str, Tool] = {}
    for function in functions:
        tool = make_tool(function, owner)
        if tool.name in tools:
            raise ToolDefinitionError(
                f"Two tools are named '{tool.name}': the model calls tools by name, so rename one of them."
            )
        tools[tool.name] = tool
    return tools


def environment_methods(environment: object) -> list[Callable]:
    """The public methods of `environment` that become tools, as bound methods sorted by name (TRL's order):
    every method whose name does not start with `_`, other than `reset` and `get_reward`. Properties are not
    read (looking one up could act on the environment) and static methods are not tools."""
    methods = []
    for name in sorted(dir(type(environment))):
        if name.startswith("_") or name in RESERVED_METHODS:
            continue
        if isinstance(inspect.getattr_static(environment, name), property | staticmethod):
            continue
        member = getattr(environment, name)
        if inspect.ismethod(member):
            methods.append(member)
    return methods


def with_observation(prompt: str | list[dict], observation: str | None) -> str | list[dict]:
    """The prompt an episode starts from: `reset`'s string appended, as is, to the prompt (a string) or to the
    content of its last message (a conversation); the prompt given is not modified.

    >>> with_observation([{"role": "user", "content": "Play. "}], "Board: X..")
    [{'role': 'user', 'content': 'Play. Board: X..'}]
    """
    if observation is None:
        return prompt
    if isinstance(prompt, str):
        return prompt + observation
    return [*prompt[:-1], {**prompt[-1], "content": prompt[-1]["content"] + observation}]


@dataclass
class Episode:
    """One episode's environment (None without a factory), its tools by name (the standalone ones, then its
    environment's methods), what `reset` returned, and its prompt with that appended."""

    environment: object | None
    tools: dict[str, Tool]
    observation: str | None = None
    prompt: Any = None


class Toolbox:
    """The tools and environments of a run, checked when built: every tool gets its schema, and each environment
    factory is called once to check that its object has a callable `reset` and that its methods describe
    themselves (the object is kept for the first episode).

    `environment_factory` is a zero-argument callable, or a dict of them by name: then each dataset row names its
    environment in an `environment` column, and only that environment's tools are offered in its episode.
    """

    def __init__(self, tools: Sequence[Callable] = (), environment_factory=None):
        self.tools = make_tools(tools)
        if environment_factory is None:
            self.factories: dict[str | None, Callable[[], object]] = {}
        elif isinstance(environment_factory, Mapping):
            self.factories = dict(environment_factory)
        else:
            self.factories = {None: environment_factory}
        self._spare: dict[str | None, list[object]] = {}
        self._methods: dict[str | None, dict[str, Tool]] = {}  # each environment's methods, bound to its probe
        self.environment_types: list[type] = []  # the class of each factory's objects, in the factories' order
        for name, factory in self.factories.items():
            environment = factory()
            self._methods[name] = self._methods_of(environment)
            self._spare[name] = [environment]
            self.environment_types.append(type(environment))

    @property
    def routed(self) -> bool:
        """Whether rows pick their environment by name (a dict of factories)."""
        return None not in self.factories and bool(self.factories)

    def _methods_of(self, environment: object) -> dict[str, Tool]:
        owner = type(environment).__name__
        if not callable(getattr(environment, "reset", None)):
            raise ToolDefinitionError(
                f"The environment {owner} has no `reset` method: define `reset(self, **kwargs)`, called at the start "
                "of each episode with the dataset row's columns, returning None or a string added to the prompt."
            )
        if inspect.iscoroutinefunction(environment.reset):
            raise ToolDefinitionError(
                f"{owner}.reset is `async def`: make it a plain `def` (it is called once per episode, before "
                "generation, as in TRL); its tools and `get_reward` may be async."
            )
        methods = make_tools(environment_methods(environment), owner)
        clashes = sorted(set(methods) & set(self.tools))
        if clashes:
            raise ToolDefinitionError(f"{owner} has methods named like the standalone tools {clashes}: rename one.")
        return methods

    def schemas(self, environment: str | None = None) -> list[dict]:
        """The JSON schemas of the tools an episode of `environment` is offered, for the chat template's `tools`.
        With a dict of factories and no `environment`: every environment's tools (the checks made once, when the
        trainer is built, cover them all)."""
        if self.routed and environment is None:
            methods = [tool for name in self.factories for tool in self._methods[name].values()]
        elif self.factories:
            methods = list(self._methods[self._environment_name({"environment": environment})].values())
        else:
            methods = []
        return [tool.schema for tool in [*self.tools.values(), *methods]]

    def _environment_name(self, row: Mapping) -> str | None:
        if not self.routed:
            return None
        name = row.get("environment")
        if name not in self.factories:
            raise ToolDefinitionError(
                f"A row has environment={name!r}, which is not one of the environments given to "
                f"environment_factory ({sorted(self.factories)}): fix the row's `environment` column."
            )
        return name

    def _bind(self, name: str | None, environment: object) -> dict[str, Tool]:
        """The probe's tools of environment `name`, bound to `environment` (schemas are made once per factory)."""
        tools = self._methods[name]
        offered = [method.__name__ for method in environment_methods(environment)]
        if offered != list(tools):
            raise ToolDefinitionError(
                f"environment_factory returned a {type(environment).__name__} with the tools {offered}, but its first "
                f"object had {list(tools)}: one factory must make environments offering the same tools (use a dict of "
                "factories, with an `environment` column, for different kinds)."
            )
        return {n: replace(tool, function=getattr(environment, n)) for n, tool in tools.items()}

    def start_episodes(self, rows: Sequence[Mapping]) -> list[Episode]:
        """One episode per row: a new environment object from the row's factory, `reset(**row)` called on it (the
        `environment` column left out when rows are routed), its observation appended to the row's `prompt`."""
        episodes = []
        for row in rows:
            if not self.factories:
                episodes.append(Episode(None, dict(self.tools), None, row.get("prompt")))
                continue
            name = self._environment_name(row)
            spare = self._spare[name]
            environment = spare.pop() if spare else self.factories[name]()
            reset_kwargs = {k: v for k, v in row.items() if k != "environment"} if self.routed else dict(row)
            observation = environment.reset(**reset_kwargs)
            methods = self._bind(name, environment)
            # Without a `prompt` column the prompt is reset's string alone, as a user message (as in TRL).
            prompt = row.get("prompt", [{"role": "user", "content": ""}])
            episodes.append(
                Episode(environment, {**self.tools, **methods}, observation, with_observation(prompt, observation))
            )
        return episodes


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
    """What a turn's calls did. `calls` counts the calls that reached a tool (whatever came of them); the parse
    failures, `malformed` calls and calls of `unknown_tools`, reached none. TRL's `tools/failure_frequency` is
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


def _in_daemon_thread(function: Callable[[], Any]) -> asyncio.Future:
    """Run `function` in a new daemon thread; its outcome settles the returned future, unless that was abandoned."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if not future.done():  # done: the call timed out and the future was cancelled
            future.set_exception(error) if error is not None else future.set_result(result)

    def target() -> None:
        try:
            result, error = function(), None
        except BaseException as e:  # handed to the awaiting coroutine, which decides
            result, error = None, e
        try:
            loop.call_soon_threadsafe(settle, result, error)
        except RuntimeError:  # the executor's loop was closed while this call ran past its timeout
            pass

    threading.Thread(target=target, daemon=True, name="grpo-tool").start()
    return future


class ToolExecutor:
    """Runs one turn's tool calls for many episodes at once (see the module docstring for the concurrency rules).

    `timeout`: seconds one call may run (None: no limit). `errors`: `"answer"` turns an exception or a timeout into
    the answer `"Error: ..."` and counts it; `"raise"` raises `ToolCallError` for the first one (in episode order),
    once every episode's calls up to its first failure have run. `max_workers`: sync calls running at once.
    `answer_parse_failures`: whether a malformed call or an unknown tool gets an `"Error: ..."` answer (so the
    model can correct itself) or none (as in TRL, where a malformed call ends the episode); either way it is
    counted, and it never raises: it is the model's mistake, not the tool's.

    The executor owns an event loop in a daemon thread, started on first use and kept across turns (an `async`
    tool may hold a client bound to it); `close()` stops it. Use it as a context manager to close it.
    """

    def __init__(
        self,
        *,
        timeout: float | None = None,
        errors: Literal["answer", "raise"] = "answer",
        max_workers: int = 32,
        answer_parse_failures: bool = True,
    ):
        if errors not in ("answer", "raise"):
            raise ValueError(f"errors={errors!r}: use 'answer' (a failed call answers 'Error: ...') or 'raise'.")
        if timeout is not None and timeout <= 0:
            raise ValueError(f"timeout={timeout}: give a number of seconds > 0, or None for no limit.")
        if max_workers < 1:
            raise ValueError(f"max_workers={max_workers}: at least one sync tool call must be able to run.")
        self.timeout = timeout
        self.errors = errors
        self.max_workers = max_workers
        self.answer_parse_failures = answer_parse_failures
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._workers: asyncio.Semaphore | None = None

    def __enter__(self) -> ToolExecutor:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def run(
        self, turns: Sequence[Sequence[ToolCall | ParseFailure]], tools: Sequence[Mapping[str, Tool]]
    ) -> tuple[list[list[ToolAnswer]], ToolCounts]:
        """Answer each episode's parsed turn (`turns[i]`, what a parser returned) with its tools (`tools[i]`).

        Returns the answers per episode, in the order of its calls (empty: the episode called nothing, or only
        unanswered parse failures), and the counts of the whole turn.
        """
        if len(turns) != len(tools):
            raise ValueError(f"{len(turns)} parsed turns but {len(tools)} episodes' tools: give one of each.")
        outcomes = asyncio.run_coroutine_threadsafe(self._run_all(turns, tools), self._event_loop()).result()
        counts = ToolCounts()
        for answer, _ in (outcome for episode in outcomes for outcome in episode):
            counts.add(answer.status)
        failure = next((error for episode in outcomes for _, error in episode if error is not None), None)
        if failure is not None:
            raise failure
        answers = [
            [a for a, _ in episode if self.answer_parse_failures or a.status not in ("malformed", "unknown_tool")]
            for episode in outcomes
        ]
        return answers, counts

    def close(self) -> None:
        """Stop the event loop. Sync calls still running past their timeout go on in their daemon threads."""
        with self._lock:
            loop, thread, self._loop, self._thread, self._workers = self._loop, self._thread, None, None, None
        if loop is not None:
            loop.call_soon_threadsafe(loop.stop)
            thread.join()
            loop.close()

    def _event_loop(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None:
                self._loop = asyncio.new_event_loop()
                self._thread = threading.Thread(target=self._loop.run_forever, daemon=True, name="grpo-tool-loop")
                self._thread.start()
            return self._loop

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
        """One call under the timeout. `asyncio.wait` rather than `wait_for`: a TimeoutError the tool itself raises
        is then the tool's error, not a timeout."""
        if tool.is_async:
            try:
                work = asyncio.ensure_future(tool.function(**call.arguments))
            except Exception as error:  # bad arguments fail when the coroutine is made
                return ToolAnswer(call.name, f"Error: {type(error).__name__}: {error}", "error"), error
            return await self._settle(call, work)
        async with self._workers:  # freed at the timeout even if the thread runs on
            return await self._settle(call, _in_daemon_thread(lambda: tool.function(**call.arguments)))

    async def _settle(self, call: ToolCall, work: asyncio.Future) -> tuple[ToolAnswer, BaseException | None]:
        done, _ = await asyncio.wait({work}, timeout=self.timeout)
        if not done:
            work.cancel()  # stops a coroutine at its next await; a thread's future is just abandoned
            error = TimeoutError(f"the call of '{call.name}' took longer than {self.timeout} s")
            return ToolAnswer(call.name, f"Error: {error}", "timeout"), error
        if work.cancelled():  # the tool cancelled itself
            error = asyncio.CancelledError(f"the call of '{call.name}' was cancelled")
            return ToolAnswer(call.name, f"Error: {error}", "error"), error
        if work.exception() is not None:
            error = work.exception()
            return ToolAnswer(call.name, f"Error: {type(error).__name__}: {error}", "error"), error
        return ToolAnswer(call.name, str(work.result()), "ok"), None
