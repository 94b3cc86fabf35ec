"""Streamed data sets (`datasets.IterableDataset`, `load_dataset(..., streaming=True)`, any `torch.utils.data.
IterableDataset`): the rounds of grpo/data/sampler.py, read from a stream in order instead of drawn by index.

Training: `StreamRounds` reads one generation round at a time, `generation_batch_size / G` prompts, the same on every
process (a group may span processes, as with a map-style set). `RoundBatches` hands this process, at every micro-step,
its rows of the round as positions in the stream, each G times; `RoundRows` turns those positions into rows. A round
is read once, when its first micro-step asks for it, and kept for the `steps_per_generation x num_iterations`
micro-steps it feeds:

    2 prompts a round, G = 2, 2 processes, a round feeds 2 micro-steps
    stream a b | c d | ...   process 0: a a | a a | c c | c c ...   process 1: b b | b b | d d | d d ...

When the stream ends, its last rows that do not fill a round are dropped and a new pass starts (`set_epoch(pass)`:
datasets reshuffles), so a run is as long as `max_steps` says. With `shuffle_dataset`, a `datasets.IterableDataset`
is shuffled by its own buffer (`IterableDataset.shuffle(seed, buffer_size=SHUFFLE_BUFFER)`) with the run's seed; a
torch `IterableDataset` is taken in its own order.

A checkpoint holds where the round in progress starts (`StreamRounds.state_dict`): its pass, the rows of that pass
read before it, and, for an unshuffled `datasets.IterableDataset`, the stream's own `state_dict()`, which
`load_state_dict` continues from without reading the rows again. A shuffled stream or a torch one is read again from
the start of its pass up to that row (a shuffle buffer is not in datasets' state, so loading it would not give the
same rows). Either way the resumed run reads what the uninterrupted one read, provided the stream gives the same rows
in the same order each time it is read.

Evaluation (`eval_stream_batches`): the whole stream, in order, in evaluation rounds like `eval_batches`'s, the last
shorter one split among the processes by rows.
"""

from __future__ import annotations

import copy
import hashlib
import itertools
from collections.abc import Iterator
from typing import Any, NamedTuple

import torch

from grpo.data import GOOD_PROMPT, RESERVED_COLUMNS, InputError, prompt_problem
from grpo.data.sampler import eval_round_size, process_share, train_batch_size

SHUFFLE_BUFFER = 1000  # rows in the shuffle buffer: datasets' own default for IterableDataset.shuffle


def is_datasets_stream(dataset: Any) -> bool:
    """Whether `dataset` is a `datasets.IterableDataset` (it has `state_dict` and a buffer `shuffle`)."""
    return all(hasattr(dataset, name) for name in ("state_dict", "load_state_dict", "shuffle", "set_epoch"))


def open_stream(stream: Any, epoch: int, state: dict | None = None) -> tuple[Any, Iterator[dict]]:
    """(the stream read, an iterator over its rows) for pass `epoch`, from its start or, for a
    `datasets.IterableDataset`, from `state` (its `state_dict()`). A datasets stream is copied first: its
    `load_state_dict` and `set_epoch` stay on the copy, never on the user's object."""
    if is_datasets_stream(stream):
        stream = copy.deepcopy(stream)
        stream.set_epoch(epoch)
        if state is not None:
            stream.load_state_dict(state)
    elif hasattr(stream, "set_epoch"):
        stream.set_epoch(epoch)
    return stream, iter(stream)


def check_row(row: Any, name: str, where: str) -> None:
    """A streamed row must be a dict with a usable `prompt` and no reserved column (the checks a map-style set gets
    at construction, `check_prompt_dataset`, made here as rows are read)."""
    if not isinstance(row, dict):
        raise InputError(f"{name} {where} is a {type(row).__name__}, not a dict of columns with a 'prompt'.")
    reserved = [c for c in row if c in RESERVED_COLUMNS]
    if reserved:
        raise InputError(
            f"{name} {where} has column(s) {reserved}, a name the trainer passes to reward functions itself. Rename "
            f"it, e.g. {name}.rename_column({reserved[0]!r}, 'reference_{reserved[0]}')."
        )
    if "prompt" not in row:
        raise InputError(f"{name} {where} has no 'prompt' column (it has {sorted(row)}). Rename your prompt column.")
    problem = prompt_problem(row["prompt"])
    if problem is not None:
        raise InputError(f"{name} {where}: the prompt is {problem}. {GOOD_PROMPT} Filter such rows out of the stream.")


