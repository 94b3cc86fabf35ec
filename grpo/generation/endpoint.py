"""An OpenAI-compatible chat-completions endpoint on loopback, for agents that call a chat API themselves
(`GRPOTrainer(agent_func=...)`, docs/agents.md "Any agent").

`ChatEndpoint` serves `GET /v1/models` and `POST /v1/chat/completions` on 127.0.0.1 at a port the system picks, with
the standard library's `ThreadingHTTPServer`. Its handler threads never touch the model: they check the key and the
request's fields (`check_request`), queue the request, and wait for the round's thread, which owns the model, to
answer it (agent_function.py batches every queued request into one backend call). A request's API key is
`<run key>-<episode id>`: the run key is random per run (`secrets.token_urlsafe`), so only the agents the trainer
started can call, and an unchanged OpenAI client carries its episode's id in its key. A request without a live key
gets 401, a malformed one 400 naming the field; error bodies follow OpenAI's schema (`{"error": {"message", "type",
"param", "code"}}`).

What a request may set (anything else that is not null is refused with a 400 naming it): `messages`, `model` (any
name), `tools`, `tool_choice` ("auto" or "none"), `n`, `max_tokens` / `max_completion_tokens` (cut the turn, which
then ends with finish_reason "length"), `logprobs` with `top_logprobs` 0, `temperature` and `top_p` equal to the
run's (GRPO trains on completions sampled from the policy at the run's settings), `stop` empty, `stream` false,
`frequency_penalty` / `presence_penalty` 0, and `user`, `metadata`, `store`, `parallel_tool_calls`, `seed`, which
are read and not acted on.
"""

from __future__ import annotations

import hmac
import json
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

HOST = "127.0.0.1"
MODEL_NAME = "policy"  # the name /v1/models lists; requests may name any model
# Fields read and not acted on; fields accepted only at one value (what a value other than that would need).
IGNORED_FIELDS = ("model", "user", "metadata", "store", "parallel_tool_calls", "seed")
FIXED_FIELDS = {
    "stream": (False, "streaming is not served: ask for the whole answer (stream=False)"),
    "stop": ([], "stop sequences are not served: the policy's turn ends at its EOS token or max_tokens"),
    "frequency_penalty": (0, "penalties would change the distribution the trainer learns from"),
    "presence_penalty": (0, "penalties would change the distribution the trainer learns from"),
    "top_logprobs": (0, "only the sampled tokens' log-probs are served"),
}
HONOURED_FIELDS = (
    "messages",
    "tools",
    "tool_choice",
    "n",
    "max_tokens",
    "max_completion_tokens",
    "logprobs",
    "temperature",
    "top_p",
)


class RequestError(ValueError):
    """A request the endpoint refuses: the HTTP status, the message, and the field at fault (OpenAI's `param`)."""

    def __init__(self, message: str, param: str | None = None, status: int = 400):
        super().__init__(message)
        self.param, self.status = param, status

    def body(self) -> dict:
        kind = "invalid_request_error" if self.status == 400 else "authentication_error"
        return {"error": {"message": str(self), "type": kind, "param": self.param, "code": None}}


@dataclass(frozen=True)
class Endpoint:
    """What an agent function is given to reach the trainer's policy: an OpenAI-compatible `base_url`, the episode's
    own `api_key`, and a `model` name to put in requests (any name is served)."""

    base_url: str
    api_key: str
    model: str = MODEL_NAME

    def client(self, **kwargs):
        """An `openai.OpenAI` client for this episode (needs the `openai` package, which grpo does not require)."""
        import openai

        return openai.OpenAI(base_url=self.base_url, api_key=self.api_key, **kwargs)

    def async_client(self, **kwargs):
        """An `openai.AsyncOpenAI` client for this episode (needs the `openai` package)."""
        import openai

        return openai.AsyncOpenAI(base_url=self.base_url, api_key=self.api_key, **kwargs)


@dataclass
class Call:
    """One chat-completions request waiting for the round's thread: its episode, its checked body, and the answer
    (status, body) once `answer` sets it."""

    episode: str
    body: dict
    arrived: float = field(default_factory=time.monotonic)
    status: int = 0
    response: dict | None = None
    done: threading.Event = field(default_factory=threading.Event)

    def answer(self, status: int, response: dict) -> None:
        self.status, self.response = status, response
        self.done.set()


