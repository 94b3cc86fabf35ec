"""`VLLMClient`: the trainer's HTTP client of `grpo vllm-serve` (grpo/generation/vllm/serve.py), and the weight-sync
communicator it opens with the server.

It speaks the server's API with the standard library only: requests retry with backoff while the server cannot be
reached, up to `timeout` seconds, then fail with the host, the port and the command that starts a server. No request
waits without bound: the wait for `/health` sends each try a short timeout and logs progress, and every other request
(a generation round, a weight update) gets `request_timeout` seconds to answer, so a server that accepts connections
and never answers cannot hang the trainer. An answer that is not JSON (another program on the port, a proxy's HTML
page) is an error naming the server and what it sent. The backend
that uses it is `VLLMGeneration` (grpo/generation/vllm/server_backend.py); vLLM itself is never imported here.

A server requires `Authorization: Bearer <key>` on every request unless started with --insecure-no-key
(docs/vllm.md#security). The client sends the key it is given (`api_key`), else GRPO_VLLM_API_KEY, else, for a
server on a loopback address, the key such a server made and wrote to this user's key file
(grpo/generation/vllm/server_key.py). Answers are parsed as JSON only.
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import secrets
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterable

import torch

from grpo.generation.vllm import weight_sync
from grpo.generation.vllm.server_key import API_KEY_ENV, is_loopback, key_file, read_key_file

logger = logging.getLogger(__name__)


# How long one try of `/health` may take: a server that runs answers it at once; one that accepted the connection and
# says nothing is tried again (until `timeout`) rather than waited on.
HEALTH_TRY_SECONDS = 10.0


class VLLMServerError(RuntimeError):
    """The vLLM server could not be reached, or refused a request."""


def _excerpt(body: bytes | str, limit: int = 200) -> str:
    """The start of an answer on one line, for an error message (an HTML page is many lines)."""
    text = body.decode(errors="replace") if isinstance(body, bytes) else body
    text = " ".join(text.split())
    return text[:limit] + ("..." if len(text) > limit else "")


class VLLMClient:
    """Talks to one `grpo vllm-serve` server at `base_url` (or http://host:port).

    Args:
        timeout: seconds to keep retrying, with backoff, a request the server does not answer (not started yet,
            restarting, or gone); also the weight-sync group's timeout.
        request_timeout: seconds a request the server has taken (a generation round, a weight update) may go
            unanswered before it fails naming the server; generous, since a round of long completions takes minutes.
        group_port: the port of the weight-sync group's store, opened by the server's first worker.
        api_key: the server's API key, sent as `Authorization: Bearer <key>`; None reads GRPO_VLLM_API_KEY, or
            when that is unset or empty and the server is on a loopback address, the key file a server on that
            port made for this user (none there: no key); "" sends no key.
    """

    def __init__(
        self,
        base_url: str | None = None,
        host: str = "127.0.0.1",
        port: int = 8000,
        timeout: float = 240.0,
        group_port: int = 51216,
        api_key: str | None = None,
        request_timeout: float = 1800.0,
    ):
        self.base_url = (base_url or f"http://{host}:{port}").rstrip("/")
        self.host = urllib.parse.urlsplit(self.base_url).hostname
        self.port = urllib.parse.urlsplit(self.base_url).port or 80
        self.timeout = timeout
        self.request_timeout = request_timeout
        self.progress_every = 10.0  # seconds between the lines the wait for the server logs
        self.group_port = group_port
        self.group = None
        self.info: dict | None = None
        self._key, self._key_source = api_key or None, "argument" if api_key else None
        if api_key is None and os.environ.get(API_KEY_ENV):
            self._key, self._key_source = os.environ[API_KEY_ENV], API_KEY_ENV
        # Read at each request, not now: a server started beside the trainer writes its key file once it runs.
        self._key_file = api_key is None and self._key is None and is_loopback(self.host)

    @property
    def key_source(self) -> str | None:
        """Where the key sent comes from: "argument", GRPO_VLLM_API_KEY, the key file's path, or None (no key)."""
        if self._key_file:
            return str(key_file(self.port)) if read_key_file(self.port) else None
        return self._key_source

    @property
    def headers(self) -> dict[str, str]:
        key = read_key_file(self.port) if self._key_file else self._key
        return {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}

    def __repr__(self) -> str:  # never the key
        return f"VLLMClient({self.base_url!r}, api_key={'set' if 'Authorization' in self.headers else 'unset'})"

    def _unreachable(self, waited: float, error: Exception) -> VLLMServerError:
        return VLLMServerError(
            f"No vLLM server answered at {self.base_url} (host {self.host}, port {self.port}) within {waited:.0f} s "
            f"({error}). Start one with `grpo vllm-serve --model <the policy's model> --host {self.host} "
            f"--port {self.port}` (docs/vllm.md), or point the trainer at it with vllm_server_base_url, or "
            f"vllm_server_host and vllm_server_port; vllm_server_timeout sets how long to wait."
        )

    def _gone(self, path: str, error: Exception) -> VLLMServerError:
        """A server that answered before (its /health is known) and now refuses or drops the connection."""
        return VLLMServerError(
            f"The vLLM server at {self.base_url} stopped answering during {path} ({error}); it answered before, so it "
            "has most likely died: its log says why. Restart it with `grpo vllm-serve` (docs/vllm.md) and resume "
            "the run from its newest checkpoint (resume_from_checkpoint=True)."
        )

    def _silent(self, path: str, waited: float, setting: str) -> VLLMServerError:
        return VLLMServerError(
            f"The vLLM server at {self.base_url} accepted the connection but did not answer {path} within "
            f"{waited:.0f} s ({setting}). It may be hung or overloaded, or another program may be listening on port "
            f"{self.port}: check the server's log, or restart it with `grpo vllm-serve` (docs/vllm.md)."
        )

    def _not_json(self, path: str, response, body: bytes) -> VLLMServerError:
        kind = response.headers.get("Content-Type") or "no Content-Type"
        return VLLMServerError(
            f"The server at {self.base_url} answered {path} with something that is not JSON ({kind}: "
            f"{_excerpt(body)!r}). Is another program (a web server, a proxy's page) listening on port {self.port}? "
            "Point vllm_server_base_url, or vllm_server_host and vllm_server_port, at a `grpo vllm-serve` server."
        )

    def _unauthorized(self, path: str, detail: str) -> VLLMServerError:
        sent = (
            f"refused the API key this client sent (from {self.key_source})" if self.key_source else "got no API key"
        )
        return VLLMServerError(
            f"The vLLM server at {self.base_url} requires an API key and {sent} ({path} answered 401: {detail}). "
            f"Set the environment variable {API_KEY_ENV} in the trainer's environment to the key the server was "
            f"started with (its --api-key or {API_KEY_ENV}), or to the one it made and printed at start-up; "
            "docs/vllm.md#security."
        )

    def _not_http(self, path: str, error: Exception) -> VLLMServerError:
        return VLLMServerError(
            f"The server at {self.base_url} answered {path} with something that is not HTTP "
            f"({type(error).__name__}: {error}). Is another program listening on port {self.port}? Point the trainer "
            "at a `grpo vllm-serve` server (vllm_server_base_url, or vllm_server_host and vllm_server_port)."
        )

    def request(self, path: str, payload: dict | None = None, retry: bool = True, waiting: bool = False) -> dict:
        """GET (no payload) or POST `path`; returns the JSON answer. Connection failures are retried with backoff
        for `timeout` seconds when `retry`; an answer with an error status raises at once with its message.

        Each try has a timeout (connecting and each read): `request_timeout` once the server has the request, which
        then fails at once naming the server; `waiting` (the wait for /health) gives each try at most
        HEALTH_TRY_SECONDS, tries again until `timeout` and logs a line every `progress_every` seconds."""
        data = None if payload is None else json.dumps(payload).encode()
        start, delay, said = time.monotonic(), 0.25, time.monotonic()
        while True:
            waited = time.monotonic() - start
            if waiting:  # short tries, so that a silent server is reported as the wait goes on
                try_seconds = max(min(HEALTH_TRY_SECONDS, self.progress_every, self.timeout - waited), 0.1)
            else:
                try_seconds = self.request_timeout
            try:
                return self._answer(path, data, try_seconds)
            except (urllib.error.URLError, ConnectionError, OSError) as e:
                waited = time.monotonic() - start
                # A TimeoutError of its own (not inside a URLError) is a read: the server took the request, then said
                # nothing. Connecting that timed out comes as URLError and is retried like a refused connection.
                silent = isinstance(e, TimeoutError)
                if silent and not waiting:
                    raise self._silent(path, waited, "vllm_request_timeout") from None
                if not retry or waited >= self.timeout:
                    if silent:
                        raise self._silent(path, waited, "vllm_server_timeout") from None
                    if self.info is not None and not waiting:
                        raise self._gone(path, getattr(e, "reason", e)) from None
                    raise self._unreachable(waited, getattr(e, "reason", e)) from None
                if waiting and time.monotonic() - said >= self.progress_every:
                    said = time.monotonic()
                    logger.warning(
                        "Waiting for the vLLM server at %s: %s for %.0f s so far (%s); giving up in %.0f s "
                        "(vllm_server_timeout).",
                        self.base_url,
                        "no answer" if silent else "not reachable",
                        waited,
                        getattr(e, "reason", e),
                        max(self.timeout - waited, 0.0),
                    )
                time.sleep(min(delay, max(self.timeout - waited, 0.0)))
                delay = min(delay * 2, 5.0)

    def _answer(self, path: str, data: bytes | None, try_seconds: float) -> dict:
        """One try of `request`: the JSON answer, or a VLLMServerError for an answer that is an error status, not
        JSON or not HTTP. A connection that fails or times out raises as urllib does, for `request` to retry."""
        sent = urllib.request.Request(self.base_url + path, data=data, headers=self.headers)
        try:
            with urllib.request.urlopen(sent, timeout=try_seconds) as response:
                body = response.read()
            try:
                return json.loads(body)
            except ValueError:
                raise self._not_json(path, response, body) from None
        except urllib.error.HTTPError as e:
            detail = e.read().decode(errors="replace")
            if e.code == 401:
                raise self._unauthorized(path, detail) from None
            raise VLLMServerError(
                f"vLLM server {self.base_url}{path} answered {e.code}: {_excerpt(detail, 500)}"
            ) from None
        except http.client.HTTPException as e:  # answered, but not in HTTP (another protocol on the port)
            raise self._not_http(path, e) from None

    def wait_until_ready(self) -> dict:
        """The server's /health answer, once it answers (at most `timeout` seconds, with a line of progress every
        `progress_every` seconds)."""
        self.info = self.request("/health", waiting=True)
        return self.info

    def generate(self, prompts: list[list[int]], n: int, images: list[list[str]] | None = None, **sampling) -> dict:
        """`n` completions for each token-id prompt, grouped by prompt: {"completion_ids", "logprobs",
        "weights_version"}. `sampling`: max_tokens, temperature, top_p, top_k, min_p, repetition_penalty, seed.
        `images`: each prompt's images, base64 PNG (grpo/generation/vllm/images.py `encode_rows`); sent only when
        given, so a text request reaches a server of any version."""
        payload = {"prompts": prompts, "n": n, **sampling}
        if images is not None:
            payload["images"] = images
        return self.request("/generate", payload)

    def reset_prefix_cache(self) -> None:
        self.request("/reset_prefix_cache", {})

    def _while_posting(self, path: str, payload: dict, work):
        """POST `path` in a thread while this thread runs `work()`: the server's side of a collective (opening the
        group, receiving a broadcast) answers only once the trainer's side has joined it."""
        reply: dict = {}

        def post():
            try:
                reply["value"] = self.request(path, payload, retry=False)
            except Exception as e:  # re-raised below, in the caller's thread
                reply["error"] = e

        thread = threading.Thread(target=post, daemon=True)
        thread.start()
        try:
            work()
        except Exception:
            thread.join(timeout=5)
            if "error" in reply:  # the server's reason is the useful one
                raise reply["error"] from None
            raise
        thread.join()
        if "error" in reply:
            raise reply["error"]
        return reply["value"]

    def _device(self) -> torch.device:
        """Where this process's side of the weight-sync group keeps its tensors: NCCL needs them on the GPU."""
        cuda = self.info["device"] == "cuda"
        return torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")

    def init_communicator(self) -> None:
        """Open the weight-sync group: this process is rank 0, the server's workers ranks 1..N. A fresh random
        token goes in the (authenticated) request and is then broadcast over the group; the workers keep the group
        only if the two agree, so a stranger who reached the store's port first cannot push weights."""
        info = self.info or self.wait_until_ready()
        world_size = info["weight_sync_world_size"]
        backend = "nccl" if info["device"] == "cuda" else "gloo"
        token = secrets.token_bytes(weight_sync.TOKEN_BYTES)

        def join():
            group = weight_sync.open_group(self.host, self.group_port, 0, world_size, backend, self.timeout)
            weight_sync.send_token(group, token, self._device())
            self.group = group

        payload = {"port": self.group_port, "timeout": self.timeout, "token": token.hex()}
        try:
            self._while_posting("/init_communicator", payload, join)
        except Exception:
            self.group = None  # the server refused or dropped the group (a failed handshake, for one)
            raise

    def update_weights(
        self,
        tensors: Iterable[tuple[str, torch.Tensor]],
        version: int,
        bucket_bytes: int,
        adapter_config: dict | None = None,
    ) -> dict:
        """Send every (checkpoint name, tensor) in buckets of about `bucket_bytes`, cast to the server's dtype; the
        server loads them and resets its prefix cache. `version` tags the weights (the trainer's step); the
        server's generations report it. With `adapter_config` (the JSON of a LoraConfig) the tensors are a LoRA
        adapter under PEFT's names, which the server (started with --enable-lora) serves over its base model from
        then on. Returns {"buckets", "tensors", "bytes", "seconds"}."""
        if self.group is None:
            self.init_communicator()
        device = self._device()
        dtype = weight_sync.parse_dtype(self.info["dtype"])
        start, sent = time.perf_counter(), {"tensors": 0}

        def counted():
            for item in tensors:
                sent["tensors"] += 1
                yield item

        def send():
            sent["buckets"], sent["bytes"] = weight_sync.send_weights(
                self.group, counted(), bucket_bytes, device, dtype
            )

        payload = {"version": version} if adapter_config is None else {"version": version, "adapter": adapter_config}
        try:
            self._while_posting("/update_weights", payload, send)
        except Exception:
            # A broadcast cut short leaves the group out of step: drop it; the next update opens a new one.
            self._drop_group()
            raise
        return {**sent, "seconds": time.perf_counter() - start}

    def close_communicator(self) -> None:
        if self.group is not None:
            self.group = None
            self.request("/close_communicator", {}, retry=False)

    def _drop_group(self) -> None:
        try:
            self.close_communicator()
        except VLLMServerError:
            pass  # the server is gone or broken; the caller reports the original error