class StreamPosition(NamedTuple):
    """Where a round starts: pass `epoch` of the stream, after `rows` of its rows; `state`, the stream's own
    `state_dict()` there (an unshuffled `datasets.IterableDataset`), else None."""

    epoch: int = 0
    rows: int = 0
    state: dict | None = None


class StreamRounds:
    """The training rounds of a stream (module docstring), read in order: `round(r)` is the `prompts_per_round`
    rows of round r (counted from the start of training), read when first asked for and kept until round r + 1 is."""

    def __init__(self, stream: Any, prompts_per_round: int, shuffle: bool, seed: int, name: str = "train_dataset"):
        shuffled = shuffle and is_datasets_stream(stream)
        self.stream = stream.shuffle(seed=seed, buffer_size=SHUFFLE_BUFFER) if shuffled else stream
        self.prompts_per_round, self.name = prompts_per_round, name
        # An unshuffled datasets stream continues from its state_dict; a shuffle buffer is not in that state.
        self.keeps_state = is_datasets_stream(stream) and not shuffled
        self.next_round, self.start = 0, StreamPosition()  # the round read next, and where it starts
        self.current: tuple[int, StreamPosition, list[dict]] | None = None  # (round, its start, its rows)
        self.live: tuple[Any, Iterator[dict]] | None = None  # the stream being read and its iterator

    def round(self, index: int) -> list[dict]:
        """The rows of round `index`. Asked for an earlier round than the one read (a new `train()` call, or a
        resume with `ignore_data_skip`), the stream is read again from its start."""
        if self.current is not None and self.current[0] == index:
            return self.current[2]
        if index < self.next_round:
            self.next_round, self.start, self.live = 0, StreamPosition(), None
        while self.next_round <= index:
            start, rows = self.read_round()
            self.current = (self.next_round, start, rows)
            self.next_round += 1
        return self.current[2]

    def read_round(self) -> tuple[StreamPosition, list[dict]]:
        """(where it starts, its rows): the next whole round, from a new pass when this one has too few rows left."""
        for _ in range(2):
            start = self.start
            if self.live is None:
                self.live = self.open(start)
            stream, rows = self.live[0], list(itertools.islice(self.live[1], self.prompts_per_round))
            if len(rows) == self.prompts_per_round:
                state = copy.deepcopy(stream.state_dict()) if self.keeps_state else None
                self.start = StreamPosition(start.epoch, start.rows + len(rows), state)
                for i, row in enumerate(rows):
                    check_row(row, self.name, f"row {start.rows + i} (pass {start.epoch + 1})")
                return start, rows
            if start.rows == 0:  # a whole pass, and not one round
                break
            self.start, self.live = StreamPosition(start.epoch + 1), None  # the rest of the pass is dropped
        raise InputError(
            f"{self.name} is a stream of {start.rows + len(rows)} prompts, fewer than one generation round takes "
            f"({self.prompts_per_round}: generation_batch_size / num_generations). Stream more prompts, or lower "
            "per_device_train_batch_size or gradient_accumulation_steps."
        )

    def open(self, start: StreamPosition) -> tuple[Any, Iterator[dict]]:
        """The stream positioned at `start`: from its own state, or read from its pass's start up to `start.rows`."""
        if start.state is not None:
            return open_stream(self.stream, start.epoch, start.state)
        stream, rows = open_stream(self.stream, start.epoch)
        for _ in itertools.islice(rows, start.rows):  # read again, and dropped: what the stopped run trained on
            pass
        return stream, rows

    def fingerprint(self) -> int:
        """A number that differs, almost surely, between two different rounds in progress: what processes compare
        to know they read the same rows."""
        prompts = repr([row["prompt"] for row in self.current[2]]) if self.current else ""
        return int.from_bytes(hashlib.sha256(prompts.encode()).digest()[:7], "little")

    def state_dict(self) -> dict[str, Any]:
        """Where the round in progress starts (the trainer's buffer holds what is left of it), or, before any round,
        the next round's start."""
        index, start = (self.current[0], self.current[1]) if self.current else (self.next_round, self.start)
        return {"round": index, "epoch": start.epoch, "rows": start.rows, "state": start.state}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.next_round, self.current, self.live = state["round"], None, None
        self.start = StreamPosition(state["epoch"], state["rows"], state["state"] if self.keeps_state else None)


