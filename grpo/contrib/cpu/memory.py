"""Training on a CPU: keep freed memory in the process for reuse instead of handing it back to the OS at every free.
Opt-in CPU tuning (`keep_freed_cpu_memory`; Linux with glibc), imported only where a user switched it on: it changes
the malloc settings of the whole process, for the rest of its life, host application included.

A training step frees and allocates the same large tensors again and again: every parameter's gradient (set to None
by `zero_grad` and allocated again by the next backward), the gradient sums of weights that several passes use, the
log-probs' logit chunks. torch's CPU allocator takes them from the C library's `malloc`. glibc serves a block of
more than `M_MMAP_THRESHOLD` bytes with a fresh `mmap` and unmaps it when freed, and gives the top of its heap back
to the OS once more than `M_TRIM_THRESHOLD` bytes are free there; either way the next allocation of that size gets
new pages, and the kernel zero-fills each 4 KiB page on first touch (a page fault). docs/performance.md, "Freed
memory kept for reuse on a CPU", has the counts and the step times.

`keep_freed_memory` changes three settings: blocks up to 32 MiB (glibc's largest allowed mmap threshold) come from
the heap, larger blocks too (no `mmap` at all: `M_MMAP_MAX` 0; on SmolLM2 the embedding's 113 MiB gradient and
the log-probs' 50 MiB logit chunks, several times a step), and up to 1 GiB of freed heap stays mapped, so a step
reuses the pages of the step before. The peak resident size changes little (blocks are reused, not added); what
changes is that up to 1 GiB of memory freed at the end of a step stays counted in the process's resident size until
it is used again or the process ends, and that a large block freed below the top of the heap is kept for the next
allocation instead of being unmapped. Only glibc is tuned; elsewhere (macOS, musl, a preloaded jemalloc or tcmalloc,
which reuse memory by themselves) it does nothing. The same settings without this module, for one process:
`GLIBC_TUNABLES=glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=1073741824:glibc.malloc.mmap_max=0`.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import platform

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameter numbers (malloc.h)
M_MMAP_THRESHOLD = -3
M_MMAP_MAX = -4
MMAP_THRESHOLD = 32 * 2**20  # the largest value glibc accepts on 64-bit machines
TRIM_THRESHOLD = 2**30
MMAP_MAX = 0  # blocks above MMAP_THRESHOLD may be mapped this many at a time: none, they come from the heap too
SETTINGS = ((M_MMAP_THRESHOLD, MMAP_THRESHOLD), (M_TRIM_THRESHOLD, TRIM_THRESHOLD), (M_MMAP_MAX, MMAP_MAX))


def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds and stop its use of `mmap` for this process (`SETTINGS`, see the module
    docstring); True if they were set.
    Process-wide, irreversible and idempotent; a no-op returning False where the C library is not glibc."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # mallopt returns 1 on success, 0 for a value it refuses.
    return all([mallopt(parameter, value) for parameter, value in SETTINGS])
