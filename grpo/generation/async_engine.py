"""Asynchronous generation (`async_generation=True`): round k+1 is generated and scored in a background thread while
the trainer trains on round k (docs/vllm.md#asynchronous-generation).

    main thread:   push w0 | train round 0 | push w1 | train round 1 | push w2 | train round 2 ...
    producer:      gen+score round 0 (w0) | gen+score round 1 (w0) | gen+score round 2 (w1) | ...

Three pieces:
- `SharedEngine` wraps the sampler (`GenerationBackend`) with one lock: the producer holds it while the engine
  generates, the trainer while it loads new weights, so a generation never sees half-loaded weights and a load waits
  at most for the generation in flight. It records which weights version (optimizer step) the engine holds, and
  every generation returns the version it used.
- `RoundProducer` runs the producer thread. Round r may be generated with weights of version v only if
  v >= first_step(r) - max_staleness, where first_step(r) is the optimizer step that first trains on it; until then
  it waits for a newer push. So max_staleness=0 generates each round with the weights the synchronous trainer would
  use (no overlap, the same updates), and 1 generates round k+1 with the weights that train round k.
- `PolicyCopyGeneration`: without vLLM, `model.generate` cannot sample while the same weights train, so the producer
  samples from a copy of the policy, refreshed at each push (twice the weights' memory), and reports the copy's
  log-probs of what it sampled: the behaviour policy of a stale round.

The producer never calls a collective operation (gather, broadcast, barrier): those belong to the main thread, which
runs them in the same order on every process. So the producer does only this process's work (its rows, its reward
calls) and the trainer gathers rewards and computes advantages when it takes the round.
"""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from grpo.generation.base import Completions, GenerationBackend, cut_at_eos, limit_for
from grpo.rollout import TokenBatch


@torch.no_grad()
def copy_weights(model: nn.Module, into: nn.Module | None) -> nn.Module:
    """`model`'s current weights in a frozen module of its own: `into` (an earlier copy) overwritten in place, or a
    new copy in eval mode when there is none."""
    if into is None:
        return copy.deepcopy(model).eval().requires_grad_(False)
    for target, source in zip(into.state_dict().values(), model.state_dict().values()):
        target.copy_(source)
    return into


