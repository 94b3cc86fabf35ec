"""This trainer against TRL's `GRPOTrainer`, on the same machine, weights, data, reward and settings.

    make bench-trl                                                   # every scenario this machine can run
    .venv-trl/bin/python benchmarks/compare_trl.py --scenarios tiny --steps 3          # a quick run
    .venv-trl/bin/python benchmarks/compare_trl.py --scenarios smol-8x4 --kinds trl,ours-cpu --repeats 2
    .venv-trl/bin/python benchmarks/compare_trl.py --plot docs/images/compare-trl.png
    make bench       # the CPU scenarios, then the table into docs/performance.md (--write-docs), the chart, the JSON
    .venv-trl/bin/python benchmarks/compare_trl.py --merge a.json b.json --write-docs docs/performance.md

It installs nothing: run it in `.venv-trl` (`make install-trl`: this package, `trl==1.16.0` and the offline
SmolLM2-135M-Instruct; TRL is never a dependency of the library). Each run of a trainer is a fresh subprocess
that trains `--steps` optimizer steps; the kinds of run alternate (TRL, ours, ours, TRL, ...) so that a slow spell of
a shared machine hits both. Both trainers get the same model folder (float32 on CPU, bf16 on GPU), the same
tokenizer, the same plain-text prompts, the same reward function and the same settings, and every completion is
forced to its full length with `generation_kwargs={"min_new_tokens": L}`, so both sample and train on the same
number of tokens. smol-8x4-bf16 is smol-8x4 with `bf16=True` in both (autocast over float32 weights; on a CPU with
`use_cpu=True`, which TrainingArguments requires for it).

Printed per scenario: the median seconds per optimizer step (over the steps after the first, then the median over
repeats), the median CPU seconds per step of the run's process (`time.process_time`: on a machine shared with other
jobs the steadier figure, with `--threads 1` the work itself), completion tokens per second (rows x L / step
time), peak memory (the child's peak resident set size from `os.wait4` on CPU; `torch.cuda.max_memory_allocated` on
GPU) and ours / TRL. For our trainer, where the step's time goes, from its public hooks in the child (`Phases`: a
subclass overriding Trainer's `training_step` and `compute_loss`, the sampler's `generate` and the reward function
wrapped): generation split into prefill (up to the first sampled token) and decode, reward, old/reference log-probs
(the rest of the generation round), forward+backward (the training micro-step from `compute_loss` on), optimizer
(Trainer's optimizer step) and the rest. On a GPU, scenario gpu-0.5b also
prints the model FLOP utilisation of our training forward+backward (6 x parameters x tokens against the bf16 peak
given by --peak-tflops). `--json` saves the summaries with each scenario's machine, versions, date and load;
`--write-docs PAGE` replaces the block between the page's `<!-- compare-trl:begin -->` and `<!-- compare-trl:end -->`
markers with the table, so the published numbers are the benchmark's own output.

Kinds: `trl`; `ours`, this trainer with its defaults; `ours-cpu`, the same with the three opt-in CPU options on
(`cpu_decode_kernel`, `cpu_inverse_cdf_sampling`, `keep_freed_cpu_memory`: grpo/contrib/cpu/), as the demo's recipe
sets them. Each kind of ours is a set of GRPOConfig fields a user could set (`OURS`). The before-kinds of earlier
measurements (`ours-noprefill`, `ours-noprompt`, `ours-base`, `ours-prepass`, `ours-mmap`, `ours-head-draw`, and
`ours-nokeep` and `ours-mkl`, which the CPU options' own fields now express) patched private functions or module
attributes of grpo and were removed (issue 27); their numbers stay in docs/performance.md as history.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# rows: completions per optimizer step (one micro-batch); G: completions per prompt; P: prompt tokens; L: completion
# tokens. The smol-* rows are issue 19's table; smol-200 is a long-prompt round where the prefill matters.
SCENARIOS = {
    "tiny": dict(model="tiny", rows=8, G=4, P=32, L=32, beta=0.04, loss="dapo"),
    "smol-200": dict(model="smollm2", rows=8, G=8, P=200, L=64, beta=0.04, loss="dapo"),
    "smol-8x4": dict(model="smollm2", rows=8, G=4, P=40, L=32, beta=0.04, loss="dapo"),
    "smol-16x8": dict(model="smollm2", rows=16, G=8, P=40, L=24, beta=0.0, loss="dapo"),
    # smol-8x4 with `bf16=True`: autocast over float32 weights, in both trainers (on a CPU also `use_cpu=True`)
    "smol-8x4-bf16": dict(model="smollm2", rows=8, G=4, P=40, L=32, beta=0.04, loss="dapo", amp=True),
    # the demo's shape (examples/recipes/demo.yaml): 2 prompts x 8 completions of 12 tokens, beta 0; the chat prompt
    # of "Calculate 6 + 3." is 37 tokens with SmolLM2's default system message
    "smol-demo": dict(model="smollm2", rows=16, G=8, P=40, L=12, beta=0.0, loss="dapo"),
    # smol-8x4 with each round replayed once (`num_iterations=2`): an optimizer step on a fresh round, then one on its
    # replay, where pi_old differs from the policy; step times are per round (the mean of its 2 steps)
    "smol-8x4-mu2": dict(model="smollm2", rows=8, G=4, P=40, L=32, beta=0.04, loss="dapo", iterations=2),
    "gpu-0.5b": dict(model="qwen-0.5b", rows=8, G=8, P=512, L=256, beta=0.04, loss="dapo", gpu=True),
}
# Our trainer's kinds of run, each a set of GRPOConfig fields a user could set: the defaults, and the three opt-in CPU
# options (grpo/contrib/cpu/; docs/performance.md, "Opt-in CPU tuning") on, as examples/recipes/demo.yaml sets them.
CPU_OPTIONS = dict(cpu_decode_kernel=True, cpu_inverse_cdf_sampling=True, keep_freed_cpu_memory=True)
OURS = {"ours": {}, "ours-cpu": CPU_OPTIONS}
KINDS = ["trl", *OURS]
CPU_SCENARIOS = ["tiny", "smol-200", "smol-8x4", "smol-16x8", "smol-8x4-bf16", "smol-demo", "smol-8x4-mu2"]
PHASES = ["prefill", "decode", "reward", "old/ref logps", "forward+backward", "optimizer"]


# ---- The child: one trainer, `steps` optimizer steps ----


def model_folder(name: str, cache: Path) -> str:
    """A folder both trainers load: the tiny test model, the offline SmolLM2, or a Qwen2.5-0.5B-shaped random model."""
    if name == "smollm2":
        from grpo.models import smollm2_path

        return str(smollm2_path())
    folder = cache / name
    if (folder / "config.json").exists():
        return str(folder)
    from grpo.testing import save_tiny_model

    if name == "tiny":
        save_tiny_model(folder)
        return str(folder)
    # Qwen2.5-0.5B's shape (494M parameters, tied embeddings, vocabulary 151,936), random weights, with the tiny
    # byte-level tokenizer: the prompts are byte strings, sampled ids above its vocabulary decode to nothing.
    save_tiny_model(
        folder,
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        head_dim=64,
        tie_word_embeddings=True,
        max_position_embeddings=4096,
    )
    return str(folder)


def prompts_of(tokenizer, count: int, length: int) -> list[str]:
    """`count` distinct plain-text prompts of `length` tokens (re-tokenised they may differ by a token or two)."""
    text = (
        "The committee met on a grey morning to review the harbour accounts, the ferry timetable and the repairs "
        "to the north pier, and agreed to report again in spring. "
    ) * (length // 8 + 4)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return [f"Note {i}: " + tokenizer.decode(ids[: max(length - 4, 1)]) + " Summary:" for i in range(count)]


def reward_vowels(prompts, completions, **kwargs):
    """A deterministic reward with a spread within groups: the share of vowels in the completion."""
    return [sum(c in "aeiou" for c in text) / max(len(text), 1) for text in completions]


class Phases:
    """Seconds per phase of our trainer's current optimizer step, from public hooks only: Trainer's `training_step`
    and `compute_loss` (overridden in a subclass, as Trainer invites), the sampler's `generate` and the reward
    function (wrapped), and the step callbacks. A micro-step's generation round (when it starts one) runs inside
    `training_step` before `compute_loss`: generation, the reward, then the old and reference log-prob passes, which
    are what is left of that stretch (with the round's bookkeeping, milliseconds)."""

    def __init__(self, completion_length: int):
        self.L, self.current, self.steps = completion_length, {}, []
        self.loss_start = None

    def add(self, name, seconds):
        self.current[name] = self.current.get(name, 0.0) + seconds

    def reward(self, fn):
        """The reward function `fn`, its calls timed as the reward phase."""

        @functools.wraps(fn)
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.add("reward", time.perf_counter() - start)

        return timed

    def trainer_class(self, base):
        """`base` (GRPOTrainer) with each micro-step split where `compute_loss` starts: before it the generation round
        (when the micro-step starts one), after it the forward and backward."""
        import torch

        phases = self

        class Timed(base):
            def training_step(self, *args, **kwargs):
                phases.loss_start = None
                start = time.perf_counter()
                result = super().training_step(*args, **kwargs)
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                phases.add("round", phases.loss_start - start)
                phases.add("forward+backward", time.perf_counter() - phases.loss_start)
                return result

            def compute_loss(self, *args, **kwargs):
                if phases.loss_start is None:
                    phases.loss_start = time.perf_counter()
                return super().compute_loss(*args, **kwargs)

        return Timed

    def split_generation(self, sampler):
        """The sampler's `generate` (an instance attribute) timed as prefill and decode."""
        generate, phases = sampler.generate, self

        def generate_split(model, prompt_ids):
            # `generate` runs L forward passes for L forced tokens: the first samples token 1 (with the prompt, or
            # after the shared prefill), the other L - 1 decode. Prefill = until the end of the first of those L.
            ends, start = [], time.perf_counter()
            handle = model.register_forward_hook(lambda *a: ends.append(time.perf_counter()))
            try:
                out = generate(model, prompt_ids)
            finally:
                handle.remove()
            total = time.perf_counter() - start
            prefill = ends[-phases.L] - start if len(ends) >= phases.L else total
            phases.add("prefill", prefill)
            phases.add("decode", total - prefill)
            return out

        sampler.generate = generate_split

    def finish_step(self, seconds):
        step = dict(self.current)
        sampled = sum(step.get(k, 0.0) for k in ("prefill", "decode", "reward"))
        step["old/ref logps"] = max(step.pop("round", 0.0) - sampled, 0.0)
        step["other"] = seconds - sum(step.values())
        self.steps.append(step)
        self.current = {}


def child(kind: str, scenario: str, steps: int, cache: Path) -> dict:
    """Train `steps` optimizer steps with one trainer; returns step times, the phase split and GPU memory."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    spec = SCENARIOS[scenario]
    on_gpu = torch.cuda.is_available()
    folder = model_folder(spec["model"], cache)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    dtype = torch.bfloat16 if on_gpu and spec.get("gpu") else torch.float32
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
    num_prompts = steps * spec["rows"] // spec["G"]
    dataset = Dataset.from_dict({"prompt": prompts_of(tokenizer, num_prompts, spec["P"])})
    settings = dict(
        output_dir=tempfile.mkdtemp(),
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        logging_steps=10**6,
        max_steps=steps,
        seed=0,
        learning_rate=1e-6,
        per_device_train_batch_size=spec["rows"],
        gradient_accumulation_steps=1,
        num_iterations=spec.get("iterations", 1),
        num_generations=spec["G"],
        max_completion_length=spec["L"],
        generation_kwargs={"min_new_tokens": spec["L"]},
        temperature=1.0,
        top_k=0,
        beta=spec["beta"],
        loss_type=spec["loss"],
        bf16=dtype == torch.bfloat16 or spec.get("amp", False),
        use_cpu=spec.get("amp", False) and not on_gpu,  # TrainingArguments allows bf16 on a CPU only with use_cpu
        dataloader_pin_memory=on_gpu,
        shuffle_dataset=False,
    )
    phases = None
    if kind == "trl":
        from trl import GRPOConfig, GRPOTrainer

        args = GRPOConfig(**settings, model_init_kwargs={"dtype": dtype})
    else:
        from grpo import GRPOConfig, GRPOTrainer

        args = GRPOConfig(**settings, max_prompt_length=None, **OURS[kind])
        phases = Phases(spec["L"])
        GRPOTrainer = phases.trainer_class(GRPOTrainer)  # noqa: N806

    step_times, cpu_times = [], []

    class StepTimer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if on_gpu:
                torch.cuda.synchronize()
            self.start, self.cpu_start = time.perf_counter(), time.process_time()

        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            self.optimizer_start = time.perf_counter()

        def on_optimizer_step(self, args, state, control, **kwargs):
            if phases is not None:
                phases.add("optimizer", time.perf_counter() - self.optimizer_start)

        def on_step_end(self, args, state, control, **kwargs):
            if on_gpu:
                torch.cuda.synchronize()
            step_times.append(time.perf_counter() - self.start)
            cpu_times.append(time.process_time() - self.cpu_start)
            progress = f"{kind} {scenario} step {len(step_times)}: {step_times[-1]:.2f} s, CPU {cpu_times[-1]:.2f} s"
            print(progress, file=sys.stderr, flush=True)
            if phases is not None:
                phases.finish_step(step_times[-1])

    reward = phases.reward(reward_vowels) if phases else reward_vowels
    trainer = GRPOTrainer(
        model=model, reward_funcs=reward, args=args, train_dataset=dataset, processing_class=tokenizer
    )
    if phases:
        phases.split_generation(trainer.generation)
    trainer.add_callback(StepTimer())
    if on_gpu:
        torch.cuda.reset_peak_memory_stats()
    trainer.train()
    return {
        "step_times": step_times,
        "cpu_times": cpu_times,
        "phases": phases.steps if phases else None,
        "gpu_peak": torch.cuda.max_memory_allocated() if on_gpu else None,
        "parameters": sum(p.numel() for p in model.parameters()),
        "threads": torch.get_num_threads(),
        "device": torch.cuda.get_device_name() if on_gpu else "cpu",
    }


# ---- The parent: alternate the runs, summarise, plot ----


def run_child(kind: str, scenario: str, steps: int, cache: Path, threads: int | None) -> dict:
    command = [sys.executable, __file__, "--child", kind, "--scenarios", scenario, "--steps", str(steps)]
    command += ["--cache", str(cache)]
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    log = cache / f"{kind}-{scenario}.log"  # the child's stderr, with a line per step: `tail -f` it
    with open(log, "w") as stderr:
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=stderr, text=True, env=env)
        # wait4: this child's own peak resident set size (RUSAGE_CHILDREN would be the maximum over all of them).
        _, status, usage = os.wait4(process.pid, 0)
    out = process.stdout.read()
    if status != 0:
        raise RuntimeError(f"{kind} on {scenario} failed:\n{log.read_text()[-4000:]}")
    result = json.loads(out.strip().splitlines()[-1])
    result["peak_rss"] = usage.ru_maxrss * 1024  # kilobytes on Linux
    return result


def per_round(values: list, iterations: int) -> list:
    """Per-step figures (numbers, or dicts of phase seconds) averaged over each generation round's `iterations`
    steps, the first round dropped (it warms up); with one step per round, the steps after the first."""
    rounds = [values[i : i + iterations] for i in range(iterations, len(values) - iterations + 1, iterations)]
    rounds = rounds or [values]
    if isinstance(values[0], dict):
        return [{k: sum(step.get(k, 0.0) for step in r) / len(r) for k in PHASES + ["other"]} for r in rounds]
    return [sum(r) / len(r) for r in rounds]


def summarise(spec: dict, results: list[dict]) -> dict:
    """Medians: of each run's rounds after the first (its steps after the first, at one step per round), then over
    runs."""
    mu = spec.get("iterations", 1)
    per_run = [statistics.median(per_round(r["step_times"], mu)) for r in results]
    step = statistics.median(per_run)
    peak = statistics.median(r["gpu_peak"] if r["gpu_peak"] is not None else r["peak_rss"] for r in results)
    cpu = statistics.median(statistics.median(per_round(r["cpu_times"], mu)) for r in results)
    summary = {"step": step, "cpu": cpu, "runs": per_run, "tokens_per_s": spec["rows"] * spec["L"] / step}
    summary["peak"] = peak
    if results[0]["phases"]:
        steps = [s for r in results for s in per_round(r["phases"], mu)]
        summary["phases"] = {k: statistics.median(s.get(k, 0.0) for s in steps) for k in PHASES + ["other"]}
    summary["parameters"] = results[0]["parameters"]
    return summary


def kinds_of(rows: dict) -> dict:
    """A scenario's summaries by kind of run, without its "_run" record (machine, versions, date, load)."""
    return {kind: summary for kind, summary in rows.items() if not kind.startswith("_")}


def print_scenario(name: str, spec: dict, rows: dict, repeats: int, peak_tflops: float) -> None:
    rows = kinds_of(rows)
    memory = "GPU max allocated" if spec.get("gpu") else "peak RSS"
    mu = spec.get("iterations", 1)
    per = "steps" if mu == 1 else f"rounds (each the mean of its {mu} optimizer steps)"
    print(
        f"\n{name}: {spec['rows']} rows, G={spec['G']}, prompts ~{spec['P']} tokens, completions {spec['L']} tokens, "
        f"beta {spec['beta']}, {spec['loss']}; median of the {per} after the first, median of {repeats} runs each"
    )
    print(f"{'':14} {'s/step':>8} {'runs':>22} {'CPU s/step':>10} {'tokens/s':>9} {memory + ' MiB':>22}")
    for kind, s in rows.items():
        runs = ", ".join(f"{t:.2f}" for t in s["runs"])
        print(
            f"{kind:14} {s['step']:8.2f} {runs:>22} {s['cpu']:10.2f} {s['tokens_per_s']:9.1f} "
            f"{s['peak'] / 2**20:22,.0f}"
        )
    if "trl" in rows:
        for kind in (k for k in rows if k != "trl"):
            print(
                f"{kind} / trl: step time {rows[kind]['step'] / rows['trl']['step']:.2f}, "
                f"CPU time {rows[kind]['cpu'] / rows['trl']['cpu']:.2f}, "
                f"memory {rows[kind]['peak'] / rows['trl']['peak']:.2f}"
            )
    for kind, s in rows.items():
        if "phases" in s:
            split = ", ".join(f"{k} {v:.2f}" for k, v in s["phases"].items())
            print(f"where {kind}'s step goes (s, medians): {split}")
            if spec.get("gpu"):
                tokens = spec["rows"] * (spec["P"] + spec["L"])
                flops = 6 * s["parameters"] * tokens
                mfu = flops / s["phases"]["forward+backward"] / (peak_tflops * 1e12)
                print(f"{kind} MFU of forward+backward: {mfu:.1%} (6 N tokens against {peak_tflops:.0f} TFLOP/s)")


def plot(path: str, table: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(table)
    labels = {
        "trl": "TRL 1.16",
        "ours": "grpo, defaults",
        "ours-cpu": "grpo, the CPU options on",
    }
    table = {name: kinds_of(rows) for name, rows in table.items()}
    kinds = [k for k in labels if any(k in table[n] for n in names)]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    width = 0.8 / len(kinds)
    for ax, key, label in zip(axes, ("step", "cpu"), ("seconds per step (wall)", "CPU seconds per step")):
        for i, kind in enumerate(kinds):
            xs = [j + (i - (len(kinds) - 1) / 2) * width for j in range(len(names))]
            ys = [table[n][kind].get(key, 0) if kind in table[n] else 0 for n in names]
            ax.bar(xs, ys, width, label=labels[kind])
            for x, y, n in zip(xs, ys, names):
                if kind != "trl" and table[n].get("trl", {}).get(key) and y:
                    ratio = y / table[n]["trl"][key]
                    ax.annotate(f"x{ratio:.2f}", (x, y), ha="center", va="bottom", fontsize=7)
        ax.set_xticks(range(len(names)), names, fontsize=8, rotation=25, ha="right")
        ax.set_ylabel(f"{label}, median (log scale)", fontsize=8)
        ax.set_yscale("log")  # the tiny model's milliseconds and SmolLM2's minutes on one axis
    handles, texts = axes[0].get_legend_handles_labels()
    fig.legend(handles, texts, fontsize=8, loc="lower center", ncol=len(kinds), frameon=False)
    fig.suptitle("GRPO step, same machine, weights, data and settings (ours / TRL above the bars)", fontsize=9)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(path, dpi=110)
    print(f"\nchart written to {path}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--scenarios", default="all", help=f"comma-separated, of {', '.join(SCENARIOS)}; or all")
    parser.add_argument(
        "--kinds",
        default="trl,ours,ours-cpu",
        help=f"comma-separated, of {', '.join(KINDS)} (ours-cpu: the opt-in CPU options on)",
    )
    parser.add_argument("--steps", type=int, default=5, help="optimizer steps per run (the first is not counted)")
    parser.add_argument("--repeats", type=int, default=1, help="runs of each kind per scenario, alternated")
    parser.add_argument("--threads", type=int, help="OMP_NUM_THREADS of every run (default: torch's choice)")
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="the GPU's dense bf16 peak (H100 SXM: 989)")
    parser.add_argument("--plot", help="write a chart of step time per scenario to this PNG")
    parser.add_argument("--json", help="also write the summary to this JSON file")
    parser.add_argument(
        "--merge", nargs="+", metavar="JSON", help="print, plot and merge saved --json summaries, run nothing"
    )
    parser.add_argument(
        "--write-docs",
        metavar="MARKDOWN",
        help="also write the table, machine, versions and dates between the compare-trl markers of this page",
    )
    parser.add_argument("--cache", default=os.path.join(tempfile.gettempdir(), "grpo-compare-trl"))
    parser.add_argument("--child", help=argparse.SUPPRESS)
    cli = parser.parse_args()
    cache = Path(cli.cache)
    cache.mkdir(parents=True, exist_ok=True)
    if cli.child:
        print(json.dumps(child(cli.child, cli.scenarios, cli.steps, cache)))
        return

    if cli.merge:
        table = {}
        for path in cli.merge:
            table.update(json.loads(Path(path).read_text()))
        for name, rows in table.items():
            repeats = len(next(iter(kinds_of(rows).values()))["runs"])
            print_scenario(name, SCENARIOS[name], rows, repeats, cli.peak_tflops)
        if cli.json:
            Path(cli.json).write_text(json.dumps(table, indent=1))
        if cli.plot:
            plot(cli.plot, table)
        if cli.write_docs:
            write_docs(cli.write_docs, table)
        return

    import torch

    names = list(SCENARIOS) if cli.scenarios == "all" else cli.scenarios.split(",")
    kinds = cli.kinds.split(",")
    unknown = [kind for kind in kinds if kind not in KINDS]
    if unknown:
        parser.error(f"unknown kinds {unknown}; the kinds are {', '.join(KINDS)}")
    on_gpu = torch.cuda.is_available()
    machine = torch.cuda.get_device_name() if on_gpu else f"{cpu_name()}, {os.cpu_count()} cores"
    threads = cli.threads or torch.get_num_threads()
    versions = f"torch {torch.__version__}, transformers {version('transformers')}, trl {version('trl')}"
    print(f"{machine}, {threads} threads per run; {versions}; load average at start {os.getloadavg()[0]:.1f}")
    table = {}
    for name in names:
        spec = SCENARIOS[name]
        if spec.get("gpu") and not on_gpu:
            print(f"\n{name}: skipped (needs a CUDA GPU; this machine has none)")
            continue
        results = {kind: [] for kind in kinds}
        run = {"date": time.strftime("%Y-%m-%d"), "machine": machine, "threads": threads, "versions": versions}
        run |= {"steps": cli.steps, "repeats": cli.repeats, "load_start": os.getloadavg()[0]}
        for repeat in range(cli.repeats):  # alternated, the order reversed every repeat
            for kind in kinds if repeat % 2 == 0 else kinds[::-1]:
                results[kind].append(run_child(kind, name, cli.steps, cache, cli.threads))
        table[name] = {kind: summarise(spec, r) for kind, r in results.items()}
        table[name]["_run"] = run | {"load_end": os.getloadavg()[0]}
        print_scenario(name, spec, table[name], cli.repeats, cli.peak_tflops)
    print(f"\nload average at the end {os.getloadavg()[0]:.1f}")
    if cli.json:
        Path(cli.json).write_text(json.dumps(table, indent=1))
    if cli.plot and table:
        plot(cli.plot, table)
    if cli.write_docs and table:
        write_docs(cli.write_docs, table)


BEGIN, END = "<!-- compare-trl:begin -->", "<!-- compare-trl:end -->"


def docs_block(table: dict) -> str:
    """The measured table as Markdown: per scenario and kind of ours (`OURS`), ours against TRL in wall and CPU time
    and peak memory, how and where it was measured, then where our step's time goes."""
    lines = [
        "| scenario | kind | TRL s/step | ours s/step | **ours / TRL** | TRL CPU s/step | ours CPU s/step | CPU ratio "
        "| TRL peak memory | ours peak memory | memory ratio | runs x steps | load average |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    split = ["| scenario | kind | " + " | ".join(PHASES) + " | rest |", "|---" * (len(PHASES) + 3) + "|"]
    where = set()
    for name, rows in table.items():
        run, kinds = rows.get("_run", {}), kinds_of(rows)
        for kind in (k for k in OURS if k in kinds):
            ours = kinds[kind]
            if "trl" in kinds:
                trl = kinds["trl"]
                load = f"{run['load_start']:.1f}-{run['load_end']:.1f}" if run else "not recorded"
                size = f"{run['repeats']} x {run['steps']}" if run else f"{len(ours['runs'])} x ?"
                lines.append(
                    f"| {name} | {kind} | {trl['step']:.2f} | {ours['step']:.2f} "
                    f"| **{ours['step'] / trl['step']:.2f}** | {trl['cpu']:.2f} | {ours['cpu']:.2f} "
                    f"| {ours['cpu'] / trl['cpu']:.2f} | {trl['peak'] / 2**20:,.0f} MiB | {ours['peak'] / 2**20:,.0f} MiB "
                    f"| {ours['peak'] / trl['peak']:.2f} | {size} | {load} |"
                )
            if "phases" in ours:
                phases = [f"{ours['phases'][k]:.2f}" for k in [*PHASES, "other"]]
                split.append(f"| {name} | {kind} | " + " | ".join(phases) + " |")
        if run:
            where.add(f"{run['date']}: {run['machine']}, {run['threads']} thread(s) per run; {run['versions']}")
    return "\n".join(
        [
            BEGIN,
            "Measured " + "; ".join(sorted(where) or ["(no machine recorded)"]) + ".",
            "",
            *lines,
            "",
            "Where our step's time goes (wall seconds, medians over the same steps):",
            "",
            *split,
            END,
        ]
    )


def write_docs(path: str, table: dict) -> None:
    """Replace the block between the compare-trl markers of the Markdown page `path` by `docs_block(table)`."""
    page = Path(path).read_text()
    if BEGIN not in page or END not in page:
        raise SystemExit(f"{path} has no {BEGIN} ... {END} block to replace; add the two markers where it goes.")
    head, rest = page.split(BEGIN, 1)
    Path(path).write_text(head + docs_block(table) + rest.split(END, 1)[1])
    print(f"table written to {path}")


def cpu_name() -> str:
    """The CPU's model name (Linux), else the platform's processor string."""
    import platform

    try:
        with open("/proc/cpuinfo") as info:
            return next(line.split(":", 1)[1].strip() for line in info if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "CPU"


def version(package: str) -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return installed(package)
    except PackageNotFoundError:
        return "not installed"


if __name__ == "__main__":
    main()
