"""Few-row matrix products on a CPU, the linear layers of a decoding step: opt-in CPU tuning for one kind of machine
(`cpu_decode_kernel`; Linux x86-64 with AVX-512), imported only where a user switched it on.

Each step of `generate` multiplies a handful of rows (one new token per sequence) by every weight matrix of the
model. torch hands `F.linear` to MKL's sgemm, which at 8 rows reaches a fraction of the machine's memory bandwidth:
the step is bound by streaming the weights (docs/performance.md, "Decoding on a CPU", has the measurements), so a
kernel that reads each weight row once, for all the step's rows at a time, is what it needs.

`few_row_linear()` is a context in which `F.linear` calls with at most `MAX_ROWS` rows run such a kernel: for each
block of 3 weight rows, the dot products with up to 8 input rows at once, 16 floats per AVX-512 instruction, the
blocks split among torch's intra-op threads (OpenMP, the same runtime torch uses). It applies only where the result
is the same product (float32 tensors on the CPU, contiguous, no gradient, no autocast; anything else goes to
torch); the sums are taken in another order than MKL's, so results differ from torch's in the last bits (about
1e-6 relative), and do not depend on the number of threads. The C source below is compiled on first use, once per
machine, with the system's C compiler into the user's cache directory ($XDG_CACHE_HOME/grpo/kernels, else
~/.cache/grpo/kernels), and called through ctypes; without a compiler or a cache directory, off Linux x86-64, or
where torch does not report the AVX512 CPU capability, the context changes nothing. With `draws=True` the same
context also answers the step's `torch.multinomial` draws (sampling.py, `cpu_inverse_cdf_sampling`).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from grpo.contrib.cpu import sampling

logger = logging.getLogger(__name__)

# Products with more rows than this go to torch: from about 16 rows on, sgemm's blocking pays for its packing.
MAX_ROWS = 16
# Models with fewer bytes of float32 weight matrices are left to torch: their weights stay in the CPU's caches, where
# sgemm is not starved, and the context's per-operation cost is not repaid (docs/performance.md).
MIN_WEIGHT_BYTES = 64 * 2**20

_SOURCE = r"""
#include <immintrin.h>

/* y[m, n] = bias[n] + sum_k x[m, k] * w[n, k] with x (M, K), w (N, K), y (M, N), float32, row-major. */
#define NB 3 /* weight rows per block */
#define MB 8 /* input rows per block: 8 x 3 accumulators, 3 weight vectors and 1 input vector in 32 registers */

/* One step of 16 k's: the block's NB weight vectors against each of its mc input rows. */
#define STEP(LOAD)                                                                                         \
    {                                                                                                      \
        __m512 b[NB];                                                                                      \
        for (int j = 0; j < NB; j++) b[j] = j < nc ? LOAD(w + (n0 + j) * K + k) : _mm512_setzero_ps();     \
        for (int i = 0; i < MB; i++)                                                                       \
            if (i < mc) {                                                                                  \
                const __m512 v = LOAD(x + (m0 + i) * K + k);                                               \
                for (int j = 0; j < NB; j++)                                                               \
                    if (j < nc) acc[i][j] = _mm512_fmadd_ps(v, b[j], acc[i][j]);                           \
            }                                                                                              \
    }
#define WHOLE(p) _mm512_loadu_ps(p)
#define MASKED(p) _mm512_maskz_loadu_ps(tail, p)

