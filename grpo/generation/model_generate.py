"""`TransformersGeneration`: the default sampler, the policy's own `model.generate`."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from transformers import GenerationConfig

from grpo.data import pad
from grpo.generation.base import Completions


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
