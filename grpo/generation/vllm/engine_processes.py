"""The engine side of `grpo vllm-serve`: the engine processes, each owning a `vllm.LLM`, and the worker methods that
receive the trainer's weights. The HTTP side (options, routes, API key, request checks) is grpo/generation/vllm/serve.py.

    engines = Engines(engine_kwargs, data_parallel_size, tensor_parallel_size, adapter_root)
    engines.call("generate", per_engine=[...])    # one command on the engines at once, results in engine order
    engines.close()

- `Engines` starts `data_parallel_size` child processes (spawned: vLLM and CUDA do not survive fork), each on its
  own `tensor_parallel_size` devices, and talks to them over pipes; one lock serialises the calls, so a weight
  update never interleaves with a generation. An engine's failure comes back as `EngineError` with its message.
- Each child (`_engine_main`) builds one `_Engine` and answers (command, kwargs) messages until its pipe closes.
- `WeightSyncWorker` is mixed into vLLM's worker class (`worker_extension_cls`, by its dotted name): each worker joins
  the weight-sync group (grpo/generation/vllm/weight_sync.py), checks the trainer's token, and loads the weights or
  the adapter it receives.

vLLM is imported only inside the engine processes (in the functions that run there), so the HTTP process and the
tests without vLLM import this module freely.

LoRA (`--enable-lora`, docs/vllm.md#lora-merged-or-adapter-sync): the trainer may send a LoRA adapter instead of
merged weights. The workers receive its tensors over the same group, the first worker of each engine writes them as
an adapter directory in a private temporary directory (removed at shutdown), and the engine loads it under a new
LoRA id at every sync, so no older adapter is served from vLLM's cache. Until the first adapter arrives, generations
use the base model.
"""

import multiprocessing
import os
import shutil
import threading
from typing import Any

from grpo.data.vision import placeholder_token_ids
from grpo.generation.vllm.images import multimodal_request, placeholder_bias
from grpo.generation.vllm.lora_sync import write_adapter
from grpo.generation.vllm.weight_sync import check_token, open_group, receive_weights

# ---- The worker side of weight sync: mixed into vLLM's worker class (`worker_extension_cls`) ----


def _local_address(host: str) -> str:
    """The address this machine's processes dial to reach a socket listening on `host`."""
    return {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)


class WeightSyncWorker:
    """Methods vLLM adds to each of its workers; the engine calls them with `LLM.collective_rpc`."""

    weight_group = None

    def open_weight_group(
        self, host: str, port: int, first_rank: int, world_size: int, backend: str, timeout, token: str
    ):
        """Join the group; the first worker hosts its store, listening on `host` (the server's --host). The group
        is kept only if rank 0 then broadcasts `token`, the one in the authenticated /init_communicator request:
        the store itself has no authentication, so this is what keeps a stranger who dialled in first from pushing
        weights."""
        # A new trainer (or one that restarted) replaces the old group.
        self.weight_group = None
        group = open_group(
            _local_address(host), port, first_rank + self.rank, world_size, backend, timeout, listen_host=host
        )
        check_token(group, bytes.fromhex(token), self.device)
        self.weight_group = group

    def receive_weights(self) -> None:
        """Stream the buckets the trainer broadcasts into the model (grpo/generation/vllm/weight_sync.py).

        `reload_weights` is the engine's in-place reload: it takes checkpoint (Hugging Face) names, fuses q/k/v
        and gate/up, shards for tensor parallelism and repacks for the device's kernels, on CPU and GPU alike (the
        model's own `load_weights` fails on vLLM's CPU build once weights were repacked)."""
        if self.weight_group is None:
            raise RuntimeError("no weight-sync group is open; call /init_communicator first")
        try:
            self.model_runner.reload_weights(weights_iterator=receive_weights(self.weight_group, self.device))
        except Exception:
            # A transfer cut short leaves layers that were waiting for tensors on the meta device, and every later
            # generation would fail. Put the old tensors back; the trainer's next update then loads a full set.
            from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload

            finalize_layerwise_reload(self.model_runner.get_model(), self.vllm_config.model_config)
            raise

    def receive_adapter(self, path: str, config: dict) -> None:
        """Receive a LoRA adapter's tensors over the group; the engine's first worker writes them, with `config`, as
        an adapter directory at `path` (`write_adapter`), which the engine then loads. The other workers (tensor
        parallelism) take part in the broadcast and drop what they received: vLLM shards the adapter on loading."""
        if self.weight_group is None:
            raise RuntimeError("no weight-sync group is open; call /init_communicator first")
        tensors = list(receive_weights(self.weight_group, self.device))  # the whole broadcast, whatever comes next
        if self.rank == 0:
            write_adapter(path, tensors, config)

    def close_weight_group(self) -> None:
        self.weight_group = None


