"""Tools for multi-turn episodes: their JSON schemas, and the environments the episodes run in.

The protocol is TRL's (`GRPOTrainer(tools=..., environment_factory=...)`), so the same functions and environment
classes work here:
  - a *tool* is a plain function, sync or `async def`, with type hints and a Google-style docstring describing each
    argument; its JSON schema, the one chat templates render, comes from `transformers.utils.get_json_schema`.
  - an *environment factory* is a zero-argument callable (usually a class). Each episode gets an object of its own
    for its duration (reused by later episodes, and closed at the end: environment_pool.py), on
    which `reset(**row)` is called with the episode's dataset row (every column, `prompt` included; with a dict of
    factories, the `environment` column picks the factory and is not passed on). When `reset` returns a string, it
    is appended to the content of the prompt's last message (`with_observation`). Its public methods, those not
    starting with `_`, other than `reset`, `get_reward`, `get_turn_rewards` and `close`, become that episode's
    tools, bound to its object.
    `get_reward()`, when defined, lets the environment score its episode (TRL adds it as a reward function).

Running a turn's calls (`ToolExecutor`, timeouts, errors as answers) is tool_executor.py's.

Where this departs from TRL: both keep a pool of environment objects per factory, grown when a round needs more
and reset between episodes; TRL never calls their `close()`.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import warnings
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

from transformers.utils import DocstringParsingException, TypeHintParsingException, get_json_schema

from grpo.generation.environment_checks import (
    check_new_object,
    checked_observation,
    factory_label,
    make_environment,
    unknown_environment,
)
from grpo.generation.environment_pool import EnvironmentPool, accepts_seed, close_pools, group_seed

# Methods of an environment that are part of the protocol, never offered to the model as tools (TRL reserves the
# first two; `close` is the trainer's to call when it is done with the object, environment_pool.py; `get_turn_rewards`:
# turn-level credit, grpo/rewards/turns.py).
RESERVED_METHODS = ("reset", "get_reward", "close", "get_turn_rewards")


class ToolDefinitionError(ValueError):
    """A tool or environment that cannot be offered to the model; the message names it and the fix."""


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
    every method whose name does not start with `_`, other than the `RESERVED_METHODS`. Properties are not
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
            environment = make_environment(factory, name, 1)
            check_new_object(environment, (pool.made[0] for pool in self.pools.values()), factory_label(factory, name))
            self.pools[name] = EnvironmentPool(factory, environment, name)
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
            raise ToolDefinitionError(unknown_environment(name, self.factories, "A row"))
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
            observation = checked_observation(environment, environment.reset(**reset_kwargs))
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


def tool_set(toolbox: Toolbox | None) -> dict[str, str]:
    """The tools a run offers (every environment's methods too), as {name: a digest of the JSON schema the model is
    shown}: what a checkpoint records, so that a resume with other tools, or tools described otherwise, is told."""
    if toolbox is None:
        return {}
    return {
        schema["function"]["name"]: hashlib.sha256(json.dumps(schema, sort_keys=True).encode()).hexdigest()[:16]
        for schema in toolbox.schemas()
    }


def make_toolbox(tools: Sequence[Callable] | None, environment_factory, args) -> Toolbox | None:
    """The run's `Toolbox` (None without tools or environments), with the group seed `environment_group_seed` asks
    for; that field without an environment_factory is refused, naming the fix, and `tools` that is not a list is
    refused too. Without either, the tool settings given other values than their defaults are warned about
    (`warn_unused_tool_settings`)."""
    if args.environment_group_seed and environment_factory is None:
        raise ToolDefinitionError(
            "environment_group_seed=True seeds the environments' reset, but no environment_factory was given: pass "
            "one to GRPOTrainer, or set environment_group_seed=False."
        )
    check_tools_list(tools)
    if not (tools or environment_factory):
        warn_unused_tool_settings(args)
        return None
    toolbox = Toolbox(tools or (), environment_factory, args.seed if args.environment_group_seed else None)
    warn_if_timeout_cuts_tools(toolbox.tools, args.tool_timeout)
    return toolbox


def warn_if_timeout_cuts_tools(tools: Mapping[str, Tool], tool_timeout: float | None) -> None:
    """Warn about each tool whose function says how long one of its calls may run (a `wall_seconds` attribute: the
    `python` tool's sandbox limit, grpo/rewards/code_tool.py) when `tool_timeout` does not leave it that long: the
    executor would answer its calls "took longer than ..." and kill their sandboxes before the code's own limit."""
    for name, tool in tools.items():
        wall = getattr(tool.function, "wall_seconds", None)
        if tool_timeout is None or not isinstance(wall, (int, float)) or wall < tool_timeout:
            continue
        warnings.warn(
            f"The tool '{name}' runs code for up to {wall} s (its sandbox's Limits(wall_seconds={wall})), but "
            f"tool_timeout={tool_timeout} s ends each call first: a call that needs its wall time is answered as "
            "a timeout (counted in tools/timeouts) and its sandbox killed, never 'timed out after ...'. Set "
            f"tool_timeout above the wall time (e.g. tool_timeout={wall + 5:g}), or build the tool with "
            f"Limits(wall_seconds=...) below {tool_timeout} s.",
            UserWarning,
            stacklevel=2,
        )


def check_tools_list(tools) -> None:
    """Refuse `tools` that is not a list (or tuple) of functions: a single function, a dict or a string would
    otherwise fail later with "'function' object is not iterable", naming neither `tools` nor the fix."""
    if tools is None or (isinstance(tools, Sequence) and not isinstance(tools, (str, bytes))):
        return
    if callable(tools):
        name = getattr(tools, "__name__", type(tools).__name__)
        raise ToolDefinitionError(
            f"tools={name} is a single {type(tools).__name__}: tools must be a list of callables, even for one tool. "
            f"Pass tools=[{name}]."
        )
    raise ToolDefinitionError(
        f"tools is a {type(tools).__name__}: tools must be a list of callables (functions with type hints and a "
        "docstring), e.g. tools=[multiply]."
    )


# The settings only the tool loop reads (grpo/generation/episodes.py): without tools or an environment_factory they
# do nothing.
TOOL_SETTINGS = (
    "max_tool_calling_iterations",
    "tool_timeout",
    "tool_errors",
    "tool_num_workers",
    "tool_max_hung_calls",
)


def warn_unused_tool_settings(args) -> None:
    """Warn, naming them, about the `TOOL_SETTINGS` that `args` sets to other values than GRPOConfig's defaults in a
    run without tools or an environment_factory, where nothing reads them (TRL ignores them without a word)."""
    defaults = {f.name: f.default for f in fields(args) if f.name in TOOL_SETTINGS}
    changed = [f"{name}={getattr(args, name)!r}" for name in TOOL_SETTINGS if getattr(args, name) != defaults[name]]
    if changed:
        warnings.warn(
            f"{', '.join(changed)} set, but this run has no tools and no environment_factory, so nothing reads "
            f"{'it' if len(changed) == 1 else 'them'}: pass tools=[...] or environment_factory=... to GRPOTrainer "
            "for multi-turn episodes, or leave these settings out.",
            UserWarning,
            stacklevel=3,
        )
