"""Per-token log-probs of completions under a model: the one place where the trainer turns hidden states into numbers.

Policy, old and reference log-probs all come from `completion_logprobs`, so they agree on temperature, positions and
masking. Spec section 8: a log-prob needs only the selected token's logit and the log-sum-exp over the vocabulary, so
the backbone runs as usual but the output projection never builds the (B, T, V) logits. `chunked_logprobs` projects
the hidden states of completion positions in chunks of rows and recomputes each chunk in backward: peak memory is
O(chunk x V) instead of O(B x T x V), and padding and prompt positions never reach the projection.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from grpo.data import content_widths, round_up
from grpo.data.vision import vision_batch
from grpo.models import unwrap_parallel
from grpo.objective.sequence_parallel import SequenceParallel, SequenceShards
from grpo.objective.settings import LogProbSettings
from grpo.objective.shared_prompt import GroupedLayout, grouped_layout, sharing_pays, unsupported_reason

# Rows per chunk are chosen so one float32 (rows, V) buffer takes at most this many bytes (forward with entropy
# holds two, backward one, or two when the entropy has a gradient).
CHUNK_BYTES = 128 * 2**20


def auto_chunk_size(vocab_size: int) -> int:
    """Rows of the (rows, V) float32 chunk that fit `CHUNK_BYTES`, rounded down to a power of two (at least 16)."""
    rows = max(CHUNK_BYTES // (4 * vocab_size), 16)
    return 1 << (rows.bit_length() - 1)


def _tempered_logits(hidden, weight, bias, scale, softcap, temperature, out):
    """z = softcap(scale * (h W^T + b)) / temperature, written into the float32 buffer `out` (c, V); also returns
    tanh(...) when soft-capping (for backward).

    softcap(u) = c * tanh(u / c) as in Gemma 2; `scale` is the model's own logit multiplier (Cohere's logit_scale,
    1 / Granite's logits_scaling). One buffer reused by every chunk and in-place arithmetic: each fresh (c, V)
    tensor would cost memory and, on CPU, the page faults of touching it."""
    if weight.dtype == out.dtype:
        torch.mm(hidden, weight.T, out=out)
    else:  # half-precision matmul as the model's own head would do it (weights in bf16, or autocast), then float32
        out.copy_(hidden @ weight.T)
    if bias is not None:
        out.add_(bias)
    if scale != 1.0:
        out.mul_(scale)
    tanh = None
    if softcap is not None:
        tanh = torch.tanh(out.div_(softcap))
        torch.mul(tanh, softcap, out=out)
    return out.div_(temperature), tanh


def _result_dtype(compute_dtype: torch.dtype) -> torch.dtype:
    """Everything after the product h W^T runs in float32, or in float64 for float64 inputs (the exact references of
    the tests)."""
    return torch.float64 if compute_dtype == torch.float64 else torch.float32


def _chunk_buffer(hidden, weight, chunk_size):
    rows = min(chunk_size, hidden.shape[0])
    return torch.empty(rows, weight.shape[0], dtype=_result_dtype(weight.dtype), device=hidden.device)


class _ChunkedLogProbs(torch.autograd.Function):
    """Selected-token log-probs (and entropies) of hidden @ weight^T, one chunk of rows at a time.

    Forward keeps only the inputs and the per-row log-sum-exp (and entropy). Backward recomputes each chunk's logits z
    and uses, with p = softmax(z_i) and H_i its entropy,
        d logp_i / d z_i = onehot(target_i) - p
        d H_i / d z_i    = -p * (log p + H_i)
    so the largest temporaries in either direction are float32 (chunk, V) tensors: one, or two when the entropy has
    a gradient to pass back (an entropy bonus in the loss).
    """

    @staticmethod
    def forward(
        ctx, hidden, weight, bias, targets, temperature, scale, softcap, chunk_size, with_entropy, fp32, entropy_grad
    ):
        num_rows = hidden.shape[0]
        dtype = torch.float32 if fp32 else _compute_dtype(hidden, weight)
        ctx.input_dtypes = (hidden.dtype, weight.dtype)
        hidden, weight = hidden.to(dtype), weight.to(dtype)  # under autocast: cast once for every chunk
        logps = torch.empty(num_rows, dtype=_result_dtype(dtype), device=hidden.device)
        lse = torch.empty_like(logps)
        entropy = torch.empty_like(logps) if with_entropy else None
        buffer = _chunk_buffer(hidden, weight, chunk_size)
        exp_buffer = torch.empty_like(buffer) if with_entropy else None
        for start in range(0, num_rows, chunk_size):
            rows = slice(start, start + chunk_size)
            size = min(chunk_size, num_rows - start)
            z, _ = _tempered_logits(hidden[rows], weight, bias, scale, softcap, temperature, buffer[:size])  # (c, V)
            picked = z.gather(-1, targets[rows, None]).squeeze(-1)
            peak = z.amax(dim=-1)
            shifted = z.sub_(peak[:, None])  # y = z - max z, in place
            if with_entropy:
                # H = logsumexp(z) - sum_v p_v z_v = log(sum e) - sum_v p_v y_v with e = exp(y), p = e / sum e.
                e = torch.exp(shifted, out=exp_buffer[:size])
                total = e.sum(-1)
                entropy[rows] = total.log() - (e[:, None, :] @ shifted[:, :, None]).view(-1) / total
            else:
                total = shifted.exp_().sum(-1)
            lse[rows] = peak + total.log()
            logps[rows] = picked - lse[rows]
        ctx.entropy_grad = with_entropy and entropy_grad
        ctx.save_for_backward(hidden, weight, bias, targets, lse, entropy if ctx.entropy_grad else None)
        ctx.settings = (temperature, scale, softcap, chunk_size)
        ctx.set_materialize_grads(False)  # an output the loss does not read gets None, not a tensor of zeros
        if with_entropy and not entropy_grad:
            ctx.mark_non_differentiable(entropy)
        return logps, entropy

    @staticmethod
    def backward(ctx, grad_logps, grad_entropy):
        hidden, weight, bias, targets, lse, entropy = ctx.saved_tensors  # in the compute dtype
        temperature, scale, softcap, chunk_size = ctx.settings
        hidden_dtype, weight_dtype = ctx.input_dtypes
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        grad_logps = torch.zeros_like(lse) if grad_logps is None else grad_logps
        grad_entropy = grad_entropy if ctx.entropy_grad else None
        grad_hidden = torch.empty_like(hidden, dtype=hidden_dtype) if need_hidden else None
        # Accumulate the projection's gradient over chunks in float32 (or float64), whatever the weight's dtype.
        accumulate = _result_dtype(weight.dtype)
        grad_weight = torch.zeros(weight.shape, dtype=accumulate, device=weight.device) if need_weight else None
        grad_bias = torch.zeros(bias.shape, dtype=accumulate, device=bias.device) if need_bias else None
        buffer = _chunk_buffer(hidden, weight, chunk_size)
        probs_buffer = torch.empty_like(buffer) if grad_entropy is not None else None
        for start in range(0, hidden.shape[0], chunk_size):
            rows = slice(start, start + chunk_size)
            size = min(chunk_size, hidden.shape[0] - start)
            z, tanh = _tempered_logits(hidden[rows], weight, bias, scale, softcap, temperature, buffer[:size])
            g = grad_logps[rows].to(z.dtype)[:, None]  # (c, 1)
            log_p = z.sub_(lse[rows, None])  # log softmax, in z's storage
            if grad_entropy is None:
                # dL/dz = g * (onehot - p), built in place.
                grad_z = log_p.exp_().mul_(-g)
            else:
                # dL/dz = g * (onehot - p) - g_H * p * (log p + H) = onehot * g - p * (g + g_H * (log p + H)).
                p = torch.exp(log_p, out=probs_buffer[:size])
                g_entropy = grad_entropy[rows].to(z.dtype)[:, None]
                grad_z = log_p.add_(entropy[rows, None]).mul_(g_entropy).add_(g).mul_(p).neg_()
            grad_z.scatter_add_(-1, targets[rows, None], g)
            # Back through / temperature, the soft cap (d c tanh(u/c) / du = 1 - tanh^2) and the scale.
            if tanh is not None:
                grad_z.mul_(1 - tanh.square_())
            grad_u = grad_z.mul_(scale / temperature).to(weight.dtype)  # (c, V)
            if need_hidden:
                grad_hidden[rows] = grad_u @ weight
            if need_weight and grad_u.dtype == accumulate:
                grad_weight.addmm_(grad_u.T, hidden[rows])  # no (V, H) temporary
            elif need_weight:
                grad_weight += (grad_u.T @ hidden[rows]).to(accumulate)
            if need_bias:
                grad_bias += grad_u.to(accumulate).sum(0)
        grad_weight = grad_weight.to(weight_dtype) if need_weight else None
        grad_bias = grad_bias.to(bias.dtype) if need_bias else None
        return grad_hidden, grad_weight, grad_bias, None, None, None, None, None, None, None, None


def _compute_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The projection's matmul dtype: autocast's (bf16 / fp16) where it is on, as the model's own head would run
    under mixed precision (the trainer computes log-probs inside `accelerator.autocast()`), else the weight's."""
    device = hidden.device.type
    if torch.is_autocast_enabled(device) and weight.dtype == torch.float32:
        return torch.get_autocast_dtype(device)
    return weight.dtype


