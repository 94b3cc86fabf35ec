"""Decoding on a CPU: grpo's opt-in kernel and draws against torch's products (MKL) and `torch.multinomial`.

The kernel is grpo/contrib/cpu/decode.py (`cpu_decode_kernel`), the draws grpo/contrib/cpu/sampling.py
(`cpu_inverse_cdf_sampling`); both are off by default.

    python benchmarks/cpu_decode.py                      # torch's thread count
    OMP_NUM_THREADS=1 python benchmarks/cpu_decode.py    # one thread, as benchmarks/compare_trl.py --threads 1

Four measurements, each alternating its variants in this process, medians over --repeats after a warm-up:
1. the memory bound: one read of SmolLM2-135M's weight matrices (`sum` of each), what a decoding step cannot beat;
2. the products of one decoding step at --rows rows: every weight matrix of SmolLM2-135M's shape (30 layers of
   q, k, v, o, gate, up and down, and the 49,152 x 576 output projection) times --rows input rows, `F.linear`
   against `decode.linear`;
3. one step's draw of the next tokens at --rows rows of a 49,152-token vocabulary: `torch.multinomial(probs, 1)`
   against `sampling.categorical`;
4. sampling itself: `TransformersGeneration.generate` on SmolLM2-135M-Instruct (the offline model), 2 prompts of
   40 tokens x 4 copies (8 rows, compare_trl.py's smol-8x4), 32 tokens forced: both options off (torch), the
   kernel alone (`cpu_decode_kernel=True`), the draws alone (`cpu_inverse_cdf_sampling=True`), and both on.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from grpo.contrib.cpu import decode, sampling
from grpo.generation import TransformersGeneration

# SmolLM2-135M: hidden 576, MLP 1536, 9 query heads and 3 key-value heads of 64, 30 layers, vocabulary 49,152.
LAYER = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)]
SHAPES = LAYER * 30 + [(49152, 576)]


def alternate(variants: dict, repeats: int) -> dict[str, float]:
    """Median seconds of each variant, run in turn `repeats` times after one warm-up round."""
    times = {name: [] for name in variants}
    for round_ in range(repeats + 1):
        for name, fn in variants.items():
            start = time.perf_counter()
            fn()
            if round_:
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--generate-repeats", type=int, default=3)
    cli = parser.parse_args()
    if not decode.available():
        raise SystemExit("The kernel cannot run here (needs Linux x86-64, AVX-512 and a C compiler).")
    print(f"{torch.get_num_threads()} thread(s); {cli.rows} rows; torch {torch.__version__}")

    torch.manual_seed(0)
    weights = [torch.randn(shape) for shape in SHAPES]
    size = sum(w.numel() * 4 for w in weights)
    inputs = {k: torch.randn(cli.rows, k) for k in {576, 1536}}
    read = alternate({"read": lambda: [w.sum() for w in weights]}, cli.repeats)["read"]
    products = alternate(
        {
            "torch": lambda: [F.linear(inputs[w.shape[1]], w) for w in weights],
            "kernel": lambda: [decode.linear(inputs[w.shape[1]], w) for w in weights],
        },
        cli.repeats,
    )
    print(f"\none read of the {size / 2**20:.0f} MiB of weights: {read * 1e3:.1f} ms ({size / read / 1e9:.1f} GB/s)")
    print(f"one decoding step's products at {cli.rows} rows:")
    for name, seconds in products.items():
        print(f"  {name:7s} {seconds * 1e3:7.1f} ms  ({size / seconds / 1e9:5.1f} GB/s of weights)")
    print(f"  kernel / torch: {products['kernel'] / products['torch']:.2f}")

    probs = torch.softmax(torch.randn(cli.rows, SHAPES[-1][0]) * 3, dim=-1)
    draws = alternate(
        {
            "torch": lambda: [torch.multinomial(probs, 1) for _ in range(10)],
            "grpo": lambda: [sampling.categorical(probs) for _ in range(10)],
        },
        cli.repeats,
    )
    print(f"\none step's draw at {cli.rows} rows x {SHAPES[-1][0]:,} tokens:")
    for name, seconds in draws.items():
        print(f"  {name:7s} {seconds / 10 * 1e3:7.2f} ms")
    print(f"  grpo / torch: {draws['grpo'] / draws['torch']:.2f}")

    from transformers import AutoModelForCausalLM

    from grpo.models import smollm2_path

    model = AutoModelForCausalLM.from_pretrained(str(smollm2_path()), dtype=torch.float32)
    prompts = [[int(t) for t in torch.randint(100, 40000, (40,))] for _ in range(2)]
    rows = [p for p in prompts for _ in range(4)]
    options = {  # the GRPOConfig fields of each variant
        "torch": {},
        "kernel": {"cpu_decode_kernel": True},
        "draws": {"cpu_inverse_cdf_sampling": True},
        "kernel and draws": {"cpu_decode_kernel": True, "cpu_inverse_cdf_sampling": True},
    }
    samplers = {
        name: TransformersGeneration(
            max_completion_length=32,
            pad_token_id=2,
            eos_token_ids=[2],
            top_k=0,
            generation_kwargs={"min_new_tokens": 32},
            **fields,
        )
        for name, fields in options.items()
    }
    generation = alternate(
        {name: (lambda sampler=sampler: sampler.generate(model, rows)) for name, sampler in samplers.items()},
        cli.generate_repeats,
    )
    print("\nTransformersGeneration.generate, 8 rows (2 prompts of 40 tokens x 4), 32 tokens:")
    for name, seconds in generation.items():
        print(f"  {name:16s} {seconds:7.2f} s  ({seconds / generation['torch']:.2f} of torch's)")


if __name__ == "__main__":
    main()
