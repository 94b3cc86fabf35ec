"""The next token drawn by the inverse of the cumulative distribution, one uniform number per row: opt-in CPU tuning
(`cpu_inverse_cdf_sampling`), imported only where a user switched it on.

`model.generate` samples with `torch.multinomial(probs, 1)`, which on a CPU draws one exponential number for every
entry of the (rows, vocabulary) probabilities; at a vocabulary of tens of thousands that is a visible part of a
decoding step once the step's matrix products are fast (docs/performance.md, "The draw", has the measurements).
`categorical` draws from the same distribution with one uniform number per row. The distribution is the same, the
random stream is not: a seed gives other samples with it than without. It is plain torch, the same on every CPU.

`inverse_cdf_draws()` is a context in which, in this thread, the `torch.multinomial` calls that draw one sample of a
2-d float tensor on the CPU are answered by `categorical`; every other call goes to torch. The sampler opens it where
`pays_for` says so: a `TorchFunctionMode` sees every torch call of a decoding step, and only for a large model is a
step's draw worth that per-call cost. The rule depends on the model and autocast, never on the CPU, and it picks the
same models as the decoding kernel's (decode.py), whose context answers the same calls through
`answer_multinomial` when both are on, so that one mode, not two, sees each call.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.overrides import TorchFunctionMode

MULTINOMIAL = (torch.multinomial, torch.Tensor.multinomial)
# Models with fewer bytes of float32 weight matrices sample with torch.multinomial: their steps are short and their
# vocabularies small, so the mode's per-call cost is not repaid (the decoding kernel's threshold, decode.py).
MIN_WEIGHT_BYTES = 64 * 2**20


def categorical(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor | None:
    """One draw per row of `probs` (R, V), non-negative weights, as `torch.multinomial(probs, 1)` draws it: (R, 1)
    int64, index v with probability probs[r, v] / sum(probs[r]). None where torch must answer instead (weights that
    are negative, infinite, NaN or all zero, for which torch.multinomial raises its error).

    By the inverse of the cumulative distribution: the first v whose cumulative sum (float64) exceeds u x total, u
    uniform in [0, 1), so a weight of 0 is never drawn. It takes one random number per row, where torch's CPU draw
    takes R x V exponentials."""
    cdf = probs.cumsum(-1, dtype=torch.float64)  # (R, V)
    total = cdf[:, -1:]  # (R, 1)
    if not (bool(torch.isfinite(total).all()) and bool((total > 0).all()) and bool((probs >= 0).all())):
        return None
    u = torch.rand(total.shape, dtype=torch.float64, generator=generator, device=probs.device) * total
    index = torch.searchsorted(cdf, u, right=True)  # (R, 1)
    past = index == probs.shape[-1]  # u x total rounded up to the total itself: the last index with a weight
    if bool(past.any()):
        last = probs.shape[-1] - 1 - (probs.flip(-1) > 0).int().argmax(-1, keepdim=True)
        index = torch.where(past, last, index)
    return index


def _single_draw(input, num_samples, replacement=False, *, generator=None, out=None) -> torch.Tensor | None:  # noqa: A002
    """`categorical` for a `torch.multinomial` call it answers (one sample of a 2-d float tensor on the CPU)."""
    probs = input
    plain = (
        type(probs) is torch.Tensor and probs.device.type == "cpu" and probs.dtype in (torch.float32, torch.float64)
    )
    if out is not None or num_samples != 1 or not plain or probs.dim() != 2 or probs.shape[-1] == 0:
        return None
    return categorical(probs, generator)


def answer_multinomial(args: tuple, kwargs: dict) -> torch.Tensor | None:
    """`categorical`'s answer to the call `torch.multinomial(*args, **kwargs)` where it can give one (a single
    sample of each row of a 2-d float32/float64 tensor on the CPU, no `out`); None where torch must answer."""
    try:
        return _single_draw(*args, **kwargs)
    except TypeError:  # a call torch itself will answer, or reject with its own message
        return None


class _InverseCdfDraws(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in MULTINOMIAL:
            draw = answer_multinomial(args, kwargs)
            if draw is not None:
                return draw
        return func(*args, **kwargs)


def pays_for(model: torch.nn.Module) -> bool:
    """Whether sampling from `model` in this thread should answer its draws: float32 weight matrices of at least
    `MIN_WEIGHT_BYTES`, and no autocast (as for the decoding kernel, so that both switched on open one context)."""
    if torch.is_autocast_enabled("cpu"):
        return False
    size = sum(p.numel() * 4 for p in model.parameters() if p.dtype == torch.float32 and p.dim() == 2)
    return size >= MIN_WEIGHT_BYTES


@contextlib.contextmanager
def inverse_cdf_draws() -> Iterator[None]:
    """Within it, in this thread, `torch.multinomial`'s single draws on the CPU are `categorical`'s (see the module
    docstring); any other call is torch's."""
    with _InverseCdfDraws():
        yield
