"""Generation through `grpo vllm-serve` against the trainer's `model.generate`, and the time of a full weight sync.

    make bench-vllm                                   # builds .venv-vllm (vLLM's CPU build), then runs this
    .venv-vllm/bin/python benchmarks/vllm_generation.py --repeats 5
    .venv-vllm/bin/python benchmarks/vllm_generation.py --plot vllm-generation.png   # also a bar chart
    .venv-vllm/bin/python benchmarks/vllm_generation.py --replot run.json --plot vllm-generation.png   # a saved run

The job is one GRPO generation round on SmolLM2-135M-Instruct (float32, CPU): 8 chat prompts x 8 completions of at
most 64 tokens, temperature 1. The baseline is `TransformersGeneration`, the trainer's own `model.generate` backend
(64 left-padded rows); the server gets the 8 prompts once each with n=8 over HTTP (`VLLMClient`), as the trainer
sends them. Both run in turn in this one run, after a warm-up each; times are medians over `--repeats`.

Two regimes: "sampled" stops each completion at its EOS, as in training; "64 tokens" forces all 64 tokens in every
completion (min_new_tokens / min_tokens), the same decode work on both sides. The weight sync sends every weight of
the policy, under the names of its checkpoint, in `--bucket-mb` buckets, and waits until the server has loaded them.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from grpo.data import render_prompt, tokenize_prompts
from grpo.generation import TransformersGeneration
from grpo.generation.policy_weights import checkpoint_tensors
from grpo.generation.vllm.client import VLLMClient
from grpo.models import smollm2_path

PROMPTS, G, TOKENS = 8, 8, 64
QUESTIONS = [f"What is {a} + {b}? Answer with the number." for a, b in zip(range(2, 10), range(9, 1, -1))]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _median_time(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--bucket-mb", type=float, default=256)
    parser.add_argument("--plot", metavar="PNG", help="also draw the measured times as a chart (needs matplotlib)")
    parser.add_argument("--json", metavar="FILE", help="also write the measured numbers to FILE")
    parser.add_argument("--replot", metavar="FILE", help="measure nothing: print and --plot the numbers in FILE")
    cli = parser.parse_args()
    if cli.replot:
        with open(cli.replot) as f:
            run = json.load(f)
    else:
        run = measure(cli)
    report(run, cli.plot)
    if cli.json:
        with open(cli.json, "w") as f:
            json.dump(run, f, indent=1)


def measure(cli) -> dict:
    """The medians: {"results": [[regime, model.generate s, vllm-serve s], ...], "sync": s, "sync_label": str,
    "repeats": int, "date": "YYYY-MM-DD"}."""
    path = smollm2_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    # Rendered and tokenized as the trainer does it (chat template, then token ids).
    messages = [[{"role": "user", "content": q}] for q in QUESTIONS[:PROMPTS]]
    prompts = tokenize_prompts([render_prompt(m, tokenizer) for m in messages], tokenizer, None)
    rows = [p for p in prompts for _ in range(G)]  # the trainer's layout: each prompt's G copies consecutive

    port = _free_port()
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    command = [sys.executable, "-m", "grpo", "vllm-serve", "--model", str(path), "--port", str(port)]
    command += ["--dtype", "float32", "--enforce-eager", "--max-model-len", "512"]
    server = subprocess.Popen(
        command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    try:
        client = VLLMClient(port=port, timeout=300, group_port=_free_port())
        client.wait_until_ready()
        results = []
        for regime, minimum in (("sampled", 0), ("64 tokens", TOKENS)):
            extra = {"min_new_tokens": minimum} if minimum else None
            backend = TransformersGeneration(
                max_completion_length=TOKENS,
                pad_token_id=tokenizer.pad_token_id,
                eos_token_ids=[tokenizer.eos_token_id],
                generation_kwargs=extra,
            )
            hf = _median_time(lambda backend=backend: backend.generate(model, rows), cli.repeats)
            served = _median_time(
                lambda minimum=minimum: client.generate(
                    prompts, n=G, max_tokens=TOKENS, min_tokens=minimum, temperature=1.0
                ),
                cli.repeats,
            )
            results.append((regime, hf, served))
        sync = _median_time(
            lambda: client.update_weights(
                checkpoint_tensors(model), version=0, bucket_bytes=int(cli.bucket_mb * 2**20)
            ),
            cli.repeats,
        )
        last = client.update_weights(checkpoint_tensors(model), version=0, bucket_bytes=int(cli.bucket_mb * 2**20))
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=30)

    sync_label = f"{last['bytes'] / 2**20:.0f} MiB in {last['buckets']} buckets of <= {cli.bucket_mb:g} MiB"
    date = time.strftime("%Y-%m-%d")
    return {"results": results, "sync": sync, "sync_label": sync_label, "repeats": cli.repeats, "date": date}


def report(run: dict, plot_path: str | None) -> None:
    print(
        f"SmolLM2-135M-Instruct, float32, CPU; {PROMPTS} prompts x {G} completions x <= {TOKENS} tokens; "
        f"medians of {run['repeats']}"
    )
    print(f"{'regime':12} {'model.generate':>15} {'vllm-serve':>11} {'speed-up':>9}")
    for regime, hf, served in run["results"]:
        print(f"{regime:12} {hf:14.2f}s {served:10.2f}s {hf / served:8.2f}x")
    print(f"weight sync: {run['sync']:.2f} s for {run['sync_label']}")
    if plot_path:
        plot(run["results"], run["sync"], run["sync_label"], f"medians of {run['repeats']}, {run['date']}", plot_path)
        print(f"chart written to {plot_path}")


def plot(results: list[tuple[str, float, float]], sync: float, sync_label: str, when: str, path: str) -> None:
    """Seconds per generation round, model.generate against vllm-serve per regime, each pair labelled with the
    speed-up (the figure to read across machines), and the full weight sync's seconds beside them."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise SystemExit("--plot needs matplotlib in this environment (make install-vllm installs it).") from e
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8), gridspec_kw={"width_ratios": [3, 1]})
    x = range(len(results))
    hf = [r[1] for r in results]
    served = [r[2] for r in results]
    left.bar([i - 0.2 for i in x], hf, 0.4, label="model.generate", color="#b0b0b0")
    left.bar([i + 0.2 for i in x], served, 0.4, label="grpo vllm-serve", color="#3b6ea8")
    for i, (h, s) in enumerate(zip(hf, served)):
        left.annotate(f"{h:.1f} s", (i - 0.2, h), ha="center", va="bottom", fontsize=9)
        left.annotate(f"{s:.1f} s, {h / s:.2f}x", (i + 0.2, s), ha="center", va="bottom", fontsize=9)
    left.set_xticks(list(x), [f"{r[0]}" for r in results])
    left.set_ylabel("seconds per generation round")
    left.set_ylim(0, max(hf) * 1.3)
    left.legend(frameon=False, fontsize=9, loc="upper right", ncol=2)
    right.bar([0], [sync], 0.5, color="#3b6ea8")
    right.annotate(f"{sync:.2f} s", (0, sync), ha="center", va="bottom", fontsize=9)
    right.set_xticks([0], ["full weight sync"])
    right.set_xlim(-0.75, 0.75)
    right.set_ylim(0, sync * 1.3)
    right.set_ylabel("seconds")
    right.set_title(sync_label, fontsize=8)
    fig.suptitle(
        f"SmolLM2-135M-Instruct, float32, CPU: {PROMPTS} prompts x {G} completions x <= {TOKENS} tokens; {when}",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
