"""Seconds per optimizer step of the generation modes, side by side in one run: synchronous `model.generate` (the
baseline), a vLLM server, a colocated vLLM engine, and asynchronous generation on the server.

    make bench-modes                                     # builds .venv-vllm, then runs this
    .venv-vllm/bin/python benchmarks/generation_modes.py --steps 6 --modes generate server async-server
    .venv-vllm/bin/python benchmarks/generation_modes.py --json run.json --plot generation-modes.png   # also a chart
    .venv-vllm/bin/python benchmarks/generation_modes.py --replot run.json --plot generation-modes.png   # a saved run

The job: GRPO on SmolLM2-135M-Instruct (float32, CPU), 2 prompts x G=8 completions of at most 32 tokens per step
(prompts that ask for a story, so most completions run to the limit), beta 0, full-weight sync after every step.
Each mode trains in a fresh process; the figure is the median step time over the steps after the first (which
builds the engine). The machine's cores are split the same way for every mode:
- generate, colocate: the trainer (and its in-process engine) on all the cores given (`--cores`, default 0,1);
- server, async-server: the trainer on the first core, the server on the others (`taskset`), so in server mode
  each side idles while the other works, and async generation can overlap them.

`scripted` and `async-scripted` replace the sampler by one that returns fixed 32-token completions (and log-probs)
at once: what is left is the trainer's own work, so their difference is what async generation costs the trainer
(the producer thread and the locks). Every mode runs with the default config, the opt-in CPU options off. (A mode
`async-scripted-prepass`, pi_old of every round from a no-grad pass of its own as before
grpo/objective/old_policy.py, patched a private function of grpo; a benchmark uses the public API only, so it was
removed (issue 27). Its numbers stay in docs/performance.md as history.)
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

MODES = (
    "generate",
    "server",
    "colocate",
    "async-server",
    "async-generate",
    "scripted",
    "async-scripted",
)
QUESTIONS = [f"Tell a short story about a {thing}." for thing in ("cat", "ship", "tree", "robot", "city", "river")]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Scripted:
    """A sampler that costs nothing: the same completion (token ids 100..131, no EOS) for every row."""

    def sync_weights(self, model, version):
        pass

    def generate(self, model, prompt_ids):
        from grpo.generation import Completions

        return Completions([list(range(100, 132)) for _ in prompt_ids], [[-1.0] * 32 for _ in prompt_ids])


def train(mode: str, steps: int, port: int | None, out: str) -> None:
    """One run of `steps` optimizer steps in `mode` (in this process); writes the step times to `out`."""
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback

    from grpo import GRPOConfig, GRPOTrainer
    from grpo.models import smollm2_path

    class StepTimes(TrainerCallback):
        def __init__(self):
            self.times = [time.perf_counter()]

        def on_step_end(self, args, state, control, **kwargs):
            self.times.append(time.perf_counter())

    settings = dict(
        output_dir=tempfile.mkdtemp(prefix="grpo-bench-modes-"),
        max_steps=steps,
        per_device_train_batch_size=16,
        num_generations=8,
        max_completion_length=32,
        learning_rate=1e-6,
        beta=0.0,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        seed=0,
    )
    if mode in ("server", "async-server"):
        settings |= dict(use_vllm=True, vllm_server_port=port, vllm_group_port=_free_port(), vllm_server_timeout=300)
    if mode == "colocate":
        settings |= dict(use_vllm=True, vllm_mode="colocate", vllm_max_model_length=512)
    if mode.startswith("async"):
        settings |= dict(async_generation=True, max_staleness=1)
    data = Dataset.from_dict({"prompt": [[{"role": "user", "content": q}] for q in QUESTIONS] * 4})
    reward = lambda completions, **kw: [len(str(c)) / 100 for c in completions]  # noqa: E731
    path = str(smollm2_path())
    trainer = GRPOTrainer(path, reward, args=GRPOConfig(**settings), train_dataset=data)
    if mode == "scripted":
        trainer.generation = Scripted()
    if mode.startswith("async-scripted"):
        trainer.generation.backend = Scripted()  # inside the shared engine
    timer = StepTimes()
    trainer.add_callback(timer)
    trainer.train()
    seconds = [b - a for a, b in zip(timer.times, timer.times[1:])]
    logs = [h for h in trainer.state.log_history if "completions/mean_length" in h]
    result = {
        "mode": mode,
        "step_seconds": seconds,
        "mean_length": statistics.mean(h["completions/mean_length"] for h in logs),
        "threads": torch.get_num_threads(),
    }
    Path(out).write_text(json.dumps(result))


def _pinned(cores: list[int], command: list[str]) -> list[str]:
    return ["taskset", "-c", ",".join(map(str, cores)), *command]


def run_mode(mode: str, steps: int, cores: list[int]) -> dict:
    """`mode` in fresh processes: the server (if any) on cores[1:], the trainer on cores[:1] or on all of them."""
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    server, port = None, None
    trainer_cores = cores
    if mode in ("server", "async-server"):
        from grpo.generation.vllm.client import VLLMClient
        from grpo.models import smollm2_path

        port, trainer_cores = _free_port(), cores[:1]
        command = [sys.executable, "-m", "grpo", "vllm-serve", "--model", str(smollm2_path()), "--port", str(port)]
        command += ["--dtype", "float32", "--enforce-eager", "--max-model-len", "512"]
        server_env = {**env, "OMP_NUM_THREADS": str(len(cores) - 1)}
        server = subprocess.Popen(
            _pinned(cores[1:], command),
            env=server_env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        VLLMClient(port=port, timeout=300).wait_until_ready()
    try:
        with tempfile.NamedTemporaryFile(suffix=".json") as out:
            command = [sys.executable, __file__, "--train", mode, "--steps", str(steps), "--out", out.name]
            command += ["--port", str(port or 0)]
            trainer_env = {**env, "OMP_NUM_THREADS": str(len(trainer_cores))}
            subprocess.run(_pinned(trainer_cores, command), env=trainer_env, check=True)
            return json.loads(Path(out.name).read_text())
    finally:
        if server is not None:
            os.killpg(server.pid, 15)
            server.wait(timeout=60)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--modes", nargs="+", default=["generate", "server", "colocate", "async-server"])
    parser.add_argument("--cores", default="0,1", help="the cores all modes share, e.g. 0,1")
    parser.add_argument("--plot", metavar="PNG", help="also draw the medians as a chart (needs matplotlib)")
    parser.add_argument("--json", metavar="FILE", help="also write every step time to FILE")
    parser.add_argument("--replot", metavar="FILE", help="measure nothing: print and --plot the numbers in FILE")
    parser.add_argument("--train", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    cli = parser.parse_args()
    if cli.train:
        return train(cli.train, cli.steps, cli.port, cli.out)
    if cli.replot:
        run = json.loads(Path(cli.replot).read_text())
    else:
        cores = [int(c) for c in cli.cores.split(",")]
        results = {mode: run_mode(mode, cli.steps, cores) for mode in cli.modes}
        run = {"cores": cli.cores, "date": time.strftime("%Y-%m-%d"), "results": results}
    report(run, cli.plot)
    if cli.json:
        Path(cli.json).write_text(json.dumps(run, indent=1))


def _medians(run: dict) -> dict[str, float]:
    """Each mode's median step time over the steps after the first (which builds the engine), in the run's order."""
    return {mode: statistics.median(result["step_seconds"][1:]) for mode, result in run["results"].items()}


def report(run: dict, plot_path: str | None) -> None:
    """The table of a run, measured or saved (--replot), and with `plot_path` its chart."""
    medians = _medians(run)
    first = next(iter(medians))
    steps = len(run["results"][first]["step_seconds"])
    print(
        f"\nSmolLM2-135M, 16 completions of <= 32 tokens per step, cores {run['cores']}; medians of steps 2..{steps}"
    )
    width = max(16, *(len(mode) + 2 for mode in medians))
    print(f"{'mode':<{width}}{'s/step':>9}{'vs ' + first:>16}{'mean length':>13}   steps (s)")
    for mode, result in run["results"].items():
        median = medians[mode]
        times = " ".join(f"{t:.1f}" for t in result["step_seconds"])
        print(
            f"{mode:<{width}}{median:>9.2f}{medians[first] / median:>15.2f}x{result['mean_length']:>13.1f}   {times}"
        )
    for faster, slower in (("async-server", "server"), ("colocate", "server")):
        if faster in medians and slower in medians:
            print(f"{faster} against {slower}: {medians[slower] / medians[faster]:.2f}x faster")
    if plot_path:
        when = f"cores {run['cores']}, medians of steps 2-{steps}, {run.get('date', 'date not recorded')}"
        plot(medians, when, plot_path)
        print(f"chart written to {plot_path}")


def plot(medians: dict[str, float], when: str, path: str) -> None:
    """Seconds per optimizer step, one bar per mode, each labelled with its speed against the run's first mode; the
    scripted modes (the trainer's side alone) in a panel of their own, async-scripted labelled with its extra seconds
    over scripted (what async generation costs the trainer)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise SystemExit("--plot needs matplotlib in this environment (make install-vllm installs it).") from e
    first = next(iter(medians))
    groups = [
        ("generation modes", [m for m in medians if "scripted" not in m]),
        ("scripted sampler: the trainer's side alone", [m for m in medians if "scripted" in m]),
    ]
    groups = [(title, modes) for title, modes in groups if modes]
    widths = [len(modes) for _, modes in groups]
    fig, axes = plt.subplots(
        1, len(groups), figsize=(2 + 1.6 * len(medians), 4), sharey=True, squeeze=False, width_ratios=widths
    )
    for ax, (title, modes) in zip(axes[0], groups):
        colors = ["#b0b0b0" if mode == first else "#3b6ea8" for mode in modes]
        ax.bar(range(len(modes)), [medians[m] for m in modes], 0.6, color=colors)
        for i, mode in enumerate(modes):
            text = f"{medians[mode]:.2f} s\n{medians[first] / medians[mode]:.2f}x"
            if mode == "async-scripted" and "scripted" in medians:
                text += f"\n+{medians[mode] - medians['scripted']:.2f} s over scripted"
            ax.annotate(text, (i, medians[mode]), ha="center", va="bottom", fontsize=9)
        ax.set_xticks(range(len(modes)), modes)
        ax.set_xlim(-0.6, len(modes) - 0.4)
        ax.set_title(title, fontsize=9)
    axes[0][0].set_ylabel("seconds per optimizer step (median)")
    axes[0][0].set_ylim(0, max(medians.values()) * 1.25)
    fig.suptitle(
        f"SmolLM2-135M-Instruct, float32, CPU: 16 completions of <= 32 tokens per step; speed against {first}\n{when}",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