# ---- An engine process ----


def _resolve_model(name: str) -> str:
    from grpo.models import SMOLLM2_NAME, smollm2_path

    return str(smollm2_path()) if name == SMOLLM2_NAME else name


class _Engine:
    """One `vllm.LLM` and the LoRA adapter its generations use (None: the base model). With LoRA enabled, the
    adapters it receives are written under `adapter_dir`, one directory per sync, the older one removed."""

    def __init__(self, engine_kwargs: dict, adapter_dir: str | None):
        from vllm import LLM

        self.llm = LLM(
            model=_resolve_model(engine_kwargs.pop("model")),
            # This module's dotted name: vLLM imports the class in each of its workers.
            worker_extension_cls=f"{__name__}.WeightSyncWorker",
            # Log-probs after temperature (and penalties): the distribution the tokens were drawn from, which is
            # what the trainer's importance-sampling correction compares with.
            logprobs_mode="processed_logprobs",
            enable_prefix_caching=True,
            **engine_kwargs,
        )
        self.adapter_dir, self.lora_request, self.next_lora_id = adapter_dir, None, 1
        # The image placeholder tokens a completion must not hold (docs/vlm.md): kept out of prompts with images.
        self.placeholders = placeholder_token_ids(self.llm.llm_engine.vllm_config.model_config.hf_config)

    def info(self) -> dict:
        config = self.llm.llm_engine.vllm_config
        return {
            "dtype": str(config.model_config.dtype).removeprefix("torch."),
            "device": config.device_config.device_type,
            "max_model_len": config.model_config.max_model_len,
            "multimodal": bool(config.model_config.is_multimodal_model),
        }

    def generate(self, prompts, seeds, n, logprobs, structured_outputs_regex=None, images=None, **sampling) -> dict:
        """`images`: each prompt's PIL images (decoded by the server process), given to vLLM as its
        `multi_modal_data`; the image placeholder tokens are then never sampled."""
        from vllm import SamplingParams

        if structured_outputs_regex is not None:
            sampling["structured_outputs"] = structured_outputs(structured_outputs_regex)
        if images is not None:
            sampling["logit_bias"] = placeholder_bias(self.placeholders)
        params = [SamplingParams(n=n, seed=seed, logprobs=0 if logprobs else None, **sampling) for seed in seeds]
        requests = [multimodal_request(p, None if images is None else images[i]) for i, p in enumerate(prompts)]
        outputs = self.llm.generate(requests, params, use_tqdm=False, lora_request=self.lora_request)
        ids, logps = [], []
        for output in outputs:
            for sample in output.outputs:
                ids.append(list(sample.token_ids))
                if logprobs:
                    logps.append([step[token].logprob for token, step in zip(sample.token_ids, sample.logprobs)])
        result = {"completion_ids": ids, "logprobs": logps if logprobs else None}
        if images is not None:  # the prompts as vLLM expanded their images, for the trainer to check
            result["prompt_ids"] = [list(output.prompt_token_ids) for output in outputs]
        return result

    def update_weights(self, adapter: dict | None = None) -> None:
        if adapter is None:
            self.llm.collective_rpc("receive_weights")
            self.drop_adapter()  # new base weights: an adapter trained on the old ones no longer applies
        else:
            self.update_adapter(adapter)
        self.llm.reset_prefix_cache()

    def update_adapter(self, adapter: dict) -> None:
        """Receive the adapter into a new directory and load it under a new id, so that vLLM, which caches
        adapters by id, cannot serve the older one; loading now (not at the next generation) makes a sync that
        vLLM refuses fail here, with vLLM's reason."""
        from vllm.lora.request import LoRARequest

        lora_id = self.next_lora_id
        self.next_lora_id += 1
        path = os.path.join(self.adapter_dir, f"adapter-{lora_id}")
        try:
            self.llm.collective_rpc("receive_adapter", kwargs={"path": path, "config": adapter})
            request = LoRARequest(f"grpo-{lora_id}", lora_id, path)
            self.llm.llm_engine.add_lora(request)
        except BaseException:
            shutil.rmtree(path, ignore_errors=True)
            raise
        self.drop_adapter()
        self.lora_request = request

    def drop_adapter(self) -> None:
        if self.lora_request is not None:
            self.llm.llm_engine.remove_lora(self.lora_request.lora_int_id)
            shutil.rmtree(self.lora_request.lora_path, ignore_errors=True)
            self.lora_request = None


