"""What every sampler shares: the `GenerationBackend` interface, its `Completions`, and the one rule applied to
whatever a backend returns (`cut_at_eos`).

A backend takes prompt token ids (one list per row; each prompt's G copies are consecutive) and returns raw
completion token ids per row, and the log-probs the sampler gave those tokens when it has them (a vLLM engine does;
`model.generate` does not, as they would equal the trainer's own). `cut_at_eos` then applies the rule the method
fixes (docs/method.md): a completion ends at its first end-of-sequence token, which stays in the loss; one that
never emits it is *truncated*. This module imports nothing of the package, so every backend can import it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, Protocol

from torch import nn


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


def equal_runs(rows: Sequence[Sequence[int]]) -> list[tuple[list[int], int]]:
    """Maximal runs of equal consecutive rows, as (row, length): [a, a, a, b, b, a] -> [(a, 3), (b, 2), (a, 1)]."""
    runs: list[tuple[list[int], int]] = []
    for row in rows:
        if runs and runs[-1][0] == list(row):
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((list(row), 1))
    return runs


def vllm_sampling(max_completion_length, temperature, top_p, top_k, min_p, repetition_penalty) -> dict:
    """The trainer's sampling settings under vLLM's names (min_p None means 0: off)."""
    return {
        "max_tokens": max_completion_length,
        "temperature": temperature,
        "top_p": top_p,
        "top_k": top_k,
        "min_p": min_p or 0.0,
        "repetition_penalty": repetition_penalty,
    }
