"""GRPO under DeepSpeed ZeRO-2 / ZeRO-3 on two CPU processes over gloo, DeepSpeed's CPU accelerator.

    DS_ACCELERATOR=cpu ACCELERATE_TORCH_DEVICE=cpu accelerate launch --config_file tests/accelerate_cpu_zero2.yaml \
        tests/deepspeed_update.py OUT

Saves, for tests/test_deepspeed.py, per loss type the parameters after 3 plain-SGD steps on scripted completions
(gathered whole: `checkpoint_tensors`, as the vLLM weight push does) and what really ran, as tests/fsdp_update.py
does under FSDP2. accelerate 1.15 starts DeepSpeed
only on accelerator devices (`AcceleratorState` checks `not cpu`, `_prepare_backend` finds no CUDA), so the same
routing patch applies: the processes report MULTI_GPU with the gloo backend."""

import sys

import torch

from grpo.generation.weights import checkpoint_tensors
from tests.fsdp_update import LOSS_TYPES, count_calls, describe, route_fsdp_to_cpu, trained

if __name__ == "__main__":
    out_file = sys.argv[1]
    route_fsdp_to_cpu()
    count_calls()
    results = {}
    for loss_type in LOSS_TYPES:
        _, trainer = trained(f"{out_file}.d", 4, loss_type=loss_type)
        params = {name: tensor.detach().clone() for name, tensor in checkpoint_tensors(trainer.model)}
        info = describe(trainer)
        info["zero_stage"] = trainer.accelerator.state.deepspeed_plugin.zero_stage
        results[loss_type] = (params, info)
    if torch.distributed.get_rank() == 0:
        torch.save(results, out_file)
    torch.distributed.destroy_process_group()
