"""One SGD step of GRPO on scripted completions; saves the parameter update per loss type and per variant.

    accelerate launch --config_file tests/accelerate_cpu_2proc.yaml tests/distributed_update.py OUT PER_DEVICE GA

tests/test_distributed.py runs it on 2 processes and compares with the same step on 1 process."""

import sys

import torch

from tests.scripted import half_flat_dataset, half_flat_reward, len_as_final_step, sgd_step_update

LOSS_TYPES = ("grpo", "dr_grpo", "dapo")

# Settings whose result depends on more than one process's rows: the entropy threshold (over all processes), GSPO
# with masked truncated rows, per-token advantages of process rewards (gathered step rewards), and dynamic sampling
# (groups chosen from all processes' rows, then redistributed).
VARIANTS = {
    "top_entropy": dict(loss_type="dapo", top_entropy_quantile=0.5),
    "gspo_mask_truncated": dict(
        loss_type="grpo", importance_sampling_level="sequence", mask_truncated_completions=True
    ),
    "process_reward": dict(loss_type="dr_grpo", reward_funcs=len_as_final_step),
    "dynamic_sampling": dict(
        loss_type="dapo", dynamic_sampling=True, reward_funcs=half_flat_reward, dataset=half_flat_dataset()
    ),
}


def one_step(name, per_device, accumulation, output_dir):
    """(update, number of processes, logged loss) of one step with the KL term on. `name`: a loss type or a
    variant."""
    settings = dict(loss_type=name) if name in LOSS_TYPES else VARIANTS[name]
    update, trainer = sgd_step_update(
        output_dir,
        beta=0.04,
        per_device_train_batch_size=per_device,
        gradient_accumulation_steps=accumulation,
        **settings,
    )
    return update, trainer.accelerator.num_processes, trainer.state.log_history[0]["loss"]


if __name__ == "__main__":
    out_file, per_device, accumulation = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    results = {name: one_step(name, per_device, accumulation, f"{out_file}.d") for name in (*LOSS_TYPES, *VARIANTS)}
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        torch.save(results, out_file)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
