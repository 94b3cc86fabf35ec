"""A streamed training set and a streamed evaluation set on 2 processes (tests/test_streaming.py).

    accelerate launch --config_file tests/configs/accelerate_cpu_2proc.yaml tests/helpers/stream_two_processes.py OUT

Trains 3 steps on a stream of 10 prompts (rounds of 4 prompts, G = 2: each process generates for 2 of them), recording
the prompts each process's rows held at every round, then evaluates 7 streamed held-out prompts
(`eval_two_processes.evaluate`), then starts training on a stream that gives each process other rows, which must be
refused. Process 0 saves the three results to OUT."""

import sys

import torch
from accelerate.utils import gather_object
from datasets import IterableDataset

from grpo import GRPOConfig, GRPOTrainer
from grpo.data import InputError
from grpo.testing import tiny_model, tiny_tokenizer
from tests.helpers.eval_two_processes import evaluate
from tests.helpers.net import end_launched_process
from tests.helpers.scripted import TINY, ScriptedGeneration, reward_len

# Rounds of 8 rows (4 per process), G = 2: 4 prompts a round, so 10 prompts make 2 rounds a pass and 2 left over.
SETTINGS = dict(num_generations=2, per_device_train_batch_size=4, max_steps=3, seed=3)


def questions(count: int = 10):
    for i in range(count):
        yield {"prompt": f"Question {i}"}


def train(output_dir: str) -> list[list[list[str]]]:
    """For each process, the prompts of its rows at every round (a list per round)."""
    tokenizer, rounds = tiny_tokenizer(), []

    def record(prompts, completions):
        rounds.append(list(prompts))
        return [float(len(c)) for c in completions]

    args = GRPOConfig(output_dir=output_dir, **{**TINY, **SETTINGS})
    stream = IterableDataset.from_generator(questions)
    trainer = GRPOTrainer(tiny_model(tokenizer), record, args=args, train_dataset=stream, processing_class=tokenizer)
    trainer.generation = ScriptedGeneration(2, 8)
    trainer.train()
    return gather_object([rounds])


def process_questions(rank: int):
    """A stream that differs between processes (as a queue or an unseeded shuffle would)."""
    for i in range(10):
        yield {"prompt": f"Question {i} for process {rank}"}


def mismatched(output_dir: str) -> str:
    """The error training on `process_questions` raises, on this process."""
    tokenizer = tiny_tokenizer()
    args = GRPOConfig(output_dir=output_dir, **{**TINY, **SETTINGS})
    rank = torch.distributed.get_rank()
    stream = IterableDataset.from_generator(process_questions, gen_kwargs={"rank": rank})
    trainer = GRPOTrainer(
        tiny_model(tokenizer), reward_len, args=args, train_dataset=stream, processing_class=tokenizer
    )
    trainer.generation = ScriptedGeneration(2, 8)
    try:
        trainer.train()
    except InputError as e:
        return str(e)
    return "trained"


if __name__ == "__main__":
    out_file = sys.argv[1]
    result = {"train": train(f"{out_file}.train"), "eval": evaluate(f"{out_file}.eval", "dapo", stream=True)}
    result["mismatched"] = gather_object([mismatched(f"{out_file}.mismatched")])
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        torch.save(result, out_file)
    end_launched_process()
