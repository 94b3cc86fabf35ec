"""The trainer's side of `grpo vllm-serve`: an HTTP client, and the generation backend that uses it.

`VLLMClient` speaks the server's API (grpo/vllm_server.py) with the standard library only: requests retry with
backoff while the server cannot be reached, up to `timeout` seconds, then fail with the host, the port and the
command that starts a server. `VLLMGeneration` is the trainer's `GenerationBackend` for `use_vllm=True`: the main
process sends the round's unique prompts once each with n = G, and pushes the policy's weights to the server before
a generation whenever an optimizer step has changed them (docs/vllm.md). vLLM itself is never imported here.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterable

import torch
from torch import nn

from grpo import weight_sync
from grpo.generation import Completions

logger = logging.getLogger(__name__)


class VLLMServerError(RuntimeError):
    """The vLLM server could not be reached, or refused a request."""


class VLLMClient:
    """Talks to one `grpo vllm-serve` server at `base_url` (or http://host:port).

    Args:
        timeout: seconds to keep retrying, with backoff, a request the server does not answer (not started yet,
            restarting, or gone); also the weight-sync group's timeout.
        group_port: the port of the weight-sync group's store, opened by the server's first worker.
    """

    def __init__(
        self,
        base_url: str | None = None,
        host: str = "127.0.0.1",
        port: int = 8000,
        timeout: float = 240.0,
        group_port: int = 51216,
    ):
        self.base_url = (base_url or f"http://{host}:{port}").rstrip("/")
        self.host = urllib.parse.urlsplit(self.base_url).hostname
        self.port = urllib.parse.urlsplit(self.base_url).port or 80
        self.timeout = timeout
        self.group_port = group_port
        self.group = None
        self.info: dict | None = None

    def _unreachable(self, waited: float, error: Exception) -> VLLMServerError:
        return VLLMServerError(
            f"No vLLM server answered at {self.base_url} (host {self.host}, port {self.port}) within {waited:.0f} s "
            f"({error}). Start one with `grpo vllm-serve --model <the policy's model> --host {self.host} "
            f"--port {self.port}` (docs/vllm.md), or point the trainer at it with vllm_server_base_url, or "
            f"vllm_server_host and vllm_server_port; vllm_server_timeout sets how long to wait."
        )

    def request(self, path: str, payload: dict | None = None, retry: bool = True) -> dict:
        """GET (no payload) or POST `path`; returns the JSON answer. Connection failures are retried with backoff
        for `timeout` seconds when `retry`; an answer with an error status raises at once with its message."""
        data = None if payload is None else json.dumps(payload).encode()
        start, delay = time.monotonic(), 0.25
        while True:
            http = urllib.request.Request(
                self.base_url + path, data=data, headers={"Content-Type": "application/json"}
            )
            try:
                # No read timeout: a generation may take long; a dead server closes the connection instead.
                with urllib.request.urlopen(http) as response:
                    return json.loads(response.read())
            except urllib.error.HTTPError as e:
                detail = e.read().decode(errors="replace")
                raise VLLMServerError(f"vLLM server {self.base_url}{path} answered {e.code}: {detail}") from None
            except (urllib.error.URLError, ConnectionError, OSError) as e:
                waited = time.monotonic() - start
                if not retry or waited >= self.timeout:
                    raise self._unreachable(waited, getattr(e, "reason", e)) from None
                time.sleep(min(delay, max(self.timeout - waited, 0.0)))
                delay = min(delay * 2, 5.0)

    def wait_until_ready(self) -> dict:
        """The server's /health answer, once it answers (at most `timeout` seconds)."""
        self.info = self.request("/health")
        return self.info

    def generate(self, prompts: list[list[int]], n: int, **sampling) -> dict:
        """`n` completions for each token-id prompt, grouped by prompt: {"completion_ids", "logprobs",
        "weights_version"}. `sampling`: max_tokens, temperature, top_p, top_k, min_p, repetition_penalty, seed."""
        return self.request("/generate", {"prompts": prompts, "n": n, **sampling})

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

    def init_communicator(self) -> None:
        """Open the weight-sync group: this process is rank 0, the server's workers ranks 1..N."""
        info = self.info or self.wait_until_ready()
        world_size = info["weight_sync_world_size"]
        backend = "nccl" if info["device"] == "cuda" else "gloo"

        def join():
            self.group = weight_sync.open_group(self.host, self.group_port, 0, world_size, backend, self.timeout)

        self._while_posting("/init_communicator", {"port": self.group_port, "timeout": self.timeout}, join)

    def update_weights(self, tensors: Iterable[tuple[str, torch.Tensor]], version: int, bucket_bytes: int) -> dict:
        """Send every (checkpoint name, tensor) in buckets of about `bucket_bytes`, cast to the server's dtype; the
        server loads them and resets its prefix cache. `version` tags the weights (the trainer's step); the
        server's generations report it. Returns {"buckets", "bytes", "seconds"}."""
        if self.group is None:
            self.init_communicator()
        cuda = self.info["device"] == "cuda"
        device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        dtype = getattr(torch, self.info["dtype"])
        start, sent = time.perf_counter(), {}

        def send():
            sent["buckets"], sent["bytes"] = weight_sync.send_weights(self.group, tensors, bucket_bytes, device, dtype)

        try:
            self._while_posting("/update_weights", {"version": version}, send)
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
        self.group = None
        try:
            self.request("/close_communicator", {}, retry=False)
        except VLLMServerError:
            pass  # the server is gone or broken; the caller reports the original error
