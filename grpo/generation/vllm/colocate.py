"""`vllm_mode="colocate"`: a vLLM engine inside each training process, sampling that process's own rows.

    GRPOConfig(use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=0.3)

Each process builds one `vllm.LLM` on its own device the first time it needs it (one engine per process: tensor
parallelism is not built here), runs vLLM's engine core in this process (no child process, no HTTP, no weight-sync
group), and loads the policy's weights into it directly whenever an optimizer step changed them (docs/vllm.md).

Where this departs from the server backend (grpo/generation/vllm/client.py):
- Each process generates only its own rows, so nothing is gathered or broadcast. A group of G equal rows may span two
  processes (grpo/data/sampler.py): each process sends every run of equal consecutive rows once, with n = the run's
  length. A split group is then sampled as two requests with different seeds, which are still G independent samples
  of one prompt: the group statistics, computed after rewards are gathered, do not care where a sample was drawn.
- The engine is built from the policy's config alone (written to a temporary folder) with dummy weights; the real
  ones arrive with the first `sync_weights`. So a model built in code, a PEFT model (its base config) and a hub id
  all take one path, nothing is read from disk twice, and no tokenizer is needed: prompts are token ids and the
  trainer's EOS ids are the stop tokens. A vision-language model's processor is written beside the config: vLLM
  runs it on the images rows bring (docs/vlm.md#vllm-with-images).
- The engine runs in the dtype of the policy's weights, which are what it receives.
"""

from __future__ import annotations

import copy
import importlib.util
import os
import random
import tempfile
import time
from collections.abc import Iterable, Sequence

import numpy as np
import torch
from torch import nn

from grpo.data.vision import ImagePrompts, placeholder_token_ids
from grpo.generation.base import Completions, SamplingRNG, equal_runs, request_seed
from grpo.generation.policy_weights import checkpoint_tensors
from grpo.generation.settings import SamplingSettings, resolve_sampling
from grpo.generation.vllm.engine_processes import structured_outputs
from grpo.generation.vllm.images import check_expanded, multimodal_request, placeholder_bias

INSTALL_HINT = (
    "vllm_mode='colocate' runs vLLM inside the training process, so vLLM must be installed in the trainer's "
    "environment: `pip install vllm` on a GPU machine, or on a CPU-only machine `make install-vllm` (the .venv-vllm "
    "environment with vLLM's CPU build) and train from it; docs/vllm.md#colocate-mode."
)


