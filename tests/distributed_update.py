"""One SGD step of GRPO on scripted completions; saves the parameter update per loss type.

    accelerate launch --config_file tests/accelerate_cpu_2proc.yaml tests/distributed_update.py OUT_FILE PER_DEVICE

tests/test_distributed.py runs it on 2 processes and compares with the same step on 1 process."""

import sys

import torch
from datasets import Dataset

from grpo import GRPOConfig, GRPOTrainer
from grpo.testing import tiny_model, tiny_tokenizer
from tests.scripted import ScriptedGeneration

LOSS_TYPES = ("grpo", "dr_grpo", "dapo")


def reward_len(prompts, completions):
    return [float(len(c)) for c in completions]


def one_step(loss_type, per_device, accumulation, output_dir):
    tokenizer = tiny_tokenizer()
    dataset = Dataset.from_dict({"prompt": [f"Question {i}: count to three." for i in range(16)]})
    args = GRPOConfig(
        output_dir=output_dir,
        report_to="none",
        max_completion_length=8,
        num_generations=4,
        max_steps=1,
        per_device_train_batch_size=per_device,
        gradient_accumulation_steps=accumulation,
        optim="sgd",
        learning_rate=0.5,
        max_grad_norm=0.0,
        shuffle_dataset=False,
        loss_type=loss_type,
        beta=0.04,
        save_strategy="no",
        disable_tqdm=True,
        logging_steps=1,
    )
    trainer = GRPOTrainer(
        tiny_model(tokenizer), reward_len, args=args, train_dataset=dataset, processing_class=tokenizer
    )
    local_rows = per_device * args.steps_per_generation
    trainer.generation = ScriptedGeneration(4, 8, offset=trainer.accelerator.process_index * local_rows)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    update = {n: p.detach() - before[n] for n, p in trainer.model.named_parameters()}
    return update, trainer.accelerator.num_processes, trainer.state.log_history[0]["loss"]


if __name__ == "__main__":
    out_file, per_device, accumulation = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    results = {lt: one_step(lt, per_device, accumulation, f"{out_file}.d") for lt in LOSS_TYPES}
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        torch.save(results, out_file)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
