"""Equality of two computations that agree in exact arithmetic, up to what float rounding explains: a parameter
update with gradient accumulation and without, on one process and on two, with a variant and without; log-probs and
gradients through two paths. (Where a computation runs in float64, compare there instead: tests/test_loss.py.)

Both sides add the same terms in different orders, and the order also changes with the CPU's vector width, the
thread count and the GPU's kernels, so a bound that holds on one machine must not lean on its rounding. Each float32
operation rounds its result x by at most half a unit in the last place, ulp(x) <= eps |x| with eps = 2^-23 = 1.19e-7,
and the errors of n roundings of either sign grow like sqrt(n) eps times the scale of what is summed. A gradient
element of the tiny test models collects about a thousand (some 256 token terms, each through the matrix products of
a layer's backward): sqrt(1024) = 32, so

    max |got - want| <= 32 eps max |want|                      (one tensor: log-probs, entropies, gradients)

with the maximum over the whole tensor, not each element: an element near zero carries the rounding of the terms
that summed to it, which are of the tensor's scale. A parameter update u = p_after - p_before is also rounded where
p_after = p_before + step is stored: two equal steps can land one ulp(p) apart (the 1.19e-7 of a step near p = 1.0
in a norm weight, however small the step), so an update adds that term, once per optimizer step:

    max |u_got - u_want| <= steps x eps (max |p| + 32 max |u_want|)

Measured with AVX-512, AVX2 and scalar kernels (ATEN_CPU_CAPABILITY), 1 and 2 threads: at most 17 eps max|want| for
one tensor (a k_proj bias gradient that nearly cancels, scalar kernels) and 3.2 eps max|u| beyond the ulp(p) term
for an update. A broken property lies far outside: an update scaled by 1 + 1e-5 is off by 84 eps max|u|.
"""

from __future__ import annotations

import torch

# sqrt(n) for the ~1,000 roundings (n) of one gradient element: the random-walk growth of their errors.
SUM_ROUNDING = 32


def _eps(tensor: torch.Tensor) -> float:
    return torch.finfo(tensor.dtype).eps


def _max_abs(tensor: torch.Tensor) -> float:
    return tensor.detach().double().abs().max().item() if tensor.numel() else 0.0


def _max_difference(got: torch.Tensor, want: torch.Tensor) -> float:
    assert got.shape == want.shape, f"shapes {tuple(got.shape)} and {tuple(want.shape)}"
    # In float64, where the difference of two float32 numbers is exact: the check adds no rounding of its own.
    return _max_abs(got.detach().double() - want.detach().double())


def assert_close_to_scale(got: torch.Tensor, want: torch.Tensor, what: str = "") -> None:
    """max |got - want| <= 32 eps max |want|: two computations of one tensor (module docstring)."""
    eps, scale = _eps(want), _max_abs(want)
    difference, bound = _max_difference(got, want), SUM_ROUNDING * eps * scale
    assert difference <= bound, (
        f"{what}: max difference {difference:.3g} > bound {bound:.3g} = 32 eps max|want| (max|want| {scale:.3g}); "
        f"difference / (eps max|want|) = {difference / (eps * scale) if scale else float('inf'):.3g}"
    )


def updates(params: dict[str, torch.Tensor], initial: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """name -> params - initial, in float32 as the optimizer step stores them: the update of a run that started at
    `initial` (for comparing the parameters of runs of several steps with `assert_same_update`)."""
    return {name: params[name].detach() - value.detach() for name, value in initial.items()}


def assert_same_update(
    update: dict[str, torch.Tensor],
    reference: dict[str, torch.Tensor],
    params: dict[str, torch.Tensor],
    steps: int = 1,
    what: str = "",
) -> None:
    """Every tensor of `update` (name -> p_after - p_before) equals `reference`'s within
    steps x eps (max |p| + 32 max |u_reference|) (module docstring). `params`: the parameters, before or after the
    steps (only their scale counts); `steps`: the optimizer steps the updates span."""
    assert sorted(update) == sorted(reference), f"{what}: not the same parameters"
    for name, want in reference.items():
        eps, scale, parameter = _eps(want), _max_abs(want), _max_abs(params[name])
        difference = _max_difference(update[name], want)
        bound = steps * eps * (parameter + SUM_ROUNDING * scale)
        beyond = (difference / steps - eps * parameter) / (eps * scale) if scale else float("inf")
        assert difference <= bound, (
            f"{what} {name}: max difference {difference:.3g} > bound {bound:.3g} = {steps} x eps (max|p| "
            f"{parameter:.3g} + 32 max|u| {scale:.3g}); beyond the ulp(p) term: {beyond:.3g} eps max|u| per step"
        )
