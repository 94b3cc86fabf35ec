"""One SGD step of GRPO on scripted completions; saves the parameter update per loss type, per variant and with a
LoRA adapter.

    accelerate launch --config_file tests/configs/accelerate_cpu_2proc.yaml \
        tests/helpers/distributed_update.py OUT PER_DEVICE GA

tests/test_distributed.py runs it on 2 processes and compares with the same step on 1 process."""

import importlib.util
import sys

import torch
from datasets import Dataset

from grpo import GRPOConfig, GRPOTrainer
from grpo.testing import tiny_model, tiny_tokenizer
from tests.helpers.agents import agent_step_update, reward_25, tool_call_turns
from tests.helpers.net import end_launched_process
from tests.helpers.scripted import (
    TINY,
    ScriptedGeneration,
    half_flat_dataset,
    half_flat_reward,
    len_as_final_step,
    reward_len,
    sgd_step_update,
)

LOSS_TYPES = ("grpo", "dr_grpo", "dapo")


def length_mod_3(completions):
    """A second outcome reward for GDPO, ranking the completions otherwise than reward_len."""
    return [float(len(c) % 3) for c in completions]


# Settings whose result depends on more than one process's rows: the entropy threshold (over all processes), GSPO
# with masked truncated rows, per-token advantages of process rewards (gathered step rewards), dynamic sampling
# (groups chosen from all processes' rows, then redistributed) and async generation.
VARIANTS = {
    "top_entropy": dict(loss_type="dapo", top_entropy_quantile=0.5),
    "gspo_mask_truncated": dict(
        loss_type="grpo", importance_sampling_level="sequence", mask_truncated_completions=True
    ),
    "process_reward": dict(loss_type="dr_grpo", reward_funcs=len_as_final_step),
    "dynamic_sampling": dict(
        loss_type="dapo", dynamic_sampling=True, reward_funcs=half_flat_reward, dataset=half_flat_dataset()
    ),
    # Rounds made by a producer thread per process, rewards gathered when the trainer takes them; weights pushed
    # with every process's engine lock held.
    "async_generation": dict(loss_type="dapo", async_generation=True, max_staleness=0),
    # The loss types with terms of their own (normalised over the step: cispo, vespo; over the micro-batch: sapo,
    # luspo), and GDPO, whose per-function group statistics and batch normalisation need every process's rows.
    "cispo": dict(loss_type="cispo", epsilon_high=5.0),
    "sapo": dict(loss_type="sapo"),
    "luspo": dict(loss_type="luspo", importance_sampling_level="sequence"),
    "vespo": dict(loss_type="vespo"),
    # The entropy bonus, aggregated with grpo's per-sequence mean, its gradient through the chunked projection.
    "entropy_bonus": dict(loss_type="grpo", entropy_coef=0.3),
    "gdpo": dict(
        loss_type="dapo",
        multi_objective_aggregation="normalize_then_sum",
        reward_funcs=[reward_len, length_mod_3],
        reward_weights=[1.0, 2.0],
    ),
}

# "agent": multi-turn episodes with tools whose rows take one to three turns (tests/helpers/agents.py), so the two
# processes run different numbers of turns; "agent_turns": the same with turn-level credit, whose turn indices and
# turn scores are gathered from processes with different widths. "lora": run only where peft is installed.
EXTRA = ("agent", "agent_turns", "lora") if importlib.util.find_spec("peft") is not None else ("agent", "agent_turns")


def lora_config():
    """A small adapter on every linear layer of the tiny model (rank 4: its hidden size is 64)."""
    from peft import LoraConfig

    return LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0, task_type="CAUSAL_LM")


def lora_step_update(output_dir, **config):
    """`sgd_step_update` with `peft_config=lora_config()`: (update of every parameter, trainer) after one plain-SGD
    step on the scripted completions of 16 fixed prompts, the KL term on (the reference is the adapter disabled)."""
    tokenizer = tiny_tokenizer()
    dataset = Dataset.from_dict({"prompt": [f"Question {i}: count to three." for i in range(16)]})
    settings = dict(max_steps=1, optim="sgd", learning_rate=0.5, max_grad_norm=0.0, shuffle_dataset=False, beta=0.04)
    args = GRPOConfig(output_dir=str(output_dir), **{**TINY, **settings, **config})
    torch.manual_seed(0)  # LoRA's A is drawn when the model is wrapped: the same on every process and every run
    trainer = GRPOTrainer(
        tiny_model(tokenizer),
        reward_len,
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        peft_config=lora_config(),
    )
    offset = trainer.accelerator.process_index * args.per_device_train_batch_size * args.steps_per_generation
    trainer.generation = ScriptedGeneration(args.num_generations, args.max_completion_length, offset=offset)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    return {n: p.detach() - before[n] for n, p in trainer.model.named_parameters()}, trainer


def one_step(name, per_device, accumulation, output_dir):
    """(update, number of processes, logged loss, parameters after the step) of one step with the KL term on.
    `name`: a loss type, a variant or "lora" (the default loss with a LoRA adapter; only the adapter moves)."""
    if name == "lora":
        update, trainer = lora_step_update(
            output_dir, per_device_train_batch_size=per_device, gradient_accumulation_steps=accumulation
        )
    elif name in ("agent", "agent_turns"):
        turns = dict(rewards=(reward_25, tool_call_turns), turn_advantage="mt_grpo") if name == "agent_turns" else {}
        update, trainer = agent_step_update(
            output_dir,
            beta=0.04,
            per_device_train_batch_size=per_device,
            gradient_accumulation_steps=accumulation,
            **turns,
        )
    else:
        settings = dict(loss_type=name) if name in LOSS_TYPES else VARIANTS[name]
        update, trainer = sgd_step_update(
            output_dir,
            beta=0.04,
            per_device_train_batch_size=per_device,
            gradient_accumulation_steps=accumulation,
            **settings,
        )
    params = {n: p.detach() for n, p in trainer.model.named_parameters()}
    return update, trainer.accelerator.num_processes, trainer.state.log_history[0]["loss"], params


if __name__ == "__main__":
    out_file, per_device, accumulation = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    results = {
        name: one_step(name, per_device, accumulation, f"{out_file}.d") for name in (*LOSS_TYPES, *VARIANTS, *EXTRA)
    }
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        torch.save(results, out_file)
    end_launched_process()
