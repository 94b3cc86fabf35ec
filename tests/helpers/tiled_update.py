"""The tiled MLP (`tiled_mlp_tokens`) on two CPU processes over gloo: DDP, FSDP2 or DeepSpeed ZeRO-3.

    ACCELERATE_USE_CPU=1 accelerate launch --config_file tests/configs/accelerate_cpu_2proc.yaml \
        tests/helpers/tiled_update.py OUT                                           # DDP
    ACCELERATE_TORCH_DEVICE=cpu accelerate launch --config_file tests/configs/accelerate_cpu_fsdp2.yaml \
        tests/helpers/tiled_update.py OUT --route                                   # FSDP2
    DS_ACCELERATOR=cpu ACCELERATE_TORCH_DEVICE=cpu accelerate launch \
        --config_file tests/configs/accelerate_cpu_zero3.yaml tests/helpers/tiled_update.py OUT --route  # ZeRO-3

Saves, for tests/test_long_sequences.py, per case the parameters (gathered whole) after 3 plain-SGD steps on
scripted completions with every MLP tiled in chunks of 3 tokens, and what really ran (tests/helpers/fsdp_update.py's
`describe`, and how many backward passes of the tiled function had ZeRO-3 parameters): the full model, the same with
non-reentrant gradient checkpointing, and a LoRA adapter. `--route`: the FSDP / DeepSpeed routing patch of
tests/helpers/fsdp_update.py (accelerate starts neither on a CPU by itself)."""

import collections
import sys

import torch

from grpo.generation.policy_weights import _full
from grpo.objective import activation_memory
from grpo.objective.activation_memory import TiledForward, decoder_mlps
from tests.helpers.fsdp_update import describe, route_fsdp_to_cpu, trained
from tests.helpers.net import end_launched_process

# The cases: name -> `trained` settings besides the tiling.
CASES = {
    "full": {},
    "checkpointed": {"activation_checkpointing": True, "activation_checkpointing_kwargs": {"use_reentrant": False}},
    "lora": {"lora": True},
}
# Tokens per chunk: fewer than any micro-batch's forward has, so every MLP call is tiled.
TOKENS = 3
# Backward passes of the tiled function in this process, by whether its parameters were ZeRO-3 partitioned ones
# (added to through DeepSpeed's hooks) or inputs of the function (their gradients returned).
BACKWARDS = collections.Counter()


def count_backwards():
    tiled = activation_memory._TiledMLP
    backward = tiled.backward

    def counted(ctx, grad_output):
        BACKWARDS["partitioned" if ctx.num_params == 0 else "returned"] += 1
        return backward(ctx, grad_output)

    tiled.backward = staticmethod(counted)


if __name__ == "__main__":
    out_file = sys.argv[1]
    if "--route" in sys.argv[2:]:
        route_fsdp_to_cpu()
    count_backwards()
    results = {}
    for name, config in CASES.items():
        _, trainer = trained(f"{out_file}.{name}", 4, tiled_mlp_tokens=TOKENS, **config)
        params = {n: _full(p).clone() for n, p in trainer.model.named_parameters()}
        info = describe(trainer)
        info["tiled"] = [isinstance(mlp.forward, TiledForward) for mlp in decoder_mlps(trainer.model).values()]
        info["backwards"] = dict(BACKWARDS)
        BACKWARDS.clear()
        results[name] = (params, info)
    if torch.distributed.get_rank() == 0:
        torch.save(results, out_file)
    end_launched_process()
