"""GRPO with DeepSpeed Ulysses sequence parallelism (sp_size 2) on two CPU processes over gloo, ZeRO-2 or ZeRO-3.

    DS_ACCELERATOR=cpu ACCELERATE_TORCH_DEVICE=cpu accelerate launch \
        --config_file tests/configs/accelerate_cpu_ulysses_zero2.yaml tests/helpers/sequence_parallel_update.py OUT

The two processes form one sequence-parallel group: each generates half of the group's rows, and both train every
row, each running its half of every sequence. Saves, for tests/test_sequence_parallel.py, per run in `RUNS` the
parameters after 3 plain-SGD steps on scripted completions with the KL term on (a reference pass under sequence
parallelism too), and what really ran: the engine and its sequence-parallel group, the passes' shard widths, the
Ulysses attention calls, the rows each process trained; and the completions of a run that samples with
`model.generate`. accelerate 1.15 starts DeepSpeed only on accelerator devices: `route_fsdp_to_cpu` patches that
routing decision, as for tests/helpers/deepspeed_update.py."""

import collections
import sys

import torch
from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

from grpo import GRPOTrainer
from grpo.generation.policy_weights import _full
from grpo.objective import sequence_parallel
from grpo.rollout import MicroBatch
from tests.helpers.fsdp_update import describe, route_fsdp_to_cpu, trained
from tests.helpers.net import end_launched_process

# name -> GRPOConfig settings of one 3-step run; the test trains the same on one process without sp_size.
# max_completion_length 32: the last completion of each group is that long and crosses the two processes' halves of
# its row (the prompts take 27 tokens), the others end in the second half. steps_per_generation 2 with accumulation
# 1: the round's second micro-batch trains after an update, so pi_old comes from a pass of its own; accumulation 2:
# dapo's normaliser spans two micro-batches; max_grad_norm 0.05 clips every step (the norms are above 1).
LONG = dict(max_completion_length=32)
RUNS = {
    "grpo": dict(loss_type="grpo", per_device_train_batch_size=4, steps_per_generation=2, **LONG),
    "dapo": dict(loss_type="dapo", per_device_train_batch_size=2, gradient_accumulation_steps=2, **LONG),
    "dapo_clipped": dict(loss_type="dapo", per_device_train_batch_size=4, max_grad_norm=0.05, **LONG),
    "lora": dict(lora=True, per_device_train_batch_size=4, **LONG),
    # Each layer's forward again in the backward: its Ulysses attention with it, on both processes.
    "checkpointed": dict(gradient_checkpointing=True, per_device_train_batch_size=4, **LONG),
}
# What the sequence-parallel passes did on this process: their (shard width, full width, first position) and the
# completion tokens each predicted of all its rows'; Ulysses attention calls; rows of the micro-batches trained.
SEEN = collections.defaultdict(list)


def record():
    """Wrap the layout, DeepSpeed's Ulysses attention and `compute_loss` to fill `SEEN`."""
    init, forward = sequence_parallel.SequenceShards.__init__, UlyssesSPAttentionHF.forward
    compute_loss = GRPOTrainer.compute_loss

    def recorded_init(self, prompt_ids, prompt_mask, completion_ids, completion_mask, parallel, multiple_of=None):
        init(self, prompt_ids, prompt_mask, completion_ids, completion_mask, parallel, multiple_of)
        width, first = self.input_ids.shape[1], int(self.position_ids[0, 0])
        full = (prompt_mask.sum(1).max() + completion_ids.shape[1]).item()
        SEEN["shards"].append((width, full, first, int(self.completion_mask.sum()), int(completion_mask.sum())))

    def counted_forward(self, *args, **kwargs):
        SEEN["ulysses"].append(self.world_size)
        return forward(self, *args, **kwargs)

    def recorded_loss(self, model, inputs: MicroBatch, *args, **kwargs):
        if model.training:
            SEEN["rows"].append((inputs.prompt_ids.tolist(), inputs.completion_ids.tolist()))
        return compute_loss(self, model, inputs, *args, **kwargs)

    sequence_parallel.SequenceShards.__init__ = recorded_init
    UlyssesSPAttentionHF.forward = counted_forward
    GRPOTrainer.compute_loss = recorded_loss


def release_groups():
    """Let the next trainer of this process set up its sequence-parallel group: DeepSpeed creates one per process
    (accelerate's preparation of a second model would fail, "sequence parallel group is already initialized")."""
    from deepspeed.runtime.sequence_parallel import parallel_state_sp

    parallel_state_sp._SEQUENCE_PARALLEL_GROUP = parallel_state_sp._SEQUENCE_DATA_PARALLEL_GROUP = None


def ran(trainer):
    """`describe` plus the sequence-parallel group DeepSpeed holds, and what `SEEN` recorded since the last call."""
    from deepspeed.utils import groups

    info = describe(trainer)
    info["sp_world_size"] = groups._get_sequence_parallel_world_size()
    info["zero_stage"] = trainer.accelerator.state.deepspeed_plugin.zero_stage
    info["seen"] = {key: list(value) for key, value in SEEN.items()}
    info["kv_groups"] = [m.num_key_value_groups for m in trainer.model.modules() if hasattr(m, "num_key_value_groups")]
    SEEN.clear()
    return info


if __name__ == "__main__":
    out_file = sys.argv[1]
    route_fsdp_to_cpu()
    record()
    results = {}
    for name, config in RUNS.items():
        release_groups()
        config = dict(config)
        _, trainer = trained(f"{out_file}.{name}", config.pop("per_device_train_batch_size"), **config)
        # Whole, gathered where ZeRO-3 partitions them.
        params = {key: _full(param).clone() for key, param in trainer.model.named_parameters()}
        results[name] = (params, ran(trainer))
    # Sampling with the policy's own `model.generate` (not sequence-parallel) between sequence-parallel passes.
    release_groups()
    _, trainer = trained(f"{out_file}.g", 4, scripted=False, max_steps=2)
    results["generate"] = ran(trainer)
    everyone = [None, None]
    torch.distributed.all_gather_object(everyone, results)
    if torch.distributed.get_rank() == 0:
        torch.save(everyone, out_file)
    end_launched_process()
