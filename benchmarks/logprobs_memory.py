"""Peak memory and time of the log-prob + loss path, chunked (grpo) against naive full logits, side by side.

    python benchmarks/logprobs_memory.py                      # CPU, float32, vocabularies 49,152 and 151,936
    python benchmarks/logprobs_memory.py --device cuda        # GPU, bfloat16, torch.cuda.max_memory_allocated
    python benchmarks/logprobs_memory.py --vocab 49152 --repeats 3
    python benchmarks/logprobs_memory.py --plot logprobs_memory.png    # also a bar chart (needs matplotlib)

What is measured: from the final hidden states (B x T x H, here 8 x 512 x 896) and the output projection (V x H) to
a GRPO loss (grpo.objective.loss.policy_loss, dapo, beta 0.04, with old and reference log-probs), forward and backward, the
gradients of the hidden states and the projection included. The backbone is left out: it is the same for both.

- naive: logits = hidden @ W^T as one (B, T, V) tensor, / temperature, then grpo's row-wise selective log-softmax
  (what the trainer did before chunking, and what most GRPO trainers do).
- chunked: grpo.objective.logprobs.chunked_logprobs on the completion rows, chunk size from the vocabulary (auto_chunk_size).

On CPU each measurement runs in a fresh subprocess and peak memory is the rise of the peak resident set size over
the resident size once the inputs exist (ru_maxrss); the two run back to back for each vocabulary. Times are medians of `--repeats` forward+backward passes after one warm-up pass.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time

import torch

from grpo.objective.logprobs import auto_chunk_size, chunked_logprobs, selective_log_softmax
from grpo.objective.loss import policy_loss
from grpo.objective.settings import LossSettings

BATCH, LENGTH, HIDDEN = 8, 512, 896
TEMPERATURE = 0.9


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def _inputs(vocab: int, device: str, dtype: torch.dtype):
    torch.manual_seed(0)
    hidden = (torch.randn(BATCH, LENGTH, HIDDEN, device=device) * 0.5).to(dtype).requires_grad_()
    weight = (torch.randn(vocab, HIDDEN, device=device) * HIDDEN**-0.5).to(dtype).requires_grad_()
    targets = torch.randint(0, vocab, (BATCH, LENGTH), device=device)
    mask = torch.ones(BATCH, LENGTH, device=device)
    # Old and reference log-probs are the policy's own plus noise of 0.1 nats, so some ratios get clipped.
    old_shift = torch.randn(BATCH, LENGTH, device=device) * 0.1
    ref_shift = torch.randn(BATCH, LENGTH, device=device) * 0.1
    advantages = torch.randn(BATCH, device=device)
    return hidden, weight, targets, mask, old_shift, ref_shift, advantages


def _loss(impl: str, hidden, weight, targets, mask, old_shift, ref_shift, advantages):
    if impl == "naive":
        logits = hidden @ weight.T / TEMPERATURE  # (B, T, V)
        logps = selective_log_softmax(logits, targets)
    else:
        rows = mask.bool()
        values, _ = chunked_logprobs(hidden[rows], weight, targets[rows], temperature=TEMPERATURE)
        logps = torch.zeros(mask.shape, device=values.device).masked_scatter(rows, values)
    old, ref = logps.detach() + old_shift, logps.detach() + ref_shift
    loss, _ = policy_loss(logps, old, ref, advantages, mask, LossSettings(beta=0.04))
    return loss


def measure(impl: str, vocab: int, device: str, repeats: int) -> dict:
    """One implementation at one vocabulary size: peak extra memory (bytes) and median seconds per fwd+bwd."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    tensors = _inputs(vocab, device, dtype)
    times = []
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = _rss_bytes()
    for i in range(repeats + 1):
        for t in tensors[:2]:
            t.grad = None
        start = time.perf_counter()
        _loss(impl, *tensors).backward()
        if device == "cuda":
            torch.cuda.synchronize()
        if i > 0:  # the first pass warms up
            times.append(time.perf_counter() - start)
    if device == "cuda":
        peak = torch.cuda.max_memory_allocated() - base
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
    return {"impl": impl, "vocab": vocab, "peak_bytes": peak, "seconds": statistics.median(times), "times": times}


