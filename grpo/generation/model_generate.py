"""`TransformersGeneration`: the default sampler, the policy's own `model.generate`.

The rows of a GRPO round come in groups of G consecutive copies of one prompt. Rather than prefilling every copy, the
sampler runs each distinct prompt through the model once (all of it but its last token), repeats that KV cache G
times along the batch, and lets `generate` continue from it: the last prompt token and every completion token are
computed per row as before, so each row is the same draw from the same distribution, for a G-th of the prefill.

On a CPU, with `cpu_decode_kernel`, the decoding steps' few-row matrix products run grpo's own kernel and their
draws take one uniform number per row (grpo/contrib/cpu/decode.py) where it pays: float32 models with weights too large for the
CPU's caches, no autocast.
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
from collections.abc import Sequence

import torch
from torch import nn
from transformers import DynamicCache, GenerationConfig

from grpo.contrib.cpu import decode as cpu_linear
from grpo.data import pad
from grpo.generation.base import Completions, equal_runs


class TransformersGeneration:
    """Samples with the policy's own `generate`, on the trainer's device, prompts left-padded; each run of identical
    prompts is prefilled once and its rows share that KV cache (`share_prefill`)."""

    # Prefill each distinct prompt once (see the module docstring); False prefills every row, as `generate` alone
    # does (benchmarks/compare_trl.py switches it to measure the difference).
    share_prefill: bool = True

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
        cpu_decode_kernel: bool = True,
    ):
        self.pad_token_id = pad_token_id
        self.cpu_decode_kernel = (
            cpu_decode_kernel  # few-row products by grpo's kernel on a CPU (grpo/contrib/cpu/decode.py)
        )
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
        input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
        counts = [length for _, length in equal_runs(prompt_ids)]  # runs of identical prompts (a group's rows)
        firsts = [0, *itertools.accumulate(counts)][:-1]  # each run's first row
        was_training = model.training
        model.eval()  # no dropout while sampling, whatever `disable_dropout` says
        kernel = device.type == "cpu" and self.cpu_decode_kernel and cpu_linear.pays_for(model)
        try:
            with cpu_linear.few_row_linear() if kernel else contextlib.nullcontext():
                cache = None
                if self._shares(model, len(firsts), *input_ids.shape):
                    cache = shared_prompt_cache(model, input_ids, attention_mask, firsts, counts)
                output = model.generate(
                    input_ids=input_ids,
                    attention_mask=attention_mask,
                    past_key_values=cache,
                    generation_config=self.generation_config,
                )
        finally:
            model.train(was_training)
        return Completions(output[:, input_ids.shape[1] :].tolist())

    def _shares(self, model: nn.Module, num_distinct: int, rows: int, width: int) -> bool:
        """Share the prefill when some prompt repeats, the prompts have a token to cache before the last one, and
        `generate` would use its default dynamic cache (a configured cache implementation is left to `generate`)."""
        return (
            self.share_prefill
            and num_distinct < rows
            and width > 1
            and self.generation_config.cache_implementation is None
            and getattr(model, "_supports_default_dynamic_cache", lambda: True)()
        )


def shared_prompt_cache(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    firsts: list[int],
    counts: list[int],
) -> DynamicCache | None:
    """The KV cache of every row's prompt but its last token, computed once per run of identical rows.

    input_ids, attention_mask: (B, P), left-padded; firsts, counts: each run of identical rows' first row and its
    length. Returns a cache of batch B and length P - 1, row i holding what a prefill of row i alone would hold (a
    row's keys and values depend only on its own tokens and positions, and identical rows have both), or None when
    the model kept no cache."""
    rows = torch.tensor(firsts, device=input_ids.device)
    ids, mask = input_ids[rows, :-1], attention_mask[rows, :-1]  # (U, P - 1)
    # The positions `generate` gives a left-padded row: count its real tokens, padding at 0.
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache(config=model.config.get_text_config(decoder=True))
    kwargs = {"logits_to_keep": 1} if _accepts(model, "logits_to_keep") else {}
    model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache, use_cache=True, **kwargs)
    if cache.get_seq_length() != ids.shape[1]:
        return None
    if len(firsts) < input_ids.shape[0]:
        repeat = torch.repeat_interleave(torch.arange(len(firsts), device=input_ids.device), torch.tensor(counts))
        cache.batch_select_indices(repeat.to(input_ids.device))  # (U, ...) -> (B, ...), run by run
    return cache


def _accepts(model: nn.Module, name: str) -> bool:
    """Whether `model.forward` takes `name` (or any keyword argument)."""
    parameters = inspect.signature(model.forward).parameters
    return name in parameters or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