static inline __attribute__((always_inline)) void block(const float *x, const float *w, const float *bias,
        float *y, long m0, const long mc, long n0, const int nc, long N, long K) {
    __m512 acc[MB][NB];
    for (int i = 0; i < MB; i++)
        for (int j = 0; j < NB; j++) acc[i][j] = _mm512_setzero_ps();
    const long whole = K & ~15L;
    long k = 0;
    for (; k < whole; k += 16) {
        /* the block after next into L2: the weights stream from memory, read once (into L1 was slower) */
        for (int j = 0; j < nc; j++) _mm_prefetch((const char *)(w + (n0 + j + 2 * NB) * K + k), _MM_HINT_T1);
        STEP(WHOLE)
    }
    if (k < K) {
        const __mmask16 tail = (__mmask16)((1u << (K - k)) - 1u);
        STEP(MASKED)
    }
    for (int i = 0; i < mc; i++)
        for (int j = 0; j < nc; j++)
            y[(m0 + i) * N + n0 + j] = _mm512_reduce_add_ps(acc[i][j]) + (bias ? bias[n0 + j] : 0.0f);
}

/* nc and a full mc as constants, so that the compiler drops the tests on them from the inner loop */
static inline __attribute__((always_inline)) void rows(const float *x, const float *w, const float *bias,
        float *y, long m0, long mc, long n0, const int nc, long N, long K) {
    if (mc == MB) block(x, w, bias, y, m0, MB, n0, nc, N, K);
    else block(x, w, bias, y, m0, mc, n0, nc, N, K);
}

void grpo_few_row_linear(const float *x, const float *w, const float *bias, float *y, long M, long N, long K,
                         int threads) {
    const long blocks = (N + NB - 1) / NB;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (long b = 0; b < blocks; b++) {
        const long n0 = b * NB;
        for (long m0 = 0; m0 < M; m0 += MB) { /* the block's weight rows stay in L1 for the next 8 input rows */
            const long mc = M - m0 < MB ? M - m0 : MB;
            if (N - n0 >= 3) rows(x, w, bias, y, m0, mc, n0, 3, N, K);
            else if (N - n0 == 2) rows(x, w, bias, y, m0, mc, n0, 2, N, K);
            else rows(x, w, bias, y, m0, mc, n0, 1, N, K);
        }
    }
}
"""
_FLAGS = ["-O3", "-mavx512f", "-mfma", "-fopenmp", "-shared", "-fPIC"]


def _supported() -> bool:
    """Whether this machine can run the kernel: Linux on x86-64, where torch reports the AVX512 CPU capability (the
    capability torch itself dispatches to; `ATEN_CPU_CAPABILITY` lowers it)."""
    if platform.system() != "Linux" or platform.machine() != "x86_64":
        return False
    return torch.backends.cpu.get_cpu_capability().startswith("AVX512")


def _cache_directory() -> Path | None:
    """$XDG_CACHE_HOME/grpo/kernels, else ~/.cache/grpo/kernels; None for a user with neither (no home directory)."""
    try:
        base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    except (RuntimeError, KeyError, OSError):  # Path.home(): "Could not determine home directory."
        return None
    return Path(base) / "grpo" / "kernels"


def _library(cache: Path) -> Path:
    """The compiled kernel's file in `cache`, named by a digest of its source and flags (a new source, a new file)."""
    digest = hashlib.sha256((_SOURCE + " ".join(_FLAGS)).encode()).hexdigest()[:16]
    return cache / f"few_row_linear-{digest}.so"


def _build(compiler: str, library: Path) -> None:
    """Compile `_SOURCE` into `library`: aside in a temporary folder, then renamed, so never seen half-written."""
    library.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=library.parent) as build:
        source, output = Path(build) / "kernel.c", Path(build) / "kernel.so"
        source.write_text(_SOURCE)
        subprocess.run(
            [compiler, *_FLAGS, str(source), "-o", str(output)], check=True, capture_output=True, timeout=120
        )
        os.replace(output, library)


def _load(compiler: str, library: Path):
    """The kernel's function from `library`, compiled first where it is missing. A cached library that does not load
    (truncated or otherwise damaged) is compiled again, once; a second failure is the caller's."""
    if library.exists():
        try:
            return ctypes.CDLL(str(library)).grpo_few_row_linear
        except (OSError, AttributeError) as e:
            logger.info("The cached few-row CPU kernel %s does not load (%s): compiling it again.", library, e)
    _build(compiler, library)
    return ctypes.CDLL(str(library)).grpo_few_row_linear