def chunked_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    scale: float = 1.0,
    softcap: float | None = None,
    chunk_size: int | None = None,
    with_entropy: bool = False,
    head_fp32: bool = False,
    entropy_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log softmax(z_i)[targets_i] for z_i = softcap(scale * (hidden_i W^T + b)) / temperature, without the full
    logits.

    hidden (N, H), weight (V, H), bias (V,) or None, targets (N,) -> logps (N,) float32 and, if `with_entropy`, the
    entropy H_i = logsumexp(z_i) - sum_v softmax(z_i)_v z_iv (N,), with a gradient only with `entropy_grad` (an
    entropy bonus in the loss; without it the backward does no extra work). Equals, in float32,
        torch.log_softmax(z, -1).gather(-1, targets[:, None]).squeeze(-1)
    with z the full (N, V) logits, but materialises only `chunk_size` rows of z at a time, in forward and backward.
    Gradients flow to `hidden`, `weight` and `bias`, in their own dtypes. `chunk_size` defaults to
    `auto_chunk_size(V)`. The product h W^T runs in the dtype the model's own head would use (autocast's, else the
    weight's), or with `head_fp32` in float32 whatever the inputs' dtypes and autocast (ScaleRL's fp32 head,
    `cast_lm_head_to_fp32`); everything after it is float32 either way (float64 for float64 inputs).
    """
    if hidden.dim() != 2 or targets.shape != hidden.shape[:1]:
        raise ValueError(
            f"expected hidden (N, H) and targets (N,), got {tuple(hidden.shape)} and {tuple(targets.shape)}"
        )
    chunk_size = chunk_size or auto_chunk_size(weight.shape[0])
    return _ChunkedLogProbs.apply(
        hidden, weight, bias, targets, temperature, scale, softcap, chunk_size, with_entropy, head_fp32, entropy_grad
    )


def selective_log_softmax(logits: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """log_softmax(logits)[..., index] from full logits: logp_t = logits_t[index_t] - logsumexp(logits_t).

    logits (B, T, V), index (B, T) -> (B, T) in float32, one row at a time. Used only where the output projection is
    partitioned by ZeRO-3 (see `completion_logprobs`) and as the naive reference in tests and benchmarks.
    """
    rows = []
    for row_logits, row_index in zip(logits, index):  # (T, V), (T,)
        row_logits = row_logits.float()
        picked = row_logits.gather(-1, row_index.unsqueeze(-1)).squeeze(-1)  # (T,)
        rows.append(picked - torch.logsumexp(row_logits, dim=-1))
    return torch.stack(rows)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) per position, H = logsumexp(z) - sum_v p_v z_v. (B, T, V) -> (B, T), float32,
    one row at a time; differentiable (pass detached logits where no gradient is wanted)."""
    rows = []
    for row_logits in logits:
        row_logits = row_logits.float()
        probs = torch.softmax(row_logits, dim=-1)
        rows.append(torch.logsumexp(row_logits, dim=-1) - (probs * row_logits).sum(-1))
    return torch.stack(rows)


