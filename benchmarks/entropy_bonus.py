"""What an entropy bonus costs the log-prob projection: time of forward + backward through `chunked_logprobs`, three
ways side by side in one process, interleaved, medians.

    python benchmarks/entropy_bonus.py                       # CPU, float32, vocabulary 49,152 (SmolLM2's)
    python benchmarks/entropy_bonus.py --vocab 151936 --rows 256 --repeats 5
    python benchmarks/entropy_bonus.py --device cuda         # GPU, under bf16 autocast, with peak memory

- logps: the log-probs alone (`with_entropy=False`), what a pass without entropy costs;
- entropy: log-probs and entropy, the entropy without a gradient (the trainer's pass when no bonus is set: the
  `entropy` metric and `top_entropy_quantile` read it);
- bonus: log-probs and entropy with its gradient (`entropy_grad=True`), the loss reading both, as with `entropy_coef`.

The loss is sum(a * logp) (+ sum(b * H)) with fixed random weights; gradients flow to the hidden states and the
projection. Ratios are against `entropy`, the pass the trainer runs without a bonus.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from grpo.objective.logprobs import chunked_logprobs

MODES = ("logps", "entropy", "bonus")


def one_pass(mode, hidden, weight, targets, a, b, device):
    """Seconds (and peak bytes on CUDA) of one forward + backward in `mode`."""
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
        logps, entropy = chunked_logprobs(
            hidden, weight, targets, temperature=0.9, with_entropy=mode != "logps", entropy_grad=mode == "bonus"
        )
    loss = (a * logps).sum() + ((b * entropy).sum() if mode == "bonus" else 0.0)
    loss.backward()
    if device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated() if device == "cuda" else None
    hidden.grad = weight.grad = None
    return seconds, peak


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--rows", type=int, default=512, help="completion tokens in the micro-batch")
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()

    g = torch.Generator().manual_seed(0)
    hidden = (torch.randn(args.rows, args.hidden, generator=g) * 0.5).to(args.device).requires_grad_(True)
    weight = (torch.randn(args.vocab, args.hidden, generator=g) * 0.05).to(args.device).requires_grad_(True)
    targets = torch.randint(0, args.vocab, (args.rows,), generator=g).to(args.device)
    a, b = torch.randn(args.rows, generator=g).to(args.device), torch.randn(args.rows, generator=g).to(args.device)

    for mode in MODES:  # warm-up
        one_pass(mode, hidden, weight, targets, a, b, args.device)
    times, peaks = {m: [] for m in MODES}, {}
    for _ in range(args.repeats):  # interleaved, so drift in the machine's load hits every mode alike
        for mode in MODES:
            seconds, peak = one_pass(mode, hidden, weight, targets, a, b, args.device)
            times[mode].append(seconds)
            peaks[mode] = peak
    base = statistics.median(times["entropy"])
    print(f"rows {args.rows}, hidden {args.hidden}, vocab {args.vocab}, {args.device}, medians of {args.repeats}")
    for mode in MODES:
        median = statistics.median(times[mode])
        memory = f", peak {peaks[mode] / 2**20:.0f} MiB" if peaks[mode] is not None else ""
        print(f"  {mode:8s} {median * 1000:8.1f} ms  x{median / base:.2f} of entropy{memory}")


if __name__ == "__main__":
    main()
