"""`VLLMGeneration`: the trainer's `GenerationBackend` on a `grpo vllm-serve` server (`vllm_mode="server"`).

The main process sends the round's unique prompts once each with n = G, and pushes the policy's weights to the
server before a generation whenever an optimizer step has changed them: merged weights, or the LoRA adapter alone
when the server was started with --enable-lora (docs/vllm.md). vLLM itself is never imported here.
"""

from __future__ import annotations

import logging

from torch import nn

from grpo.data.vision import ImagePrompts
from grpo.generation.base import Completions, SamplingRNG, equal_runs, request_seed
from grpo.generation.policy_weights import adapter_tensors, checkpoint_tensors
from grpo.generation.settings import SamplingSettings, resolve_sampling
from grpo.generation.vllm import lora_sync
from grpo.generation.vllm.client import VLLMClient, VLLMServerError
from grpo.generation.vllm.images import check_expanded, encode_rows
from grpo.models import is_peft_model

logger = logging.getLogger(__name__)


def _mode_note(mode: str, is_peft: bool, info: dict) -> str:
    """The one log line that says what each sync sends, and why."""
    if mode == "adapter":
        return "the LoRA adapter alone (the server was started with --enable-lora)"
    if is_peft:
        return "merged weights (the server was started without --enable-lora; with it, the adapter alone is sent)"
    return "the full weights (the policy is not a PEFT model)"


def _whole_groups(rows: list, size: int) -> bool:
    """Whether `rows` are groups of `size` equal consecutive rows."""
    return len(rows) % size == 0 and all(rows[i] == rows[i - i % size] for i in range(len(rows)))


