"""Sampling completions: one small interface, and the `model.generate` backend behind it.

A backend takes prompt token ids (one list per row; each prompt's G copies are consecutive) and returns raw
completion token ids per row, and the log-probs the sampler gave those tokens when it has them (a vLLM engine does;
`model.generate` here does not, as they would equal the trainer's own). `cut_at_eos` then applies the one rule the
method fixes (docs/method.md): a completion ends at its first end-of-sequence token, which stays in the loss; one that never emits it
is *truncated*. The vLLM backends are `grpo.vllm_client.VLLMGeneration` (a `grpo vllm-serve` server) and
`grpo.vllm_colocate.VLLMColocateGeneration` (an engine inside each training process); docs/vllm.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple, Protocol

import torch
from torch import nn
from transformers import GenerationConfig

from grpo.data import decode_completions, pad, render_prompt, tokenize_prompts
from grpo.rollout import Rollout


class Completions(NamedTuple):
    ids: list[list[int]]  # one completion per prompt row; anything after its first EOS is ignored
    logprobs: list[list[float]] | None = None  # the sampler's log-prob of each token of `ids`, if it reports them


class GenerationBackend(Protocol):
    def generate(self, model: nn.Module, prompt_ids: list[list[int]]) -> Completions:
        """Sample one completion per row of `prompt_ids` (each prompt's G copies are consecutive rows)."""
        ...

    def sync_weights(self, model: nn.Module, version: int) -> None:
        """Make the sampler use `model`'s current weights, tagged `version` (the optimizer step); called by every
        process before each generation, it does nothing when the weights of `version` are already there."""
        ...


class TransformersGeneration:
    """Samples with the policy's own `generate`, on the trainer's device, prompts left-padded."""

    def __init__(
        self,
        *,
        max_completion_length: int,
        pad_token_id: int,
        eos_token_ids: Sequence[int],
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        min_p: float | None = None,
        repetition_penalty: float = 1.0,
        generation_kwargs: dict | None = None,
        greedy: bool = False,
    ):
        self.pad_token_id = pad_token_id
        settings = {
            "max_new_tokens": max_completion_length,
            "do_sample": not greedy,
            "pad_token_id": pad_token_id,
            "eos_token_id": list(eos_token_ids),
            "use_cache": True,
        }
        if not greedy:  # with `greedy` (evaluation samples) every sampling setting is ignored
            settings |= {
                "temperature": temperature,
                "top_p": top_p,
                "top_k": top_k,  # 0 disables the top-k filter; left unset it would default to 50
                "min_p": min_p,
                "repetition_penalty": repetition_penalty,
            }
        self.generation_config = GenerationConfig(**{**settings, **(generation_kwargs or {})})

    def sync_weights(self, model: nn.Module, version: int) -> None:
        """Nothing to do: `generate` samples with the live model."""

    @torch.no_grad()
    def generate(self, model: nn.Module, prompt_ids: list[list[int]]) -> Completions:
        device = next(model.parameters()).device
        input_ids, attention_mask = pad(prompt_ids, self.pad_token_id, side="left")
        was_training = model.training
        model.eval()  # no dropout while sampling, whatever `disable_dropout` says
        try:
            output = model.generate(
                input_ids=input_ids.to(device),
                attention_mask=attention_mask.to(device),
                generation_config=self.generation_config,
            )
        finally:
            model.train(was_training)
        return Completions(output[:, input_ids.shape[1] :].tolist())


def make_generation_backend(args, accelerator, pad_token_id: int, eos_token_ids: Sequence[int]) -> GenerationBackend:
    """The trainer's sampler for a `GRPOConfig`: the policy's own `generate`, or with `use_vllm` a vLLM server
    (`vllm_mode="server"`) or an engine in this process (`vllm_mode="colocate"`); docs/vllm.md."""
    sampling = dict(
        max_completion_length=args.max_completion_length,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
    )
    if not args.use_vllm:
        return TransformersGeneration(
            pad_token_id=pad_token_id,
            eos_token_ids=eos_token_ids,
            generation_kwargs=args.generation_kwargs,
            **sampling,
        )
    if args.vllm_mode == "colocate":
        from grpo.vllm_colocate import VLLMColocateGeneration

        return VLLMColocateGeneration(
            accelerator,
            eos_token_ids=eos_token_ids,
            gpu_memory_utilization=args.vllm_gpu_memory_utilization,
            max_model_length=args.vllm_max_model_length,
            enable_sleep_mode=args.vllm_enable_sleep_mode,
            **sampling,
        )
    from grpo.vllm_client import VLLMClient, VLLMGeneration

    client = VLLMClient(
        base_url=args.vllm_server_base_url,
        host=args.vllm_server_host,
        port=args.vllm_server_port,
        timeout=args.vllm_server_timeout,
        group_port=args.vllm_group_port,
    )
    return VLLMGeneration(
        accelerator,
        client=client,
        num_generations=args.num_generations,
        bucket_bytes=int(args.vllm_sync_bucket_mb * 2**20),
        **sampling,
    )


def cut_at_eos(
    completions: Sequence[Sequence[int]], eos_token_ids: Sequence[int], max_completion_length: int
) -> tuple[list[list[int]], list[bool]]:
    """Keep each completion up to and including its first EOS token (at most `max_completion_length` tokens).

    Returns the cut completions and, per row, whether it is truncated (no EOS within the limit).
        [5, 7, EOS, 9, PAD] -> [5, 7, EOS], truncated False
        [5, 7, 9]           -> [5, 7, 9],   truncated True
    """
    eos = set(eos_token_ids)
    cut, truncated = [], []
    for ids in completions:
        ids = list(ids[:max_completion_length])
        end = next((t for t, token in enumerate(ids) if token in eos), None)
        cut.append(ids if end is None else ids[: end + 1])
        truncated.append(end is None)
    return cut, truncated


def sample_rollout(
    inputs: list[dict[str, Any]], backend: GenerationBackend, model: nn.Module, tokenizer, eos_token_ids, args
) -> tuple[Rollout, dict[str, list]]:
    """Steps 2-3 of a round: render and tokenize the prompts of `inputs` (dataset rows), sample one completion per
    row with `backend`, cut each after its first EOS (kept; a completion without one is truncated) and decode. The
    rollout is not scored yet. Also returns the rows' other columns, for the reward functions."""
    if "prompt" not in inputs[0]:
        raise KeyError(f"Each example needs a 'prompt' field; got fields {sorted(inputs[0])}.")
    prompts = [example["prompt"] for example in inputs]
    columns = {key: [example[key] for example in inputs] for key in inputs[0] if key != "prompt"}
    prompt_ids = tokenize_prompts([render_prompt(p, tokenizer) for p in prompts], tokenizer, args.max_prompt_length)
    raw = backend.generate(model, prompt_ids)
    completion_ids, truncated = cut_at_eos(raw.ids, eos_token_ids, args.max_completion_length)
    sampling_logps = None
    if raw.logprobs is not None:
        sampling_logps = [row[: len(ids)] for row, ids in zip(raw.logprobs, completion_ids)]
    rollout = Rollout.from_tokens(
        prompts,
        decode_completions(completion_ids, prompts, tokenizer),
        prompt_ids,
        completion_ids,
        truncated,
        tokenizer.pad_token_id,
        mask_truncated=args.mask_truncated_completions,
        sampling_logps=sampling_logps,
    )
    return rollout, columns