@functools.cache
def _kernel():
    """The compiled kernel as a ctypes function, or None where it cannot run here (see the module docstring)."""
    if not _supported():
        return None
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    cache = _cache_directory()
    if compiler is None or cache is None:
        missing = "C compiler" if compiler is None else "cache directory (no XDG_CACHE_HOME and no home directory)"
        logger.info("No %s for the few-row CPU kernel: decoding uses torch's matrix products.", missing)
        return None
    try:
        function = _load(compiler, _library(cache))
    except (OSError, AttributeError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", b"") or b""
        logger.info(
            "The few-row CPU kernel could not be built (%s %s): torch's matrix products are used.",
            e,
            detail.decode(errors="replace")[-500:],
        )
        return None
    function.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_long] * 3 + [ctypes.c_int]
    function.restype = None
    return function


def available() -> bool:
    """Whether the kernel runs on this machine (compiling it on first use)."""
    return _kernel() is not None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` by the kernel; the caller checks `_applies` (float32, contiguous, CPU)."""
    rows = x.numel() // x.shape[-1]
    out = torch.empty(*x.shape[:-1], weight.shape[0], dtype=x.dtype)
    bias_pointer = None if bias is None else bias.data_ptr()
    _kernel()(
        x.data_ptr(),
        weight.data_ptr(),
        bias_pointer,
        out.data_ptr(),
        rows,
        weight.shape[0],
        x.shape[-1],
        torch.get_num_threads(),
    )
    return out


def _plain(t: torch.Tensor | None) -> bool:
    return t is None or (
        type(t) in (torch.Tensor, nn.Parameter)
        and t.device.type == "cpu"
        and t.dtype == torch.float32
        and t.is_contiguous()
    )


def _applies(x, weight, bias) -> bool:
    return (
        isinstance(x, torch.Tensor)
        and isinstance(weight, torch.Tensor)
        and _plain(x)
        and _plain(weight)
        and _plain(bias)
        and x.dim() >= 1
        and weight.dim() == 2
        and x.shape[-1] == weight.shape[1] > 0
        and 0 < x.numel() // x.shape[-1] <= MAX_ROWS
        and (bias is None or bias.shape == (weight.shape[0],))
        and not torch.is_grad_enabled()
        and not torch.is_autocast_enabled("cpu")
    )


class _FewRowLinear(TorchFunctionMode):
    def __init__(self, draws: bool):
        super().__init__()
        self.draws = draws

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            x, weight, *rest = args
            bias = rest[0] if rest else kwargs.get("bias")
            if _applies(x, weight, bias):
                return linear(x, weight, bias)
        elif self.draws and func in sampling.MULTINOMIAL:
            draw = sampling.answer_multinomial(args, kwargs)
            if draw is not None:
                return draw
        return func(*args, **kwargs)


def pays_for(model: nn.Module) -> bool:
    """Whether sampling from `model` in this thread should use the kernel: float32 weight matrices of at least
    `MIN_WEIGHT_BYTES` (weights streamed from memory), no autocast (whose products are bf16), and a kernel here."""
    if torch.is_autocast_enabled("cpu"):
        return False
    size = sum(p.numel() * 4 for p in model.parameters() if p.dtype == torch.float32 and p.dim() == 2)
    return size >= MIN_WEIGHT_BYTES and _kernel() is not None


@contextlib.contextmanager
def few_row_linear(draws: bool = False) -> Iterator[None]:
    """Within it, in this thread, `F.linear` with at most `MAX_ROWS` rows runs the kernel where it applies (module
    docstring), and with `draws` `torch.multinomial`'s single draws on the CPU are `sampling.categorical`'s. Where
    the kernel cannot run it changes no product (the draws still apply). Callers open it where `pays_for` says so."""
    if _kernel() is None:
        with sampling.inverse_cdf_draws() if draws else contextlib.nullcontext():
            yield
        return
    with _FewRowLinear(draws):
        yield
