"""Evaluation of 7 held-out prompts, one completion each, 2 rows a process in a batch: with 2 processes, a batch of 4
rows and a last one of 3, split 1 / 2. Saves the evaluation metrics and every prompt scored, on all processes.

    accelerate launch --config_file tests/configs/accelerate_cpu_2proc.yaml tests/helpers/eval_two_processes.py OUT

tests/test_distributed.py runs it on 2 processes and compares with 1 process (batches of 2, 2, 2 and 1 rows)."""

import sys

import torch
from accelerate.utils import gather_object
from datasets import Dataset, IterableDataset

from grpo import GRPOConfig, GRPOTrainer
from grpo.testing import tiny_model, tiny_tokenizer
from tests.helpers.net import end_launched_process
from tests.helpers.scripted import TINY, ScriptedGeneration

# Timings differ from run to run; every other metric must be the same with 1 and 2 processes.
TIMED = ("eval_runtime", "eval_samples_per_second", "eval_steps_per_second", "eval_model_preparation_time")


LOSS_TYPES = ("dapo", "grpo")  # normalised over the step's tokens; a mean over each process's rows


def held_out_prompts(count: int = 7):
    """The held-out prompts, one at a time, as a stream reads them."""
    for i in range(count):
        yield {"prompt": f"Held out {i}"}


def evaluate(output_dir: str, loss_type: str, stream: bool = False) -> tuple[dict[str, float], list[str]]:
    """(the evaluation metrics but the timed ones, every prompt scored on any process, in process order). With
    `stream`, the held-out set is a stream (`IterableDataset.from_generator`, no length)."""
    tokenizer, seen = tiny_tokenizer(), []

    def prompt_and_length(prompts, completions):
        seen.extend(prompts)
        return [int(p.split()[-1]) + float(len(c)) for p, c in zip(prompts, completions)]

    held_out = Dataset.from_list(list(held_out_prompts()))
    if stream:
        held_out = IterableDataset.from_generator(held_out_prompts)
    train = Dataset.from_dict({"prompt": [f"Question {i}" for i in range(8)]})
    # beta > 0, and the policy moved away from the reference below: the loss of a batch is its KL term, not 0.
    settings = dict(num_generations_eval=1, per_device_eval_batch_size=2, beta=0.04, loss_type=loss_type)
    args = GRPOConfig(output_dir=output_dir, **TINY, **settings)
    trainer = GRPOTrainer(
        tiny_model(tokenizer),
        prompt_and_length,
        args=args,
        train_dataset=train,
        eval_dataset=held_out,
        processing_class=tokenizer,
    )
    trainer.generation = ScriptedGeneration(1, 8)  # one completion per prompt, the same on any process
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():  # the same move on every process
        for p in trainer.model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=generator).to(p.device))
    metrics = {k: v for k, v in trainer.evaluate().items() if k not in TIMED and not k.startswith("eval_timing")}
    return metrics, gather_object(seen)


if __name__ == "__main__":
    out_file = sys.argv[1]
    result = {loss_type: evaluate(f"{out_file}.{loss_type}", loss_type) for loss_type in LOSS_TYPES}
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        torch.save(result, out_file)
    end_launched_process()
