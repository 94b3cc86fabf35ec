"""Peak memory and step time of GRPO training with LoRA against full fine-tuning, side by side, on CPU.

    python benchmarks/peft_memory.py                  # SmolLM2-135M-Instruct, 3 repeats of each (about 3 minutes)
    python benchmarks/peft_memory.py --repeats 5 --completion-length 128

What is measured: two optimizer steps of `GRPOTrainer` on SmolLM2-135M-Instruct (offline, float32), the KL term on
(beta 0.04), AdamW, 8 rows (1 prompt x 8 completions) per step, completions of a fixed length:

- lora: `peft_config=LoraConfig(r=16, lora_alpha=32, target_modules="all-linear")`; the reference log-probs come
  from the same network with the adapter disabled, so there is one copy of the weights and optimizer state for the
  adapter only (4.9M parameters).
- full: every weight trains; the reference is a frozen copy of the model (`frozen_copy`), and AdamW keeps two
  moments per weight.

Each run is a fresh subprocess; its peak memory is the peak resident set size of that child (`ru_maxrss` from
`os.wait4`), which includes the interpreter, torch and loading the model. The step time is the second optimizer
step (the first allocates the optimizer state), from reference log-probs to the optimizer update. Generation is left
out: completions are fixed random tokens, so both runs train on the same rows and the time is the training step's
(sampling with an unmerged adapter costs a little more than with plain weights; merge it for fast inference).
The figures are medians over `--repeats` subprocesses of each kind.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


class FixedGeneration:
    """Completions of `length` random tokens with no EOS (the same for both kinds of run): training only."""

    def __init__(self, length: int, vocab: int):
        self.length, self.vocab = length, vocab

    def sync_weights(self, model, version: int) -> None:
        pass

    def generate(self, model, prompt_ids):
        import torch

        from grpo.generation import Completions

        generator = torch.Generator().manual_seed(0)
        ids = torch.randint(1000, self.vocab, (len(prompt_ids), self.length), generator=generator)
        return Completions(ids.tolist())


def child(kind: str, completion_length: int) -> dict:
    """Two GRPO steps in this process; returns the second step's seconds."""
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback

    from grpo import GRPOConfig, GRPOTrainer

    peft_config = None
    if kind == "lora":
        from peft import LoraConfig

        peft_config = LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", lora_dropout=0.0)

    step_times = []

    class StepTimer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            step_times.append(time.perf_counter() - self.start)

    def alternating(completions):
        return [float(i % 2) for i in range(len(completions))]  # a spread in every group: a non-zero gradient

    with tempfile.TemporaryDirectory() as output_dir:
        args = GRPOConfig(
            output_dir=output_dir,
            report_to="none",
            save_strategy="no",
            disable_tqdm=True,
            max_steps=2,
            per_device_train_batch_size=8,
            num_generations=8,
            max_completion_length=completion_length,
            learning_rate=1e-5,
            beta=0.04,
            logging_steps=1,
        )
        dataset = Dataset.from_dict({"prompt": ["What is 3 + 4? Reply with just the number."] * 4})
        trainer = GRPOTrainer(
            "smollm2-135m-instruct", alternating, args=args, train_dataset=dataset, peft_config=peft_config
        )
        trainer.generation = FixedGeneration(completion_length, len(trainer.processing_class))
        trainer.add_callback(StepTimer())
        trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
        trainer.train()
    return {"step_seconds": step_times[-1], "trainable": trainable, "threads": torch.get_num_threads()}


def run_child(kind: str, completion_length: int) -> dict:
    """One child process: its result and its peak resident set size (bytes)."""
    command = [sys.executable, __file__, "--child", kind, "--completion-length", str(completion_length)]
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    # wait4 gives this child's own resource usage (getrusage(RUSAGE_CHILDREN) would be the maximum over all of them).
    _, status, usage = os.wait4(process.pid, 0)
    out, err = process.stdout.read(), process.stderr.read()
    if status != 0:
        raise RuntimeError(f"{kind} run failed:\n{err[-3000:]}")
    result = json.loads(out.strip().splitlines()[-1])
    result["peak_rss"] = usage.ru_maxrss * 1024  # kilobytes on Linux
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--completion-length", type=int, default=256)
    parser.add_argument("--child", choices=["lora", "full"], help=argparse.SUPPRESS)
    cli = parser.parse_args()
    if cli.child:
        print(json.dumps(child(cli.child, cli.completion_length)))
        return

    runs = {"lora": [], "full": []}
    for _ in range(cli.repeats):  # alternated, so a slow spell of the machine hits both kinds
        for kind in runs:
            runs[kind].append(run_child(kind, cli.completion_length))
    rows = {
        kind: {
            "peak": statistics.median(r["peak_rss"] for r in results) / 2**20,
            "step": statistics.median(r["step_seconds"] for r in results),
            "trainable": results[0]["trainable"],
        }
        for kind, results in runs.items()
    }
    threads = runs["lora"][0]["threads"]
    print(
        f"SmolLM2-135M-Instruct, CPU float32 ({threads} threads), beta 0.04, AdamW, 8 rows x "
        f"{cli.completion_length} completion tokens; medians of {cli.repeats} fresh processes each"
    )
    print(f"{'':28} {'LoRA r=16':>12} {'full + ref copy':>16} {'LoRA / full':>12}")
    lora, full = rows["lora"], rows["full"]
    print(f"{'trainable parameters':28} {lora['trainable']:>12,} {full['trainable']:>16,} "
          f"{lora['trainable'] / full['trainable']:>12.3f}")  # fmt: skip
    print(f"{'peak RSS (MiB)':28} {lora['peak']:>12.0f} {full['peak']:>16.0f} {lora['peak'] / full['peak']:>12.2f}")
    print(f"{'step time (s)':28} {lora['step']:>12.2f} {full['step']:>16.2f} {lora['step'] / full['step']:>12.2f}")


if __name__ == "__main__":
    main()
