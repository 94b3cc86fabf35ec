"""Sampling completions (steps 2-3 of a round): `sample_rollout` turns dataset rows into a `Rollout` with one
sampled completion per row, through the backend `make_generation_backend` picks for a config.

Backends implement `GenerationBackend` (base.py): `TransformersGeneration` (model_generate.py, the policy's own
`generate`), `ContinuousBatchingGeneration` (continuous_batching.py, transformers' continuous-batching engine on
the policy's weights), `VLLMGeneration` (vllm/server_backend.py, a `grpo vllm-serve` server, whose HTTP client is
vllm/client.py and whose server is vllm/serve.py) and `VLLMColocateGeneration` (vllm/colocate.py, an engine inside
each training process); offline training replays stored completions through `StoredCompletions` (stored.py). The weights a vLLM engine needs come from policy_weights.py and travel by
vllm/weight_sync.py (all of them) or vllm/lora_sync.py (the adapter alone); docs/vllm.md. Asynchronous generation's
engine, shared between the producer thread and the trainer, is async_engine.py. What every backend draws from is one
`SamplingSettings` (settings.py, beside the checks of the generation fields that `GRPOConfig` runs).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from grpo.data import InputError, decode_completions, encode_prompts
from grpo.data.vision import (
    encode_vision_prompts,
    image_prompts,
    is_processor,
    open_rows,
    row_images,
    text_tokenizer,
)
from grpo.generation.base import Completions, GenerationBackend, SamplingRNG, cut_at_eos
from grpo.generation.continuous_batching import ContinuousBatchingGeneration
from grpo.generation.episodes import AgentLoop
from grpo.generation.model_generate import TransformersGeneration
from grpo.generation.settings import SamplingSettings
from grpo.generation.stored import StoredCompletions
from grpo.rollout import Rollout

__all__ = [
    "Completions",
    "AgentLoop",
    "ContinuousBatchingGeneration",
    "GenerationBackend",
    "SamplingRNG",
    "SamplingSettings",
    "StoredCompletions",
    "TransformersGeneration",
    "cut_at_eos",
    "make_generation_backend",
    "sample_rollout",
]


def make_generation_backend(
    args, accelerator, tokenizer, eos_token_ids: Sequence[int], stored=None, rng: SamplingRNG | None = None
) -> GenerationBackend:
    """The trainer's sampler for a `GRPOConfig`: the policy's own `generate` (with
    `use_transformers_continuous_batching`, transformers' continuous-batching engine), or with `use_vllm` a vLLM server
    (`vllm_mode="server"`) or an engine in this process (`vllm_mode="colocate"`); docs/vllm.md. With `stored`
    (offline training's `OfflineGroups`), nothing samples: `StoredCompletions` replays them. `rng`: the trainer's
    sampling stream, which every sampler draws from (base.py). `tokenizer`: the policy's (its padding token; a
    colocated engine loads it to apply `vllm_structured_outputs_regex`), or a vision-language model's processor (whose
    tokenizer that is; a colocated engine runs the processor on the images)."""
    if stored is not None:
        return StoredCompletions(stored, accelerator)
    processor, tokenizer = (tokenizer if is_processor(tokenizer) else None), text_tokenizer(tokenizer)
    sampling = SamplingSettings.from_config(args)  # one value for whichever backend samples
    if args.use_transformers_continuous_batching:
        if accelerator.distributed_type in ("FSDP", "DEEPSPEED"):
            # The engine runs the forward passes in a thread of its own, a different number on each process: a
            # sharded model's collective gathers would not line up.
            raise InputError(
                "use_transformers_continuous_batching=True samples with the policy's whole weights in a thread of "
                f"transformers' engine, which a sharded model ({accelerator.distributed_type}) does not have. Set it "
                "False (model.generate), or use vLLM (use_vllm=True)."
            )
        return ContinuousBatchingGeneration(
            pad_token_id=tokenizer.pad_token_id,
            eos_token_ids=eos_token_ids,
            sampling=sampling,
            settings=args.transformers_continuous_batching_config,
            rng=rng,
        )
    if not args.use_vllm:
        return TransformersGeneration(
            pad_token_id=tokenizer.pad_token_id,
            eos_token_ids=eos_token_ids,
            sampling=sampling,
            cache_implementation=args.cache_implementation,
            pad_to_multiple_of=args.pad_to_multiple_of,
            cpu_decode_kernel=args.cpu_decode_kernel,
            cpu_inverse_cdf_sampling=args.cpu_inverse_cdf_sampling,
            rng=rng,
        )
    return _vllm_backend(args, accelerator, tokenizer, eos_token_ids, rng, sampling, processor)


def _vllm_backend(
    args, accelerator, tokenizer, eos_token_ids, rng, sampling: SamplingSettings, processor
) -> GenerationBackend:
    """`use_vllm`'s sampler: an engine in this process (`vllm_mode="colocate"`) or a `grpo vllm-serve` server."""
    if args.vllm_mode == "colocate":
        from grpo.generation.vllm.colocate import VLLMColocateGeneration

        return VLLMColocateGeneration(
            accelerator,
            eos_token_ids=eos_token_ids,
            sampling=sampling,
            gpu_memory_utilization=args.vllm_gpu_memory_utilization,
            max_model_length=args.vllm_max_model_length,
            enable_sleep_mode=args.vllm_enable_sleep_mode,
            engine_kwargs={"trust_remote_code": args.trust_remote_code},
            rng=rng,
            model_impl=args.vllm_model_impl,
            tokenizer=tokenizer,
            processor=processor,
        )
    from grpo.generation.vllm.client import VLLMClient
    from grpo.generation.vllm.server_backend import VLLMGeneration

    client = VLLMClient(
        base_url=args.vllm_server_base_url,
        host=args.vllm_server_host,
        port=args.vllm_server_port,
        timeout=args.vllm_server_timeout,
        group_port=args.vllm_group_port,
        request_timeout=args.vllm_request_timeout,
    )
    return VLLMGeneration(
        accelerator,
        client=client,
        num_generations=args.num_generations,
        num_generations_eval=args.num_generations_eval,
        bucket_bytes=int(args.vllm_sync_bucket_mb * 2**20),
        sampling=sampling,
        rng=rng,
        model_impl=args.vllm_model_impl,
    )


