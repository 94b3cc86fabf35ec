"""OpenEnv environments as an `environment_factory`, with no change to the environment (docs/agents.md).

OpenEnv (`pip install openenv-core`) serves an environment over HTTP and a WebSocket: each connection to `/ws` is one
session on the server, with an environment object of its own, driven by `reset`, `step` and `state` messages. A
typed client (an `EnvClient[Action, Observation, State]` subclass such as `EchoEnv`) turns actions into messages and
the server's replies into `StepResult`s. `openenv_environment(EchoEnv, base_url=..., tool="echo")` makes a class of
this library's protocol (tools.py) whose objects each hold one session, opened when the object is made:
  - one tool, `tool`, whose arguments are the Action type's fields (types, defaults and descriptions from the
    pydantic model or dataclass). A call builds the Action, steps the session with it, and answers the
    observation's text; the step's reward and `done` are recorded (`rewards`, `done`, `observation`).
  - `reset(**row)` resets the session, passing on the row's `reset_columns` that it has (a `seed`, for one), and
    returns the reset observation's text, which is appended to the prompt.
  - `get_reward()`: the episode's reward from the server, its last step's (`reward="last"`) or their sum.
  - `close()` closes the session and the client (the server then closes its environment object).
With `app=` instead of `base_url`, the class serves that app itself with uvicorn, on 127.0.0.1 on a port the system
picks, in a daemon thread of this process, from when its first object is made until its last one is closed.

openenv is imported when such a class is made, never by `import grpo`.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import json
import re
import socket
import threading
import time
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from grpo.generation.tools import RESERVED_METHODS, ToolDefinitionError, make_tool

INSTALL = "pip install openenv-core"
# Fields of every OpenEnv observation that are the step's outcome, not what the model is shown.
OUTCOME_FIELDS = ("reward", "done", "metadata")


def openenv_core():
    """The `openenv.core` module, or an ImportError that names the package to install."""
    try:
        return importlib.import_module("openenv.core")
    except ImportError as error:
        raise ImportError(f"OpenEnv environments need the openenv-core package: {INSTALL} ({error})") from error


@dataclasses.dataclass(frozen=True)
class ActionField:
    """One argument of the tool: a field of the Action type."""

    name: str
    annotation: Any
    required: bool
    description: str


def action_type_of(client: type) -> type | None:
    """The Action type a typed client declares (`class EchoEnv(EnvClient[EchoAction, ...])`), or None for a client
    of dicts (`GenericEnvClient`) or one that declares none."""
    for klass in client.__mro__:
        for base in klass.__dict__.get("__orig_bases__", ()):
            args = typing.get_args(base)
            if args and isinstance(args[0], type) and (_is_model(args[0]) or dataclasses.is_dataclass(args[0])):
                return args[0]
    return None


def _is_model(kind: type) -> bool:
    return isinstance(getattr(kind, "model_fields", None), dict)  # a pydantic (v2) model class


def action_fields(action: type) -> list[ActionField]:
    """The fields of an Action type that the model fills in: a pydantic model's fields, less those of OpenEnv's base
    `Action` (`metadata`, not the model's to set), or a dataclass's `__init__` fields. A description comes from
    `Field(description=...)` (or a dataclass field's `metadata["description"]`); without one the argument is
    described by its name."""
    if _is_model(action):
        inherited = openenv_core().Action.model_fields if issubclass(action, openenv_core().Action) else {}
        found = [
            ActionField(name, info.annotation, info.is_required(), info.description or "")
            for name, info in action.model_fields.items()
            if name not in inherited
        ]
    elif dataclasses.is_dataclass(action):
        hints = typing.get_type_hints(action)
        missing = dataclasses.MISSING
        found = [
            ActionField(
                f.name,
                hints[f.name],
                f.default is missing and f.default_factory is missing,
                str(f.metadata.get("description", "")),
            )
            for f in dataclasses.fields(action)
            if f.init
        ]
    else:
        raise ToolDefinitionError(
            f"The action type {action!r} is neither a pydantic model nor a dataclass: pass action= the Action class "
            "the environment's step takes (an openenv `Action` subclass)."
        )
    return [
        dataclasses.replace(f, description=" ".join(f.description.split()) or f"the {f.name} of the {action.__name__}")
        for f in found
    ]


def step_tool(name: str, fields: Sequence[ActionField], summary: str) -> Callable:
    """A method named `name` taking `fields` as keyword arguments, typed and described in a Google-style docstring
    (so that `get_json_schema` describes it to the model), that steps the object's session with them."""

    def tool(self, **arguments):
        return self._step(arguments)

    parameters = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    for f in fields:
        default = inspect.Parameter.empty if f.required else None  # only "required" is read from it
        parameters.append(
            inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=f.annotation)
        )
    tool.__signature__ = inspect.Signature(parameters, return_annotation=str)
    tool.__annotations__ = {**{f.name: f.annotation for f in fields}, "return": str}
    tool.__name__ = tool.__qualname__ = name
    described = "".join(f"\n    {f.name}: {f.description}" for f in fields)
    tool.__doc__ = f"{summary}\n\nArgs:{described}" if fields else summary
    return tool


def observation_fields(observation: Any) -> dict[str, Any]:
    """What an observation shows, as a dict: its fields (a pydantic model, a dataclass or a client's dict), less
    `reward`, `done` and `metadata`."""
    if _is_model(type(observation)):
        fields = observation.model_dump()
    elif dataclasses.is_dataclass(observation):
        fields = dataclasses.asdict(observation)
    elif isinstance(observation, Mapping):
        fields = dict(observation)
    else:
        return {"observation": observation}
    return {k: v for k, v in fields.items() if k not in OUTCOME_FIELDS}


def observation_text(observation: Any, show: str | Callable | None) -> str | None:
    """The text the model is shown for `observation`: `show(observation)` when `show` is a function, the field
    `show` names, or else the observation's one field, or all of its fields as JSON."""
    if callable(show):
        text = show(observation)
        return None if text is None else str(text)
    fields = observation_fields(observation)
    if show is not None:
        if show not in fields:
            raise KeyError(f"observation={show!r}: the observation has no such field; its fields are {sorted(fields)}")
        return str(fields[show])
    if len(fields) == 1:
        return str(next(iter(fields.values())))
    return json.dumps(fields, default=str)


def resolve_app(app: Any) -> Any:
    """An ASGI app given as itself or as a `"module:attribute"` string (imported here, so that a typo fails now)."""
    if not isinstance(app, str):
        return app
    module_name, _, attribute = app.partition(":")
    if not module_name or not attribute:
        raise ValueError(f"app={app!r}: name the app as 'module:attribute', e.g. 'echo_env.server.app:app'.")
    found = getattr(importlib.import_module(module_name), attribute, None)
    if found is None:
        raise ValueError(f"app={app!r}: module '{module_name}' has no attribute '{attribute}'.")
    return found


class LocalServer:
    """An ASGI app (OpenEnv's `create_app(...)`) served by uvicorn on 127.0.0.1, on a port the system picks, in a
    daemon thread: started by the first `acquire()`, stopped when every `acquire()` has had its `release()`, and
    started again, on a new port, by the next `acquire()`. uvicorn's logging and signal handlers are left alone."""

    def __init__(self, app: Any, start_timeout: float = 30.0):
        self.app = app
        self.start_timeout = start_timeout
        self.url: str | None = None
        self._lock = threading.Lock()
        self._users = 0
        self._running: tuple | None = None  # (uvicorn server, its thread, its socket)

    def acquire(self) -> str:
        """The server's URL, starting it if it is not running."""
        with self._lock:
            if self._users == 0:
                self._start()
            self._users += 1
            return self.url

    def release(self) -> None:
        """One user fewer; the last one stops the server."""
        with self._lock:
            self._users -= 1
            if self._users == 0 and self._running is not None:
                server, thread, sock = self._running
                self._running = None
                server.should_exit = True
                thread.join()
                sock.close()

    def _start(self) -> None:
        import uvicorn

        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))  # loopback only: nothing off this machine can reach the environment
        config = uvicorn.Config(self.app, log_config=None, access_log=False, timeout_graceful_shutdown=5)
        server = uvicorn.Server(config)
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True, name="grpo-openenv")
        thread.start()
        deadline = time.monotonic() + self.start_timeout
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                server.should_exit = True
                sock.close()
                raise RuntimeError(
                    f"The OpenEnv app {self.app!r} did not start serving on 127.0.0.1 within {self.start_timeout} s "
                    "(its error, if it raised one, is logged above)."
                )
            time.sleep(0.01)
        self._running = (server, thread, sock)
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"