class SharedEngine:
    """A `GenerationBackend` shared by the trainer's main thread and the producer thread (see the module docstring).
    `generate` and `sync_weights` keep the protocol, so evaluation and the synchronous paths use it unchanged."""

    def __init__(self, backend: GenerationBackend, accelerator, background_loads: bool = False):
        self.backend = backend
        self.accelerator = accelerator
        self.lock = threading.Lock()  # held while the engine generates or loads weights
        self.changed = threading.Condition()  # notified when `version` changes
        self.version: int | None = None  # the optimizer step whose weights the engine holds
        self.sync_seconds = 0.0  # time the trainer spent handing over weights, summed (metrics)
        # With `background_loads` (one training process), a load runs in a thread of its own from a copy of the
        # weights, so the trainer goes on training while the engine loads: `snapshot` is that copy, `loader` the
        # thread of the latest load.
        self.background_loads = background_loads
        self.snapshot: nn.Module | None = None
        self.loader: threading.Thread | None = None
        self.load_error: BaseException | None = None

    def close(self) -> None:
        """Close the engine it shares, when that engine holds something to release (a colocated vLLM engine), once
        a load in flight has finished; the next `sync_weights` loads the weights again."""
        if not hasattr(self.backend, "close"):
            return
        if self.loader is not None:
            self.loader.join()
        self.backend.close()
        self.version, self.snapshot = None, None

    def sync_weights(self, model: nn.Module, version: int) -> None:
        """Hand `model`'s weights of step `version` to the engine (main thread, every process, in step). Each process
        first takes its own engine lock and then waits for the others: one server serves every process, so no
        process may still be generating on it while any process loads. With `background_loads` the trainer only
        copies the weights and the load runs in a thread; the first load (which may build the engine) does not."""
        if version == self.version:
            return
        start = time.perf_counter()
        self.wait_for_load()
        if self.background_loads and self.version is not None:
            self._copy_weights(model)
            self.loader = threading.Thread(target=self._load_in_background, args=(version,), daemon=True)
            self.loader.start()
        else:
            self._load(model, version)
        self.sync_seconds += time.perf_counter() - start

    def _load(self, model: nn.Module, version: int) -> None:
        with self.lock:
            if self.accelerator.num_processes > 1:
                self.accelerator.wait_for_everyone()
            self.backend.sync_weights(model, version)
        with self.changed:
            self.version = version
            self.changed.notify_all()

    def _load_in_background(self, version: int) -> None:
        try:
            self._load(self.snapshot, version)
        except BaseException as e:  # raised in the trainer's thread by `wait_for_load` or `RoundProducer.take`
            with self.changed:
                self.load_error = e
                self.changed.notify_all()

    def _copy_weights(self, model: nn.Module) -> None:
        self.snapshot = copy_weights(model, self.snapshot)

    def wait_for_load(self) -> None:
        """Wait for a background load in flight; re-raise its failure."""
        if self.loader is not None:
            self.loader.join()
            self.loader = None
        if self.load_error is not None:
            error, self.load_error = self.load_error, None
            raise RuntimeError(f"Loading the weights into the sampler failed: {error}") from error

    def generate(self, model: nn.Module, prompt_ids: list[list[int]]) -> Completions:
        """The backend's own `generate` (main thread: evaluation), under the lock, after any load in flight."""
        self.wait_for_load()
        with self.lock:
            return self.backend.generate(model, prompt_ids)

    def generate_local(self, model: nn.Module, prompt_ids: list[list[int]], **limit) -> tuple[Completions, int | None]:
        """This process's rows alone, with no collective call (the producer thread), and the weights version used.
        Backends whose `generate` gathers across processes (the server backend) provide `generate_local`. `limit`:
        an episode's turn's `max_new_tokens`, for a backend that takes it."""
        generate = getattr(self.backend, "generate_local", self.backend.generate)
        with self.lock:
            return generate(model, prompt_ids, **limit_for(generate, limit)), self.version


class VersionedSampler:
    """What `sample_rollout` calls in the producer: `SharedEngine.generate_local`, keeping the version it used."""

    def __init__(self, engine: SharedEngine):
        self.engine = engine
        # The weights the engine holds as the round starts: a round that never samples with it (a rollout_func
        # with a sampler of its own) was made at this version.
        self.version: int | None = engine.version

    def generate(
        self, model: nn.Module, prompt_ids: list[list[int]], max_new_tokens: int | None = None
    ) -> Completions:
        limit = {} if max_new_tokens is None else {"max_new_tokens": max_new_tokens}
        completions, self.version = self.engine.generate_local(model, prompt_ids, **limit)
        return completions


class ProducerError(RuntimeError):
    """The producer thread failed; the original error is the cause."""


