"""Tools for multi-turn episodes: their JSON schemas, one environment per episode, and running a turn's calls.

The protocol is TRL's (`GRPOTrainer(tools=..., environment_factory=...)`), so the same functions and environment
classes work here:
  - a *tool* is a plain function, sync or `async def`, with type hints and a Google-style docstring describing each
    argument; its JSON schema, the one chat templates render, comes from `transformers.utils.get_json_schema`.
  - an *environment factory* is a zero-argument callable (usually a class). Each episode gets an object of its own
    for its duration (reused by later episodes, and closed at the end: environment_pool.py), on
    which `reset(**row)` is called with the episode's dataset row (every column, `prompt` included; with a dict of
    factories, the `environment` column picks the factory and is not passed on). When `reset` returns a string, it
    is appended to the content of the prompt's last message (`with_observation`). Its public methods, those not
    starting with `_`, other than `reset`, `get_reward` and `close`, become that episode's tools, bound to its
    object.
    `get_reward()`, when defined, lets the environment score its episode (TRL adds it as a reward function).

One turn runs as (`ToolExecutor.run`): the calls of every episode at once, each episode's own calls one after the
other in the order the model wrote them (they may act on one environment, and order matters there: "move up, then
left"). `async def` tools run on one event loop kept across turns (`ToolLoop`: a tool may hold a client, an HTTP
session, bound to it), sync ones in daemon threads (at most `max_workers` at once), each call under `timeout`
seconds counted from its start. The turn itself runs on a second loop that only ever waits, so no tool can keep
a timeout from firing. A failure (an exception, `SystemExit` and `KeyboardInterrupt` included, a timeout, a call
that could not be parsed) becomes the answer the model sees, `"Error: ..."`, and is counted, unless
`errors="raise"`. A sync call that times out cannot be stopped: its thread keeps running until the function
returns (a daemon thread, so it never holds up the interpreter's exit), and frees its place among the
`max_workers` at the timeout. An `async def` tool that times out is cancelled at its next `await`; one that blocks
without awaiting (`time.sleep` in an `async def`) holds the whole tools' loop, so at its timeout that loop is
left to it, to stop once the call returns, and the next async call starts a new one (a client bound to the old
loop is lost with it: blocking work belongs in sync tools). Threads left running past a timeout, of either kind,
are counted: with `max_hung` of them, the next call raises `HungToolsError` instead of leaking more.

Where this departs from TRL: TRL calls an episode's sync tools in the trainer's thread, episodes one after another,
with no timeout; a failed call's answer is `str({"error": message})`; a malformed call is read as plain text (the
episode ends) and not counted. Both keep a pool of environment objects per factory, grown when a round needs more
and reset between episodes; TRL never calls their `close()`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import threading
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

from transformers.utils import DocstringParsingException, TypeHintParsingException, get_json_schema

from grpo.generation.environment_pool import EnvironmentPool, accepts_seed, close_pools, group_seed
from grpo.generation.tool_calls import ParseFailure, ToolCall

# Methods of an environment that are part of the protocol, never offered to the model as tools (TRL reserves the
# first two; `close` is the trainer's to call when it is done with the object, environment_pool.py).
RESERVED_METHODS = ("reset", "get_reward", "close")


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
    every method whose name does not start with `_`, other than `reset`, `get_reward` and `close`. Properties are not
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

    def __init__(self, tools: Sequence[Callable] = (), environment_factory=None, group_seed: int | None = None):
        self.tools = make_tools(tools)
        if environment_factory is None:
            self.factories: dict[str | None, Callable[[], object]] = {}
        elif isinstance(environment_factory, Mapping):
            self.factories = dict(environment_factory)
        else:
            self.factories = {None: environment_factory}
        self.group_seed = group_seed  # the run's seed when the G episodes of a group reset with one seed, else None
        self.pools: dict[str | None, EnvironmentPool] = {}
        self._methods: dict[str | None, dict[str, Tool]] = {}  # each environment's methods, bound to its probe
        self.environment_types: list[type] = []  # the class of each factory's objects, in the factories' order
        # The pools are closed when the toolbox is collected too (a trainer built and dropped without training, or
        # one whose construction failed after this point).
        weakref.finalize(self, close_pools, self.pools)
        for name, factory in self.factories.items():
            environment = factory()
            self.pools[name] = EnvironmentPool(factory, environment)
            self._methods[name] = self._methods_of(environment)
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
        if self.group_seed is not None and not accepts_seed(environment.reset):
            raise ToolDefinitionError(
                f"environment_group_seed=True passes `seed=` to reset, but {owner}.reset takes no `seed` argument "
                "(nor **kwargs): add one and start the episode's state from it, or set environment_group_seed=False."
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
        """One episode per row: an environment object from the row's pool (an idle one, or a new one), `reset(**row)`
        called on it (the `environment` column left out when rows are routed; `seed=` added under a group seed), its
        observation appended to the row's `prompt`. Give the objects back (`give_back`) once the round is scored."""
        episodes = []
        for row in rows:
            if not self.factories:
                episodes.append(Episode(None, dict(self.tools), None, row.get("prompt")))
                continue
            name = self._environment_name(row)
            environment = self.pools[name].take()
            reset_kwargs = {k: v for k, v in row.items() if k != "environment"} if self.routed else dict(row)
            if self.group_seed is not None:
                if "seed" in reset_kwargs:
                    raise ToolDefinitionError(
                        "environment_group_seed passes `seed=` to reset, but the rows have a `seed` column too: "
                        "rename the column, or set environment_group_seed=False."
                    )
                reset_kwargs["seed"] = group_seed(reset_kwargs, self.group_seed)
            observation = environment.reset(**reset_kwargs)
            methods = self._bind(name, environment)
            # Without a `prompt` column the prompt is reset's string alone, as a user message (as in TRL).
            prompt = row.get("prompt", [{"role": "user", "content": ""}])
            episodes.append(
                Episode(environment, {**self.tools, **methods}, observation, with_observation(prompt, observation))
            )
        return episodes

    def give_back(self, environments: Sequence[object]) -> None:
        """Make a scored round's environment objects idle again, for the next episodes to reset (None: no object)."""
        for pool in self.pools.values():
            pool.give_back(e for e in environments if e is not None)

    def close(self) -> None:
        """Close every environment object made so far (`EnvironmentPool.close`); new episodes make new ones."""
        close_pools(self.pools)