@dataclasses.dataclass(frozen=True)
class Settings:
    """What `openenv_environment` was given, checked (one per class it makes)."""

    client: type
    action: type
    base_url: str | None
    server: LocalServer | None
    observation: str | Callable | None
    reward: str
    show_reset: bool
    reset_columns: tuple[str, ...]
    client_kwargs: dict


class OpenEnvSession:
    """One OpenEnv session as an environment of this library's protocol: the base of the classes that
    `openenv_environment` makes, which add the tool method and their `Settings`. Public attributes for reward
    functions: `rewards` (each step's reward this episode, None where the server sent none), `done`, `observation`
    (the last one, as the client parsed it), and `url`, the server's."""

    _settings: Settings

    def __init__(self):
        self.rewards: list[float | None] = []
        self.done = False
        self.observation = None
        self._client = None
        settings = self._settings
        self.url = settings.server.acquire() if settings.server else settings.base_url
        try:
            self._client = self._connect()
        except BaseException:
            if settings.server:
                settings.server.release()
            raise

    def _connect(self):
        settings = self._settings
        client = settings.client(base_url=self.url, **settings.client_kwargs).sync()
        try:
            client.connect()
        except Exception as error:
            client.close()  # stops the client's event-loop thread
            raise ConnectionError(
                f"Cannot open a session on the OpenEnv server at {self.url}: {error}. Start the server first, or "
                "pass app=... (the server's app) to have it served here."
            ) from error
        return client

    def reset(self, **row) -> str | None:
        """Reset the session for a new episode, with the row's `reset_columns` that it has."""
        sent = {k: row[k] for k in self._settings.reset_columns if k in row}
        result = self._request("reset", lambda: self._client.reset(**sent))
        self.rewards, self.done, self.observation = [], bool(result.done), result.observation
        return observation_text(result.observation, self._settings.observation) if self._settings.show_reset else None

    def get_reward(self) -> float:
        """The episode's reward from the server: its last step's, or their sum (`reward="sum"`); 0 without one."""
        given = [r for r in self.rewards if r is not None]
        if not given:
            return 0.0
        return float(given[-1]) if self._settings.reward == "last" else float(sum(given))

    def close(self) -> None:
        """Close the session and the client (once; later calls do nothing)."""
        client, self._client = self._client, None
        if client is None:
            return
        try:
            client.close()
        finally:
            if self._settings.server:
                self._settings.server.release()

    def __deepcopy__(self, memo):
        # A remote session cannot be copied: a copy is the object itself.
        return self

    def _step(self, arguments: dict) -> str | None:
        if self.done:
            raise RuntimeError("the episode is over (the environment said done): answer without calling it again")
        if self._client is None:
            raise RuntimeError("this environment was closed")
        action = self._settings.action(**arguments)
        result = self._request("step", lambda: self._client.step(action))
        self.rewards.append(result.reward)
        self.done, self.observation = bool(result.done), result.observation
        return observation_text(result.observation, self._settings.observation)

    def _request(self, what: str, request: Callable):
        from websockets.exceptions import ConnectionClosed

        try:
            return request()
        except (RuntimeError, ConnectionClosed) as error:  # the server answered with an error, or hung up
            hint = ""
            if isinstance(error, ConnectionClosed) or "CAPACITY_REACHED" in str(error):
                hint = (
                    " An OpenEnv server refuses (and closes) a session when it already serves max_concurrent_envs "
                    "of them: serve it with create_app(..., max_concurrent_envs=N), N at least the episodes of one "
                    "generation round, and set SUPPORTS_CONCURRENT_SESSIONS = True on its environment class."
                )
            raise RuntimeError(f"The OpenEnv server at {self.url} failed the {what}: {error!r}.{hint}") from error


