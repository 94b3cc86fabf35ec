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
import copy
import inspect
import itertools
from collections.abc import Sequence

import torch
from torch import nn
from transformers import DynamicCache, GenerationConfig

from grpo.data import pad, round_up
from grpo.data.vision import placeholder_token_ids, vision_batch
from grpo.generation.base import Completions, SamplingRNG, cut_at_eos, equal_runs
from grpo.generation.settings import SamplingSettings, resolve_sampling


class TransformersGeneration:
    """Samples with the policy's own `generate`, on the trainer's device, prompts left-padded; each run of identical
    prompts is prefilled once and its rows share that KV cache (see the module docstring)."""

    def __init__(
        self,
        *,
        pad_token_id: int,
        eos_token_ids: Sequence[int],
        sampling: SamplingSettings | None = None,
        cache_implementation: str | None = None,
        pad_to_multiple_of: int | None = None,
        greedy: bool = False,
        cpu_decode_kernel: bool = False,
        cpu_inverse_cdf_sampling: bool = False,
        rng: SamplingRNG | None = None,
        **fields,
    ):
        """`sampling`: what completions are drawn from (`make_generation_backend` passes the config's), or instead
        its fields as keywords (`max_completion_length=8, top_k=0`) for a sampler built on its own. With `greedy`
        (evaluation samples, the CLI's check) every setting but the length is ignored."""
        self.sampling_settings = sampling = resolve_sampling(sampling, fields)
        self.pad_token_id = pad_token_id
        # Inputs padded to a multiple of this width (None: the longest row), for compilers that see each shape anew.
        self.pad_to_multiple_of = pad_to_multiple_of
        # The trainer's sampling stream (base.py): `generate` draws from it, not from what user code can reseed.
        # None (a sampler used on its own): torch's default generators.
        self.rng = rng
        # Opt-in CPU tuning (GRPOConfig's fields of the same names; grpo/contrib/cpu/).
        self.cpu_decode_kernel = cpu_decode_kernel
        self.cpu_inverse_cdf_sampling = cpu_inverse_cdf_sampling
        settings = {
            "max_new_tokens": sampling.max_completion_length,
            "do_sample": not greedy,
            "pad_token_id": pad_token_id,
            "eos_token_id": list(eos_token_ids),
            "use_cache": True,
            "cache_implementation": cache_implementation,  # None: the model's default (dynamic) cache
        }
        if not greedy:  # with `greedy` (evaluation samples) every sampling setting is ignored
            settings |= {
                "temperature": sampling.temperature,
                "top_p": sampling.top_p,
                "top_k": sampling.top_k,  # 0 disables the top-k filter; left unset it would default to 50
                "min_p": sampling.min_p,
                "repetition_penalty": sampling.repetition_penalty,
            }
        # `return_dict_in_generate`: the sequences and the cache `generate` ended with (`CarriedTurns` goes on from it).
        self.generation_config = GenerationConfig(
            **{**settings, **(sampling.generation_kwargs or {}), "return_dict_in_generate": True}
        )

    def sync_weights(self, model: nn.Module, version: int) -> None:
        """Nothing to do: `generate` samples with the live model."""

    @torch.no_grad()
    def generate(
        self,
        model: nn.Module,
        prompt_ids: list[list[int]],
        vision: list | None = None,
        max_new_tokens: int | None = None,
    ) -> Completions:
        """`vision`: each row's vision inputs (vision-language models, grpo/data/vision.py); then every row is
        prefilled with its images, none shared, and the model's image placeholder tokens are never sampled (a
        completion holding one would ask the log-prob passes for an image that is not there). `max_new_tokens`: at
        most that many tokens per row (None: `max_completion_length`)."""
        input_ids, attention_mask = self.left_padded(model, prompt_ids)
        limit = {"max_new_tokens": max_new_tokens}
        if vision is not None:
            inputs = vision_batch(vision, input_ids.shape[1], 0, input_ids.device)
            sequences, _ = self.generate_from(model, input_ids, attention_mask, vision=inputs, **limit)
        else:
            sequences, _ = self.generate_from(model, input_ids, attention_mask, prompt_ids, **limit)
        return Completions(sequences[:, input_ids.shape[1] :].tolist())

    def turns(self) -> CarriedTurns:
        """A sampler for the turns of one batch of episodes that carries each row's KV cache from a turn to the
        next (grpo/generation/episodes.py asks for it at the start of a round)."""
        return CarriedTurns(self)

    def left_padded(self, model: nn.Module, prompt_ids: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """`prompt_ids` as (B, P) ids and attention mask on the model's device, left-padded to the longest row (or a
        multiple of `pad_to_multiple_of`): the layout `generate_from` takes."""
        device = next(model.parameters()).device
        width = round_up(max(map(len, prompt_ids), default=0), self.pad_to_multiple_of)
        input_ids, attention_mask = pad(prompt_ids, self.pad_token_id, side="left", width=width)
        return input_ids.to(device), attention_mask.to(device)

    def generate_from(
        self,
        model: nn.Module,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        prompt_ids: list[list[int]] | None = None,
        cache: DynamicCache | None = None,
        vision: dict[str, torch.Tensor] | None = None,
        max_new_tokens: int | None = None,
    ) -> tuple[torch.Tensor, DynamicCache | None]:
        """`generate` from `input_ids` (B, T) (`generate` calls it for a batch of prompts, `CarriedTurns` for each
        turn), given a `cache` of its first columns or, with `prompt_ids`, sharing the prefill of identical prompts;
        `vision`: the model's vision keyword arguments (pixel values, ...), with which the model's image placeholder
        tokens are suppressed; `max_new_tokens`: at most that many new tokens (None: the settings' length, the
        `max_completion_length`). Returns the sequences (B, T + N) and the cache `generate` ended with (of its first
        T + N - 1 columns: the last token sampled was never fed to the model)."""
        device = input_ids.device
        config = self.generation_config
        if vision is not None or max_new_tokens is not None:
            config = copy.deepcopy(config)
        if max_new_tokens is not None:
            config.max_new_tokens = min(max_new_tokens, config.max_new_tokens)
        if vision is not None:
            config.suppress_tokens = [*(config.suppress_tokens or []), *placeholder_token_ids(model.config)]
        was_training = model.training
        model.eval()  # no dropout while sampling, whatever `disable_dropout` says
        drawing = self.rng.as_default() if self.rng is not None else contextlib.nullcontext()
        try:
            with self._cpu_decoding(model, device), drawing:
                # With pad_to_multiple_of the prompts' whole padded width is prefilled, not the shared prefix's.
                if cache is None and prompt_ids is not None and self.pad_to_multiple_of is None:
                    counts = [length for _, length in equal_runs(prompt_ids)]  # runs of identical prompts (groups)
                    firsts = [0, *itertools.accumulate(counts)][:-1]  # each run's first row
                    if len(firsts) < input_ids.shape[0] and input_ids.shape[1] > 1 and self.uses_dynamic_cache(model):
                        cache = shared_prompt_cache(model, input_ids, attention_mask, firsts, counts)
                output = model.generate(
                    input_ids=input_ids,
                    attention_mask=attention_mask,
                    generation_config=config,
                    **{cache_keyword(model.forward): cache},
                    **(vision or {}),
                )
        finally:
            model.train(was_training)
        # The output names it `cache` from transformers 5.24 on, `past_key_values` before.
        kept = getattr(output, "cache", None)
        return output.sequences, kept if kept is not None else getattr(output, "past_key_values", None)

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

    def uses_dynamic_cache(self, model: nn.Module) -> bool:
        """Whether `generate` would use its default dynamic cache, the one a prefill can be handed to (a configured
        cache implementation is left to `generate`)."""
        return (
            self.generation_config.cache_implementation is None
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
    kwargs[cache_keyword(model.forward)] = cache
    model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, **kwargs)
    if cache.get_seq_length() != ids.shape[1]:
        return None
    if len(firsts) < input_ids.shape[0]:
        runs = torch.arange(len(firsts), device=input_ids.device)
        repeat = torch.repeat_interleave(runs, torch.tensor(counts, device=input_ids.device))
        cache.batch_select_indices(repeat)  # (U, ...) -> (B, ...), run by run
    return cache


def cache_keyword(function) -> str:
    """The name a model's `forward` (and its `generate`) takes a KV cache by: `cache` from transformers 5.24 on
    (where `past_key_values` is a deprecated alias), `past_key_values` before."""
    return "cache" if "cache" in inspect.signature(function).parameters else "past_key_values"


def _accepts(model: nn.Module, name: str) -> bool:
    """Whether `model.forward` takes `name` (or any keyword argument)."""
    parameters = inspect.signature(model.forward).parameters
    return name in parameters or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())


