"""The round maker's side of asynchronous generation (`async_generation=True`; the mechanism is in
grpo/generation/async_engine.py, the objective in docs/vllm.md#asynchronous-generation).

`AsyncRounds` starts the producer at the first training round, has it make round r from the rows the trainer's loader
will hand this process at that round (`round_indices`), and when the trainer reaches round r hands it over checked:
the same prompts as the loader's batch, weights at most `max_staleness` steps older than the current ones (an older
round is dropped, counted, and made again now), and with the sampler's log-probs when it is stale.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from accelerate.utils import gather

from grpo.data import InputError
from grpo.data.sampler import round_indices
from grpo.generation.async_engine import (
    PolicyCopyGeneration,
    RoundProducer,
    SharedEngine,
    VersionedSampler,
)
from grpo.generation.model_generate import TransformersGeneration
from grpo.rollout import Rollout


def shared_engine(backend, args, accelerator, pad_token_id, eos_token_ids, logprobs) -> SharedEngine:
    """The sampler for async generation: vLLM as it is (loading in the background with one training process);
    `model.generate` on a copy of the policy, with the copy's log-probs when rounds may be stale
    (`logprobs(model, batch)`, the trainer's own function)."""
    sharded = accelerator.distributed_type in ("FSDP", "DEEPSPEED")
    # A vLLM engine loads from a copy of the weights in a thread of its own, when one process owns the engine.
    background = accelerator.num_processes == 1 and not sharded and not isinstance(backend, TransformersGeneration)
    if isinstance(backend, TransformersGeneration):
        if sharded:
            raise InputError(
                "async_generation=True without vLLM samples from a full copy of the policy, which a sharded model "
                "(FSDP, DeepSpeed) does not have on one process. Use vLLM (use_vllm=True), or train synchronously."
            )
        backend = PolicyCopyGeneration(
            backend,
            eos_token_ids,
            args.max_completion_length,
            pad_token_id,
            logprobs=logprobs if args.max_staleness > 0 else None,
        )
    return SharedEngine(backend, accelerator, background_loads=background)


class AsyncRounds:
    """Rounds made ahead by a `RoundProducer` for `rounds`, a `RoundMaker` (rounds.py) whose sampler it wraps in a
    `SharedEngine` (`rounds.generation`). It never sees the trainer: what a round reads of it comes with `take`."""

    def __init__(self, rounds):
        self.rounds, args = rounds, rounds.args
        if rounds.offline_data is not None:
            raise InputError(
                "async_generation=True, but train_dataset holds stored completions (offline training): nothing is "
                "generated. Set async_generation=False."
            )

        def logprobs(model, batch):
            return rounds.logprobs(model, batch, batch_size=args.per_device_train_batch_size)[0]

        pad_id = rounds.tokenizer.pad_token_id
        rounds.generation = shared_engine(
            rounds.generation, args, rounds.accelerator, pad_id, rounds.eos_token_ids, logprobs
        )
        self.per_round = args.micro_steps_per_round
        self.producer: RoundProducer | None = None
        self.context = None  # the RoundContext of the first round taken: the models and state the producer reads

    def first_step(self, round_index: int) -> int:
        """The optimizer step that first trains on round `round_index` (short steps at epoch ends included)."""
        return self.context.schedule.optimizer_step(round_index * self.per_round)

    def produce(self, round_index: int) -> dict[str, Any]:
        """Round `round_index`, generated and scored on this process's rows (in the producer thread)."""
        rounds = self.rounds
        accelerator, dataset = rounds.accelerator, rounds.train_dataset
        indices = round_indices(
            rounds.args, len(dataset), round_index, accelerator.process_index, accelerator.num_processes
        )
        sampler = VersionedSampler(rounds.generation)
        rollout, columns = rounds.sample_round([dataset[i] for i in indices], sampler, self.context)
        scores = rounds.local_scores(rollout, columns, "train", self.context.state)
        return {"rollout": replace(rollout, weights_version=sampler.version), "columns": columns, "scores": scores}

    def take(self, inputs: list[dict], context) -> tuple[Rollout, dict[str, list], Any]:
        """The round that starts at micro-step `context.micro_step`, whose rows the loader gave as `inputs`:
        (rollout, columns, reward scores), this process's rows, not gathered yet."""
        args, round_index = self.rounds.args, context.micro_step // self.per_round
        if self.producer is None:
            self.context = context
            first = self.first_step
            self.producer = RoundProducer(self.rounds.generation, self.produce, first, args.max_staleness, round_index)
        item, waited = self.producer.take(round_index)
        rollout = item["rollout"]
        expected = [row["prompt"] for row in inputs]
        if rollout.prompts != expected:
            raise RuntimeError(
                f"The async producer made round {round_index} from other prompts than the data loader gave "
                f"({rollout.prompts[:1]} against {expected[:1]}). This is a bug in grpo: please report it."
            )
        global_step, dropped = context.state.global_step, 0
        staleness = global_step - rollout.weights_version
        if staleness > args.max_staleness:  # the step count outran first_step's forecast: make it again, now
            dropped, item = rollout.num_rows, self.produce(round_index)
            rollout, staleness = item["rollout"], global_step - item["rollout"].weights_version
        if staleness > 0 and rollout.sampling_logps is None:
            raise RuntimeError(
                f"Round {round_index} was sampled {staleness} step(s) ago and its sampler reported no log-probs, so "
                "the loss has no behaviour policy to correct with. The sampler must return log-probs "
                "(`Completions.logprobs`) under async_generation with max_staleness > 0."
            )
        self._record(staleness, waited, dropped)
        return rollout, item["columns"], item["scores"]

    def _record(self, staleness: int, waited: float, dropped: int) -> None:
        """async/* metrics, over all processes: version lag of the rounds, time the trainer waited, dropped rows."""
        rounds = self.rounds
        device = rounds.accelerator.device
        local = torch.tensor([staleness, waited, dropped, rounds.generation.sync_seconds], device=device)
        everyone = gather(local[None]).reshape(-1, 4)
        window = rounds.metric_windows["train"]
        window.add_mean("async/staleness", everyone[:, 0].mean().item())
        window.add_max("async/staleness_max", everyone[:, 0].max().item())
        window.add_mean("timing/async_wait", everyone[:, 1].max().item())
        window.add_sum("async/dropped_rows", everyone[:, 2].sum().item())
        window.set_last("timing/weight_sync_total", everyone[:, 3].max().item())

    def close(self) -> None:
        if self.producer is not None:
            self.producer.close()
            self.producer = None
