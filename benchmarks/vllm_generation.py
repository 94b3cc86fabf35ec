"""Generation through `grpo vllm-serve` against the trainer's `model.generate`, and the time of a full weight sync.

    make bench-vllm                                   # builds .venv-vllm (vLLM's CPU build), then runs this
    .venv-vllm/bin/python benchmarks/vllm_generation.py --repeats 5

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
from grpo.generation.vllm_client import VLLMClient
from grpo.generation.weights import checkpoint_tensors
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
    cli = parser.parse_args()

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

    print(
        f"SmolLM2-135M-Instruct, float32, CPU; {PROMPTS} prompts x {G} completions x <= {TOKENS} tokens; "
        f"medians of {cli.repeats}"
    )
    print(f"{'regime':12} {'model.generate':>15} {'vllm-serve':>11} {'speed-up':>9}")
    for regime, hf, served in results:
        print(f"{regime:12} {hf:14.2f}s {served:10.2f}s {hf / served:8.2f}x")
    print(
        f"weight sync: {sync:.2f} s for {last['bytes'] / 2**20:.0f} MiB in {last['buckets']} buckets of <= {cli.bucket_mb:g} MiB"
    )


if __name__ == "__main__":
    main()