def check_request(body: Any, sampling) -> dict:
    """The request's body, checked: a JSON object whose fields are served (module docstring), with the defaults
    filled in (`n` 1, `tool_choice` "auto", `logprobs` False, `max_tokens` None). `sampling`: the run's
    `SamplingSettings` (temperature and top_p must match). Raises `RequestError` naming the field."""
    if not isinstance(body, dict):
        raise RequestError("The request body must be a JSON object.")
    for name, value in body.items():
        if value is None or name in IGNORED_FIELDS or name in HONOURED_FIELDS:
            continue
        if name in FIXED_FIELDS:
            allowed, why = FIXED_FIELDS[name]
            if value != allowed and not (allowed == [] and value == ""):
                raise RequestError(f"{name}={value!r} is not served: {why}.", name)
            continue
        raise RequestError(
            f"The field {name!r} is not served by the trainer's endpoint (served: {', '.join(HONOURED_FIELDS)}).", name
        )
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty list of chat messages.", "messages")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise RequestError(f"messages[{i}] must be an object with a 'role' string.", "messages")
    for name, run in (("temperature", sampling.temperature), ("top_p", sampling.top_p)):
        value = body.get(name)
        if value is not None and (not isinstance(value, int | float) or abs(value - run) > 1e-6):
            raise RequestError(
                f"{name}={value!r} differs from the run's {name}={run}: the trainer samples every episode with the "
                f"run's settings (set {name} in GRPOConfig, or leave it out of the request).",
                name,
            )
    checked = {"messages": messages, "tools": body.get("tools") or None, "n": body.get("n") or 1}
    if not isinstance(checked["n"], int) or isinstance(checked["n"], bool) or checked["n"] < 1:
        raise RequestError(f"n must be a positive integer, got {body.get('n')!r}.", "n")
    if checked["tools"] is not None and not (
        isinstance(checked["tools"], list) and all(isinstance(t, dict) for t in checked["tools"])
    ):
        raise RequestError("tools must be a list of tool objects ({'type': 'function', 'function': {...}}).", "tools")
    choice = body.get("tool_choice") or "auto"
    if choice not in ("auto", "none"):
        raise RequestError(
            f"tool_choice={choice!r} is not served: only 'auto' and 'none' (the policy's turn is not constrained).",
            "tool_choice",
        )
    checked["tool_choice"] = choice
    limit = body.get("max_completion_tokens", body.get("max_tokens"))
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 1):
        raise RequestError(f"{name} must be a positive integer, got {limit!r}.", name)
    checked["max_tokens"] = limit
    checked["logprobs"] = bool(body.get("logprobs"))
    return checked


class ChatEndpoint:
    """The HTTP server (module docstring). `submit(call)` receives each authenticated, checked request (the round's
    queue); `sampling` is the run's `SamplingSettings`. `open_episodes` makes episodes' keys valid for a round,
    `close_episodes` invalidates them; `close` stops the server."""

    def __init__(self, submit: Callable[[Call], None], sampling):
        self.run_key = secrets.token_urlsafe(24)
        self.submit, self.sampling = submit, sampling
        self.live: set[str] = set()  # the episode ids whose keys are valid now
        self.lock = threading.Lock()
        self.server = ThreadingHTTPServer((HOST, 0), _handler_class(self))
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, name="grpo-endpoint", daemon=True)
        self.thread.start()

    @property
    def base_url(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host}:{port}/v1"

    def endpoint(self, episode: str) -> Endpoint:
        """What the agent of `episode` is given: the base URL and its own key."""
        return Endpoint(self.base_url, f"{self.run_key}-{episode}")

    def open_episodes(self, episodes: list[str]) -> None:
        with self.lock:
            self.live.update(episodes)

    def close_episodes(self, episodes: list[str]) -> None:
        with self.lock:
            self.live.difference_update(episodes)

    def episode_of(self, authorization: str | None) -> str:
        """The live episode a request's `Authorization: Bearer <run key>-<episode>` header names; else 401."""
        key = (authorization or "").removeprefix("Bearer ").strip().encode()
        prefix = f"{self.run_key}-".encode()
        if not (len(key) > len(prefix) and hmac.compare_digest(key[: len(prefix)], prefix)):
            raise RequestError("A valid API key is required (the key the trainer gave this episode).", status=401)
        episode = key[len(prefix) :].decode(errors="replace")
        with self.lock:
            live = episode in self.live
        if not live:
            raise RequestError(f"The episode {episode!r} is not running (it ended or timed out).", status=401)
        return episode

    def close(self) -> None:
        """Stop serving and free the port (again: nothing); requests still waiting are answered by the round that
        queued them."""
        if self.thread.is_alive():
            self.server.shutdown()
            self.server.server_close()


def _handler_class(endpoint: ChatEndpoint) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format, *args):  # noqa: A002 (the base class's name): no line per request on stderr
            pass

        def do_GET(self):
            try:
                endpoint.episode_of(self.headers.get("Authorization"))
                if self.path.rstrip("/") not in ("/v1/models", "/models"):
                    raise RequestError(f"No such path {self.path!r}: GET /v1/models.", status=404)
            except RequestError as error:
                return self.reply(error.status, error.body())
            self.reply(200, {"object": "list", "data": [{"id": MODEL_NAME, "object": "model", "owned_by": "grpo"}]})

        def do_POST(self):
            try:
                episode = endpoint.episode_of(self.headers.get("Authorization"))
                if self.path.rstrip("/") not in ("/v1/chat/completions", "/chat/completions"):
                    raise RequestError(f"No such path {self.path!r}: POST /v1/chat/completions.", status=404)
                length = int(self.headers.get("Content-Length") or 0)
                try:
                    body = json.loads(self.rfile.read(length) or b"null")
                except (json.JSONDecodeError, UnicodeDecodeError) as error:
                    raise RequestError(f"The request body is not valid JSON: {error}.") from error
                call = Call(episode, check_request(body, endpoint.sampling))
            except RequestError as error:
                return self.reply(error.status, error.body())
            endpoint.submit(call)
            call.done.wait()
            self.reply(call.status, call.response)

        def reply(self, status: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    return Handler
