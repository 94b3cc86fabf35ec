"""`RoundLoaders`: the data loaders of `GRPOTrainer`, where one loader batch is this process's share of a generation
round (grpo/data/sampler.py): G copies of each prompt, or with offline data whole groups of stored completions."""

from __future__ import annotations

import math

from torch.utils.data import DataLoader, Dataset
from transformers import Trainer

from grpo.data import is_stream
from grpo.data.sampler import (
    RepeatSampler,
    StepSchedule,
    eval_batches,
    eval_sampler,
    step_schedule,
    train_batch_size,
    train_sampler,
)
from grpo.data.stream import EvalStream, RoundRows, round_batches
from grpo.objective.sequence_parallel import gradient_factor

# A stream's "epoch" in micro-steps: Trainer counts a loader without a length as one epoch of max_steps steps, and
# every optimizer step holds gradient_accumulation_steps micro-steps, so none is short.
STREAM_EPOCH = 2**62


class RoundLoaders(Trainer):
    """Trainer's sampler and loader hooks, answered by the repeat sampler. Reads `self.offline_data` (set by
    `GRPOTrainer` before Trainer's constructor): not None means the training set is a data set of groups.

    Under sequence parallelism (accelerate's sp_size) every process still draws and generates its own rows; the
    group pools them once they are scored (grpo/training/rounds.py). So Trainer must not wrap the loader in
    DeepSpeed's Ulysses adapter (which shards each batch's token tensors) nor count its batches sp_size times."""

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        size = self.args.sequence_parallel_size
        if size == 1:
            return
        config, kind = self.accelerator.parallelism_config, str(self.accelerator.distributed_type)
        if kind != "DistributedType.DEEPSPEED" or config is None or config.sp_size != size:
            raise ValueError(
                f"sp_size={size} splits sequences with DeepSpeed's Ulysses attention, which accelerate sets up only "
                f"under DeepSpeed, but this run is {kind}. Launch with a DeepSpeed accelerate config that has a "
                "parallelism_config section (examples/accelerate_configs/deepspeed_ulysses.yaml)."
            )
        gradient_factor(self.accelerator.state.deepspeed_plugin.deepspeed_config, size)  # refused settings: now
        self.accelerator.deepspeed_ulysses_dl_adapter = lambda loader, model: loader  # rows are pooled in rounds

    def get_sp_size(self) -> int:
        """1: each process's loader yields its own rows, one batch per micro-step (class docstring)."""
        return 1

    def get_total_train_batch_size(self, args) -> int:
        """Rows of one optimizer step over all processes: a sequence-parallel group trains one micro-batch."""
        return super().get_total_train_batch_size(args) // args.sequence_parallel_size

    def _get_train_sampler(self, train_dataset=None) -> RepeatSampler:
        dataset = train_dataset if train_dataset is not None else self.train_dataset
        return train_sampler(self.args, len(dataset), groups=self.offline_data is not None)

    def get_train_dataloader(self):
        if self.train_dataset is None:
            raise ValueError("GRPOTrainer: training requires a train_dataset.")
        if is_stream(self.train_dataset):  # rounds read in order (grpo/data/stream.py), not prepared by accelerate
            batches = round_batches(self.args, self.accelerator.process_index, self.accelerator.num_processes)
            return self._loader(RoundRows(self.rounds.stream), batches)
        groups = self.offline_data is not None
        return self._get_dataloader(
            dataset=self.train_dataset,
            description="Training",
            batch_size=train_batch_size(self.args, self.accelerator.num_processes, groups=groups),
            sampler_fn=self._get_train_sampler,
            is_training=True,
        )

    def _get_eval_sampler(self, eval_dataset) -> RepeatSampler:
        return eval_sampler(self.args, len(eval_dataset), self.accelerator.num_processes)

    def get_eval_dataloader(self, eval_dataset: str | Dataset | None = None) -> DataLoader:
        """This process's evaluation batches (`eval_batches`): every prompt, a last shorter batch split among the
        processes by rows. Not prepared by accelerate, whose `even_batches` would fill that batch up with rows from
        the start of the set, evaluated twice; a batch is a list of data set rows, which need no device."""
        if eval_dataset is None and self.eval_dataset is None:
            raise ValueError("GRPOTrainer: evaluation requires an eval_dataset.")
        if isinstance(eval_dataset, str):
            eval_dataset = self.eval_dataset[eval_dataset]
        dataset = self.eval_dataset if eval_dataset is None else eval_dataset
        accelerator, args = self.accelerator, self.args
        if is_stream(dataset):  # a stream's batches, read afresh at each evaluation (grpo/data/stream.py)
            return self._loader(EvalStream(args, dataset, accelerator.process_index, accelerator.num_processes))
        batches = eval_batches(args, len(dataset), accelerator.process_index, accelerator.num_processes)
        return self._loader(dataset, batches)

    def _loader(self, dataset, batch_sampler=None) -> DataLoader:
        """A loader of `dataset` with Trainer's loader settings: batches of rows from `batch_sampler`, or, without
        one, the batches `dataset` yields (a stream's evaluation batches)."""
        args = self.args
        return DataLoader(
            dataset,
            batch_size=None if batch_sampler is None else 1,
            batch_sampler=batch_sampler,
            collate_fn=self.data_collator,
            num_workers=args.dataloader_num_workers,
            pin_memory=args.dataloader_pin_memory,
            persistent_workers=args.dataloader_persistent_workers,
            prefetch_factor=args.dataloader_prefetch_factor,
            multiprocessing_context=args.dataloader_multiprocessing_context,
            in_order=args.dataloader_in_order,
        )

    def planned_steps(self) -> int | None:
        """The optimizer steps of the run, as Trainer counts them: `max_steps`, or `num_train_epochs` epochs of
        `step_schedule.steps_per_epoch` each (rounded up); None for a data set without a length."""
        if self.args.max_steps > 0:
            return self.args.max_steps
        if not hasattr(self.train_dataset, "__len__"):
            return None
        return math.ceil(self.args.num_train_epochs * max(self.step_schedule.steps_per_epoch, 1))

    @property
    def step_schedule(self) -> StepSchedule:
        """Where Trainer's optimizer steps fall among the run's micro-steps (short epoch-end steps included; a
        stream has none)."""
        if is_stream(self.train_dataset):
            return StepSchedule(STREAM_EPOCH, self.args.gradient_accumulation_steps)
        return step_schedule(self.args, len(self.train_dataset))
