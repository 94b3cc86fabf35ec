"""One training run of the exact-resume tests (tests/test_resume.py), in a process of its own so it can be killed.

    python tests/helpers/resume_run.py SETTINGS_JSON OUTPUT_DIR
        [--kill-after-micro-step K | --kill-in-save STEP | --sigterm-in-save STEP | --sigterm-after-micro-step K
         [--sigterm-again] [--sleep-after-sigterm S]] [--resume] [--lora] [--agent] [--prompts N]

It trains the tiny model with real sampling (`model.generate`) and writes OUTPUT_DIR/result.pt (the log history
and the final parameters) when it ends. `--kill-after-micro-step K` SIGKILLs the process right after its K-th
micro-step (counted from the start of this process); `--kill-in-save STEP` SIGKILLs it while checkpoint STEP is
being written: every file is written, the rename that publishes it has not happened; `--sigterm-in-save STEP` sends a
SIGTERM at that moment instead, and the save goes on. `--sigterm-after-micro-step K`
sends the process a SIGTERM (a scheduler's notice) right after its K-th micro-step; `--sigterm-again` sends a
second one after the next micro-step, `--sleep-after-sigterm S` sleeps S seconds there instead (a step that will
not end in time); `--sigterm-rank R` sends it to the process of rank R only (under accelerate launch).
SETTINGS_JSON may override any setting below. `--lora` trains a LoRA adapter
(rank 4 on every linear layer) instead of every weight. `--prompts N` trains on N prompts (default 24).
`--stream` gives the prompts as a stream (`datasets.IterableDataset.from_generator`, no length) and saves the
prompts the rewards saw, in order, in result.pt (`prompts`). `--agent` makes each row a multi-turn episode with real sampling (`agent_trainer`): chat prompts, an `add` tool,
and turns that each end at the first sampled letter, so an episode's turns and tool calls depend on what was drawn.
"""

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
from datasets import Dataset, IterableDataset
from transformers import TrainerCallback

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import grpo.training.checkpoints  # noqa: E402
from grpo import GRPOConfig, GRPOTrainer  # noqa: E402
from grpo.testing import tiny_model, tiny_tokenizer  # noqa: E402
from tests.helpers.agents import add, chat_prompts, last_turn_length, tool_tokenizer  # noqa: E402
from tests.helpers.distributed_update import lora_config  # noqa: E402
from tests.helpers.net import end_launched_process  # noqa: E402


def reward_parity(completions):
    """Equal rewards within a group happen often (dynamic sampling then has groups to replace)."""
    return [float(len(c) % 2) for c in completions]


def reward_length(completions):
    return [len(c) / 10 for c in completions]


def count_apples(prompts):
    """The prompts of the tests' data set, one at a time, as a stream reads them."""
    for i in range(prompts):
        yield {"prompt": f"Count {i} apples."}


def record_prompts(seen):
    """A reward of 0 (it changes no advantage) that appends the prompts it is given to `seen`."""

    def prompts_seen(prompts, completions):
        seen.extend(prompts)
        return [0.0] * len(prompts)

    return prompts_seen


def odd_turns_call_add(text, tool_names):
    """A tool-call parser for the random model, which writes no JSON: a turn of odd length calls `add(len, 1)`, an even
    one answers, so whether an episode goes on depends on the tokens sampled."""
    from grpo.generation.tool_calls import ToolCall

    return [ToolCall("add", {"a": len(text), "b": 1})] if len(text) % 2 else []


def reward_messages(completions):
    """The number of messages of each conversation (policy turns and tool answers), over 10."""
    return [len(c) / 10 for c in completions]


def agent_trainer(args, prompts):
    """A trainer whose rows are episodes of up to three tool turns, sampled by the tiny model: every lowercase letter
    ends a turn (random turns end after a few tokens) and `odd_turns_call_add` reads the calls."""
    tokenizer = tool_tokenizer()
    model = tiny_model(tokenizer)
    letters = tokenizer("abcdefghijklmnopqrstuvwxyz", add_special_tokens=False)["input_ids"]
    model.generation_config.eos_token_id = [tokenizer.eos_token_id, *letters]
    trainer = GRPOTrainer(
        model,
        [last_turn_length, reward_messages],
        args=args,
        train_dataset=chat_prompts(prompts),
        processing_class=tokenizer,
        tools=[add],
    )
    trainer.agent.parser = odd_turns_call_add
    return trainer