def _language_model(model: nn.Module) -> nn.Module:
    """The causal LM inside DDP / DeepSpeed / compile wrappers and a PEFT model (whose layers carry the adapters)."""
    model = unwrap_parallel(model)
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def output_projection(model: nn.Module) -> tuple[nn.Module, float, float | None]:
    """The output projection of a causal LM and the logit transforms its forward applies after it:
    (lm_head, scale, softcap). Covers Gemma 2/3 (`final_logit_softcapping`), Cohere (`logit_scale`) and Granite
    (`logits_scaling`); other models have scale 1 and no soft cap."""
    lm = _language_model(model)
    head = lm.get_output_embeddings()
    if head is None or not hasattr(head, "weight"):
        raise ValueError(f"{type(lm).__name__} has no output projection (get_output_embeddings() is {head!r}).")
    config = lm.config.get_text_config() if hasattr(lm.config, "get_text_config") else lm.config
    scale = 1.0
    if getattr(config, "logit_scale", None) is not None:
        scale *= float(config.logit_scale)
    if getattr(config, "logits_scaling", None) is not None:
        scale /= float(config.logits_scaling)
    return head, scale, getattr(config, "final_logit_softcapping", None)


def _check_head_for_fp32(head: nn.Module) -> None:
    """`cast_lm_head_to_fp32` projects with the head's own weight (and bias): an adapter on the head would not be in
    it, and a ZeRO-3 partitioned weight is gathered only inside the model's forward, which runs the head as is."""
    if hasattr(head, "base_layer"):  # a PEFT tuner layer (LoRA, ...) wraps the head
        raise ValueError(
            "cast_lm_head_to_fp32=True projects with the output head's own weight, but a PEFT adapter targets the "
            "head (target_modules includes lm_head). Remove lm_head from the adapter's target_modules, or set "
            "cast_lm_head_to_fp32=False."
        )
    if _is_sharded(head.weight) and not _is_dtensor(head.weight):
        raise ValueError(
            "cast_lm_head_to_fp32=True is not supported under DeepSpeed ZeRO-3: its partitioned output head runs only "
            "inside the model's forward, in the model's dtype. Set cast_lm_head_to_fp32=False, or use ZeRO-2 or FSDP."
        )


