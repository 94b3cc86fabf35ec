"""Peak memory and step time of GRPO training with LoRA against full fine-tuning, side by side, on CPU.

    python benchmarks/peft_memory.py                  # SmolLM2-135M-Instruct, 3 repeats of each (about 3 minutes)
    python benchmarks/peft_memory.py --repeats 5 --completion-length 128
    python benchmarks/peft_memory.py --completion-length 32 256 --json run.json --plot peft-memory.png   # also a chart
    python benchmarks/peft_memory.py --replot run.json --plot peft-memory.png   # a saved run (--json)

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
The figures are medians over `--repeats` subprocesses of each kind, for each of the `--completion-length` values.
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
    parser.add_argument(
        "--completion-length", type=int, nargs="+", default=[256], help="one or more, measured in turn"
    )
    parser.add_argument("--plot", metavar="PNG", help="also draw the peak memory as a chart (needs matplotlib)")
    parser.add_argument("--json", metavar="FILE", help="also write the measured numbers to FILE")
    parser.add_argument("--replot", metavar="FILE", help="measure nothing: print and --plot the numbers in FILE")
    parser.add_argument("--child", choices=["lora", "full"], help=argparse.SUPPRESS)
    cli = parser.parse_args()
    if cli.child:
        print(json.dumps(child(cli.child, cli.completion_length[0])))
        return
    if cli.replot:
        run = json.loads(Path(cli.replot).read_text())
    else:
        run = {"date": time.strftime("%Y-%m-%d"), "runs": [measure(n, cli.repeats) for n in cli.completion_length]}
    report(run, cli.plot)
    if cli.json:
        Path(cli.json).write_text(json.dumps(run, indent=1))


def measure(completion_length: int, repeats: int) -> dict:
    """Medians of `repeats` children of each kind: {"completion_length", "repeats", "threads", "lora": {"peak_mib",
    "step_seconds", "trainable"}, "full": {...}}."""
    runs = {"lora": [], "full": []}
    for _ in range(repeats):  # alternated, so a slow spell of the machine hits both kinds
        for kind in runs:
            runs[kind].append(run_child(kind, completion_length))
    rows = {
        kind: {
            "peak_mib": statistics.median(r["peak_rss"] for r in results) / 2**20,
            "step_seconds": statistics.median(r["step_seconds"] for r in results),
            "trainable": results[0]["trainable"],
        }
        for kind, results in runs.items()
    }
    threads = runs["lora"][0]["threads"]
    return {"completion_length": completion_length, "repeats": repeats, "threads": threads, **rows}


def report(run: dict, plot_path: str | None) -> None:
    """The table of each completion length of a run, measured or saved (--replot), and with `plot_path` its chart.
    A saved run may lack the step times or the thread count (null): they are then printed as not recorded."""
    for entry in run["runs"]:
        lora, full = entry["lora"], entry["full"]
        threads = f" ({entry['threads']} threads)" if entry["threads"] else ""
        print(
            f"SmolLM2-135M-Instruct, CPU float32{threads}, beta 0.04, AdamW, 8 rows x "
            f"{entry['completion_length']} completion tokens; medians of {entry['repeats']} fresh processes each"
        )
        print(f"{'':28} {'LoRA r=16':>12} {'full + ref copy':>16} {'LoRA / full':>12}")
        print(f"{'trainable parameters':28} {lora['trainable']:>12,} {full['trainable']:>16,} "
              f"{lora['trainable'] / full['trainable']:>12.3f}")  # fmt: skip
        a, b = lora["peak_mib"], full["peak_mib"]
        print(f"{'peak RSS (MiB)':28} {a:>12.0f} {b:>16.0f} {a / b:>12.2f}")
        a, b = lora["step_seconds"], full["step_seconds"]
        if a is None or b is None:
            print(f"{'step time (s)':28} {'not recorded':>12}")
        else:
            print(f"{'step time (s)':28} {a:>12.2f} {b:>16.2f} {a / b:>12.2f}")
    if plot_path:
        plot(run["runs"], run["date"], plot_path)
        print(f"chart written to {plot_path}")


def plot(runs: list[dict], when: str, path: str) -> None:
    """Peak resident set size, full fine-tuning with a reference copy against LoRA, one pair of bars per completion
    length, each LoRA bar labelled with its share of the full one."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise SystemExit("--plot needs matplotlib: pip install 'grpo[plot]' (make install installs it).") from e
    fig, ax = plt.subplots(figsize=(3 + 2.2 * len(runs), 4))
    x = range(len(runs))
    full = [entry["full"]["peak_mib"] for entry in runs]
    lora = [entry["lora"]["peak_mib"] for entry in runs]
    ax.bar([i - 0.2 for i in x], full, 0.4, label="full fine-tuning + reference copy", color="#b0b0b0")
    ax.bar([i + 0.2 for i in x], lora, 0.4, label="LoRA r=16, all linear layers", color="#3b6ea8")
    for i, (f, lo) in enumerate(zip(full, lora)):
        ax.annotate(f"{f:,.0f} MiB", (i - 0.2, f), ha="center", va="bottom", fontsize=9)
        ax.annotate(f"{lo:,.0f} MiB\n(x{lo / f:.2f})", (i + 0.2, lo), ha="center", va="bottom", fontsize=9)
    labels = [f"{e['completion_length']} completion tokens per row\n(medians of {e['repeats']})" for e in runs]
    ax.set_xticks(list(x), labels)
    ax.set_ylabel("peak resident set size (MiB)")
    ax.set_ylim(0, max(full + lora) * 1.3)
    ax.legend(frameon=False, fontsize=9, loc="upper left")
    fig.suptitle(
        f"Two GRPO steps on SmolLM2-135M-Instruct, float32, CPU: 8 rows each, beta 0.04, AdamW; {when}",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