class VLLMGeneration:
    """`GenerationBackend` on a `grpo vllm-serve` server (`use_vllm=True`).

    Every process hands in its rows; the main process sends each group's prompt once with n = G (the engine shares
    the prompt's prefill among the G samples), then every process takes its rows of the answer. Rows with images
    (`takes_images`) send them with their group's prompt, as PNG (grpo/generation/vllm/images.py). Weights go to the
    server in `sync_weights`, from the main process; sharded weights are gathered by all processes together.
    """

    takes_images = True  # `sample_rollout` gives `generate` each row's images, not the processed vision inputs

    def __init__(
        self,
        accelerator,
        *,
        client: VLLMClient,
        num_generations: int,
        bucket_bytes: int,
        sampling: SamplingSettings | None = None,
        num_generations_eval: int | None = None,
        rng: SamplingRNG | None = None,
        model_impl: str | None = None,
        **fields,
    ):
        """`sampling`: what completions are drawn from (`make_generation_backend` passes the config's), or instead
        its fields as keywords (`max_completion_length=8, temperature=0.7`)."""
        self.sampling_settings = sampling = resolve_sampling(sampling, fields)
        self.accelerator = accelerator
        self.rng = rng  # the trainer's sampling stream, which request seeds are drawn from (None: torch's default)
        self.client = client
        self.num_generations = num_generations
        self.num_generations_eval = num_generations_eval or num_generations  # G of an evaluation batch
        self.sampling = sampling.vllm_params()  # what every request sends
        regex = sampling.structured_outputs_regex
        if regex is not None:  # sent only when set: a server without the field takes the rest
            self.sampling["structured_outputs_regex"] = regex
        self.model_impl = model_impl  # the `--model-impl` the server must run (None: any)
        self.bucket_bytes = bucket_bytes
        self.synced_version: int | None = None  # the trainer step whose weights the server holds
        self.last_sync: dict | None = None  # {"mode", "buckets", "tensors", "bytes", "seconds"} of the latest sync
        self.mode: str | None = None  # "merged" or "adapter", chosen at the first sync
        if accelerator.is_main_process:
            client.wait_until_ready()

    def _choose_mode(self, model: nn.Module) -> str:
        """The main process picks the sync mode from the model and the server's /health (`sync_mode`), logs it, and
        tells the other processes, which gather sharded weights in step with it. An adapter the server cannot take,
        or a server running another model implementation than `model_impl`, is an error on every process."""
        from accelerate.utils import broadcast_object_list

        choice = [None]
        if self.accelerator.is_main_process:
            info, peft = self.client.info, is_peft_model(model)
            mode = lora_sync.sync_mode(peft, info)
            problems = []
            if mode == "adapter":
                config = model.peft_config[model.active_adapters[0]]
                problems = lora_sync.adapter_problems(config, info["max_lora_rank"], model.active_adapters)
            error = lora_sync.adapter_error(problems, self.client.base_url) if problems else None
            served = info.get("model_impl")  # a server from before the option reports none
            if self.model_impl is not None and served is not None and served != self.model_impl:
                error = (
                    f"The vLLM server at {self.client.base_url} runs --model-impl {served}, but vllm_model_impl="
                    f"{self.model_impl!r}. Restart `grpo vllm-serve` with --model-impl {self.model_impl}, or set "
                    f"vllm_model_impl={served!r}."
                )
            choice = [(mode, error)]
            if error is None:
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

    def generate(
        self, model: nn.Module, prompt_ids: list[list[int]], images: ImagePrompts | None = None
    ) -> Completions:
        """`images`: the rows' images and their prompts with one placeholder per image (vision-language models),
        sent as PNG once per group (grpo/generation/vllm/images.py); the rows of a group must then share their
        images too, and the prompts the server expanded must be `prompt_ids`."""
        from accelerate.utils import broadcast_object_list, gather_object

        local = prompt_ids
        if images is not None:  # [expanded ids, ids with one placeholder per image, PNG images] per row
            local = [list(row) for row in zip(prompt_ids, images.prompt_ids, encode_rows(images.images))]
        rows = gather_object(local)  # every process's rows, in process order
        answer = [None]
        if self.accelerator.is_main_process:
            # A training round comes in groups of num_generations, an evaluation batch of num_generations_eval. Any
            # cut of the rows into equal-prompt groups samples the same way (each completion is its own draw).
            sizes = dict.fromkeys([self.num_generations, self.num_generations_eval])
            G = next((g for g in sizes if _whole_groups(rows, g)), None)
            if G is None:
                what = "prompt rows" if images is None else "prompt rows with their images"
                raise ValueError(
                    f"{what} do not come as groups of {' or '.join(map(str, sizes))} equal consecutive rows"
                )
            firsts = [rows[i] for i in range(0, len(rows), G)]
            prompts, sent = (firsts, None) if images is None else ([f[1] for f in firsts], [f[2] for f in firsts])
            if images is not None:
                self._check_images()
            # A fresh seed per call from the trainer's sampling stream, seeded by `args.seed` and saved in checkpoints:
            # runs are reproducible, a resumed run draws the seeds the uninterrupted one would, no two calls share
            # samples, and a reward that reseeds torch cannot make every call send the same seed.
            seed = request_seed(self.rng)
            reply = self.client.generate(prompts, n=G, seed=seed, images=sent, **self.sampling)
            self._check_version(reply)
            if images is not None:
                check_expanded(
                    [f[0] for f in firsts], reply["prompt_ids"], f"The vLLM server at {self.client.base_url}"
                )
            answer = [(reply["completion_ids"], reply["logprobs"])]
        answer = broadcast_object_list(answer, from_process=0)
        ids, logprobs = answer[0]
        counts = gather_object([len(prompt_ids)])  # a last, shorter evaluation batch may split unevenly
        start = sum(counts[: self.accelerator.process_index])
        return Completions(ids[start : start + len(prompt_ids)], logprobs[start : start + len(prompt_ids)])

    def generate_local(
        self, model: nn.Module, prompt_ids: list[list[int]], max_new_tokens: int | None = None
    ) -> Completions:
        """This process's rows, sent by this process itself, with no collective call (the async producer thread,
        grpo/generation/async_engine.py, and episodes' turns, at most `max_new_tokens` tokens each). Each run of
        equal rows goes as one prompt with n = its length (a group split between processes is two runs), one
        request per distinct length."""
        sampling = dict(self.sampling)
        if max_new_tokens is not None:
            sampling["max_tokens"] = min(max_new_tokens, sampling["max_tokens"])
        runs = equal_runs(prompt_ids)
        by_count: dict[int, list[int]] = {}
        for i, (_, count) in enumerate(runs):
            by_count.setdefault(count, []).append(i)
        seed = request_seed(self.rng)
        samples: list = [None] * len(runs)  # per run: (its completion ids, their log-probs)
        for k, (count, members) in enumerate(by_count.items()):
            reply = self.client.generate([runs[i][0] for i in members], n=count, seed=seed + k, **sampling)
            self._check_version(reply)
            for j, i in enumerate(members):
                rows = slice(j * count, (j + 1) * count)
                samples[i] = (reply["completion_ids"][rows], reply["logprobs"][rows])
        ids = [row for run_ids, _ in samples for row in run_ids]
        return Completions(ids, [row for _, run_logprobs in samples for row in run_logprobs])

    def _check_images(self) -> None:
        """A server that cannot take images: one from before images were served, or one whose model reads none; and
        LoRA adapter sync, not built for vision-language models."""
        if self.mode == "adapter":
            raise VLLMServerError(
                f"The data has images, and the vLLM server at {self.client.base_url} was started with --enable-lora: "
                "syncing a vision-language model's LoRA adapter alone is not supported yet. Restart the server "
                "without --enable-lora: the trainer then sends merged weights (docs/vlm.md#vllm-with-images)."
            )
        info = self.client.info or {}
        if not info.get("multimodal"):
            served = (
                f"serves {info.get('model')!r}, which takes no images" if "multimodal" in info else "takes no images"
            )
            raise VLLMServerError(
                f"The data has images, and the vLLM server at {self.client.base_url} {served} (its /health says "
                "multimodal: false or nothing). Start `grpo vllm-serve --model` with the vision-language model being "
                "trained, from this version of grpo (docs/vlm.md#vllm-with-images)."
            )

    def _check_version(self, reply: dict) -> None:
        if reply["weights_version"] != self.synced_version:
            raise VLLMServerError(
                f"The vLLM server at {self.client.base_url} holds weights of version {reply['weights_version']} "
                f"(None: as loaded from disk), not the trainer's step {self.synced_version}: it was restarted, or "
                "another trainer updates it. Give each trainer its own server, and restart training from a "
                "checkpoint after a server restart."
            )
