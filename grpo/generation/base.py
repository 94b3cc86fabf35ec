"""What every sampler shares: the `GenerationBackend` interface, its `Completions`, and the one rule applied to
whatever a backend returns (`cut_at_eos`).

A backend takes prompt token ids (one list per row; each prompt's G copies are consecutive) and returns raw
completion token ids per row, and the log-probs the sampler gave those tokens when it has them (a vLLM engine does;
`model.generate` does not, as they would equal the trainer's own). `cut_at_eos` then applies the rule the method
fixes (docs/method.md): a completion ends at its first end-of-sequence token, which stays in the loss; one that
never emits it is *truncated*. This module imports nothing of the package, so every backend can import it.

Every sampler draws its random numbers from the trainer's own stream, `SamplingRNG`, not from torch's default
generators: those belong to the whole process, and a reward function, a tool or a callback that calls
`torch.manual_seed(0)` would otherwise make every later round draw the same numbers.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator, Sequence
from typing import NamedTuple, Protocol

import torch
from torch import nn


class Completions(NamedTuple):
    ids: list[list[int]]  # one completion per prompt row; anything after its first EOS is ignored
    logprobs: list[list[float]] | None = None  # the sampler's log-prob of each token of `ids`, if it reports them


class GenerationBackend(Protocol):
    def generate(self, model: nn.Module, prompt_ids: list[list[int]]) -> Completions:
        """Sample one completion per row of `prompt_ids` (each prompt's G copies are consecutive rows). A backend
        whose `generate` also takes `max_new_tokens` (the built-in ones) is asked for no more than an episode's turn
        has left of its budget (`limit_for`); any other samples up to its own length, and the turn is cut."""
        ...

    def sync_weights(self, model: nn.Module, version: int) -> None:
        """Make the sampler use `model`'s current weights, tagged `version` (the optimizer step); called by every
        process before each generation, it does nothing when the weights of `version` are already there."""
        ...


class SamplingRNG:
    """The random stream a sampler draws from: `torch.Generator`s of its own, on the CPU and on `device` (an
    accelerator's), seeded with `seed`, that only sampling advances.

    `model.generate` takes no generator: it draws from torch's default ones. `as_default()` makes this stream the
    default for the length of a call (and puts the process's own state back afterwards), so code run between calls
    (reward functions, tools, callbacks) can reseed or draw from torch's default generators without moving it.
    vLLM backends draw their request seeds from it (`request_seed`). The trainer saves `state_dict()` in every
    checkpoint, so a resumed run samples what the uninterrupted one would.

    Not thread-safe: torch's default generators are process-wide, so a thread drawing from them while another
    thread is inside `as_default()` draws from (and advances) this stream, and the exit then puts back the state the
    other thread had at entry."""

    def __init__(self, seed: int, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.cpu = torch.Generator().manual_seed(seed)
        # The device's generator (cuda, xpu, mps): what `model.generate` draws from when the model is there.
        self.on_device = None if self.device.type == "cpu" else torch.Generator(self.device).manual_seed(seed)

    @contextlib.contextmanager
    def as_default(self) -> Iterator[None]:
        """Within the block, torch's default generators (the CPU's and the device's) are this stream; afterwards the
        stream keeps what was drawn, and the default generators are as they were before the block."""
        module = None if self.on_device is None else torch.get_device_module(self.device)
        saved = (torch.get_rng_state(), module.get_rng_state(self.device) if module else None)
        torch.set_rng_state(self.cpu.get_state())
        if module:
            module.set_rng_state(self.on_device.get_state(), self.device)
        try:
            yield
        finally:
            self.cpu.set_state(torch.get_rng_state())
            torch.set_rng_state(saved[0])
            if module:
                self.on_device.set_state(module.get_rng_state(self.device))
                module.set_rng_state(saved[1], self.device)

    def request_seed(self) -> int:
        """A seed for one request to a sampler that takes seeds (vLLM), drawn from this stream."""
        return int(torch.randint(2**31 - 1, (), generator=self.cpu))

    def state_dict(self) -> dict[str, torch.Tensor]:
        state = {"cpu": self.cpu.get_state()}
        if self.on_device is not None:
            state["device"] = self.on_device.get_state()
        return state

    def load_state_dict(self, state: dict[str, torch.Tensor] | None) -> None:
        """Continue the stream `state_dict()` saved (its tensors may have been moved to any device); None (a
        checkpoint written before the sampler had a stream of its own) leaves it as it is."""
        if state is None:
            return
        self.cpu.set_state(state["cpu"].cpu())
        if self.on_device is not None and "device" in state:
            self.on_device.set_state(state["device"].cpu())


def limit_for(generate: Callable, limit: dict) -> dict:
    """`limit` ({"max_new_tokens": n} or {}) when `generate` takes `max_new_tokens`, else {}: a backend of the user's,
    or a test's, written to the plain `generate(model, prompt_ids)`, is called as it was written."""
    return limit if "max_new_tokens" in inspect.signature(generate).parameters else {}


def request_seed(rng: SamplingRNG | None) -> int:
    """A seed for one vLLM request: from the trainer's sampling stream, or without one from torch's default CPU
    generator (a backend used on its own)."""
    return rng.request_seed() if rng is not None else int(torch.randint(2**31 - 1, ()))


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


@torch.no_grad()
def policy_logprobs(model, prompt_ids: list[list[int]], completion_ids: list[list[int]], temperature: float):
    """The log-prob of each completion token under `model` at `temperature`, one forward pass per row (a sampler
    that reports none, such as `model.generate`): log softmax(logits / temperature) at the token, per row a list."""
    device, was_training = next(model.parameters()).device, model.training
    model.eval()  # no dropout: the log-probs of the policy that sampled
    try:
        out = []
        for prompt, ids in zip(prompt_ids, completion_ids):
            if not ids:
                out.append([])
                continue
            inputs = torch.tensor([prompt + ids], device=device)
            logits = model(input_ids=inputs).logits[0, len(prompt) - 1 : -1].float() / temperature  # (T, V)
            picked = torch.tensor(ids, device=device)[:, None]
            out.append(logits.log_softmax(-1).gather(-1, picked)[:, 0].tolist())
        return out
    finally:
        model.train(was_training)
