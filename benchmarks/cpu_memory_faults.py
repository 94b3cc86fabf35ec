"""Page faults per training step with and without the opt-in `keep_freed_cpu_memory`, side by side.

    python benchmarks/cpu_memory_faults.py                      # 3 runs of each setting, 16 steps each
    python benchmarks/cpu_memory_faults.py --runs 5 --steps 64

What is measured: the minor page faults (`ru_minflt`) of each step of a loop with a training loop's pattern: an
embedding of 72 MiB (above glibc's largest mmap threshold, as SmolLM2's 113 MiB one) and 8 MLP blocks (16 weights of
3.5 MiB) whose gradients are set to None after every backward, as Trainer's zero_grad does, and allocated again by
the next. The settings are process-wide and cannot be undone, so each run is a fresh interpreter; the settings
alternate run by run:

- default: glibc's own malloc settings (what `keep_freed_cpu_memory=False`, the default, leaves);
- keep: `keep_freed_memory()` (grpo/contrib/cpu/memory.py), as the trainer applies it on a CPU with
  `keep_freed_cpu_memory=True`.

(A third setting, keep-mmap, the thresholds raised but blocks above 32 MiB still mapped afresh, patched the module's
`MMAP_MAX`; a benchmark patches no module attribute of grpo, so it was removed (issue 27). Its counts stay in
docs/performance.md as history; tests/test_cpu_memory.py still checks what that difference does to the allocator.)

Printed per setting: the median over runs of the median step (steps 3 on: the first two grow the heap in every
setting) and of the faults summed over those steps, each also as a ratio to the default's of this invocation, next
to the pages each step allocates. What to expect on an idle Linux machine without transparent huge pages for every
mapping (docs/performance.md, "Blocks above 32 MiB"): default 19,000-37,000 per step (the embedding's gradient
mapped afresh each time, some MLP ones too), keep 0 in the median step, with one or two steps in the first few where the heap settles. A count of page faults moves with the machine's
load and its kernel settings: that is why it is measured here, not asserted by a test (tests/test_cpu_memory.py
checks what the setting does to the allocator, which no load changes).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import subprocess
import sys

LOOP = """
import resource, sys, torch
mode, steps = sys.argv[1], int(sys.argv[2])
if mode == "keep":
    from grpo.contrib.cpu import memory
    assert memory.keep_freed_memory(), "glibc refused the settings"
torch.manual_seed(0)
mlp = lambda: torch.nn.Sequential(torch.nn.Linear(576, 1536), torch.nn.SiLU(), torch.nn.Linear(1536, 576))
model = torch.nn.Sequential(torch.nn.Embedding(32768, 576), *[mlp() for _ in range(8)])
tokens = torch.randint(0, 32768, (64,))
faults = []
for step in range(steps):
    start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    model(tokens).square().mean().backward()
    model.zero_grad(set_to_none=True)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - start)
print(*faults)
"""
MODES = ("default", "keep")
MLP_PAGES = 16 * 1536 * 576 * 4 // 4096  # 13,824 pages of MLP gradients per step
EMBEDDING_PAGES = 32768 * 576 * 4 // 4096  # 18,432 pages of the embedding's gradient per step


def run(mode: str, steps: int) -> list[int]:
    """Page faults of steps 3 to `steps` of the loop in a fresh interpreter."""
    out = subprocess.run(
        [sys.executable, "-c", LOOP, mode, str(steps)], capture_output=True, text=True, check=True
    ).stdout
    return [int(n) for n in out.split()[2:]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=3, help="fresh interpreters per setting, alternating")
    parser.add_argument("--steps", type=int, default=16, help="steps per run (the first two are not counted)")
    cli = parser.parse_args()
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        sys.exit("keep_freed_cpu_memory tunes glibc's malloc only: nothing to measure on this system")
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            huge_pages = f.read().strip()
    except OSError:
        huge_pages = "unknown"
    medians = {mode: [] for mode in MODES}
    totals = {mode: [] for mode in MODES}
    for _ in range(cli.runs):
        for mode in MODES:
            faults = run(mode, cli.steps)
            medians[mode].append(statistics.median(faults))
            totals[mode].append(sum(faults))
    print(
        f"{cli.runs} runs x steps 3-{cli.steps}; pages allocated per step: embedding gradient {EMBEDDING_PAGES:,}, "
        f"MLP gradients {MLP_PAGES:,}; transparent huge pages: {huge_pages}"
    )
    print(f"{'setting':10s} {'median step':>12s} {'x default':>10s} {'sum of steps':>13s} {'x default':>10s}")
    base_step, base_sum = statistics.median(medians["default"]), statistics.median(totals["default"])
    for mode in MODES:
        step, total = statistics.median(medians[mode]), statistics.median(totals[mode])
        ratios = [value / base if base else float("nan") for value, base in ((step, base_step), (total, base_sum))]
        print(f"{mode:10s} {step:12,.0f} {ratios[0]:10.3f} {total:13,.0f} {ratios[1]:10.3f}")


if __name__ == "__main__":
    main()
