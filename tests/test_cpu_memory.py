"""grpo/contrib/cpu/memory.py: on glibc, large blocks come from the heap and freed ones stay there for reuse; the trainer
applies it on a CPU when `keep_freed_cpu_memory` is switched on, and by default loads none of it. What the settings do to the allocator is read from glibc's own bookkeeping
(`mallinfo2`), which depends only on the process's calls to malloc and free, never on the machine's load; the page
faults they save per step are counted by benchmarks/cpu_memory_faults.py."""

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

import grpo.contrib.cpu.memory
from grpo import GRPOTrainer
from tests.helpers.scripted import TINY

GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"
ROOT = Path(__file__).resolve().parents[1]
MiB = 2**20

# In a fresh interpreter (the settings are process-wide and cannot be undone) that imports no torch: malloc a block
# of each size, free it, and print per block the bytes glibc mapped for it on their own (mmap, unmapped again at
# free: fresh pages next time) and the bytes its heap gave back to the OS at the free (trimmed: fresh pages next
# time too). grpo/contrib/cpu/memory.py needs only the standard library and is loaded by its path.
ALLOCATOR = """
import ctypes, importlib.util, sys
libc = ctypes.CDLL("libc.so.6")
name, word = ("mallinfo2", ctypes.c_size_t) if hasattr(libc, "mallinfo2") else ("mallinfo", ctypes.c_int)
fields = ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")
Info = type("Info", (ctypes.Structure,), {"_fields_": [(field, word) for field in fields]})
mallinfo = getattr(libc, name)
mallinfo.restype = Info
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
mode, path, *sizes = sys.argv[1:]
if mode != "default":
    spec = importlib.util.spec_from_file_location("cpu_memory", path)
    cpu_memory = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cpu_memory)
if mode == "keep-mmap":  # the setting's thresholds without its M_MMAP_MAX: blocks above 32 MiB still mapped
    libc.mallopt.argtypes, libc.mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    assert all(libc.mallopt(p, v) for p, v in cpu_memory.SETTINGS if p != cpu_memory.M_MMAP_MAX)
if mode == "keep":
    assert cpu_memory.keep_freed_memory()
for size in map(int, sizes):
    before = mallinfo()
    block = libc.malloc(size)
    during = mallinfo()
    libc.free(block)
    after = mallinfo()
    print(during.hblkhd - before.hblkhd, during.arena - after.arena)
"""
SIZES = (16 * MiB, 64 * MiB)  # below and above 32 MiB, the largest mmap threshold glibc accepts


def _allocations(mode: str, tunables: str | None = None) -> list[tuple[int, int]]:
    """(bytes mapped on their own, bytes trimmed from the heap at the free) of each block of SIZES; `tunables`: the
    process's GLIBC_TUNABLES."""
    # glibc's own settings from the environment would change the default's answers: left out.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "GLIBC_TUNABLES", "LD_PRELOAD"))}
    if tunables is not None:
        env["GLIBC_TUNABLES"] = tunables
    command = [sys.executable, "-c", ALLOCATOR, mode, grpo.contrib.cpu.memory.__file__, *map(str, SIZES)]
    out = subprocess.run(command, capture_output=True, text=True, check=True, env=env).stdout
    return [tuple(int(n) for n in line.split()) for line in out.splitlines()]


@pytest.mark.skipif(not GLIBC, reason="tunes glibc's malloc only")
def test_large_blocks_come_from_the_heap_and_stay_there():
    (mapped_16, _), (mapped_64, _) = _allocations("default")
    # glibc's defaults: both blocks mapped afresh (its mmap threshold is 128 KiB, at most 32 MiB as it adapts).
    assert mapped_16 >= SIZES[0] and mapped_64 >= SIZES[1]
    # The thresholds raised but mmap allowed: the 16 MiB block comes from the heap and stays, the 64 MiB one does not.
    (mapped_16, trimmed_16), (mapped_64, _) = _allocations("keep-mmap")
    assert (mapped_16, trimmed_16) == (0, 0) and mapped_64 >= SIZES[1]
    # The setting: no block is mapped on its own and none is handed back, so the next step reuses the same pages.
    assert _allocations("keep") == [(0, 0), (0, 0)]


@pytest.mark.skipif(not GLIBC, reason="tunes glibc's malloc only")
def test_the_same_settings_from_the_environment():
    """docs/performance.md gives the setting as GLIBC_TUNABLES, for a process that wants it without grpo."""
    names = {
        grpo.contrib.cpu.memory.M_MMAP_THRESHOLD: "mmap_threshold",
        grpo.contrib.cpu.memory.M_TRIM_THRESHOLD: "trim_threshold",
        grpo.contrib.cpu.memory.M_MMAP_MAX: "mmap_max",
    }
    tunables = ":".join(f"glibc.malloc.{names[p]}={v}" for p, v in grpo.contrib.cpu.memory.SETTINGS)
    assert tunables in (ROOT / "docs" / "performance.md").read_text()
    assert _allocations("default", tunables) == [(0, 0), (0, 0)]


def test_keep_freed_memory_does_nothing_without_glibc(monkeypatch):
    def no_libc(*args):
        raise AssertionError("the C library was loaded")

    monkeypatch.setattr(grpo.contrib.cpu.memory.platform, "libc_ver", lambda: ("", ""))
    monkeypatch.setattr(grpo.contrib.cpu.memory.ctypes, "CDLL", no_libc)
    assert grpo.contrib.cpu.memory.keep_freed_memory() is False


def test_the_trainer_keeps_freed_memory_on_a_cpu_only_when_switched_on(
    tmp_path, tiny_model_path, prompt_dataset, monkeypatch
):
    from grpo import GRPOConfig

    calls = []
    monkeypatch.setattr(grpo.contrib.cpu.memory, "keep_freed_memory", lambda: calls.append(1))
    # TINY's use_cpu: the trainer runs on the CPU on a machine with a GPU too, so that the setting applies there as well.
    GRPOTrainer(
        tiny_model_path,
        lambda completions, **kw: [0.0] * len(completions),
        args=GRPOConfig(output_dir=str(tmp_path / "a"), keep_freed_cpu_memory=True, **TINY),
        train_dataset=prompt_dataset,
    )
    assert calls == [1]
    GRPOTrainer(  # the default: the C library's settings are left alone
        tiny_model_path,
        lambda completions, **kw: [0.0] * len(completions),
        args=GRPOConfig(output_dir=str(tmp_path / "b"), **TINY),
        train_dataset=prompt_dataset,
    )
    assert calls == [1]
