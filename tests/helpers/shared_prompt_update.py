"""One SGD step with each group's prompt computed once (the default) under gradient checkpointing, on scripted
completions and on multi-turn agent episodes; saves the updates, the logged losses and how many log-prob passes
shared the prompt.

    accelerate launch --config_file tests/configs/accelerate_cpu_2proc.yaml \
        tests/helpers/shared_prompt_update.py OUT

tests/test_shared_prompt.py runs it on 2 processes (DDP over gloo) and compares with 1 process that computes the
prompt once per row and does not checkpoint."""

import sys

import torch

from grpo.objective import logprobs
from tests.helpers.agents import agent_step_update
from tests.helpers.net import end_launched_process
from tests.helpers.scripted import sgd_step_update

# The two runs compared: scripted completions (dapo: normalised over both processes' tokens), and agent episodes,
# where the shared part is the initial prompt and the tool answers stay in each completion.
RUNS = {
    "scripted": (sgd_step_update, dict(loss_type="dapo", beta=0.04)),
    "agent": (agent_step_update, dict(beta=0.04)),
}


def shared_step(name, output_dir, per_device, **config):
    """(update, process count, logged loss, parameters after the step, passes that shared the prompt)."""
    passes = []
    layout = logprobs.grouped_layout

    def counted(*args, **kwargs):
        grouped = layout(*args, **kwargs)
        passes.append(grouped is not None)
        return grouped

    logprobs.grouped_layout = counted
    try:
        step, settings = RUNS[name]
        update, trainer = step(output_dir, per_device_train_batch_size=per_device, **settings, **config)
    finally:
        logprobs.grouped_layout = layout
    params = {n: p.detach() for n, p in trainer.model.named_parameters()}
    return update, trainer.accelerator.num_processes, trainer.state.log_history[0]["loss"], params, sum(passes)


if __name__ == "__main__":
    out_file = sys.argv[1]
    results = {name: shared_step(name, f"{out_file}.d", 4, gradient_checkpointing=True) for name in RUNS}
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        torch.save(results, out_file)
    end_launched_process()
