"""grpo/cpu_memory.py: on glibc, freed blocks are reused instead of page-faulted in again; the trainer applies it on a
CPU unless told not to."""

import platform
import statistics
import subprocess
import sys

import pytest

import grpo.trainer
from grpo import GRPOTrainer
from tests.scripted import TINY

GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"


def _huge_pages_always() -> bool:
    """With transparent huge pages on for every mapping, a fresh block faults once per 2 MiB, not per 4 KiB page."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return "[always]" in f.read()
    except OSError:
        return False


# A training loop's pattern: an embedding of 72 MiB (above glibc's largest mmap threshold, as SmolLM2's 113 MiB one)
# and 8 MLP blocks (16 weights of 3.5 MiB), whose gradients are set to None after every backward, as Trainer's
# zero_grad does, and allocated again by the next. Prints the minor page faults of each of 16 steps.
FAULTS = """
import resource, sys, torch
if sys.argv[1] != "default":
    from grpo import cpu_memory
    if sys.argv[1] == "keep-mmap":  # the setting without M_MMAP_MAX: blocks above 32 MiB mapped afresh
        cpu_memory.MMAP_MAX = None
    assert cpu_memory.keep_freed_memory()
torch.manual_seed(0)
mlp = lambda: torch.nn.Sequential(torch.nn.Linear(576, 1536), torch.nn.SiLU(), torch.nn.Linear(1536, 576))
model = torch.nn.Sequential(torch.nn.Embedding(32768, 576), *[mlp() for _ in range(8)])
tokens = torch.randint(0, 32768, (64,))
faults = []
for step in range(16):
    start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    model(tokens).square().mean().backward()
    model.zero_grad(set_to_none=True)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - start)
print(*faults)
"""
MLP_PAGES = 16 * 1536 * 576 * 4 // 4096  # 13,824 pages of MLP gradients per step
EMBEDDING_PAGES = 32768 * 576 * 4 // 4096  # 18,432 pages of the embedding's gradient per step


def _faults(mode: str) -> list[int]:
    """Page faults of steps 3-16 (the first two grow the heap to its size in every mode)."""
    out = subprocess.run([sys.executable, "-c", FAULTS, mode], capture_output=True, text=True, check=True).stdout
    return [int(n) for n in out.split()[2:]]


@pytest.mark.slow  # three fresh interpreters that import torch
@pytest.mark.skipif(not GLIBC, reason="tunes glibc's malloc only")
@pytest.mark.skipif(_huge_pages_always(), reason="transparent huge pages for every mapping: few faults either way")
def test_freed_blocks_are_reused_without_page_faults():
    default, thresholds_only, kept = _faults("default"), _faults("keep-mmap"), _faults("keep")
    # glibc's defaults map the embedding's gradient afresh at every step, and some of the MLP ones too.
    assert min(default) >= EMBEDDING_PAGES
    assert statistics.median(default) > EMBEDDING_PAGES + MLP_PAGES // 4
    # With the thresholds raised but mmap allowed, the MLP gradients are reused, the embedding's is mapped afresh.
    assert EMBEDDING_PAGES <= statistics.median(thresholds_only) < EMBEDDING_PAGES + MLP_PAGES // 4
    # With the setting, a step reuses the pages of the step before. The heap still settles into its size: in one or
    # two of the steps (which ones varies from run to run, with the heap's addresses) the embedding's gradient
    # no longer fits the free space that other blocks left and is faulted in at the top once more; in a 1,000-step
    # loop that happened 3 times, so the median step faults nothing and the sum is a fraction of the default's.
    assert statistics.median(kept) < MLP_PAGES // 100
    assert sum(kept) < sum(default) / 4


def test_the_trainer_keeps_freed_memory_on_a_cpu_unless_told_not_to(
    tmp_path, tiny_model_path, prompt_dataset, monkeypatch
):
    from grpo import GRPOConfig

    calls = []
    monkeypatch.setattr(grpo.trainer, "keep_freed_memory", lambda: calls.append(1))
    GRPOTrainer(
        tiny_model_path,
        lambda completions, **kw: [0.0] * len(completions),
        args=GRPOConfig(output_dir=str(tmp_path / "a"), **TINY),
        train_dataset=prompt_dataset,
    )
    assert calls == [1]
    GRPOTrainer(
        tiny_model_path,
        lambda completions, **kw: [0.0] * len(completions),
        args=GRPOConfig(output_dir=str(tmp_path / "b"), keep_freed_cpu_memory=False, **TINY),
        train_dataset=prompt_dataset,
    )
    assert calls == [1]
