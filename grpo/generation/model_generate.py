"""`TransformersGeneration`: the default sampler, the policy's own `model.generate`.

The rows of a GRPO round come in groups of G consecutive copies of one prompt. Rather than prefilling every copy, the
sampler runs each distinct prompt through the model once (all of it but its last token), repeats that KV cache G
times along the batch, and lets `generate` continue from it: the last prompt token and every completion token are
computed per row as before, so each row is the same draw from the same distribution, for a G-th of the prefill.

Two opt-in CPU tunings (grpo/contrib/cpu/, imported only when switched on): with `cpu_decode_kernel` the decoding
steps' few-row matrix products run grpo's own AVX-512 kernel where it pays (decode.py: float32 models with weights
too large for the CPU's caches, no autocast), and with `cpu_inverse_cdf_sampling` the next tokens are drawn with one
uniform number per row instead of `torch.multinomial` (sampling.py, for the same models).
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
from collections.abc import Sequence

import torch
from torch import nn
from transformers import DynamicCache, GenerationConfig

from grpo.data import pad
from grpo.generation.base import Completions, equal_runs


class TransformersGeneration:
    """Samples with the policy's own `generate`, on the trainer's device, prompts left-padded; each run of identical
    prompts is prefilled once and its rows share that KV cache (see the module docstring)."""

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
        cpu_decode_kernel: bool = False,
        cpu_inverse_cdf_sampling: bool = False,
    ):
        self.pad_token_id = pad_token_id
        # Opt-in CPU tuning (GRPOConfig's fields of the same names; grpo/contrib/cpu/).
        self.cpu_decode_kernel = cpu_decode_kernel
        self.cpu_inverse_cdf_sampling = cpu_inverse_cdf_sampling
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
        try:
            with self._cpu_decoding(model, device):
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

    def _cpu_decoding(self, model: nn.Module, device: torch.device) -> contextlib.AbstractContextManager:
        """The context of the CPU tunings switched on (a no-op when none is, or off the CPU). The kernel's context
        also answers the draws when both are on: one `TorchFunctionMode` sees each torch call, not two."""
        kernel, draws = self.cpu_decode_kernel, self.cpu_inverse_cdf_sampling
        if device.type != "cpu" or not (kernel or draws):
            return contextlib.nullcontext()
        if kernel:
            from grpo.contrib.cpu import decode  # compiles the kernel on its first use on this machine

            if decode.pays_for(model):
                return decode.few_row_linear(draws=draws)
        if draws:
            from grpo.contrib.cpu import sampling

            if sampling.pays_for(model):
                return sampling.inverse_cdf_draws()
        return contextlib.nullcontext()

    def _shares(self, model: nn.Module, num_distinct: int, rows: int, width: int) -> bool:
        """Share the prefill when some prompt repeats, the prompts have a token to cache before the last one, and
        `generate` would use its default dynamic cache (a configured cache implementation is left to `generate`)."""
        return (
            num_distinct < rows
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