class CarriedTurns:
    """`generate` for the turns of one batch of episodes, each row's KV cache carried from one turn to the next.

    Turn k + 1 of an episode is its turn-k context, the tokens sampled at turn k (cut after their EOS) and the tool
    answers. A plain `generate` would prefill all of that again. Here the rows of turn k stay in a left-padded layout
    (ids and mask, (B, T)) whose first T - 1 columns are in the KV cache that `generate` ended with; turn k + 1 keeps
    each continuing row's cache up to what its new context shares with it, masks the rest out (tokens sampled after
    the EOS, a cut), and prefills only the new tokens (the tool answers), left-padded behind the old columns:

        row layout, turn k:      [pad | context_k | sampled ... EOS junk]
        row layout, turn k + 1:  [pad | context_k | sampled ... EOS  0000 | pad | tool answer] + turn k + 1

    (0: masked out.) Positions come from the mask (`generate` counts the unmasked columns), so every kept token has
    the position and the keys and values a fresh prefill of the new context would give it: a kept token was computed
    attending to kept tokens only, since only suffixes are masked out. The draw is the same; the numbers differ by
    float rounding only. A context that continues no row of the previous turn (or a turn with nothing new to feed)
    starts afresh, with the whole batch prefilled as `TransformersGeneration.generate` does.
    """

    def __init__(self, sampler: TransformersGeneration):
        self.sampler = sampler
        eos = sampler.generation_config.eos_token_id
        self.eos_token_ids = list(eos) if isinstance(eos, (list, tuple)) else [eos]
        self.ids: torch.Tensor | None = None  # (B, T) the last turn's rows: context and sampled tokens
        self.mask: torch.Tensor | None = None  # (B, T)
        self.cache: DynamicCache | None = None  # of the first T - 1 columns
        self.expected: list[list[int]] = []  # per row: its context and its sampled tokens up to their EOS

    @torch.no_grad()
    def generate(self, model: nn.Module, contexts: list[list[int]], max_new_tokens: int | None = None) -> Completions:
        """A turn of each context, of at most `max_new_tokens` tokens (None: `max_completion_length`)."""
        continued = self._continuation(contexts)
        limit = {"max_new_tokens": max_new_tokens}
        if continued is None:
            input_ids, attention_mask = self.sampler.left_padded(model, contexts)
            sequences, cache = self.sampler.generate_from(model, input_ids, attention_mask, contexts, **limit)
        else:
            input_ids, attention_mask, cache = continued
            sequences, cache = self.sampler.generate_from(model, input_ids, attention_mask, cache=cache, **limit)
        width = input_ids.shape[1]
        new = sequences[:, width:].tolist()
        # Only a dynamic cache of full-attention layers is carried: a static, sliding-window or recurrent cache does
        # not keep every column to mask and extend, so those turns start afresh.
        carries = (
            isinstance(cache, DynamicCache)
            and not any(getattr(layer, "is_sliding", False) for layer in getattr(cache, "layers", ()))
            and cache.get_seq_length() == sequences.shape[1] - 1
        )
        self.ids, self.cache = sequences, cache if carries else None
        self.mask = torch.cat([attention_mask, attention_mask.new_ones(len(contexts), len(new[0]))], dim=1)
        cut, _ = cut_at_eos(new, self.eos_token_ids, len(new[0]))
        self.expected = [list(c) + k for c, k in zip(contexts, cut)]
        return Completions(new)

    def _continuation(self, contexts: list[list[int]]):
        """The inputs of a `generate` that goes on from the last turn's cache: (ids, mask, cache), with the rows of
        the last turn that `contexts` continue (in order), or None when some context continues none of them."""
        if self.cache is None or not contexts:
            return None
        rows, kept, chunks = [], [], []
        row = 0
        for context in contexts:
            while row < len(self.expected) and context[: len(self.expected[row])] != self.expected[row]:
                row += 1
            if row == len(self.expected):
                return None
            # Keep the row's tokens that the context repeats, but at least one token to feed: the model needs an
            # input whose logits give the first new token (a token fed again replaces its cached copy, masked out).
            keep = min(len(self.expected[row]), len(context) - 1)
            rows.append(row)
            kept.append(keep)
            chunks.append(context[keep:])
            row += 1
        device = self.ids.device
        index = torch.tensor(rows, device=device)
        ids, mask = self.ids[index], self.mask[index]  # (R, T)
        keep = torch.tensor(kept, device=device)[:, None]
        mask = mask * (mask.cumsum(1) <= keep)  # only suffixes go: after the EOS, or what the context cut
        # (R, W), W such that the whole input's width T + W is a multiple of pad_to_multiple_of when it is set
        width = round_up(ids.shape[1] + max(map(len, chunks)), self.sampler.pad_to_multiple_of) - ids.shape[1]
        chunk_ids, chunk_mask = pad(chunks, self.sampler.pad_token_id, side="left", width=width)
        self.cache.batch_select_indices(index)
        input_ids = torch.cat([ids, chunk_ids.to(device)], dim=1)
        attention_mask = torch.cat([mask, chunk_mask.to(device)], dim=1)
        return input_ids, attention_mask, self.cache
