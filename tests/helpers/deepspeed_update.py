"""GRPO under DeepSpeed ZeRO-2 / ZeRO-3 on two CPU processes over gloo, DeepSpeed's CPU accelerator.

    DS_ACCELERATOR=cpu ACCELERATE_TORCH_DEVICE=cpu accelerate launch \
        --config_file tests/configs/accelerate_cpu_zero2.yaml tests/helpers/deepspeed_update.py OUT

Saves, for tests/test_deepspeed.py, per loss type and with a LoRA adapter the parameters after 3 plain-SGD steps on
scripted completions (gathered whole: `checkpoint_tensors`, as the vLLM weight push does) and what really ran, as
tests/helpers/fsdp_update.py does under FSDP2; and, per `ds3_gather_for_generation`, 2 steps that sample with
`model.generate` (the completions, whether the weights were whole while sampling, the parameters after) and `generate`
on processes that stop after different numbers of tokens; the parameters of 3 Adam steps saved every step and, with
`--resume OUTPUT_DIR`, of the same run resumed from its checkpoint-2; and the dapo run with the model, then also a
reward model, loaded from the folders OUT.model and OUT.rm that the test writes first. accelerate 1.15 starts DeepSpeed
only on accelerator devices (`AcceleratorState` checks `not cpu`, `_prepare_backend` finds no CUDA), so the same
routing patch applies: the processes report MULTI_GPU with the gloo backend."""

import sys

import torch
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

from grpo.generation import TransformersGeneration
from grpo.generation.policy_weights import _full, checkpoint_tensors, zero3_gathered_for_generation
from grpo.models import is_zero3_partitioned
from tests.helpers.fsdp_update import LOSS_TYPES, SAVED, count_calls, describe, route_fsdp_to_cpu, trained
from tests.helpers.net import end_launched_process
from tests.helpers.scripted import reward_len

# Per call of TransformersGeneration.generate in this process: (every weight whole while sampling, completion ids).
GENERATED = []


def record_generation():
    generate = TransformersGeneration.generate

    def recorded(self, model, prompt_ids):
        available = ZeroParamStatus.AVAILABLE  # a ZeRO-3 parameter gathered whole (ZeRO-2's are plain tensors)
        whole = all(getattr(param, "ds_status", available) == available for param in model.parameters())
        completions = generate(self, model, prompt_ids)
        GENERATED.append((whole, completions.ids))
        return completions

    TransformersGeneration.generate = recorded


def uneven_generate(trainer, gather):
    """[(new tokens, sum over processes of rank + 1 taken right after)] per process, when process r's `generate`
    stops after 2 + 4 r tokens. Without the gather every decoding step all-gathers the partitioned weights, so the
    process that stops first must keep joining the other's steps (`synced_gpus`); otherwise this hangs."""
    rank = trainer.accelerator.process_index
    new = 2 + 4 * rank
    eos = trainer.processing_class.eos_token_id
    backend = TransformersGeneration(
        max_completion_length=new, pad_token_id=eos, eos_token_ids=[eos], generation_kwargs={"min_new_tokens": new}
    )
    with zero3_gathered_for_generation(trainer.model_wrapped, gather):
        completions = backend.generate(trainer.accelerator.unwrap_model(trainer.model), [[5, 6, 7]])
    total = torch.tensor([float(rank + 1)])
    torch.distributed.all_reduce(total)
    everyone = [None] * trainer.accelerator.num_processes
    torch.distributed.all_gather_object(everyone, (len(completions.ids[0]), total.item()))
    return everyone


def whole_parameters(trainer):
    """The policy's parameters gathered whole, under their checkpoint names (as the vLLM weight push reads them)."""
    return {name: tensor.detach().clone() for name, tensor in checkpoint_tensors(trainer.model)}


if __name__ == "__main__":
    out_file = sys.argv[1]
    route_fsdp_to_cpu()
    count_calls()
    results = {}
    if sys.argv[2:3] == ["--resume"]:  # OUT --resume OUTPUT_DIR: the saved run again, from its checkpoint-2
        _, trainer = trained(sys.argv[3], 4, resume=f"{sys.argv[3]}/checkpoint-2", **SAVED)
        results["resumed"] = (whole_parameters(trainer), describe(trainer))
        if torch.distributed.get_rank() == 0:
            torch.save(results, out_file)
        end_launched_process()
    _, trainer = trained(f"{out_file}.c", 4, **SAVED)  # Adam, a checkpoint every step
    results["saved"] = (whole_parameters(trainer), describe(trainer))
    for loss_type in LOSS_TYPES:
        _, trainer = trained(f"{out_file}.d", 4, loss_type=loss_type)
        params = whole_parameters(trainer)
        info = describe(trainer)
        info["zero_stage"] = trainer.accelerator.state.deepspeed_plugin.zero_stage
        results[loss_type] = (params, info)
    # The same dapo run from a folder, as users pass a model: under ZeRO-3 `from_pretrained` partitions the weights
    # as it loads them, so the reference cannot be a copy of the policy and is loaded from the folder too. The
    # folders OUT.model and OUT.rm are written by tests/test_deepspeed.py before the launch: here, building a model
    # on one process would wait for the other in ZeRO-3's partitioning.
    _, trainer = trained(f"{out_file}.p", 4, model=f"{out_file}.model", loss_type="dapo")
    info = {**describe(trainer), "ref_partitioned": is_zero3_partitioned(trainer.ref_model)}
    results["from_path"] = (whole_parameters(trainer), info)
    # And scored by a reward model loaded from a folder too (partitioned at load under ZeRO-3, like the reference).
    rewards = [f"{out_file}.rm", reward_len]
    _, trainer = trained(f"{out_file}.r", 4, model=f"{out_file}.model", rewards=rewards, loss_type="dapo")
    partitioned = is_zero3_partitioned(trainer.rewards.outcome_funcs[0])
    results["reward_model"] = (whole_parameters(trainer), {**describe(trainer), "rm_partitioned": partitioned})
    _, trainer = trained(f"{out_file}.l", 4, lora=True)  # the parameters under their PEFT names, adapter unmerged
    params = {name: _full(param).clone() for name, param in trainer.model.named_parameters()}
    results["lora"] = (
        params,
        {**describe(trainer), "zero_stage": trainer.accelerator.state.deepspeed_plugin.zero_stage},
    )
    record_generation()
    for gather in (True, False):
        GENERATED.clear()
        _, trainer = trained(f"{out_file}.g", 4, scripted=False, max_steps=2, ds3_gather_for_generation=gather)
        params = whole_parameters(trainer)
        results["generate", gather] = (params, describe(trainer), list(GENERATED))
        results["uneven", gather] = uneven_generate(trainer, gather)
    if torch.distributed.get_rank() == 0:
        torch.save(results, out_file)
    end_launched_process()