def openenv_environment(
    client: type,
    *,
    base_url: str | None = None,
    app: Any = None,
    tool: str | None = None,
    action: type | None = None,
    description: str | None = None,
    observation: str | Callable | None = None,
    reward: str = "last",
    show_reset: bool = True,
    reset_columns: Sequence[str] = ("seed", "episode_id"),
    client_kwargs: Mapping[str, Any] | None = None,
) -> type:
    """An `environment_factory` for the OpenEnv environment that `client` (an `EnvClient` subclass) talks to: a class
    whose objects each hold one session on the server (see the module docstring).

    Args:
        client: the environment's client class, e.g. `EchoEnv`, or openenv's `GenericEnvClient` with `action=`.
        base_url: the URL of a server that is already running (`http://`, `ws://` or their secure forms).
        app: instead of `base_url`, the server's ASGI app (or `"module:attribute"`), served here on 127.0.0.1.
        tool: the tool's name (default: the Action type's name without `Action`, in snake case: `echo`).
        action: the Action type (default: the one `client` declares).
        description: the tool's description for the model (default: the Action type's docstring).
        observation: what the model is shown of an observation: a field's name, or a function of the
            observation (default: its one field, or all its fields as JSON).
        reward: `"last"` (the episode's last step's reward) or `"sum"` (their sum), for `get_reward()`.
        show_reset: whether `reset` returns the reset observation's text (appended to the prompt).
        reset_columns: the dataset columns passed to the server's `reset` when a row has them.
        client_kwargs: more arguments for `client(...)`, e.g. `{"message_timeout_s": 30}`.
    """
    action = _checked(client, base_url, app, reward, action)
    name = _tool_name(tool, action)
    method = step_tool(name, action_fields(action), description or _summary(action, client))
    make_tool(method, client.__name__)  # a field the schema cannot describe fails here, naming it
    settings = Settings(
        client,
        action,
        base_url,
        LocalServer(resolve_app(app)) if app is not None else None,
        observation,
        reward,
        show_reset,
        tuple(reset_columns),
        dict(client_kwargs or {}),
    )
    doc = f"The OpenEnv environment of {client.__name__} (openenv_environment): one session per object."
    return type(client.__name__, (OpenEnvSession,), {name: method, "_settings": settings, "__doc__": doc})