def structured_outputs(regex: str):
    """vLLM's constraint that a completion match `regex` (its structured outputs, `SamplingParams.structured_outputs`
    since vLLM 0.11). Imports vLLM: call it where an engine runs."""
    from vllm.sampling_params import StructuredOutputsParams

    return StructuredOutputsParams(regex=regex)


def _engine_main(conn, engine_kwargs: dict, env: dict, adapter_dir: str | None = None) -> None:
    """Run one engine (`_Engine`) and answer (command, kwargs) messages on `conn` until the pipe closes."""
    os.environ.update(env)
    engine = _Engine(engine_kwargs, adapter_dir)
    llm = engine.llm
    handlers = {
        "generate": engine.generate,
        "update_weights": engine.update_weights,
        "reset_prefix_cache": lambda: llm.reset_prefix_cache(),
        "open_weight_group": lambda **kw: llm.collective_rpc("open_weight_group", kwargs=kw),
        "close_weight_group": lambda: llm.collective_rpc("close_weight_group"),
    }
    conn.send(("ok", engine.info()))
    while True:
        try:
            command, kwargs = conn.recv()
        except (EOFError, OSError):  # the server process is gone
            return
        try:
            conn.send(("ok", handlers[command](**kwargs)))
        except Exception as e:  # the server answers the request with this message
            conn.send(("error", f"{type(e).__name__}: {e}"))


# ---- The engines, seen from the server process ----


class EngineError(RuntimeError):
    """An engine rejected a request (bad input, or an engine failure); the message is the engine's."""


class Engines:
    """The data-parallel engine processes, each a `vllm.LLM` on `tensor_parallel_size` devices; with LoRA enabled,
    engine i writes the adapters it receives under `adapter_root`/engine-i."""

    def __init__(
        self,
        engine_kwargs: dict,
        data_parallel_size: int,
        tensor_parallel_size: int,
        adapter_root: str | None = None,
    ):
        context = multiprocessing.get_context("spawn")  # vLLM and CUDA do not survive fork
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        needed = data_parallel_size * tensor_parallel_size
        devices = visible.split(",") if visible else [str(i) for i in range(needed)]
        if len(devices) < needed:
            raise EngineError(
                f"CUDA_VISIBLE_DEVICES={visible} lists {len(devices)} devices; --data-parallel-size x "
                f"--tensor-parallel-size = {needed} are needed"
            )
        self.lock = threading.Lock()
        self.tensor_parallel_size = tensor_parallel_size
        self.conns, self.processes = [], []
        for rank in range(data_parallel_size):
            env = {
                # The engine core runs in the engine process itself (vLLM V1's own child process would be a third
                # process level); tensor-parallel workers still get processes of their own.
                "VLLM_ENABLE_V1_MULTIPROCESSING": os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "0"),
                "CUDA_VISIBLE_DEVICES": ",".join(
                    devices[rank * tensor_parallel_size : (rank + 1) * tensor_parallel_size]
                ),
            }
            parent, child = context.Pipe()
            # Not a daemon: vLLM starts processes of its own for tensor parallelism. An engine leaves when its pipe
            # closes, also when this process is killed.
            adapter_dir = None if adapter_root is None else os.path.join(adapter_root, f"engine-{rank}")
            if adapter_dir is not None:
                os.makedirs(adapter_dir, mode=0o700)
            process = context.Process(target=_engine_main, args=(child, dict(engine_kwargs), env, adapter_dir))
            process.start()
            child.close()
            self.conns.append(parent)
            self.processes.append(process)
        self.info = self._receive(len(self.conns))[0]

    def call(self, command: str, per_engine: list[dict] | None = None, **kwargs) -> list[Any]:
        """Run `command` on the engines at once: on every engine with `kwargs`, or on the first len(per_engine)
        engines, each with its own kwargs. Returns their results in engine order."""
        messages = per_engine if per_engine is not None else [kwargs] * len(self.conns)
        with self.lock:
            for conn, message in zip(self.conns, messages):
                conn.send((command, message))
            return self._receive(len(messages))

    def _receive(self, count: int) -> list[Any]:
        replies = []
        for rank, conn in enumerate(self.conns[:count]):
            try:
                replies.append(conn.recv())
            except EOFError:
                raise EngineError(f"engine {rank} exited (see its log above)") from None
        errors = [value for status, value in replies if status == "error"]
        if errors:
            raise EngineError(errors[0])
        return [value for _, value in replies]

    def close(self) -> None:
        for conn in self.conns:
            conn.close()
        for process in self.processes:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