def sample_rollout(
    inputs: list[dict[str, Any]],
    backend: GenerationBackend,
    model: nn.Module,
    tokenizer,
    eos_token_ids,
    args,
    agent: AgentLoop | None = None,
    lockstep=None,
) -> tuple[Rollout, dict[str, list]]:
    """Steps 2-3 of a round: render and tokenize the prompts of `inputs` (dataset rows), sample one completion per
    row with `backend`, cut each after its first EOS (kept; a completion without one is truncated) and decode. The
    rollout is not scored yet. Also returns the rows' other columns, for the reward functions. Offline training's
    backend, `StoredCompletions`, makes the rollout of its drawn groups itself. With an `agent` (tools or
    environments), each row is a multi-turn episode (`AgentLoop.rollout`, episodes.py; `lockstep` there).
    Rows with an `image` or `images` column (vision-language models; `tokenizer` is then the model's processor) are
    rendered and tokenized with their images (grpo/data/vision.py), and the rollout carries their vision inputs; a
    backend with `takes_images` (vLLM's) is given the images themselves instead (`ImagePrompts`)."""
    if isinstance(backend, StoredCompletions):
        return backend.rollout(inputs, tokenizer, eos_token_ids)
    if agent is not None:
        return agent.rollout(inputs, backend, model, lockstep)
    if "prompt" not in inputs[0]:
        raise KeyError(f"Each example needs a 'prompt' field; got fields {sorted(inputs[0])}.")
    prompts = [example["prompt"] for example in inputs]
    columns = {key: [example[key] for example in inputs] for key in inputs[0] if key != "prompt"}
    images = [row_images(example) for example in inputs]
    vision = None
    if images[0] is not None:  # vision inputs beside the prompt tokens, from the processor
        images, prompt_ids, vision = _encode_with_images(prompts, images, tokenizer, args)
        prompt_cut = [0] * len(prompts)
        raw = _generate_with_images(backend, model, prompt_ids, vision, prompts, images, tokenizer, args)
    else:
        prompt_ids, prompt_cut = encode_prompts(
            prompts,
            text_tokenizer(tokenizer),
            args.max_prompt_length,
            args.truncation_side,
            chat_template_kwargs=args.chat_template_kwargs,
        )
        raw = backend.generate(model, prompt_ids)
    rollout = _cut_and_decode(prompts, prompt_ids, raw, text_tokenizer(tokenizer), eos_token_ids, args)
    rollout.prompt_truncated = torch.tensor(prompt_cut, dtype=torch.long)
    rollout.vision = vision
    if vision is not None and args.log_completions and args.log_multimodal:  # for the completions log only
        rollout.images = images
    return rollout, columns


def _encode_with_images(prompts: list, images: list, tokenizer, args) -> tuple[list, list[list[int]], list]:
    """The rows' images opened, their prompts rendered and tokenized with them by the model's processor
    (`tokenizer`), and each row's vision inputs (grpo/data/vision.py)."""
    if not is_processor(tokenizer):
        raise TypeError(
            "The data set has an image column, but the trainer's processing_class is a tokenizer. Pass the "
            "model's processor: processing_class=AutoProcessor.from_pretrained(...)."
        )
    images = open_rows(images, prompts)
    prompt_ids, vision = encode_vision_prompts(
        prompts, images, tokenizer, args.max_prompt_length, args.chat_template_kwargs
    )
    return images, prompt_ids, vision


def _generate_with_images(backend, model, prompt_ids, vision, prompts, images, processor, args) -> Completions:
    """Sample rows that have images: a backend with `takes_images` (vLLM's, which runs the processor itself) is given
    the images, any other the processed vision inputs."""
    if getattr(backend, "takes_images", False):
        return backend.generate(
            model, prompt_ids, images=image_prompts(prompts, images, processor, args.chat_template_kwargs)
        )
    return backend.generate(model, prompt_ids, vision=vision)


def _cut_and_decode(prompts, prompt_ids, raw: Completions, tokenizer, eos_token_ids, args) -> Rollout:
    """Step 3: each completion cut after its first EOS (a completion without one is truncated), the sampler's
    log-probs cut to match, the text decoded, as a `Rollout` not yet scored."""
    completion_ids, truncated = cut_at_eos(raw.ids, eos_token_ids, args.max_completion_length)
    sampling_logps = None
    if raw.logprobs is not None:
        sampling_logps = [row[: len(ids)] for row, ids in zip(raw.logprobs, completion_ids)]
    return Rollout.from_tokens(
        prompts,
        decode_completions(completion_ids, prompts, tokenizer),
        prompt_ids,
        completion_ids,
        truncated,
        tokenizer.pad_token_id,
        mask_truncated=args.mask_truncated_completions,
        sampling_logps=sampling_logps,
    )