def _is_sharded(weight: torch.Tensor) -> bool:
    """True when the projection's weight is not whole on this process (DeepSpeed ZeRO-3 partitions, FSDP shards)."""
    return weight.dim() != 2 or weight.numel() == 0 or hasattr(weight, "ds_id") or _is_dtensor(weight)


def _is_dtensor(tensor: torch.Tensor | None) -> bool:
    return type(tensor).__name__ == "DTensor"


def _whole(param: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """A DTensor parameter (FSDP2's shards) gathered whole on every process, in `dtype`; anything else as it is.

    Differentiable: the whole tensor's gradient goes back to the shards averaged over the mesh (a reduce-scatter),
    which is what FSDP2 does with the gradients of the parameters it gathers for the forward itself (its default
    gradient divide factor). `dtype` is the hidden states', as FSDP2's mixed precision casts the gathered weights."""
    if not _is_dtensor(param):
        return param
    from torch.distributed.tensor import Partial, Replicate

    dims = param.device_mesh.ndim
    whole = param.redistribute(placements=[Replicate()] * dims).to_local(grad_placements=[Partial("avg")] * dims)
    return whole.to(dtype)


def _padded_inputs(
    prompt_ids, prompt_mask, completion_ids, completion_mask, model=None, extra=None
) -> dict[str, torch.Tensor]:
    """Prompt and completion side by side, (B, P+T), with position ids that count only real tokens (cumulative sum of
    the attention mask), as `generate` does for left-padded prompts; with `extra` (vision inputs), those too, and no
    position ids for a model that computes multimodal ones from the mask and the image grids itself. (Rows with
    images always run whole, never packed nor with a shared prompt: the model places each image's features at the
    placeholder tokens of the rows it is given.)"""
    attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
    inputs = {"input_ids": torch.cat([prompt_ids, completion_ids], dim=1), "attention_mask": attention_mask}
    if not (extra and _own_positions(model)):
        inputs["position_ids"] = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
    return {**inputs, **(extra or {})}


def _own_positions(model: nn.Module | None) -> bool:
    """Whether a vision-language model computes its own multimodal position ids (Qwen-VL's `get_rope_index`: each
    image token's 3-D position over time, height and width), which 1-D position ids would replace."""
    lm = _language_model(model) if model is not None else None
    return lm is not None and any(hasattr(m, "get_rope_index") for m in (lm, getattr(lm, "model", None)))


def _packed_inputs(prompt_ids, prompt_mask, completion_ids, completion_mask):
    """All real tokens of the batch in one row, each sequence's positions restarting at 0, plus the index of every
    completion-predicting position in that row. Row-major order of completion_mask == 1, as boolean indexing gives."""
    prompt_lengths = prompt_mask.sum(1)
    completion_lengths = completion_mask.sum(1)
    sequences, positions, targets_at = [], [], []
    offset = 0
    for i in range(prompt_ids.shape[0]):
        p, c = int(prompt_lengths[i]), int(completion_lengths[i])
        sequences += [prompt_ids[i, prompt_ids.shape[1] - p :], completion_ids[i, :c]]
        positions.append(torch.arange(p + c, device=prompt_ids.device))
        targets_at.append(torch.arange(offset + p - 1, offset + p - 1 + c, device=prompt_ids.device))
        offset += p + c
    return torch.cat(sequences)[None], torch.cat(positions)[None], torch.cat(targets_at)


def completion_logprobs(
    model: nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    batch_size: int | None = None,
    chunk_size: int | None = None,
    padding_free: bool = False,
    head_fp32: bool = False,
    pad_to_multiple_of: int | None = None,
    share_prompt: bool = True,
    vision: list[dict[str, torch.Tensor]] | None = None,
    entropy_grad: bool = False,
    aux_losses: list[torch.Tensor] | None = None,
    sequence_parallel: SequenceParallel | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log pi(o_t | q, o_<t) for every completion token, from logits divided by the sampling temperature.

    prompt_ids/prompt_mask (B, P) left-padded; completion_ids/completion_mask (B, T) right-padded, the mask 1 for
    tokens up to and including EOS. Returns logps (B, T) float32 and, if `with_entropy`, the per-token entropy (B, T)
    of the same tempered distribution (differentiable with `entropy_grad`, for an entropy bonus); both are 0 where
    completion_mask is 0. A list as `aux_losses` collects a MoE model's load-balancing loss (`_decoder_hidden_states`).

    1. The backbone runs on the batch in one forward call: with `share_prompt`, rows that repeat a prompt in the
       grouped layout (each prompt once, its completions after it: shared_prompt.py); else padded, or with
       `padding_free` packed into one row with positions restarting per sequence (for variable-length kernels).
       Position ids count only real tokens, as `generate` does for left-padded prompts.
    2. The final hidden states of the positions that predict completion tokens, and only those, go through
       `chunked_logprobs` with the model's own output projection, logit scaling and soft cap (`_projected`).
    `batch_size` splits the rows into separate forward passes (for no-grad passes); `chunk_size` is the row chunk of
    the projection (default: from the vocabulary size); `head_fp32` runs it in float32 (`chunked_logprobs`);
    `pad_to_multiple_of` rounds the widths the forward sees up (`_forward_columns`; not a packed row). `vision`: each
    row's images as the model takes them (grpo/data/vision.py), given with its tokens (`_padded_inputs`); rows with
    images run padded and whole: never packed, never in the grouped layout. `sequence_parallel`: a group of
    processes holding the same rows, each running its shard of every sequence (sequence_parallel.py).
    """
    if batch_size is not None and batch_size < prompt_ids.shape[0]:
        tensors = (prompt_ids, prompt_mask, completion_ids, completion_mask)
        settings = dict(temperature=temperature, with_entropy=with_entropy, chunk_size=chunk_size, head_fp32=head_fp32)
        settings.update(padding_free=padding_free, share_prompt=share_prompt, entropy_grad=entropy_grad)
        settings.update(pad_to_multiple_of=pad_to_multiple_of, aux_losses=aux_losses)
        return _in_row_batches(model, tensors, vision, batch_size, sequence_parallel=sequence_parallel, **settings)

    tensors, options = (prompt_ids, prompt_mask, completion_ids, completion_mask), (padding_free, pad_to_multiple_of)
    batch, forward = _forward_plan(model, tensors, *options, share_prompt, vision, aux_losses, sequence_parallel)
    logps, entropy = _projected(model, batch, forward, temperature, with_entropy, chunk_size, head_fp32, entropy_grad)
    widen = (0, completion_ids.shape[1] - logps.shape[1])  # back to the batch's width: padded, or cut (masked columns)
    return nn.functional.pad(logps, widen), nn.functional.pad(entropy, widen) if with_entropy else None


def _forward_plan(model, tensors, padding_free, pad_to_multiple_of, share_prompt, vision, aux_losses, parallel):
    """Step 1's plan: the columns of `tensors` (prompt ids and mask, completion ids and mask) the forward sees, and
    how it runs them: (padding_free, the grouped or sequence-parallel layout or None, the vision keyword arguments,
    `aux_losses`)."""
    padding_free = padding_free and vision is None  # rows with images are never packed
    batch = _forward_columns(*tensors, None if padding_free else pad_to_multiple_of)
    extra = vision_batch(vision, batch[0].shape[1], batch[2].shape[1], tensors[0].device) if vision else {}
    # No grouped layout with pad_to_multiple_of (its widths would not be the padded ones), nor with images (the model
    # merges their features into each row's prompt inside its own forward), nor for a router's loss (a mean over one
    # forward's tokens, where each prompt counts once per row).
    plain = pad_to_multiple_of or extra or aux_losses is not None
    layout = _layout(model, batch, share_prompt and not plain, parallel, pad_to_multiple_of)
    return batch, (padding_free, layout, extra, aux_losses)


def completion_hidden_states(
    model: nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    *,
    padding_free: bool = False,
    pad_to_multiple_of: int | None = None,
    share_prompt: bool = True,
    vision: list[dict[str, torch.Tensor]] | None = None,
    aux_losses: list[torch.Tensor] | None = None,
) -> torch.Tensor:
    """Step 1 of `completion_logprobs` alone, for a loss that applies the output projection itself (Liger's fused
    linear loss, liger.py): the backbone's final hidden states at the positions that predict completion tokens, (N, H)
    in row-major order of completion_mask == 1, from the same forward (layouts, vision, `aux_losses`) as
    `completion_logprobs`, without sequence parallelism."""
    tensors = (prompt_ids, prompt_mask, completion_ids, completion_mask)
    batch, forward = _forward_plan(
        model, tensors, padding_free, pad_to_multiple_of, share_prompt, vision, aux_losses, None
    )
    return _completion_hidden_states(model, *batch, *forward)


def projection_is_whole(weight: torch.Tensor) -> bool:
    """Whether an output projection's weight is whole on this process: not partitioned by DeepSpeed ZeRO-3, nor
    sharded by FSDP."""
    return not _is_sharded(weight)


def _projected(model, batch, forward, temperature, with_entropy, chunk_size, head_fp32, entropy_grad):
    """Step 2 of `completion_logprobs` on `batch` (its four tensors at the forward's widths): (logps, entropy or
    None), (B, T'). `forward`: how step 1 runs (padding_free, the grouped layout or None, the vision keyword
    arguments, the list collecting a router's loss or None). Under FSDP2 the
    projection's weight is read after the forward: whole if its module keeps it gathered for the backward (the root
    module of accelerate's wrapping), else a DTensor, gathered once per call (`_whole`). Under DeepSpeed ZeRO-3 it
    can only be gathered inside the model's forward, so the logits of the completion positions are built there
    instead; so are they when a PEFT adapter wraps the head, whose update is not in the head's weight."""
    padding_free, layout, extra, aux_losses = forward
    head, scale, softcap = output_projection(model)
    if head_fp32:
        _check_head_for_fp32(head)
    adapted_head = hasattr(head, "base_layer")  # a PEFT adapter's update is in the wrapper's forward, not its weight
    if adapted_head or (_is_sharded(head.weight) and not _is_dtensor(head.weight)):
        values = _logprobs_from_full_logits(
            model, *batch, temperature, with_entropy, layout, extra, entropy_grad, aux_losses
        )
        return _every_row(values, layout)
    # Chunked projection of the completion positions only; a sharded (FSDP2) weight read after the forward.
    hidden = _completion_hidden_states(model, *batch, padding_free, layout, extra, aux_losses)
    mask = _predicted(batch[3], layout)
    values = chunked_logprobs(
        hidden,
        _whole(head.weight, hidden.dtype),
        batch[2][mask],
        bias=_whole(head.bias, hidden.dtype),
        temperature=temperature,
        scale=scale,
        softcap=softcap,
        chunk_size=chunk_size,
        with_entropy=with_entropy,
        head_fp32=head_fp32,
        entropy_grad=entropy_grad,
    )
    return _every_row((None if v is None else v.new_zeros(mask.shape).masked_scatter(mask, v) for v in values), layout)


def _every_row(values, layout) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(logps, entropy) of the pass; under sequence parallelism, this process's tokens joined with its group's."""
    logps, entropy = values
    if isinstance(layout, SequenceShards):
        return layout.combine(logps), layout.combine(entropy)
    return logps, entropy


class LogProbs:
    """The log-prob pass of a run, the same for the policy, pi_old and pi_ref: `completion_logprobs` of a batch (a
    `Rollout`, `MicroBatch` or `TokenBatch`: its four token tensors and its images) with the run's `LogProbSettings`
    and forward layout (`padding_free`, `share_prompt`: shared_prompt.py decides), inside `autocast()` (mixed
    precision: the head in bf16 unless `head_fp32`; each weight cast once). With `sequence_parallel_size` > 1, each
    process of a group runs its shard of every sequence (`sequence_parallel`, its group; None without)."""

    def __init__(self, settings: LogProbSettings, padding_free: bool, share_prompt: bool, autocast=None):
        self.settings, self.padding_free, self.share_prompt = settings, padding_free, share_prompt
        self.autocast = autocast or contextlib.nullcontext
        size = settings.sequence_parallel_size
        self.sequence_parallel = SequenceParallel(size) if size > 1 else None

    def __call__(self, model, batch, with_entropy: bool = False, batch_size: int | None = None, **extra):
        """(logps, entropy or None) of `batch` under `model`; `extra`: `entropy_grad`, `aux_losses`."""
        s = self.settings
        with self.autocast():
            return completion_logprobs(
                model,
                batch.prompt_ids,
                batch.prompt_mask,
                batch.completion_ids,
                batch.completion_mask,
                temperature=s.temperature,
                with_entropy=with_entropy,
                batch_size=batch_size,
                chunk_size=s.chunk_size,
                padding_free=self.padding_free,
                head_fp32=s.head_fp32,
                pad_to_multiple_of=s.pad_to_multiple_of,
                share_prompt=self.share_prompt,
                vision=getattr(batch, "vision", None),  # images (vision-language models), or None
                sequence_parallel=self.sequence_parallel,
                **extra,
            )

    def hidden_states(self, model, batch, aux_losses: list[torch.Tensor] | None = None) -> torch.Tensor:
        """The pass's final hidden states at the positions that predict `batch`'s completion tokens, (N, H)
        (`completion_hidden_states`, inside `autocast()`), for a loss that projects them itself."""
        with self.autocast():
            return completion_hidden_states(
                model,
                batch.prompt_ids,
                batch.prompt_mask,
                batch.completion_ids,
                batch.completion_mask,
                padding_free=self.padding_free,
                pad_to_multiple_of=self.settings.pad_to_multiple_of,
                share_prompt=self.share_prompt,
                vision=getattr(batch, "vision", None),
                aux_losses=aux_losses,
            )


def _in_row_batches(model, tensors, vision, batch_size: int, **settings):
    """`completion_logprobs` of `tensors` (prompt ids and mask, completion ids and mask) and `vision`, `batch_size`
    rows at a time, joined."""
    chunks = [
        completion_logprobs(
            model,
            *(x[i : i + batch_size] for x in tensors),
            vision=None if vision is None else vision[i : i + batch_size],
            **settings,
        )
        for i in range(0, tensors[0].shape[0], batch_size)
    ]
    entropy = torch.cat([c[1] for c in chunks]) if settings["with_entropy"] else None
    return torch.cat([c[0] for c in chunks]), entropy


@contextlib.contextmanager
def _head_on_no_positions(model: nn.Module) -> Iterator[None]:
    """Within it, the model's own output projection runs on no positions: the passes below read the decoder's hidden
    states and never the logits. (`logits_to_keep=1` alone still projects the last position, a strided slice that
    torch multiplies under autograd as a batched product with the (V, H) weight expanded per row: 80 ms a pass on
    SmolLM2-135M at 8 rows on a CPU.)"""

    def no_positions(module, args):
        if args and isinstance(args[0], torch.Tensor) and args[0].dim() >= 2:
            return (args[0][..., :0, :], *args[1:])
        return None

    head = _language_model(model).get_output_embeddings()
    handle = head.register_forward_pre_hook(no_positions) if isinstance(head, nn.Module) else None
    try:
        yield
    finally:
        if handle is not None:
            handle.remove()


def _forward_columns(prompt_ids, prompt_mask, completion_ids, completion_mask, multiple_of):
    """The columns the forward pass sees: the batch without the columns that are padding in every row (it may be
    padded to a longer one's width), then, with `multiple_of` (`pad_to_multiple_of`), masked columns added back up to
    widths that are multiples of it, on the left of the prompts and the right of the completions."""
    prompt_width, completion_width = content_widths(prompt_mask, completion_mask)
    left = round_up(prompt_width, multiple_of) - prompt_width
    right = round_up(completion_width, multiple_of) - completion_width
    prompt = (nn.functional.pad(x[:, -prompt_width:], (left, 0)) for x in (prompt_ids, prompt_mask))
    completion = (nn.functional.pad(x[:, :completion_width], (0, right)) for x in (completion_ids, completion_mask))
    return *prompt, *completion


def _grouped(model: nn.Module, *batch: torch.Tensor) -> GroupedLayout | None:
    """The batch in the grouped layout where the model can take it, a prompt repeats and sharing it costs less than
    the plain layout (`sharing_pays`: not for long completions of a short prompt), else None."""
    language_model = _language_model(model)
    if unsupported_reason(language_model) is not None:
        return None
    layout = grouped_layout(*batch)
    rows, width = batch[0].shape[0], batch[0].shape[1] + batch[2].shape[1]
    return layout if layout is not None and sharing_pays(layout, rows, width, language_model.config) else None


def _layout(model, batch, shared: bool, sequence_parallel, multiple_of) -> GroupedLayout | SequenceShards | None:
    """How the forward lays out `batch` other than padded or packed: this process's shard of every row under
    `sequence_parallel`, else (where `shared`) the grouped layout if it applies, else None."""
    if sequence_parallel is not None:
        return SequenceShards(*batch, sequence_parallel, multiple_of=multiple_of)
    return _grouped(model, *batch) if shared else None


def _layout_inputs(model: nn.Module, layout: GroupedLayout | SequenceShards) -> dict:
    """The forward's inputs in the grouped layout (ids, position ids, and the 4D mask for the model's attention), or
    in the sequence-parallel one (`SequenceShards.model_inputs`)."""
    language_model = _language_model(model)
    if isinstance(layout, SequenceShards):
        return layout.model_inputs(language_model)
    return {
        "input_ids": layout.input_ids,
        "position_ids": layout.position_ids,
        "attention_mask": layout.attention_mask(language_model.config, language_model.dtype),
    }


def _predicted(completion_mask: torch.Tensor, layout) -> torch.Tensor:
    """(B, T) bool: the completion tokens this pass predicts, in the order of its hidden states: every one, or under
    sequence parallelism those of this process's columns."""
    return layout.completion_mask if isinstance(layout, SequenceShards) else completion_mask.bool()


def _completion_hidden_states(
    model, prompt_ids, prompt_mask, completion_ids, completion_mask, padding_free, layout=None, extra=None, aux=None
):
    """1. The backbone's final (normed) hidden states at the positions that predict completion tokens: (N, H), in
    row-major order of completion_mask == 1.

    A hook on the decoder catches its output while the model's own head runs on no position
    (`_head_on_no_positions`; logits_to_keep=1 too, for a head the hook cannot shorten); calling the outer model
    keeps DDP / DeepSpeed / PEFT wrappers in charge of the forward. `layout`: the batch in the grouped layout
    (grpo/objective/shared_prompt.py), run instead of the padded or packed batch. `extra`: the model's vision
    keyword arguments (padded batches only). `aux`: a list to collect a MoE model's load-balancing loss in."""
    with _head_on_no_positions(model):
        return _decoder_hidden_states(
            model, prompt_ids, prompt_mask, completion_ids, completion_mask, padding_free, layout, extra, aux
        )


def _router_outputs(aux_losses: list | None) -> dict:
    """The forward's keyword asking a Mixture-of-Experts model for its load-balancing loss, when one is collected."""
    return {} if aux_losses is None else {"output_router_logits": True}


def _keep_aux_loss(output, aux_losses: list | None) -> None:
    if aux_losses is not None:
        aux_losses.append(output.aux_loss)


def _decoder_hidden_states(
    model, prompt_ids, prompt_mask, completion_ids, completion_mask, padding_free, layout, extra=None, aux_losses=None
):
    """`_completion_hidden_states` inside the head's hook. With a list as `aux_losses`, the model runs with
    `output_router_logits=True` and its load-balancing loss (`aux_loss`: over every prompt and completion token of the
    pass, padding excluded, as its own training loss counts them) is appended to the list (never in the grouped
    layout: `completion_logprobs`)."""
    captured = []
    decoder = _language_model(model).get_decoder()
    hook = decoder.register_forward_hook(lambda module, args, output: captured.append(output[0]))
    try:
        if layout is not None:  # each run of identical prompts once (shared_prompt.py), or a shard of every row
            model(**_layout_inputs(model, layout), logits_to_keep=1, use_cache=False)
            # index_select, never `x[index]`: on CPU the backward of indexing with repeated indices (the prompt's
            # last position predicts token 0 of every completion) accumulates in an order that changes run to run.
            return captured[0].flatten(0, 1).index_select(0, layout.predicting)
        if padding_free:
            input_ids, position_ids, targets_at = _packed_inputs(
                prompt_ids, prompt_mask, completion_ids, completion_mask
            )
            output = model(
                input_ids=input_ids,
                position_ids=position_ids,
                logits_to_keep=1,
                use_cache=False,
                **_router_outputs(aux_losses),
            )
            _keep_aux_loss(output, aux_losses)
            return captured[0][0, targets_at]
        output = model(
            **_padded_inputs(prompt_ids, prompt_mask, completion_ids, completion_mask, model, extra),
            logits_to_keep=1,
            use_cache=False,
            **_router_outputs(aux_losses),
        )
        _keep_aux_loss(output, aux_losses)
        # Position j predicts token j+1: positions P-1 .. P+T-2 predict the T completion tokens.
        predicting = captured[0][:, prompt_ids.shape[1] - 1 : -1]  # (B, T, H)
        return predicting[completion_mask.bool()]
    finally:
        hook.remove()


def _logprobs_from_full_logits(
    model, prompt_ids, prompt_mask, completion_ids, completion_mask, temperature, with_entropy, layout=None, extra=None,
    entropy_grad=False, aux_losses=None,
):  # fmt: skip
    """Fallback for a ZeRO-3 partitioned output projection, or one a PEFT adapter wraps: the model's forward builds
    the (B, T, V) logits (in the grouped layout: of the columns from the prompt's last on, (U, L - P + 1, V))."""
    mask = _predicted(completion_mask, layout)
    if layout is not None:
        rows, width = layout.input_ids.shape
        kept = width - layout.completions_from + 1
        logits = model(**_layout_inputs(model, layout), logits_to_keep=kept, use_cache=False).logits
        # The predicting positions' flat indices in (U, L), moved to the kept columns' (U, kept).
        row, column = layout.predicting // width, layout.predicting % width
        picked = logits.flatten(0, 1).index_select(0, row * kept + column - (width - kept))[None] / temperature
        logps = selective_log_softmax(picked, completion_ids[mask][None])[0]  # (N,)
        entropy = entropy_from_logits(picked if entropy_grad else picked.detach())[0] if with_entropy else None
        return tuple(None if v is None else v.new_zeros(mask.shape).masked_scatter(mask, v) for v in (logps, entropy))
    output = model(
        **_padded_inputs(prompt_ids, prompt_mask, completion_ids, completion_mask, model, extra),
        logits_to_keep=completion_ids.shape[1] + 1,
        use_cache=False,
        **_router_outputs(aux_losses),
    )
    _keep_aux_loss(output, aux_losses)
    logits = output.logits[:, :-1, :] / temperature
    logps = selective_log_softmax(logits, completion_ids).masked_fill(~mask, 0.0)
    entropy = None
    if with_entropy:
        entropy = entropy_from_logits(logits if entropy_grad else logits.detach()).masked_fill(~mask, 0.0)
    return logps, entropy
