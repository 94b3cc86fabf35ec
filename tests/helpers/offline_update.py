"""One SGD step of offline GRPO on a fixed file of scored completions (groups of 2 to 4 completions, behaviour
log-probs, the KL term on); saves the parameter update, the process count and the logged loss.

    accelerate launch --config_file tests/configs/accelerate_cpu_2proc.yaml tests/helpers/offline_update.py OUT

tests/test_offline.py runs it on 2 processes and compares with the same step on 1 process."""

import sys

import torch
from datasets import Dataset

from grpo import GRPOConfig, GRPOTrainer
from grpo.testing import tiny_model, tiny_tokenizer
from tests.helpers.net import end_launched_process
from tests.helpers.scripted import TINY


def offline_rows(tokenizer):
    """8 prompts with 2, 3 or 4 completions each, rewards spread within each group, and behaviour log-probs."""
    rows = []
    for i in range(8):
        for j in range(2 + i % 3):
            completion = f"answer {j} " * (1 + (i + j) % 3)
            n = len(tokenizer(completion, add_special_tokens=False)["input_ids"]) + 1
            behaviour = [-5.0 - 0.05 * ((i + j + t) % 7) for t in range(n)]
            rows.append(
                {"prompt": f"Question {i}?", "completion": completion, "reward": float((i * j) % 5), "lp": behaviour}
            )
    return rows


def offline_update(output_dir):
    """(update of every parameter, number of processes, logged loss, parameters after) after one plain-SGD step on
    all 8 groups: one round of 8 groups, 2 micro-batches per process (gradient accumulation 2), loss dapo."""
    tokenizer = tiny_tokenizer()
    dataset = Dataset.from_list(offline_rows(tokenizer))
    probe = GRPOConfig(output_dir=str(output_dir), report_to="none")
    processes = probe.world_size
    settings = dict(
        max_steps=1,
        optim="sgd",
        learning_rate=0.5,
        max_grad_norm=0.0,
        shuffle_dataset=False,
        num_generations=2,
        per_device_train_batch_size=8 // processes,  # 16 rows (8 groups of 2 nominal) per round on all processes
        gradient_accumulation_steps=2,
        loss_type="dapo",
        beta=0.04,
        offline_logprobs_column="lp",
        max_completion_length=32,
    )
    args = GRPOConfig(output_dir=str(output_dir), **{**TINY, **settings})
    trainer = GRPOTrainer(tiny_model(tokenizer), None, args=args, train_dataset=dataset, processing_class=tokenizer)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    after = {n: p.detach() for n, p in trainer.model.named_parameters()}
    update = {n: p - before[n] for n, p in after.items()}
    return update, trainer.accelerator.num_processes, trainer.state.log_history[0]["loss"], after


if __name__ == "__main__":
    result = offline_update(f"{sys.argv[1]}.d")
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        torch.save(result, sys.argv[1])
    end_launched_process()
