"""Time (and on a GPU peak memory) of the projection + GRPO loss, forward and backward: this library's chunked
log-probs and `policy_loss` against Liger's fused linear GRPO loss (`use_liger_kernel=True`), with and without the
no-grad projection that gives the Liger path its metrics (grpo/objective/liger.py). Needs liger-kernel.

    python benchmarks/liger_loss.py                              # CPU, float32, one thread, SmolLM2-135M's head
    python benchmarks/liger_loss.py --device cuda --dtype bfloat16 --vocab 151936 --hidden 896

From the final hidden states (rows x tokens x hidden) and the output head (vocab x hidden) to a dapo loss, with the
gradients of both; the backbone is left out (the same for both). Medians of `--repeats` passes after one warm-up
(on a GPU the warm-up also compiles Liger's loss math).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from grpo.objective.liger import fused_policy_loss, loss_module
from grpo.objective.logprobs import chunked_logprobs
from grpo.objective.loss import policy_loss
from grpo.objective.settings import LossSettings
from grpo.rollout import MicroBatch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    rows, tokens = args.rows, args.tokens
    mask = torch.ones(rows, tokens, device=device)
    ids = torch.randint(0, args.vocab, (rows, tokens), device=device)
    batch = MicroBatch(
        prompt_ids=ids[:, :1], prompt_mask=mask[:, :1], completion_ids=ids, completion_mask=mask, loss_mask=mask,
        advantages=torch.randn(rows, device=device),
    )  # fmt: skip
    hidden = torch.randn(rows * tokens, args.hidden, device=device, dtype=dtype, requires_grad=True)
    weight = (0.02 * torch.randn(args.vocab, args.hidden, device=device, dtype=dtype)).requires_grad_()
    settings, targets = LossSettings(loss_type="dapo"), ids.reshape(-1)
    module = loss_module(settings, 1.0, compiled=device.type == "cuda")

    def ours():
        values, _ = chunked_logprobs(hidden, weight, targets, with_entropy=True)
        policy_loss(values.view(rows, tokens), None, None, batch.advantages, mask, settings)[0].backward()

    def liger(metrics: bool):
        if metrics:
            with torch.no_grad():
                chunked_logprobs(hidden.detach(), weight, targets, with_entropy=True)
        fused_policy_loss(module, hidden, weight, None, batch).backward()

    for name, run in [("ours", ours), ("liger", lambda: liger(False)), ("liger + metrics", lambda: liger(True))]:
        seconds = []
        for _ in range(args.repeats + 1):
            hidden.grad = weight.grad = None
            if device.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            start = time.perf_counter()
            run()
            if device.type == "cuda":
                torch.cuda.synchronize()
            seconds.append(time.perf_counter() - start)
        peak = f", peak {torch.cuda.max_memory_allocated() / 2**20:.0f} MiB" if device.type == "cuda" else ""
        print(f"{name}: median {statistics.median(seconds[1:]):.3f} s of {seconds[1:]}{peak}")


if __name__ == "__main__":
    main()
