"""Activations that do not grow with the whole sequence: each decoder layer's MLP computed in chunks of tokens
(`tile_mlps`, `tiled_mlp_tokens`), and the tensors saved for backward kept in host memory on a GPU (`HostOffload`,
`activation_offloading`). Both leave the values and gradients as they are (tests/test_long_sequences.py).

Why the MLP: with gradient checkpointing a layer keeps only its input between forward and backward, but its
recomputation in backward still builds the MLP's (N, I) tensors for all N tokens of the micro-batch at once (gate, up,
act(gate), act(gate) * up: four of them, I = intermediate_size, 2.7 x the hidden size on SmolLM2 and Llama). Tiled, as
in Arctic Long Sequence Training's TiledMLP (Bekman et al., arXiv:2506.13996), the MLP keeps only its (N, H) input and
builds those tensors for `tokens` rows at a time, in forward and in backward; the price is one more forward of the MLP
per step. The vocabulary projection is already chunked that way (`chunked_logprobs` in grpo/objective/logprobs.py).

Which modules: the `mlp` child of every layer (an element of a `ModuleList`) of the language model's decoder, as
Llama, Qwen2, Mistral, Gemma, Phi-3 and GPT-2 name it. Its forward must be position-wise (row i of the output depends
on row i of the input only), which a dense MLP is and a Mixture-of-Experts block is not quite (its router's outputs
are recorded per call, for the load-balancing loss): those are refused.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from collections.abc import Callable

import torch
from torch import nn

from grpo.models import unwrap_parallel

logger = logging.getLogger(__name__)

# Saved tensors smaller than this stay on the GPU: copying a mask or a per-token scalar costs more than it frees.
MIN_OFFLOAD_BYTES = 256 * 2**10


def _trainable(module: nn.Module) -> list[nn.Parameter]:
    return [p for p in module.parameters() if p.requires_grad]


def _partitioned(params: list[torch.Tensor]) -> bool:
    """DeepSpeed ZeRO-3 parameters: whole only inside their module's forward, gathered there by DeepSpeed's hooks."""
    return any(hasattr(p, "ds_id") for p in params)


class _TiledMLP(torch.autograd.Function):
    """y = f(x) for a position-wise f (`run`, an MLP's own forward), `tokens` rows of x at a time.

    x (..., H) -> y (..., H'). Forward keeps only x. Backward recomputes each chunk x_c with gradients on and adds up
        dL/dx_c     = J_c(x_c)^T g_c                 (written into its rows of dL/dx)
        dL/dtheta   = sum_c J_c(theta)^T g_c          (g_c: the chunk's rows of dL/dy)
    which is the whole-sequence gradient, the sum over rows of a position-wise function split into blocks of rows.
    The parameter gradients are returned once, as gradients of the `params` inputs (so DDP's and ZeRO-2's hooks
    fire once per step, as for the plain MLP); summed in float32 for lower-precision weights. ZeRO-3 parameters
    (empty outside the module's forward) are not inputs: each chunk's backward accumulates into them through
    DeepSpeed's hooks, told to reduce only after the last chunk (`ds_grad_is_ready`, as DeepSpeed's own TiledMLP).
    Dropout draws the same masks in the recomputation as in the forward (the random state is replayed), and the
    recomputation runs under the forward's autocast.
    """

    @staticmethod
    def forward(ctx, module, run, tokens, x, *params):
        ctx.module, ctx.run, ctx.tokens, ctx.num_params = module, run, tokens, len(params)
        device = x.device.type
        ctx.autocast = (device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
        ctx.rng = _random_state(x.device) if _draws_random(module) else None
        ctx.save_for_backward(x)
        return _in_chunks(run, x, tokens)

    @staticmethod
    def backward(ctx, grad_output):
        (x,) = ctx.saved_tensors
        need_x = ctx.needs_input_grad[3]
        params = _trainable(ctx.module)  # as the module holds them now (FSDP2: gathered again for the backward)
        partitioned = ctx.num_params == 0 and _partitioned(params)
        if not partitioned and len(params) != ctx.num_params:
            raise RuntimeError(
                f"tiled MLP: {type(ctx.module).__name__} had {ctx.num_params} trainable parameters in the forward and "
                f"{len(params)} in the backward. Set tiled_mlp_tokens=None."
            )
        rows = x.detach().reshape(-1, x.shape[-1])  # (N, H)
        grad_rows = grad_output.reshape(rows.shape[0], -1)  # (N, H')
        grad_x = torch.empty_like(rows) if need_x else None
        sums = [] if partitioned else [torch.zeros_like(p, dtype=_sum_dtype(p)) for p in params]
        device, enabled, dtype = ctx.autocast
        with _replayed(ctx.rng, x.device), torch.autocast(device, dtype=dtype, enabled=enabled):
            for start in range(0, rows.shape[0], ctx.tokens):
                stop = min(start + ctx.tokens, rows.shape[0])
                chunk = rows[start:stop].detach().requires_grad_(need_x)
                with torch.enable_grad():
                    y = ctx.run(_shaped(chunk, x.dim()))  # (1, c, H') for a (B, T, H) input
                g = grad_rows[start:stop].view(y.shape)
                if partitioned:
                    for p in params:  # reduce-scatter each gradient once, after the last chunk added to it
                        p.ds_grad_is_ready = stop == rows.shape[0]
                    torch.autograd.backward(y, g, inputs=[chunk, *params] if need_x else params)
                    if need_x:
                        grad_x[start:stop] = chunk.grad
                    continue
                # Every parameter of an MLP is used (allow_unused=False): a parameter missing from the recomputed
                # graph (a wrapper that swapped it for a copy) fails here rather than getting no gradient.
                grads = torch.autograd.grad(y, [chunk, *params] if need_x else params, g)
                if need_x:
                    grad_x[start:stop], grads = grads[0], grads[1:]
                for total, grad in zip(sums, grads):
                    total += grad
        grad_params = [total.to(p.dtype) for total, p in zip(sums, params)]
        grad_x = grad_x.view(x.shape) if need_x else None
        return None, None, None, grad_x, *grad_params


def _sum_dtype(param: torch.Tensor) -> torch.dtype:
    return torch.float32 if param.dtype in (torch.float16, torch.bfloat16) else param.dtype


def _shaped(rows: torch.Tensor, dim: int) -> torch.Tensor:
    """Rows (c, H) as the module took its input: (1, c, H) for a (B, T, H) input, so a forward that reads a batch
    and a sequence dimension still finds them."""
    return rows.view(*(1,) * (dim - 2), *rows.shape)


def _in_chunks(run: Callable, x: torch.Tensor, tokens: int) -> torch.Tensor:
    """run(x) computed `tokens` rows of x at a time into one output (N, H'), returned as (..., H')."""
    rows = x.reshape(-1, x.shape[-1])  # (N, H)
    out = None
    for start in range(0, rows.shape[0], tokens):
        chunk = _shaped(rows[start : start + tokens], x.dim())
        y = run(chunk)
        if not isinstance(y, torch.Tensor) or y.shape[:-1] != chunk.shape[:-1]:
            got = tuple(y.shape) if isinstance(y, torch.Tensor) else type(y).__name__
            raise TypeError(
                f"tiled_mlp_tokens: the MLP returned {got} for an input of {tuple(chunk.shape)}; only a position-wise "
                "MLP that returns one tensor of the same rows can be tiled. Set tiled_mlp_tokens=None."
            )
        y = y.reshape(-1, y.shape[-1])
        if out is None:
            out = y.new_empty(rows.shape[0], y.shape[-1])
        out[start : start + y.shape[0]] = y
    return out.view(*x.shape[:-1], out.shape[-1])


def _draws_random(module: nn.Module) -> bool:
    """Whether the module's forward draws random numbers: a dropout with p > 0 in training mode."""
    return any(isinstance(m, nn.Dropout) and m.p > 0 and m.training for m in module.modules())


def _random_state(device: torch.device) -> tuple:
    accelerator = device.type != "cpu"
    return torch.get_rng_state(), torch.get_device_module(device.type).get_rng_state(device) if accelerator else None


@contextlib.contextmanager
def _replayed(state: tuple | None, device: torch.device):
    """Within it the random generators (the CPU's and `device`'s) start from `state` again; restored after."""
    if state is None:
        yield
        return
    devices = [device] if state[1] is not None else []
    with torch.random.fork_rng(devices=devices, device_type=device.type):
        torch.set_rng_state(state[0])
        if state[1] is not None:
            torch.get_device_module(device.type).set_rng_state(state[1], device)
        yield


class TiledForward:
    """An MLP's forward replaced by its tiled computation: `tokens` rows at a time (`_TiledMLP`) where gradients
    are needed and the input has more rows, else in chunks without a graph (no-grad passes: pi_old, the reference),
    or as it was (at most `tokens` rows: decoding steps, short sequences)."""

    def __init__(self, module: nn.Module, inner: Callable, tokens: int):
        self.module, self.inner, self.tokens = module, inner, tokens

    def __call__(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if args or kwargs:
            raise TypeError(
                f"tiled_mlp_tokens: {type(self.module).__name__}.forward was called with more than the hidden states "
                f"({len(args)} more positional, keywords {sorted(kwargs)}); only a forward of the hidden states alone "
                "is tiled. Set tiled_mlp_tokens=None for this model."
            )
        if hidden_states.numel() <= self.tokens * hidden_states.shape[-1]:
            return self.inner(hidden_states)
        params = _trainable(self.module)
        if not torch.is_grad_enabled() or not (hidden_states.requires_grad or params):
            with torch.no_grad():
                return _in_chunks(self.inner, hidden_states, self.tokens)
        inputs = () if _partitioned(params) else params
        return _TiledMLP.apply(self.module, self.inner, self.tokens, hidden_states, *inputs)


def decoder_mlps(model: nn.Module) -> dict[str, nn.Module]:
    """{name: module} of the `mlp` child of every layer of the language model's decoder (a layer: an element of a
    `nn.ModuleList`). Read through PEFT and DDP/DeepSpeed wrappers; a vision-language model's language model only."""
    model = _language_model(model)
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
    inside = {id(module) for module in decoder.modules()}
    found = {}
    for name, module in model.named_modules():  # names as the model's state dict has them
        if isinstance(module, nn.ModuleList) and id(module) in inside:
            for index, layer in enumerate(module):
                mlp = getattr(layer, "mlp", None)
                if isinstance(mlp, nn.Module):
                    found[f"{name}.{index}.mlp" if name else f"{index}.mlp"] = mlp
    return found


def tile_mlps(model: nn.Module, tokens: int | None) -> int:
    """Make every decoder layer's MLP (`decoder_mlps`) compute in chunks of `tokens` rows (`TiledForward`); None
    undoes it. In place, on the model's modules (their names, parameters and state dict are unchanged); returns the
    number of MLPs tiled. Refuses, naming the fix, a model with no such MLP, a Mixture-of-Experts block, and an MLP
    whose forward takes more than the hidden states."""
    if tokens is not None and (isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1):
        raise ValueError(f"tiled_mlp_tokens={tokens!r} must be a positive int (tokens per chunk) or None (off).")
    if tokens is None:
        for module in model.modules():
            if isinstance(module.__dict__.get("forward"), TiledForward):
                module.forward = module.forward.inner
        return 0
    mlps = decoder_mlps(model)
    if not mlps:
        raise ValueError(
            f"tiled_mlp_tokens={tokens} found no MLP to tile in {type(_language_model(model)).__name__}: it tiles "
            "the `mlp` module of each layer of the decoder (model.model.layers[i].mlp in Llama or Qwen2), and this "
            "model has none. Set tiled_mlp_tokens=None."
        )
    for name, mlp in mlps.items():
        _check_tileable(name, mlp, tokens)
    for mlp in mlps.values():
        forward = mlp.__dict__.get("forward")
        inner = forward.inner if isinstance(forward, TiledForward) else mlp.forward
        mlp.forward = TiledForward(mlp, inner, tokens)
    return len(mlps)


def _language_model(model: nn.Module) -> nn.Module:
    """The causal LM inside DDP / DeepSpeed wrappers and a PEFT model (whose modules carry the adapters)."""
    model = unwrap_parallel(model)
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _check_tileable(name: str, mlp: nn.Module, tokens: int) -> None:
    if hasattr(mlp, "experts"):
        raise ValueError(
            f"tiled_mlp_tokens={tokens}: {name} is a Mixture-of-Experts block ({type(mlp).__name__}), whose router's "
            "outputs are recorded per call for the load-balancing loss; only dense MLPs are tiled. Set "
            "tiled_mlp_tokens=None."
        )
    forward = mlp.__dict__.get("forward")
    forward = forward.inner if isinstance(forward, TiledForward) else mlp.forward
    required = [
        p
        for p in inspect.signature(forward).parameters.values()
        if p.default is inspect.Parameter.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    if len(required) != 1:
        raise ValueError(
            f"tiled_mlp_tokens={tokens}: {name}.forward ({type(mlp).__name__}) takes "
            f"{[p.name for p in required]}, not the hidden states alone; only such a forward is tiled. Set "
            "tiled_mlp_tokens=None."
        )


class HostOffload(torch.autograd.graph.saved_tensors_hooks):
    """Within it, every tensor the forward saves for backward that lives on an accelerator (not a parameter, nor a
    view of one, nor smaller than `min_bytes`) is copied to pinned host memory as it is saved, and back to its device
    when the backward reads it: the accelerator holds the saved activations of one layer's backward at a time
    instead of all of them. With gradient checkpointing, the saved activations are each layer's input; the
    recomputation in backward runs outside this context and stays on the device. `devices`: the device types whose
    tensors are copied (the tests pass "cpu" to run the copies on a machine without a GPU)."""

    def __init__(self, model: nn.Module, min_bytes: int = MIN_OFFLOAD_BYTES, devices: tuple[str, ...] = ("cuda",)):
        self.params = {p.untyped_storage().data_ptr() for p in model.parameters() if p.numel()}
        self.min_bytes, self.devices = min_bytes, devices
        self.offloaded_bytes = 0  # copied to the host since this context was made
        super().__init__(self.pack, self.unpack)

    def pack(self, tensor: torch.Tensor):
        if (
            tensor.device.type not in self.devices
            or tensor.layout != torch.strided
            or isinstance(tensor, nn.Parameter)
            or isinstance(tensor._base, nn.Parameter)
            or tensor.untyped_storage().data_ptr() in self.params
            or tensor.numel() * tensor.element_size() < self.min_bytes
        ):
            return tensor
        pin = tensor.device.type != "cpu"
        host = torch.empty(tensor.shape, dtype=tensor.dtype, layout=tensor.layout, pin_memory=pin)
        host.copy_(tensor, non_blocking=pin)
        self.offloaded_bytes += host.numel() * host.element_size()
        return tensor.device, host

    @staticmethod
    def unpack(packed):
        if isinstance(packed, torch.Tensor):
            return packed
        device, host = packed
        return host.to(device, non_blocking=device.type != "cpu")


def forward_context(model: nn.Module, accelerator, args) -> Callable:
    """How a run's log-prob passes run the policy `model`: its decoder MLPs tiled in place with
    `args.tiled_mlp_tokens` (`tile_mlps`; None leaves them alone), and the context each pass enters, returned:
    `accelerator.autocast()` (mixed precision), with `HostOffload` around it where `args.activation_offloading` is
    on and the accelerator is a CUDA device. Elsewhere offloading is a no-op, said in one log line."""
    tile_mlps(model, args.tiled_mlp_tokens)
    autocast, device = accelerator.autocast, accelerator.device
    if not args.activation_offloading:
        return autocast
    if device.type != "cuda":
        if accelerator.is_main_process:
            logger.warning(
                f"activation_offloading=True does nothing on a {device.type} device: the tensors saved for backward "
                "are in host memory already."
            )
        return autocast

    @contextlib.contextmanager
    def offloaded():
        with autocast(), HostOffload(model):
            yield

    return offloaded
