"""One SGD step of GRPO on scripted completions; saves the parameter update per loss type.

    accelerate launch --config_file tests/accelerate_cpu_2proc.yaml tests/distributed_update.py OUT PER_DEVICE GA

tests/test_distributed.py runs it on 2 processes and compares with the same step on 1 process."""

import sys

import torch

from tests.scripted import sgd_step_update

LOSS_TYPES = ("grpo", "dr_grpo", "dapo")


def one_step(loss_type, per_device, accumulation, output_dir):
    """(update, number of processes, logged loss) of one step with the KL term on."""
    update, trainer = sgd_step_update(
        output_dir,
        loss_type=loss_type,
        beta=0.04,
        per_device_train_batch_size=per_device,
        gradient_accumulation_steps=accumulation,
    )
    return update, trainer.accelerator.num_processes, trainer.state.log_history[0]["loss"]


if __name__ == "__main__":
    out_file, per_device, accumulation = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    results = {lt: one_step(lt, per_device, accumulation, f"{out_file}.d") for lt in LOSS_TYPES}
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        torch.save(results, out_file)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
