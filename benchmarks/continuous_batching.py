"""One generation round through transformers' continuous-batching engine (`use_transformers_continuous_batching`)
against the default `model.generate`, side by side in one run.

    .venv/bin/python benchmarks/continuous_batching.py                       # both models, 5 repeats
    .venv/bin/python benchmarks/continuous_batching.py --models tiny --repeats 9 --threads 1

A round is the trainer's: chat prompts rendered and tokenized, each repeated G times consecutively, sampled at
temperature 1 until EOS or the length limit. The two samplers are the backends the trainer builds for
`use_transformers_continuous_batching=False` and `=True` (`TransformersGeneration`, `ContinuousBatchingGeneration`),
with the same settings. Each is warmed up once; then the two alternate, round by round, so that a load that comes
and goes on a shared machine falls on both alike; the times printed are medians. Completions are sampled, so their
lengths differ between the two and between rounds: the tokens generated per second are printed beside the times.

Models: "tiny" (the random 2-layer model of grpo.testing, 16 prompts x 8 x <= 32 tokens) and "smollm2"
(SmolLM2-135M-Instruct, float32, offline: 4 prompts x 8 x <= 32 tokens).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from grpo.data import render_prompt, tokenize_prompts
from grpo.generation import ContinuousBatchingGeneration, SamplingRNG, TransformersGeneration, cut_at_eos

QUESTIONS = [f"What is {a} + {b}? Answer with the number." for a, b in zip(range(2, 18), range(17, 1, -1))]


def load(name: str):
    """(model, tokenizer, prompts, G, max tokens) of a scenario."""
    if name == "tiny":
        from grpo.testing import tiny_model, tiny_tokenizer

        tokenizer = tiny_tokenizer()
        return tiny_model(tokenizer), tokenizer, QUESTIONS[:16], 8, 32
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grpo.models import smollm2_path

    path = smollm2_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), tokenizer, QUESTIONS[:4], 8, 32


def measure(name: str, repeats: int) -> dict:
    model, tokenizer, questions, groups, tokens = load(name)
    messages = [[{"role": "user", "content": q}] for q in questions]
    prompts = tokenize_prompts([render_prompt(m, tokenizer) for m in messages], tokenizer, None)
    rows = [p for p in prompts for _ in range(groups)]
    eos = [tokenizer.eos_token_id]
    common = dict(max_completion_length=tokens, pad_token_id=tokenizer.pad_token_id, eos_token_ids=eos)
    samplers = {
        "model.generate": TransformersGeneration(rng=SamplingRNG(0), **common),
        "continuous batching": ContinuousBatchingGeneration(rng=SamplingRNG(0), **common),
    }
    times = {label: [] for label in samplers}
    generated = {label: [] for label in samplers}
    for sampler in samplers.values():
        sampler.generate(model, rows)  # warm-up
    for _ in range(repeats):
        for label, sampler in samplers.items():
            start = time.perf_counter()
            ids = sampler.generate(model, rows).ids
            times[label].append(time.perf_counter() - start)
            generated[label].append(sum(map(len, cut_at_eos(ids, eos, tokens)[0])))
    shape = f"{len(questions)} prompts x {groups} x <= {tokens} tokens"
    return {"name": name, "shape": shape, "times": times, "generated": generated}


def report(run: dict) -> None:
    print(f"\n{run['name']}: {run['shape']}, medians of {len(run['times']['model.generate'])} rounds each")
    print(f"{'sampler':22} {'s / round':>10} {'tokens / s':>11}", flush=True)
    medians = {}
    for label, times in run["times"].items():
        medians[label] = statistics.median(times)
        rate = statistics.median(n / t for n, t in zip(run["generated"][label], times))
        print(f"{label:22} {medians[label]:10.2f} {rate:11.0f}")
    ratio = medians["model.generate"] / medians["continuous batching"]
    print(f"continuous batching takes {1 / ratio:.2f}x the time of model.generate ({ratio:.2f}x its speed)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="tiny,smollm2", help="comma-separated: tiny, smollm2")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, help="torch's intra-op threads (default: torch's choice)")
    cli = parser.parse_args()
    if cli.threads:
        torch.set_num_threads(cli.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    for name in cli.models.split(","):
        report(measure(name, cli.repeats))


if __name__ == "__main__":
    main()
