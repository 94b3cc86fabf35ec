"""The sampler that turns a prompt dataset into GRPO generation rounds.

One generation round needs `prompts_per_round` distinct prompts, each repeated G times consecutively (a group). The
trainer's data loader yields, per process, that process's share of a whole round at every micro-step; the round is
only *used* at the first of the `steps_per_generation x num_iterations` micro-steps it feeds (the rest come from the
trainer's buffer), so the sampler repeats each round that many times. This keeps `len(dataloader)` equal to the
number of micro-steps, which is what `transformers.Trainer` counts for epochs, scheduling and resuming.

    prompts_per_round=2, G=3, repeat_count=2, permutation [4, 1, 0, 3]
    ->  4 4 4 1 1 1 | 4 4 4 1 1 1 | 0 0 0 3 3 3 | 0 0 0 3 3 3
        round 1       (replayed)    round 2       (replayed)

Every process builds the same permutation from `seed + epoch`, and accelerate hands batch k to process
k % num_processes, so all loaders stay in step and a group may span processes (rewards are gathered before the
group statistics). In training a last incomplete round is dropped so that every round is whole; evaluation keeps it
(`keep_last`) and evaluates every prompt.
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch.utils.data import Sampler

from grpo.data import InputError, is_stream


class RepeatSampler(Sampler[int]):
    def __init__(
        self,
        num_samples: int,
        num_generations: int,
        prompts_per_round: int,
        repeat_count: int = 1,
        shuffle: bool = True,
        seed: int = 0,
        keep_last: bool = False,
    ):
        if num_samples < prompts_per_round:
            raise ValueError(
                f"The dataset has {num_samples} prompts but one generation round needs {prompts_per_round} "
                "(generation_batch_size / num_generations). Use more prompts or a smaller generation batch."
            )
        self.num_samples = num_samples
        self.num_generations = num_generations
        self.prompts_per_round = prompts_per_round
        self.repeat_count = repeat_count
        self.shuffle = shuffle
        self.seed = seed
        self.keep_last = keep_last  # a last, shorter round of the prompts left over (evaluation), else dropped
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Called by the trainer at each epoch: a new, still deterministic, order of prompts."""
        self.epoch = epoch

    def __len__(self) -> int:
        prompts = (
            self.num_samples if self.keep_last else self.num_samples // self.prompts_per_round * self.prompts_per_round
        )
        return prompts * self.num_generations * self.repeat_count

    def __iter__(self) -> Iterator[int]:
        if self.shuffle:
            generator = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.num_samples, generator=generator).tolist()
        else:
            order = list(range(self.num_samples))
        num_rounds = (
            -(-self.num_samples // self.prompts_per_round)
            if self.keep_last
            else self.num_samples // self.prompts_per_round
        )
        for r in range(num_rounds):
            round_prompts = order[r * self.prompts_per_round : (r + 1) * self.prompts_per_round]
            for _ in range(self.repeat_count):
                for index in round_prompts:
                    yield from [index] * self.num_generations


def train_sampler(args, num_samples: int, groups: bool = False) -> RepeatSampler:
    """The training order for a `GRPOConfig`: rounds of `generation_batch_size / G` prompts, each repeated for the
    `steps_per_generation x num_iterations` micro-steps it feeds. With `groups` the samples are stored groups of
    completions (offline data, grpo/data/offline.py), drawn once each per round instead of G times."""
    return RepeatSampler(
        num_samples=num_samples,
        num_generations=1 if groups else args.num_generations,
        prompts_per_round=args.generation_batch_size // args.num_generations,
        repeat_count=args.micro_steps_per_round,
        shuffle=args.shuffle_dataset,
        seed=args.seed if args.data_seed is None else args.data_seed,  # TrainingArguments' seed of the data order
    )


def train_batch_size(args, num_processes: int, groups: bool = False) -> int:
    """One process's loader batch: its rows of a round (per_device_train_batch_size x steps_per_generation, divided
    by sp_size under sequence parallelism), or with `groups` (offline data) its whole groups of a round, the round's
    `generation_batch_size / G` groups split evenly so that no group spans two processes."""
    if not groups:
        return args.generation_batch_size // num_processes
    count = args.generation_batch_size // args.num_generations
    if count % num_processes != 0:
        raise ValueError(
            f"Training on stored completions gives each process whole groups, but a round has {count} groups "
            f"(generation_batch_size / num_generations) for {num_processes} processes. Make it a multiple, e.g. by "
            "raising per_device_train_batch_size or gradient_accumulation_steps."
        )
    return count // num_processes


def eval_round_size(args, num_processes: int) -> int:
    """The rows of one evaluation round (batch k of every process together): `per_device_eval_batch_size x
    processes`, which must be whole groups of `args.eval_generations` (`num_generations_eval`, or G) rows."""
    rows, generations, name = args.per_device_eval_batch_size * num_processes, args.eval_generations, args.eval_name
    if rows % generations != 0:
        raise InputError(
            f"per_device_eval_batch_size x processes = {rows} is not a multiple of {name}={generations}: each "
            f"evaluation batch must hold whole groups. Change per_device_eval_batch_size or {name}."
        )
    return rows


def eval_round_rows(args, num_samples: int, num_processes: int) -> int:
    """The rows of one evaluation round (`eval_round_size`). Checks that the set of `num_samples` prompts can be
    evaluated: it is not empty, and the last round, which holds the prompts left over and may be shorter, gives every
    process at least one row (or, with `dataloader_drop_last`, is dropped, and one whole round remains)."""
    rows, generations, name = eval_round_size(args, num_processes), args.eval_generations, args.eval_name
    if num_samples == 0:
        raise InputError("The evaluation set is empty. Give it prompts, or pass eval_dataset=None to skip evaluation.")
    prompts = rows // generations
    left = num_samples % prompts  # the prompts of a last, shorter round
    if args.dataloader_drop_last and num_samples < prompts:
        raise InputError(
            f"The evaluation set has {num_samples} prompts, fewer than one evaluation batch takes ({prompts}: "
            f"per_device_eval_batch_size x processes / {name} = {rows} / {generations}), and "
            "dataloader_drop_last=True drops that shorter batch, leaving nothing to evaluate. Set "
            f"dataloader_drop_last=False (a shorter last batch is evaluated), or lower per_device_eval_batch_size."
        )
    if left and left * generations < num_processes and not args.dataloader_drop_last:
        raise InputError(
            f"The evaluation set's last batch holds {left} prompt(s) x {name}={generations} = "
            f"{left * generations} rows for {num_processes} processes, and every process needs at least one row "
            f"(the set has {num_samples} prompts, a batch of all processes takes {prompts}). Add or drop prompts so "
            f"that the last batch holds at least {num_processes} rows, or raise {name}."
        )
    return rows


def eval_sampler(args, num_samples: int, num_processes: int) -> RepeatSampler:
    """The evaluation order: every prompt once, in order, `args.eval_generations` times, in rounds of whole groups
    (`eval_round_rows`, which checks the set); a last, shorter round is kept unless `dataloader_drop_last`."""
    prompts = eval_round_rows(args, num_samples, num_processes) // args.eval_generations
    return RepeatSampler(
        num_samples=num_samples,
        num_generations=args.eval_generations,
        prompts_per_round=min(prompts, num_samples),
        shuffle=False,
        keep_last=not args.dataloader_drop_last,
    )


def eval_batches(args, num_samples: int, process_index: int, num_processes: int) -> list[list[int]]:
    """This process's evaluation batches, as row indices: batch k of every process is evaluation round k
    (`eval_sampler`'s order), `per_device_eval_batch_size` rows each; the last round, when shorter, is split as
    evenly as its rows allow (process shares differ by at most one row), so no process is given rows twice.

        7 prompts, G_eval = 1, 2 processes x 2 rows:  process 0: [0, 1] [4]    process 1: [2, 3] [5, 6]

    (With 5 prompts the last round's one row cannot feed both processes: `eval_round_rows` refuses it.)
    """
    rows = eval_round_rows(args, num_samples, num_processes)
    order = list(eval_sampler(args, num_samples, num_processes))
    return [
        process_share(order[start : start + rows], process_index, num_processes)
        for start in range(0, len(order), rows)
    ]


def process_share(round_rows: list, process_index: int, num_processes: int) -> list:
    """This process's part of an evaluation round's rows: equal parts, or as even as a shorter round allows (parts
    differ by at most one row), in process order."""
    bounds = [p * len(round_rows) // num_processes for p in range(num_processes + 1)]
    return round_rows[bounds[process_index] : bounds[process_index + 1]]


def check_dataset_sizes(args, train_dataset, eval_dataset, groups: bool = False) -> None:
    """Enough prompts (or, with `groups`, stored groups) in `train_dataset` for one training round, and in
    `eval_dataset` (a data set or a dict of them) for evaluation (`eval_round_rows`): checked when the trainer is
    built, not at `train()` or at the first evaluation, hours later. A stream's length is unknown: its settings are
    checked instead (`check_stream_settings`), its rows as they are read (grpo/data/stream.py)."""
    if is_stream(train_dataset):
        check_stream_settings(args, train_dataset, "train_dataset")
    elif train_dataset is not None:
        train_sampler(args, len(train_dataset), groups=groups)
    for held_out in eval_dataset.values() if isinstance(eval_dataset, dict) else [eval_dataset]:
        if is_stream(held_out):
            check_stream_settings(args, held_out, "eval_dataset")
            eval_round_size(args, args.world_size)
        elif held_out is not None:
            warn_short_eval_batch(args, len(held_out), eval_round_rows(args, len(held_out), args.world_size))


def check_stream_settings(args, stream, name: str) -> None:
    """What a streamed `train_dataset` or `eval_dataset` needs of the config: `max_steps` (no length, so no epochs
    to count the run in), the rows read in this process (no loader workers, which would each read the stream), and
    for training none of the features that draw prompts by index; a torch stream, which cannot be shuffled, is
    warned about."""
    kind = type(stream).__name__
    if args.dataloader_num_workers:
        raise InputError(
            f"{name} is a stream ({kind}) and dataloader_num_workers={args.dataloader_num_workers}: a stream is read "
            "in order in the training process, so that its position can be saved in checkpoints (each worker would "
            "read it again). Set dataloader_num_workers=0."
        )
    if name != "train_dataset":
        return
    if args.max_steps <= 0:
        raise InputError(
            f"train_dataset is a stream ({kind}, no length), so num_train_epochs={args.num_train_epochs} cannot say "
            "how long to train: set max_steps, the number of optimizer steps (a stream that ends is read again, in a "
            "new pass)."
        )
    for flag, what in (
        ("async_generation", "reads rounds ahead by index"),
        ("dynamic_sampling", "draws extra prompts by index"),
    ):
        if getattr(args, flag):
            raise InputError(
                f"{flag}=True {what}, which a stream ({kind}) cannot give. Set {flag}=False, or load the data set "
                "without streaming=True."
            )
    if args.shuffle_dataset and not hasattr(stream, "shuffle"):
        warnings.warn(
            f"train_dataset is a {kind}, which has no shuffle buffer: its rows are taken in its own order "
            "(shuffle_dataset=True cannot shuffle it). Shuffle it yourself, or set shuffle_dataset=False to say so.",
            stacklevel=4,
        )


def warn_short_eval_batch(args, num_samples: int, rows: int) -> None:
    """One warning, when the trainer is built, for an evaluation set whose last batch of `rows`-row rounds is
    shorter: it is evaluated, its metrics counting by the rows it holds, or dropped with `dataloader_drop_last`."""
    prompts = rows // args.eval_generations
    left = num_samples % prompts
    if left:
        what = (
            "dropped (dataloader_drop_last=True): those prompts are not evaluated"
            if args.dataloader_drop_last
            else "evaluated, and each batch's metrics count by the rows it holds"
        )
        warnings.warn(
            f"The evaluation set's {num_samples} prompts make {num_samples // prompts} evaluation batch(es) of "
            f"{prompts} prompts (per_device_eval_batch_size x processes / {args.eval_name} = {rows} / "
            f"{args.eval_generations}) and a last, shorter one of {left}, which is {what}.",
            stacklevel=4,
        )


@dataclass(frozen=True)
class StepSchedule:
    """Where `transformers.Trainer` puts its optimizer steps among a run's micro-steps (counted over the whole run).

    Trainer cuts each epoch (the loader's `micro_steps_per_epoch` batches) into optimizer steps of `accumulation`
    micro-steps; when the epoch is not a multiple, its last step is short, and the next epoch starts a new step:

        8 micro-steps per epoch, accumulation 3:   0 1 2 | 3 4 5 | 6 7 || 8 9 10 | 11 12 13 | 14 15 || ...

    Every epoch has the same length and starts a new generation round (the sampler's rounds do not cross epochs),
    so a micro-step's place in its round and in its optimizer step both follow from its run-wide index.
    """

    micro_steps_per_epoch: int
    accumulation: int

    @property
    def steps_per_epoch(self) -> int:
        return -(-self.micro_steps_per_epoch // self.accumulation)

    def steps_left(self, micro_step: int) -> int:
        """Micro-steps from `micro_step` (included) to the end of its optimizer step."""
        within = micro_step % self.micro_steps_per_epoch
        return min(self.accumulation - within % self.accumulation, self.micro_steps_per_epoch - within)

    def optimizer_step(self, micro_step: int) -> int:
        """The optimizer steps completed when `micro_step` is trained (Trainer's `global_step` then)."""
        epoch, within = divmod(micro_step, self.micro_steps_per_epoch)
        return epoch * self.steps_per_epoch + within // self.accumulation

    def first_micro_step(self, optimizer_step: int) -> int:
        """The first micro-step trained after `optimizer_step` optimizer steps: where a resumed run continues."""
        epoch, within = divmod(optimizer_step, self.steps_per_epoch)
        return epoch * self.micro_steps_per_epoch + within * self.accumulation


def step_schedule(args, num_samples: int) -> StepSchedule:
    """The `StepSchedule` of training a `GRPOConfig` on `num_samples` prompts (or stored groups): one epoch is its
    whole rounds, each feeding `steps_per_generation x num_iterations` micro-steps, which is `len(dataloader)` on
    every process."""
    rounds = num_samples // (args.generation_batch_size // args.num_generations)
    return StepSchedule(rounds * args.micro_steps_per_round, args.gradient_accumulation_steps)


def round_indices(args, num_samples: int, round_index: int, process_index: int, num_processes: int) -> list[int]:
    """The dataset indices of this process's rows of training round `round_index` (counted from the start of
    training, across epochs): what the trainer's loader hands this process at that round's first micro-step. The
    asynchronous producer (grpo/generation/async_engine.py) reads rounds ahead of the loader with it."""
    sampler = train_sampler(args, num_samples)
    rounds_per_epoch = num_samples // sampler.prompts_per_round
    epoch, within = divmod(round_index, rounds_per_epoch)
    sampler.set_epoch(epoch)
    sampler.repeat_count = 1
    rows = list(itertools.islice(iter(sampler), within * args.generation_batch_size, None))
    rows = rows[: args.generation_batch_size]
    share = args.generation_batch_size // num_processes
    return rows[process_index * share : (process_index + 1) * share]
