"""The trainer's side of `grpo vllm-serve`: an HTTP client, and the generation backend that uses it.

`VLLMClient` speaks the server's API (grpo/vllm_server.py) with the standard library only: requests retry with
backoff while the server cannot be reached, up to `timeout` seconds, then fail with the host, the port and the
command that starts a server. `VLLMGeneration` is the trainer's `GenerationBackend` for `use_vllm=True`: the main
process sends the round's unique prompts once each with n = G, and pushes the policy's weights to the server before
a generation whenever an optimizer step has changed them (docs/vllm.md). vLLM itself is never imported here.

A server started with an API key (docs/vllm.md#security) needs `Authorization: Bearer <key>` on every request: the
client sends it when it is given `api_key`, or else when GRPO_VLLM_API_KEY is set. Answers are parsed as JSON only.
"""

from __future__ import annotations

import json
import logging
import os
import re
import secrets
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from grpo import lora_sync, weight_sync
from grpo.generation import Completions
from grpo.models import is_peft_model

logger = logging.getLogger(__name__)

API_KEY_ENV = "GRPO_VLLM_API_KEY"  # the server (grpo/vllm_server.py) reads the same variable


class VLLMServerError(RuntimeError):
    """The vLLM server could not be reached, or refused a request."""


class VLLMClient:
    """Talks to one `grpo vllm-serve` server at `base_url` (or http://host:port).

    Args:
        timeout: seconds to keep retrying, with backoff, a request the server does not answer (not started yet,
            restarting, or gone); also the weight-sync group's timeout.
        group_port: the port of the weight-sync group's store, opened by the server's first worker.
        api_key: the server's API key, sent as `Authorization: Bearer <key>`; None reads GRPO_VLLM_API_KEY, and
            "" (or the variable unset or empty) sends no key.
    """

    def __init__(
        self,
        base_url: str | None = None,
        host: str = "127.0.0.1",
        port: int = 8000,
        timeout: float = 240.0,
        group_port: int = 51216,
        api_key: str | None = None,
    ):
        self.base_url = (base_url or f"http://{host}:{port}").rstrip("/")
        self.host = urllib.parse.urlsplit(self.base_url).hostname
        self.port = urllib.parse.urlsplit(self.base_url).port or 80
        self.timeout = timeout
        self.group_port = group_port
        self.group = None
        self.info: dict | None = None
        api_key = os.environ.get(API_KEY_ENV, "") if api_key is None else api_key
        self.headers = {"Content-Type": "application/json"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"

    def __repr__(self) -> str:  # never the key
        return f"VLLMClient({self.base_url!r}, api_key={'set' if 'Authorization' in self.headers else 'unset'})"

    def _unreachable(self, waited: float, error: Exception) -> VLLMServerError:
        return VLLMServerError(
            f"No vLLM server answered at {self.base_url} (host {self.host}, port {self.port}) within {waited:.0f} s "
            f"({error}). Start one with `grpo vllm-serve --model <the policy's model> --host {self.host} "
            f"--port {self.port}` (docs/vllm.md), or point the trainer at it with vllm_server_base_url, or "
            f"vllm_server_host and vllm_server_port; vllm_server_timeout sets how long to wait."
        )

    def _unauthorized(self, path: str, detail: str) -> VLLMServerError:
        sent = "refused the API key this client sent" if "Authorization" in self.headers else "got no API key"
        return VLLMServerError(
            f"The vLLM server at {self.base_url} requires an API key and {sent} ({path} answered 401: {detail}). "
            f"Set the environment variable {API_KEY_ENV} in the trainer's environment to the key the server was "
            f"started with (its --api-key or {API_KEY_ENV}); docs/vllm.md#security."
        )

    def request(self, path: str, payload: dict | None = None, retry: bool = True) -> dict:
        """GET (no payload) or POST `path`; returns the JSON answer. Connection failures are retried with backoff
        for `timeout` seconds when `retry`; an answer with an error status raises at once with its message."""
        data = None if payload is None else json.dumps(payload).encode()
        start, delay = time.monotonic(), 0.25
        while True:
            http = urllib.request.Request(self.base_url + path, data=data, headers=self.headers)
            try:
                # No read timeout: a generation may take long; a dead server closes the connection instead.
                with urllib.request.urlopen(http) as response:
                    return json.loads(response.read())
            except urllib.error.HTTPError as e:
                detail = e.read().decode(errors="replace")
                if e.code == 401:
                    raise self._unauthorized(path, detail) from None
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


# ---- The weights as a checkpoint names them ----

_MODULES_TO_SAVE = re.compile(r"\.modules_to_save\.[^.]+\.")


def _full(param: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a parameter that may be sharded across processes (every process must call this)."""
    if hasattr(param, "ds_id"):  # DeepSpeed ZeRO-3
        import deepspeed

        with deepspeed.zero.GatheredParameters([param]):
            return param.data.detach().clone()
    if hasattr(param, "full_tensor"):  # FSDP2 (DTensor)
        return param.full_tensor().detach()
    return param.detach()


def checkpoint_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every weight of `model` under the names of its Hugging Face checkpoint, which the engine's
    loader expects. A PEFT model yields its base weights with the LoRA deltas merged in (W + scale * B A, computed
    here; the model is not modified) and drops the adapter tensors."""
    if any("_fsdp_wrapped_module" in name for name, _ in model.named_parameters()):
        raise NotImplementedError(
            "Weight sync to vLLM does not support FSDP version 1 (flattened parameters); use FSDP2 "
            "(`fsdp_version: 2` in the accelerate config) or DeepSpeed."
        )
    is_peft = getattr(model, "peft_config", None) is not None
    lora_layers = {}
    if is_peft:
        lora_layers = {
            name: module
            for name, module in model.named_modules()
            if hasattr(module, "get_delta_weight") and hasattr(module, "base_layer")
        }
    with torch.no_grad():
        for name, param in model.named_parameters():
            if is_peft and (".lora_" in name or ".original_module." in name):
                continue
            tensor = _full(param)
            owner, _, leaf = name.rpartition(".base_layer.")
            if owner in lora_layers and leaf == "weight":
                layer = lora_layers[owner]
                for adapter in layer.active_adapters:
                    if adapter in layer.lora_A:
                        tensor = tensor + layer.get_delta_weight(adapter).to(tensor.dtype)
            if is_peft:
                name = _MODULES_TO_SAVE.sub(".", name.removeprefix("base_model.model.").replace(".base_layer.", "."))
            yield name, tensor


def adapter_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for each weight of a PEFT model's active adapter, under the names PEFT's
    `get_peft_model_state_dict` gives them (those of adapter_model.safetensors, which vLLM loads), gathered whole
    when sharded (every process must iterate it)."""
    from peft import get_peft_model_state_dict

    (adapter,) = model.active_adapters
    parameters = dict(model.named_parameters())
    # The parameters themselves (not a state dict): only PEFT's selection and names are wanted, and `_full` gathers.
    selected = get_peft_model_state_dict(
        model, state_dict=parameters, adapter_name=adapter, save_embedding_layers=False
    )
    with torch.no_grad():
        for name, param in selected.items():
            yield name, _full(param)


# ---- The trainer's generation backend ----


def _mode_note(mode: str, is_peft: bool, info: dict) -> str:
    """The one log line that says what each sync sends, and why."""
    if mode == "adapter":
        return "the LoRA adapter alone (the server was started with --enable-lora)"
    if is_peft:
        return "merged weights (the server was started without --enable-lora; with it, the adapter alone is sent)"
    return "the full weights (the policy is not a PEFT model)"


def vllm_sampling(max_completion_length, temperature, top_p, top_k, min_p, repetition_penalty) -> dict:
    """The trainer's sampling settings under vLLM's names (min_p None means 0: off)."""
    return {
        "max_tokens": max_completion_length,
        "temperature": temperature,
        "top_p": top_p,
        "top_k": top_k,
        "min_p": min_p or 0.0,
        "repetition_penalty": repetition_penalty,
    }


class VLLMGeneration:
    """`GenerationBackend` on a `grpo vllm-serve` server (`use_vllm=True`).

    Every process hands in its rows; the main process sends each group's prompt once with n = G (the engine shares
    the prompt's prefill among the G samples), then every process takes its rows of the answer. Weights go to the
    server in `sync_weights`, from the main process; sharded weights are gathered by all processes together.
    """

    def __init__(
        self,
        accelerator,
        *,
        client: VLLMClient,
        num_generations: int,
        max_completion_length: int,
        temperature: float,
        top_p: float,
        top_k: int,
        min_p: float | None,
        repetition_penalty: float,
        bucket_bytes: int,
    ):
        self.accelerator = accelerator
        self.client = client
        self.num_generations = num_generations
        self.sampling = vllm_sampling(max_completion_length, temperature, top_p, top_k, min_p, repetition_penalty)
        self.bucket_bytes = bucket_bytes
        self.synced_version: int | None = None  # the trainer step whose weights the server holds
        self.last_sync: dict | None = None  # {"mode", "buckets", "tensors", "bytes", "seconds"} of the latest sync
        self.mode: str | None = None  # "merged" or "adapter", chosen at the first sync
        if accelerator.is_main_process:
            client.wait_until_ready()

    def _choose_mode(self, model: nn.Module) -> str:
        """The main process picks the sync mode from the model and the server's /health (`sync_mode`), logs it, and
        tells the other processes, which gather sharded weights in step with it. An adapter the server cannot take
        is an error on every process."""
        from accelerate.utils import broadcast_object_list

        choice = [None]
        if self.accelerator.is_main_process:
            info, peft = self.client.info, is_peft_model(model)
            mode = lora_sync.sync_mode(peft, info)
            problems = []
            if mode == "adapter":
                config = model.peft_config[model.active_adapters[0]]
                problems = lora_sync.adapter_problems(config, info["max_lora_rank"], model.active_adapters)
            choice = [(mode, lora_sync.adapter_error(problems, self.client.base_url) if problems else None)]
            if not problems:
                logger.info("vLLM weight sync: %s", _mode_note(mode, peft, info))
        mode, error = broadcast_object_list(choice, from_process=0)[0]
        if error:
            raise ValueError(error)
        return mode

    def sync_weights(self, model: nn.Module, version: int) -> None:
        """Push `model`'s weights unless the server already holds those of step `version`: merged, or the LoRA
        adapter alone when the server serves adapters (`lora_sync.sync_mode`). All processes call it."""
        if version == self.synced_version:
            return
        if self.mode is None:
            self.mode = self._choose_mode(model)
        adapter = self.mode == "adapter"
        tensors = adapter_tensors(model) if adapter else checkpoint_tensors(model)
        if self.accelerator.is_main_process:
            config = lora_sync.adapter_config(model.peft_config[model.active_adapters[0]]) if adapter else None
            try:
                sync = self.client.update_weights(tensors, version, self.bucket_bytes, adapter_config=config)
            except VLLMServerError as e:
                if not adapter:
                    raise
                raise VLLMServerError(
                    f"{e}. The server could not load the LoRA adapter; restart it without --enable-lora to sync "
                    "merged weights instead (docs/vllm.md#lora-merged-or-adapter-sync)."
                ) from None
            self.last_sync = {"mode": self.mode, **sync}
        else:
            for _ in tensors:  # take part in gathering sharded weights
                pass
        self.accelerator.wait_for_everyone()
        self.synced_version = version

    def generate(self, model: nn.Module, prompt_ids: list[list[int]]) -> Completions:
        from accelerate.utils import broadcast_object_list, gather_object

        rows = gather_object(prompt_ids)  # every process's rows, in process order
        G, answer = self.num_generations, [None]
        if self.accelerator.is_main_process:
            groups = [rows[i : i + G] for i in range(0, len(rows), G)]
            if len(rows) % G or any(row != group[0] for group in groups for row in group):
                raise ValueError(f"prompt rows do not come as groups of {G} equal consecutive rows")
            # A fresh seed per call from torch's generator, seeded by `args.seed` and saved in checkpoints: runs are
            # reproducible, a resumed run draws the seeds the uninterrupted one would, no two calls share samples.
            seed = int(torch.randint(2**31 - 1, ()))
            reply = self.client.generate([group[0] for group in groups], n=G, seed=seed, **self.sampling)
            if reply["weights_version"] != self.synced_version:
                raise VLLMServerError(
                    f"The vLLM server at {self.client.base_url} holds weights of version {reply['weights_version']} "
                    f"(None: as loaded from disk), not the trainer's step {self.synced_version}: it was restarted, or "
                    "another trainer updates it. Give each trainer its own server, and restart training from a "
                    "checkpoint after a server restart."
                )
            answer = [(reply["completion_ids"], reply["logprobs"])]
        answer = broadcast_object_list(answer, from_process=0)
        ids, logprobs = answer[0]
        start = self.accelerator.process_index * len(prompt_ids)
        return Completions(ids[start : start + len(prompt_ids)], logprobs[start : start + len(prompt_ids)])