def _reload(worker, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Run inside vLLM's worker (`LLM.collective_rpc`): load checkpoint-named tensors in place. `reload_weights`
    fuses q/k/v and gate/up and repacks for the device's kernels; the model's own `load_weights` fails on vLLM's CPU
    build once weights were repacked (grpo/generation/vllm/engine_processes.py uses the same call)."""
    worker.model_runner.reload_weights(weights_iterator=tensors)


def _base(model: nn.Module) -> nn.Module:
    """The model a PEFT model wraps, or `model`."""
    return model.get_base_model() if getattr(model, "peft_config", None) is not None else model


def _runs(prompt_ids: list[list[int]], images: ImagePrompts | None) -> list[tuple[tuple, int]]:
    """Maximal runs of consecutive rows with equal prompts and, with `images`, the same image objects (the G copies
    of a row share them, grpo/data/vision.py `open_rows`), as ((prompt, prompt sent to vLLM, images), length)."""
    if images is None:
        return [((prompt, prompt, None), count) for prompt, count in equal_runs(prompt_ids)]
    runs: list = []
    for prompt, sent, row in zip(prompt_ids, images.prompt_ids, images.images):
        last = runs[-1][0] if runs else None
        if last and last[0] == list(prompt) and list(map(id, last[2])) == list(map(id, row)):
            runs[-1] = (last, runs[-1][1] + 1)
        else:
            runs.append(((list(prompt), list(sent), list(row)), 1))
    return runs


class EnvironmentChanges:
    """Variables of `os.environ` set for an engine's life, each put back by `restore` as it was before (removed
    where it was unset): the engine needs them, the rest of the process (a second trainer, user code) must not see
    them once it is gone."""

    def __init__(self):
        self.previous: dict[str, str | None] = {}  # name -> its value before the first change (None: unset)

    def set(self, name: str, value: str) -> None:
        self.previous.setdefault(name, os.environ.get(name))
        os.environ[name] = value

    def set_default(self, name: str, value: str) -> None:
        """Set `name` only where the process has no value for it (a launcher's RANK stays as it is)."""
        if name not in os.environ:
            self.set(name, value)

    def restore(self) -> None:
        for name, value in self.previous.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        self.previous.clear()


class VLLMColocateGeneration:
    """`GenerationBackend` on a vLLM engine in this process (`use_vllm=True, vllm_mode="colocate"`).

    Args:
        sampling: what completions are drawn from (`make_generation_backend` passes the config's), or instead its
            fields as keywords (`max_completion_length=8, temperature=0.7`); its `structured_outputs_regex`
            constrains every completion (vLLM's structured outputs), and the engine then loads `tokenizer`, which
            the grammar is compiled against.
        gpu_memory_utilization: the fraction of the device's memory the engine takes (vLLM's CPU build ignores it
            and reads VLLM_CPU_KVCACHE_SPACE, in GiB).
        max_model_length: the engine's context length; None takes the model's.
        enable_sleep_mode: sleep (weights to CPU memory, KV cache freed) after each generation, wake before the
            next; an error where vLLM has no sleep mode (its CPU build).
        engine_kwargs: further `vllm.LLM` arguments, over the ones chosen here.
        model_impl: the model code vLLM runs ('vllm', 'transformers' or 'auto'; GRPOConfig.vllm_model_impl).
        processor: a vision-language model's processor (docs/vlm.md#vllm-with-images): saved beside the config, since
            vLLM runs it on the images each prompt brings (`generate`'s `images`).
    """

    takes_images = True  # `sample_rollout` gives `generate` each row's images, not the processed vision inputs

    def __init__(
        self,
        accelerator,
        *,
        eos_token_ids: Sequence[int],
        sampling: SamplingSettings | None = None,
        gpu_memory_utilization: float = 0.3,
        max_model_length: int | None = None,
        enable_sleep_mode: bool = False,
        engine_kwargs: dict | None = None,
        rng: SamplingRNG | None = None,
        model_impl: str = "vllm",
        tokenizer=None,
        processor=None,
        **fields,
    ):
        if importlib.util.find_spec("vllm") is None:  # fail when the trainer is built, not at its first step
            raise ImportError(INSTALL_HINT)
        self.sampling_settings = sampling = resolve_sampling(sampling, fields)
        self.accelerator = accelerator
        self.rng = rng  # the trainer's sampling stream, which request seeds are drawn from (None: torch's default)
        self.sampling = {
            **sampling.vllm_params(),
            # vLLM has no tokenizer here (prompts are ids), so it knows no EOS of its own: stop at the trainer's.
            "stop_token_ids": list(eos_token_ids),
        }
        self.gpu_memory_utilization = gpu_memory_utilization
        self.max_model_length = max_model_length
        self.enable_sleep_mode = enable_sleep_mode
        self.engine_kwargs = {"model_impl": model_impl, **(engine_kwargs or {})}
        if sampling.structured_outputs_regex is not None and tokenizer is None:
            raise ValueError(
                "structured_outputs_regex needs the tokenizer: the engine compiles the pattern against it"
            )
        self.regex, self.tokenizer, self.processor = sampling.structured_outputs_regex, tokenizer, processor
        self.llm = None  # built at the first sync_weights or generate, from the policy's config
        self.asleep = False
        self.synced_version: int | None = None  # the trainer step whose weights the engine holds
        self.last_sync: dict | None = None  # {"seconds"} of the latest sync
        self._config_dir: tempfile.TemporaryDirectory | None = None
        self.environment = EnvironmentChanges()  # the variables set for the engine, put back by `close`

    # ---- The engine ----

    def engine(self, model: nn.Module):
        """This process's `vllm.LLM`, built on first use from `model`'s config with dummy weights. A build that fails
        leaves nothing behind (`close`)."""
        if self.llm is not None:
            return self.llm
        # The engine core runs in this process: a child process could not take weights without a transport.
        self.environment.set("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        try:
            self.llm = self._build(model)
        except BaseException:
            self.close()
            raise
        return self.llm

    def _build(self, model: nn.Module):
        """A new `vllm.LLM` for `model` (`engine` keeps it)."""
        try:
            from vllm import LLM
            from vllm.platforms import current_platform
        except ImportError as e:
            raise ImportError(f"{INSTALL_HINT} ({e})") from e
        if self.enable_sleep_mode and not current_platform.is_sleep_mode_available():
            raise ValueError(
                f"vllm_enable_sleep_mode=True, but vLLM has no sleep mode on this platform "
                f"({current_platform.device_type or 'cpu'}; it needs CUDA, ROCm or XPU). Set "
                "vllm_enable_sleep_mode=False; on CPU the engine's memory is its KV cache, sized by "
                "VLLM_CPU_KVCACHE_SPACE (GiB)."
            )
        base = _base(model)
        config = copy.deepcopy(base.config)
        config.architectures = config.architectures or [type(base).__name__]
        self._config_dir = tempfile.TemporaryDirectory(prefix="grpo-colocate-")
        config.save_pretrained(self._config_dir.name)
        if self.regex is not None:  # structured outputs compile the pattern against the tokenizer's vocabulary
            self.tokenizer.save_pretrained(self._config_dir.name)
        if self.processor is not None:  # vLLM processes the images itself, with the model's processor
            self.processor.save_pretrained(self._config_dir.name)
        settings = dict(
            model=self._config_dir.name,
            load_format="dummy",  # random weights until the first sync_weights, which loads every tensor
            skip_tokenizer_init=self.regex is None and self.processor is None,
            dtype=str(next(base.parameters()).dtype).removeprefix("torch."),
            tensor_parallel_size=1,
            gpu_memory_utilization=self.gpu_memory_utilization,
            max_model_len=self.max_model_length,
            enable_sleep_mode=self.enable_sleep_mode,
            enable_prefix_caching=True,
            # Log-probs after temperature (and penalties), as the server returns them: the distribution the tokens
            # were drawn from, which the trainer's importance-sampling correction compares with.
            logprobs_mode="processed_logprobs",
            # CPU has no CUDA graphs, and compiling costs ~35 s per process at start (docs/vllm.md#colocate-mode).
            enforce_eager=current_platform.is_cpu(),
            seed=self.accelerator.process_index,
        )
        if self.accelerator.num_processes > 1:
            # Several training processes: vLLM builds its (size-1) parallel groups inside the trainer's process
            # group instead of starting one of its own, which is what its external launcher mode is for.
            self.environment.set_default("RANK", str(self.accelerator.process_index))
            self.environment.set_default("LOCAL_RANK", str(self.accelerator.local_process_index))
            self.environment.set_default("WORLD_SIZE", str(self.accelerator.num_processes))
            settings["distributed_executor_backend"] = "external_launcher"
        # vLLM seeds the process's random generators with its `seed` and lowers torch's thread count "for serving":
        # the trainer's seeded streams (and a resumed run's) and its threads are put back.
        threads, states = torch.get_num_threads(), (random.getstate(), np.random.get_state())
        with torch.random.fork_rng():
            llm = LLM(**{**settings, **self.engine_kwargs})
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.set_num_threads(threads)
        return llm

    def close(self) -> None:
        """Let go of the engine and put back what building it changed in this process: every environment variable
        it set (to its earlier value, or unset) and the temporary folder of its config. A later `sync_weights`
        builds a new engine."""
        self.llm, self.asleep, self.synced_version = None, False, None
        self.environment.restore()
        if self._config_dir is not None:
            self._config_dir.cleanup()
            self._config_dir = None

    def _wake(self) -> None:
        if self.asleep:
            self.llm.wake_up()
            self.llm.reset_prefix_cache()
            self.asleep = False

    def _sleep(self) -> None:
        # Level 1 keeps the weights (in CPU memory): a generation with no optimizer step since (evaluation, a second
        # round at one step) needs them back without a sync. Level 2 would drop them.
        if self.enable_sleep_mode:
            self.llm.sleep(level=1)
            self.asleep = True

    # ---- GenerationBackend ----

    def sync_weights(self, model: nn.Module, version: int) -> None:
        """Load `model`'s weights into the engine unless it holds those of step `version`; then drop the cached
        prefixes, computed with the old weights. Every process loads its own engine; sharded weights (ZeRO-3, FSDP2)
        are gathered by all processes together inside `checkpoint_tensors`."""
        if version == self.synced_version:
            return
        llm = self.engine(model)
        self._wake()
        start = time.perf_counter()
        self.synced_version = None  # a load cut short leaves no version
        llm.collective_rpc(_reload, args=(checkpoint_tensors(model),))
        llm.reset_prefix_cache()
        self.synced_version = version
        self.last_sync = {"seconds": time.perf_counter() - start}

    def generate(
        self,
        model: nn.Module,
        prompt_ids: list[list[int]],
        images: ImagePrompts | None = None,
        max_new_tokens: int | None = None,
    ) -> Completions:
        """`images` (vision-language models): each row's images and its prompt with one placeholder per image,
        which vLLM expands against the images (into `prompt_ids`, which is checked); the image placeholder tokens
        are never sampled (`placeholder_bias`). `max_new_tokens`: at most that many tokens per row (an episode's
        turn; None: `max_completion_length`)."""
        from vllm import SamplingParams

        if self.synced_version is None:
            raise RuntimeError("call sync_weights before generate: the engine holds no weights of the policy yet")
        llm = self.engine(model)
        self._wake()
        # A fresh seed per call from the trainer's sampling stream (seeded by `args.seed`, per process, and saved in
        # checkpoints): runs are reproducible and no two calls, or processes, share samples. Row r draws with seed
        # + r (vLLM gives the i-th of n samples seed + i).
        seed, start = request_seed(self.rng), 0
        settings = dict(self.sampling)
        if max_new_tokens is not None:
            settings["max_tokens"] = min(max_new_tokens, settings["max_tokens"])
        if self.regex is not None:
            settings["structured_outputs"] = structured_outputs(self.regex)
        if images is not None:
            settings["logit_bias"] = placeholder_bias(placeholder_token_ids(_base(model).config))
        runs = _runs(prompt_ids, images)
        requests, params = [], []
        for (_, sent, row_images), count in runs:
            requests.append(multimodal_request(sent, row_images))
            params.append(SamplingParams(n=count, seed=seed + start, logprobs=0, detokenize=False, **settings))
            start += count
        outputs = llm.generate(requests, params, use_tqdm=False)
        if images is not None:
            check_expanded(
                [run[0] for run, _ in runs], [o.prompt_token_ids for o in outputs], "The colocated vLLM engine"
            )
        ids, logprobs = [], []
        for output in outputs:
            for sample in output.outputs:
                ids.append(list(sample.token_ids))
                logprobs.append([step[token].logprob for token, step in zip(sample.token_ids, sample.logprobs)])
        self._sleep()
        return Completions(ids, logprobs)