def _checked(client: type, base_url: str | None, app: Any, reward: str, action: type | None) -> type:
    """The Action type, once `openenv_environment`'s arguments are checked (each mistake named with its fix)."""
    if not (isinstance(client, type) and issubclass(client, openenv_core().EnvClient)):
        raise TypeError(
            f"openenv_environment(client=...) takes an OpenEnv client class (an EnvClient subclass such as "
            f"EchoEnv), not {client!r}."
        )
    if (base_url is None) == (app is None):
        raise ValueError(
            "openenv_environment: give base_url= (a server that is already running) or app= (its ASGI app, served "
            "here on 127.0.0.1), not both and not neither."
        )
    if reward not in ("last", "sum"):
        raise ValueError(f"reward={reward!r}: use 'last' (the last step's reward) or 'sum' (every step's).")
    action = action or action_type_of(client)
    if action is None:
        raise ToolDefinitionError(
            f"{client.__name__} does not declare its Action type (as in EnvClient[MyAction, MyObservation, State]): "
            "pass action=MyAction, the pydantic model or dataclass the environment's step takes."
        )
    return action


def _tool_name(tool: str | None, action: type) -> str:
    """`tool`, or the Action type's name without `Action`, in snake case (`EchoAction` -> `echo`)."""
    name = tool or _snake_case(re.sub(r"Action$", "", action.__name__)) or "step"
    if not name.isidentifier() or name.startswith("_") or name in RESERVED_METHODS:
        raise ToolDefinitionError(
            f"tool={name!r}: name the tool with a Python identifier not starting with '_', "
            f"other than {', '.join(RESERVED_METHODS)}."
        )
    return name


def _snake_case(name: str) -> str:
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", name).lower()


def _summary(action: type, client: type) -> str:
    """The Action type's own docstring (not an inherited one, nor a dataclass's generated signature), else a line
    naming the environment."""
    own = inspect.cleandoc(action.__dict__.get("__doc__") or "")
    if own and not own.startswith(f"{action.__name__}("):
        return own.split("\n\n")[0]
    return f"Act in the {client.__name__} environment with one {action.__name__}."