class RoundRows(torch.utils.data.Dataset):
    """The loader's view of `StreamRounds`: item `r * prompts_per_round + i` is prompt i of round r. No length."""

    def __init__(self, rounds: StreamRounds):
        self.rounds = rounds

    def __getitem__(self, index: int) -> dict:
        round_index, i = divmod(index, self.rounds.prompts_per_round)
        return self.rounds.round(round_index)[i]


class RoundBatches(torch.utils.data.Sampler):
    """This process's loader batch at every micro-step, as `RoundRows` items: its `rows_per_process` rows of the
    G-fold round (each prompt G times), the round given for each of the `repeat_count` micro-steps it feeds. Endless,
    and it reads nothing: skipping batches (a resume) costs nothing."""

    def __init__(self, prompts_per_round: int, num_generations: int, repeat_count: int, rows: slice):
        self.prompts_per_round, self.num_generations = prompts_per_round, num_generations
        self.repeat_count, self.rows = repeat_count, rows

    def __iter__(self) -> Iterator[list[int]]:
        positions = list(range(self.prompts_per_round * self.num_generations))[self.rows]
        for micro_step in itertools.count():
            first = micro_step // self.repeat_count * self.prompts_per_round
            yield [first + j // self.num_generations for j in positions]


def train_stream(args, stream: Any) -> StreamRounds:
    """The `StreamRounds` of a `GRPOConfig`: rounds of `generation_batch_size / G` prompts, shuffled by the
    stream's buffer with the run's data seed (`data_seed`, else `seed`) when `shuffle_dataset`."""
    seed = args.seed if args.data_seed is None else args.data_seed
    return StreamRounds(stream, args.generation_batch_size // args.num_generations, args.shuffle_dataset, seed)


def round_batches(args, process_index: int, num_processes: int) -> RoundBatches:
    """This process's batches of a training stream: rows `[p * share, (p + 1) * share)` of each G-fold round, as
    `train_sampler` gives with a map-style set."""
    share = train_batch_size(args, num_processes)
    return RoundBatches(
        args.generation_batch_size // args.num_generations,
        args.num_generations,
        args.micro_steps_per_round,
        slice(process_index * share, (process_index + 1) * share),
    )


def eval_stream_batches(args, stream: Any, process_index: int, num_processes: int) -> Iterator[list[dict]]:
    """This process's evaluation batches of a finite stream, as `eval_batches` gives for a map-style set: rounds of
    `per_device_eval_batch_size x processes` rows (whole groups of `args.eval_generations`), the last one shorter
    and split by rows (dropped with `dataloader_drop_last`). Every process reads the whole stream."""
    generations, name = args.eval_generations, "eval_dataset"
    prompts = eval_round_size(args, num_processes) // generations
    _, rows = open_stream(stream, 0)
    count = 0
    while batch := list(itertools.islice(rows, prompts)):
        for i, row in enumerate(batch):
            check_row(row, name, f"row {count + i}")
        count += len(batch)
        if len(batch) < prompts and args.dataloader_drop_last:
            break
        if len(batch) * generations < num_processes:
            raise InputError(
                f"The evaluation stream's last batch holds {len(batch)} prompt(s) x {args.eval_name}={generations} "
                f"rows for {num_processes} processes, and every process needs at least one row (the stream has "
                f"{count} prompts, a batch of all processes takes {prompts}). Stream more or fewer prompts, or set "
                "dataloader_drop_last=True."
            )
        yield process_share([row for row in batch for _ in range(generations)], process_index, num_processes)
    if count == 0 or (args.dataloader_drop_last and count < prompts):
        raise InputError(
            f"The evaluation stream gave {count} prompts, not one evaluation batch ({prompts} prompts"
            f"{' with dataloader_drop_last=True' if count else ''}). Give it prompts, or pass eval_dataset=None."
        )


class EvalStream(torch.utils.data.IterableDataset):
    """The evaluation batches of a stream for this process (`eval_stream_batches`), read afresh at each evaluation."""

    def __init__(self, args, stream: Any, process_index: int, num_processes: int):
        self.args, self.stream, self.process_index, self.num_processes = args, stream, process_index, num_processes

    def __iter__(self) -> Iterator[list[dict]]:
        return eval_stream_batches(self.args, self.stream, self.process_index, self.num_processes)