def check_numerics(vocab: int, device: str) -> tuple[float, float]:
    """Largest |difference| of log-probs and largest relative difference of gradients, chunked vs naive (float32)."""
    hidden, weight, targets, *_ = _inputs(vocab, device, torch.float32)
    hidden, weight = hidden[:1, :64].detach().requires_grad_(), weight.detach().requires_grad_()
    naive = selective_log_softmax(hidden @ weight.T / TEMPERATURE, targets[:1, :64])
    chunked, _ = chunked_logprobs(hidden[0], weight, targets[0, :64], temperature=TEMPERATURE)
    g_naive = torch.autograd.grad(naive.sum(), [hidden, weight])
    g_chunked = torch.autograd.grad(chunked.sum(), [hidden, weight])
    logp_err = (naive[0] - chunked).abs().max().item()
    grad_err = max(((a - b).norm() / a.norm()).item() for a, b in zip(g_naive, g_chunked))
    return logp_err, grad_err


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--vocab", type=int, nargs="+", default=[49_152, 151_936])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--plot", metavar="PNG", help="also draw the measured memory and time as a chart")
    parser.add_argument("--worker", nargs=2, metavar=("IMPL", "VOCAB"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:  # one measurement in this (fresh) process
        print(json.dumps(measure(args.worker[0], int(args.worker[1]), args.device, args.repeats)))
        return

    print(f"log-prob + loss forward+backward, {BATCH} x {LENGTH} tokens, hidden {HIDDEN}, device {args.device}")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    header = f"{'vocab':>8} {'chunk':>6} | {'naive MiB':>10} {'chunked MiB':>12} {'ratio':>6} | "
    header += f"{'naive s':>8} {'chunked s':>10} {'ratio':>6} | {'max|dlogp|':>10} {'grad rel':>9}"
    print(header)
    rows = []  # (vocab, naive, chunked) for --plot
    for vocab in args.vocab:
        results = {}
        for impl in ("naive", "chunked"):
            command = [sys.executable, __file__, "--device", args.device, "--repeats", str(args.repeats)]
            output = subprocess.run(command + ["--worker", impl, str(vocab)], capture_output=True, text=True)
            if output.returncode != 0:
                sys.exit(f"{impl} at vocabulary {vocab} failed:\n{output.stderr}")
            results[impl] = json.loads(output.stdout.strip().splitlines()[-1])
        naive, chunked = results["naive"], results["chunked"]
        logp_err, grad_err = check_numerics(vocab, args.device)
        mib = 2**20
        print(
            f"{vocab:>8} {auto_chunk_size(vocab):>6} | {naive['peak_bytes'] / mib:>10.0f} "
            f"{chunked['peak_bytes'] / mib:>12.0f} {chunked['peak_bytes'] / naive['peak_bytes']:>6.3f} | "
            f"{naive['seconds']:>8.2f} {chunked['seconds']:>10.2f} {chunked['seconds'] / naive['seconds']:>6.2f} | "
            f"{logp_err:>10.1e} {grad_err:>9.1e}"
        )
        print(f"{'':>8} times naive {naive['times']}, chunked {chunked['times']}", flush=True)
        rows.append((vocab, naive, chunked))
    if args.plot:
        plot(rows, args.plot, args.device)
        print(f"chart written to {args.plot}")


def plot(rows: list[tuple[int, dict, dict]], path: str, device: str) -> None:
    """Two bar charts side by side, peak memory and seconds per forward+backward, naive against chunked per
    vocabulary, each pair labelled with the chunked/naive ratio (the figure to read across machines)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise SystemExit("--plot needs matplotlib: pip install 'grpo[plot]'.") from e
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    x = range(len(rows))
    for ax, key, scale, unit in ((axes[0], "peak_bytes", 2**20, "peak memory (MiB)"), (axes[1], "seconds", 1, "s")):
        naive = [r[1][key] / scale for r in rows]
        chunked = [r[2][key] / scale for r in rows]
        ax.bar([i - 0.2 for i in x], naive, 0.4, label="full logits", color="#b0b0b0")
        ax.bar([i + 0.2 for i in x], chunked, 0.4, label="chunked (grpo)", color="#3b6ea8")
        for i, (n, c) in enumerate(zip(naive, chunked)):
            ax.annotate(f"x{c / n:.2f}", (i + 0.2, c), ha="center", va="bottom", fontsize=9)
        ax.set_xticks(list(x), [f"V = {r[0]:,}" for r in rows])
        ax.set_ylabel(unit if key == "peak_bytes" else "seconds per forward+backward")
        ax.legend(frameon=False, fontsize=9)
    fig.suptitle(f"log-probs + GRPO loss, {BATCH} x {LENGTH} tokens, hidden {HIDDEN}, {device}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