class KillAfter(TrainerCallback):
    """Sends `signum` to this process right after micro-step `micro_steps`; then, at the next micro-step, sends it
    again (`again`) or sleeps `sleep` seconds."""

    def __init__(self, micro_steps, signum=signal.SIGKILL, again=False, sleep=0.0):
        self.remaining, self.signum, self.again, self.sleep = micro_steps, signum, again, sleep

    def _count(self):
        self.remaining -= 1
        if self.remaining == 0:
            os.kill(os.getpid(), self.signum)
        elif self.remaining == -1 and self.again:
            os.kill(os.getpid(), self.signum)
        elif self.remaining == -1 and self.sleep:
            time.sleep(self.sleep)

    def on_substep_end(self, args, state, control, **kwargs):
        self._count()

    def on_step_end(self, args, state, control, **kwargs):
        self._count()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("settings")
    parser.add_argument("output_dir")
    parser.add_argument("--kill-after-micro-step", type=int)
    parser.add_argument("--kill-in-save", type=int)
    parser.add_argument("--sigterm-in-save", type=int)
    parser.add_argument("--sigterm-after-micro-step", type=int)
    parser.add_argument("--sigterm-again", action="store_true")
    parser.add_argument("--sleep-after-sigterm", type=float, default=0.0)
    parser.add_argument("--sigterm-rank", type=int)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--lora", action="store_true")
    parser.add_argument("--agent", action="store_true")
    parser.add_argument("--prompts", type=int, default=24)
    parser.add_argument("--stream", action="store_true")
    cli = parser.parse_args()

    if cli.kill_in_save is not None or cli.sigterm_in_save is not None:
        publish = grpo.training.checkpoints.publish
        step, signum = (
            (cli.kill_in_save, signal.SIGKILL)
            if cli.kill_in_save is not None
            else (cli.sigterm_in_save, signal.SIGTERM)
        )

        def publish_or_signal(staged, final):
            if final.endswith(f"checkpoint-{step}"):
                os.kill(os.getpid(), signum)  # SIGTERM: the handler runs now, in this thread; the save goes on
            publish(staged, final)

        grpo.training.checkpoints.publish = publish_or_signal

    tokenizer = tiny_tokenizer()
    dataset = Dataset.from_dict({"prompt": [f"Count {i} apples." for i in range(cli.prompts)]})
    seen = []  # the prompts the rewards saw, in order
    if cli.stream:
        dataset = IterableDataset.from_generator(count_apples, gen_kwargs={"prompts": cli.prompts})
    settings = dict(
        output_dir=cli.output_dir,
        use_cpu=True,  # bit-identical weights are the CPU float32 run's (on a GPU machine, GRPOConfig picks CUDA, bf16)
        bf16=False,
        report_to="none",
        logging_steps=1,  # every step's loss and reward are compared
        save_strategy="steps",
        save_steps=1,
        disable_tqdm=True,
        num_generations=4,
        temperature=1.0,
        learning_rate=1e-2,  # large enough that every step visibly moves the weights
        seed=7,
        max_completion_length=8,  # short completions keep each run to a few seconds (an episode's is the scenario's)
    )
    args = GRPOConfig(**{**settings, **json.loads(cli.settings)})
    if cli.agent:
        trainer = agent_trainer(args, cli.prompts)
    else:
        trainer = GRPOTrainer(
            tiny_model(tokenizer),
            [reward_parity, reward_length, *([record_prompts(seen)] if cli.stream else [])],
            args=args,
            train_dataset=dataset,
            processing_class=tokenizer,
            peft_config=lora_config() if cli.lora else None,
        )
    if cli.kill_after_micro_step is not None:
        trainer.add_callback(KillAfter(cli.kill_after_micro_step))
    if cli.sigterm_after_micro_step is not None and cli.sigterm_rank in (None, int(os.environ.get("RANK", "0"))):
        stop = KillAfter(cli.sigterm_after_micro_step, signal.SIGTERM, cli.sigterm_again, cli.sleep_after_sigterm)
        trainer.add_callback(stop)
    trainer.train(resume_from_checkpoint=True if cli.resume else None)
    params = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    result = {"log_history": trainer.state.log_history, "params": params, "prompts": seen}
    torch.save(result, Path(cli.output_dir) / "result.pt")


if __name__ == "__main__":
    main()
    end_launched_process()