def make_toolbox(tools: Sequence[Callable] | None, environment_factory, args) -> Toolbox | None:
    """The run's `Toolbox` (None without tools or environments), with the group seed `environment_group_seed` asks
    for; that field without an environment_factory is refused, naming the fix."""
    if args.environment_group_seed and environment_factory is None:
        raise ToolDefinitionError(
            "environment_group_seed=True seeds the environments' reset, but no environment_factory was given: pass "
            "one to GRPOTrainer, or set environment_group_seed=False."
        )
    if not (tools or environment_factory):
        return None
    return Toolbox(tools or (), environment_factory, args.seed if args.environment_group_seed else None)


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
            return str(await Steps(coroutine, self, name)), None
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
        unanswered parse failures), and the counts of the whole turn. Raises `HungToolsError` when `max_hung`
        calls run past their timeout.
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
            [a for a, _ in episode if self.answer_parse_failures or a.status not in ("malformed", "unknown_tool")]
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
        """One call under the timeout: an `async def` tool on the tools' loop, a sync one in a daemon thread."""
        self._check_hung(call.name)
        if tool.is_async:
            try:
                coroutine = tool.function(**call.arguments)
            except Exception as error:  # bad arguments fail when the coroutine is made
                return ToolAnswer(call.name, f"Error: {type(error).__name__}: {error}", "error"), error
            tool_loop = self._tools_loop()
            return await self._settle(call, tool_loop.submit(call.name, coroutine), tool_loop)
        async with self._workers:  # freed at the timeout even if the thread runs on
            work, thread = self._in_daemon_thread(lambda: str(tool.function(**call.arguments)))
            return await self._settle(call, work, thread)

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
        self, call: ToolCall, work: asyncio.Future, runner: threading.Thread | ToolLoop
    ) -> tuple[ToolAnswer, BaseException | None]:
        """`asyncio.wait` rather than `wait_for`: a TimeoutError the tool itself raises is then the tool's error, not
        a timeout. At the timeout, a coroutine is cancelled at its next await; a thread, or a tools' loop the call
        blocks, cannot be stopped: it is left running, counted among the hung ones, and the next async call gets a
        new loop."""
        done, _ = await asyncio.wait({work}, timeout=self.timeout)
        if not done:
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
