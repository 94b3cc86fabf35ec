"""`ContinuousBatchingGeneration`: sampling with transformers' own continuous-batching engine
(`use_transformers_continuous_batching`, TRL's name), beside the default `model.generate`.

transformers' `ContinuousBatchingManager` keeps the KV cache in pages, schedules requests in a thread of its own and
feeds it every row's next token in one flat batch: no left padding, and a finished row leaves the batch at once
instead of being carried to the longest row's end. Rows whose prompts share a prefix (the G copies of a prompt) share
its cache pages. What it returns is what `model.generate` returns: each row's sampled tokens, up to and including the
first EOS (`cut_at_eos` applies as for every backend), from the policy's live weights.

Three choices differ from a plain `model.generate_batch(...)` call:
- The cache is sized for the round (every row's prompt plus `max_completion_length`, all rows at once) unless
  `transformers_continuous_batching_config` sets `num_blocks` or `max_memory_percent`: transformers otherwise sizes
  it from free memory, which on a CPU means tens of GB of zeroed host memory per round.
- Every request is queued before the engine's thread starts, so which rows share a forward pass, and so the order of
  the random draws, does not depend on thread timing: the same seed samples the same completions.
- The engine seeds torch's default generators itself (`torch.manual_seed`), once per round. The seed comes from the
  trainer's sampling stream (`SamplingRNG`), and the engine runs with that stream as torch's default, so the
  process's own generators are untouched and a checkpoint resumes the stream. The draws themselves are the engine's:
  the same seed gives other completions than `model.generate` would.
"""

from __future__ import annotations

import contextlib
import copy
import math

import torch
from torch import nn

from grpo.generation.base import Completions, request_seed
from grpo.generation.model_generate import TransformersGeneration

# Logits processors transformers does not mark as supported by continuous batching that read only each row's own
# scores, so they are right there too.
ROW_LOCAL_PROCESSORS = {"MinPLogitsWarper"}

# Tokens per cache page when the settings do not say: transformers' 256 would give a 40-token completion a page six
# times its size, and the engine's attention reads every page of the cache.
PAGE_SIZE = 32


class ContinuousBatchingGeneration(TransformersGeneration):
    """Samples with the policy's own weights through `ContinuousBatchingManager` (transformers >= 5.8).

    Takes `TransformersGeneration`'s arguments (its `sampling` settings, or their fields), plus `settings`: keyword
    arguments of `transformers.generation.ContinuousBatchingConfig` (GRPOConfig's
    `transformers_continuous_batching_config`)."""

    def __init__(self, *, settings: dict | None = None, **kwargs):
        super().__init__(**kwargs)
        self.settings = dict(settings or {})

    def turns(self) -> ContinuousBatchingGeneration:
        """The sampler of an episode's turns (grpo/generation/episodes.py): each turn is a batch of its own, whose
        rows share the pages of their common prefixes; no cache is carried from one turn to the next."""
        return self

    @torch.no_grad()
    def generate(
        self, model: nn.Module, prompt_ids: list[list[int]], max_new_tokens: int | None = None
    ) -> Completions:
        """`max_new_tokens`: at most that many tokens per row (an episode's turn; None: `max_completion_length`)."""
        if not prompt_ids:
            return Completions([])
        from transformers.generation import ContinuousBatchingConfig

        generation_config = copy.deepcopy(self.generation_config)
        if max_new_tokens is not None:
            generation_config.max_new_tokens = min(max_new_tokens, generation_config.max_new_tokens)
        max_new = generation_config.max_new_tokens
        config = ContinuousBatchingConfig(**round_settings(self.settings, prompt_ids, max_new, request_seed(self.rng)))
        was_training = model.training
        try:
            with self._drawing(model):
                return Completions(run_requests(model, generation_config, config, prompt_ids))
        finally:
            model.train(was_training)  # the engine puts the model in eval mode and leaves it there

    def _drawing(self, model: nn.Module) -> contextlib.AbstractContextManager:
        """The trainer's stream as torch's default generators; without one, the process's generators restored after
        the engine reseeds them."""
        if self.rng is not None:
            return self.rng.as_default()
        device = next(model.parameters()).device
        return torch.random.fork_rng(devices=[device] if device.type != "cpu" else [], device_type=device.type)


def round_settings(settings: dict, prompt_ids: list[list[int]], max_new_tokens: int, seed: int) -> dict:
    """`ContinuousBatchingConfig` keyword arguments for one round: the user's `settings`, and where they do not say,
    a cache of pages enough for every row at once (prompt plus `max_new_tokens`), every row in one batch, and the
    logits processors kept (`run_requests` refuses those the engine cannot apply). `seed`: the round's seed."""
    rounded = {"page_size": PAGE_SIZE, **settings, "seed": seed, "drop_unsupported_processors": False}
    page = rounded["page_size"]
    if rounded.get("num_blocks") is None and rounded.get("max_memory_percent") is None:
        rounded["num_blocks"] = sum(math.ceil((len(ids) + max_new_tokens) / page) for ids in prompt_ids)
    rounded.setdefault("max_requests_per_batch", len(prompt_ids))
    # One forward pass prefills at most this many tokens; every row must fit in a decoding step.
    rounded.setdefault("max_batch_tokens", max(len(prompt_ids), min(sum(map(len, prompt_ids)), 2048)))
    return rounded


def run_requests(model: nn.Module, generation_config, config, prompt_ids: list[list[int]]) -> list[list[int]]:
    """Each row's generated tokens, through a `ContinuousBatchingManager` that lives for this call. Every request is
    queued before the engine's thread starts (a fixed schedule, so a fixed order of draws); a request or an engine
    that fails raises instead of returning fewer rows."""
    manager = model.init_continuous_batching(generation_config=generation_config, continuous_batching_config=config)
    try:
        refuse_unsupported_processors(manager.logit_processor.logits_processor)
        request_ids = manager.add_requests(prompt_ids, max_new_tokens=generation_config.max_new_tokens)
        manager.start()
        results = {}
        while len(results) < len(request_ids):
            result = manager.get_result(timeout=1)
            if result is None:
                error = manager.background_thread_status.fatal_error
                if error is not None or not manager.is_running():
                    raise RuntimeError(f"transformers' continuous-batching engine stopped: {error!r}") from error
            elif result.is_finished():
                if result.error is not None:
                    raise RuntimeError(f"continuous batching failed on request {result.request_id}: {result.error}")
                results[result.request_id] = list(result.generated_tokens)
    finally:
        manager.stop(block=True)
        manager.destroy()
    return [results[request_id] for request_id in request_ids]


def refuse_unsupported_processors(processors) -> None:
    """Raise unless every logits processor the sampling settings asked for is one the engine can apply: those
    transformers marks as supported by continuous batching, and min-p, which reads only a row's own scores. The
    engine shows a processor only each row's last token, so one that needs the row's history (a repetition penalty,
    n-gram blocking) would be wrong; transformers would drop the ones it knows of with a warning and run the rest."""
    wrong = [
        type(p).__name__
        for p in processors
        if not getattr(p, "supports_continuous_batching", None) and type(p).__name__ not in ROW_LOCAL_PROCESSORS
    ]
    if wrong:
        raise ValueError(
            f"use_transformers_continuous_batching: transformers' engine cannot apply {', '.join(wrong)} "
            "(asked for by the sampling settings or generation_kwargs). Remove that setting, or set "
            "use_transformers_continuous_batching=False to sample with model.generate."
        )