class RoundProducer:
    """The background thread that makes rounds `first_round, first_round + 1, ...` with `produce(round)`.

    Args:
        engine: the `SharedEngine` whose version gates each round.
        produce: makes round r (in the producer thread): generates through the engine and scores this process's rows.
        first_step: the optimizer step that first trains on round r.
        max_staleness: how many steps the weights of a round may lag `first_step(round)`.
        first_round: the first round to make (after a resume, the next one the trainer needs).
    """

    def __init__(
        self,
        engine: SharedEngine,
        produce: Callable[[int], Any],
        first_step: Callable[[int], int],
        max_staleness: int,
        first_round: int,
    ):
        self.engine = engine
        self.produce = produce
        self.first_step = first_step
        self.max_staleness = max_staleness
        self.next_round = first_round
        self.ready: dict[int, Any] = {}
        self.error: BaseException | None = None
        self.stopped = False
        self.thread = threading.Thread(target=self._run, name="grpo-round-producer", daemon=True)
        self.thread.start()

    def needed_version(self, round_index: int) -> int:
        """The oldest weights version round `round_index` may be generated with."""
        return max(self.first_step(round_index) - self.max_staleness, 0)

    def _run(self) -> None:
        changed = self.engine.changed
        try:
            while True:
                round_index = self.next_round
                need = self.needed_version(round_index)
                with changed:
                    while not self.stopped and (self.engine.version is None or self.engine.version < need):
                        changed.wait()
                    if self.stopped:
                        return
                item = self.produce(round_index)
                with changed:
                    self.ready[round_index] = item
                    self.next_round += 1
                    changed.notify_all()
        except BaseException as e:  # handed to the main thread by `take`
            with changed:
                self.error = e
                changed.notify_all()

    def take(self, round_index: int) -> tuple[Any, float]:
        """Round `round_index` once it is made, and the seconds the caller waited for it. Re-raises a failure of the
        producer in the caller's thread."""
        start = time.perf_counter()
        with self.engine.changed:
            while round_index not in self.ready and self.error is None and self.engine.load_error is None:
                if round_index < self.next_round:
                    raise RuntimeError(f"Round {round_index} was already taken; rounds are taken once, in order.")
                self.engine.changed.wait(timeout=1.0)
            if round_index not in self.ready and self.engine.load_error is not None:
                self.engine.wait_for_load()  # raises the load's error
            if round_index not in self.ready:
                raise ProducerError(f"Generating round {round_index} in the background failed: {self.error}") from (
                    self.error
                )
            return self.ready.pop(round_index), time.perf_counter() - start

    def close(self, timeout: float = 60.0) -> None:
        """Stop making rounds; waits for the one in flight (at most `timeout` seconds)."""
        if self.engine.loader is not None:
            self.engine.loader.join(timeout)
        with self.engine.changed:
            self.stopped = True
            self.engine.changed.notify_all()
        self.thread.join(timeout)


class PolicyCopyGeneration:
    """`model.generate` on a copy of the policy (async generation without vLLM): the trainer updates the policy
    while the copy samples. `sync_weights` copies the policy's tensors in; with `logprobs`, `generate` also returns
    the copy's log-probs of the sampled tokens (the behaviour policy of a stale round).

    Args:
        sampler: the `TransformersGeneration` that samples, called with the copy.
        eos_token_ids, max_completion_length: where completions end (`cut_at_eos`), for the log-probs.
        logprobs: None, or `logprobs(model, batch) -> (B, T)` completion log-probs (the trainer's own function), with
            batch holding prompt_ids, prompt_mask, completion_ids and completion_mask.
        pad_token_id: the padding token of the batch handed to `logprobs`.
    """

    def __init__(self, sampler, eos_token_ids, max_completion_length: int, pad_token_id: int, logprobs=None):
        self.sampler = sampler
        self.eos_token_ids = list(eos_token_ids)
        self.max_completion_length = max_completion_length
        self.pad_token_id = pad_token_id
        self.logprobs = logprobs
        self.copy: nn.Module | None = None

    def sync_weights(self, model: nn.Module, version: int) -> None:
        self.copy = copy_weights(model, self.copy)

    def generate(
        self, model: nn.Module, prompt_ids: list[list[int]], max_new_tokens: int | None = None
    ) -> Completions:
        if self.copy is None:
            raise RuntimeError("call sync_weights before generate: the copy of the policy does not exist yet")
        raw = self.sampler.generate(self.copy, prompt_ids, max_new_tokens=max_new_tokens)
        if self.logprobs is None:
            return raw
        from grpo.data import pad

        ids, _ = cut_at_eos(raw.ids, self.eos_token_ids, self.max_completion_length)
        device = next(self.copy.parameters()).device
        prompt, prompt_mask = pad(prompt_ids, self.pad_token_id, side="left")
        completion, completion_mask = pad(ids, self.pad_token_id, side="right")
        batch = TokenBatch(
            prompt.to(device), prompt_mask.to(device), completion.to(device), completion_mask.to(device)
        )
        with torch.no_grad():
            logps = self.logprobs(self.copy, batch).float().cpu()
        return Completions(raw.ids, [row[: len(r)].tolist() for row, r in zip(logps, ids)])
