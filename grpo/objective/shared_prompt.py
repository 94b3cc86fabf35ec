"""The backbone's hidden states for a batch whose rows repeat prompts, with each distinct prompt run once.

A GRPO micro-batch holds G completions of each prompt, the G copies of the prompt in consecutive rows. A plain
forward computes every copy's prompt again, (B, P + T) tokens; here each run of identical prompt rows goes through
the model once, with a KV cache, and the completions attend to that cache repeated along the batch: U x P + B x T
tokens, U the number of distinct prompts. In the backward the prompt's activations receive the gradients of all
the completions that read them, which is the sum the plain forward's G copies would each receive; the values are
the same up to float rounding (tests/test_shared_prompt.py compares log-probs and gradients).

Used by `completion_logprobs` (logprobs.py) for the policy, old and reference passes, except where a wrapper must see
one forward per backward (DDP, DeepSpeed, FSDP2 while training), on a checkpointed model in training mode (its layers
drop the cache), with padding-free packing, and with caches other than plain per-layer key/value tensors (sliding
windows, linear attention).
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from grpo.generation.model_generate import cache_keyword
from grpo.models import unwrap_parallel


def prompt_groups(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> tuple[list[int], list[int]]:
    """Runs of consecutive identical rows of (prompt_ids, prompt_mask), (B, P): each run's first row and its length.

    Rows [a, a, b, b, b, a] -> ([0, 2, 5], [2, 3, 1])."""
    same = (prompt_ids[1:] == prompt_ids[:-1]).all(1) & (prompt_mask[1:] == prompt_mask[:-1]).all(1)  # (B - 1,)
    firsts = [0] + (torch.nonzero(~same).flatten() + 1).tolist()
    counts = [b - a for a, b in zip(firsts, firsts[1:] + [prompt_ids.shape[0]])]
    return firsts, counts


def can_share(model: nn.Module, language_model: nn.Module) -> bool:
    """Whether two forward passes (prompt, then completions) may stand in for one here."""
    checkpointing = getattr(language_model, "is_activation_checkpointing", None)  # transformers >= 5.2x
    if checkpointing is None:
        checkpointing = getattr(language_model, "is_gradient_checkpointing", False)
    if checkpointing and language_model.training:  # checkpointed layers drop the cache, with or without gradients
        return False
    if torch.is_grad_enabled():
        if unwrap_parallel(model) is not model:  # DDP / DeepSpeed expect one forward per backward
            return False
        if any(type(p).__name__ == "DTensor" for p in language_model.parameters()):  # FSDP2
            return False
    supports = getattr(language_model, "_supports_default_dynamic_cache", None)
    return supports is None or supports()


def shared_prompt_hidden_states(
    model: nn.Module,
    language_model: nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
) -> torch.Tensor | None:
    """The final hidden states at the positions that predict completion tokens, (N, H) in row-major order of
    completion_mask == 1, as the plain padded forward gives them; None where sharing does not apply (no prompt
    repeats, or `can_share` says no), and the caller runs the plain forward.

    prompt_ids/prompt_mask (B, P) left-padded, completion_ids/completion_mask (B, T) right-padded.
    1. Prompt pass: the U distinct prompts, (U, P), filling a KV cache; its last position predicts completion token 0.
    2. The cache repeated run by run to (B, ...) (an index: differentiable).
    3. Completion pass: tokens 0..T-2 of every row, (B, T - 1), at positions that continue each prompt's count of
       real tokens, attending to the cache under the (B, P + T - 1) mask; position t predicts token t + 1.
    """
    firsts, counts = prompt_groups(prompt_ids, prompt_mask)
    if len(firsts) == prompt_ids.shape[0] or not can_share(model, language_model):
        return None
    cache = DynamicCache(config=language_model.config)
    if not all(type(layer) is DynamicLayer for layer in cache.layers):
        return None
    device = prompt_ids.device
    rows = torch.tensor(firsts, device=device)
    repeat = torch.repeat_interleave(torch.arange(len(firsts), device=device), torch.tensor(counts, device=device))

    captured = []
    hook = language_model.get_decoder().register_forward_hook(lambda m, a, output: captured.append(output[0]))
    try:
        # 1. Prompt pass, positions counting real tokens (as `generate` and the plain forward do).
        mask = prompt_mask[rows]  # (U, P)
        positions = (mask.cumsum(1) - 1).clamp(min=0)
        # The cache by the name this transformers takes it (`past_key_values` is a deprecated alias from 5.24 on).
        with_cache = {cache_keyword(language_model.forward): cache}
        model(
            input_ids=prompt_ids[rows],
            attention_mask=mask,
            position_ids=positions,
            **with_cache,
            use_cache=True,
            logits_to_keep=1,
        )
        if cache.get_seq_length() != prompt_ids.shape[1]:  # a layer kept no cache: run the batch plainly
            return None
        # index_select, never `x[repeat]`: on CPU the backward of indexing with repeated indices accumulates the
        # copies' gradients in parallel, in an order that changes from run to run (no exact resume, no equal runs).
        first = captured[0][:, -1].index_select(0, repeat)  # (B, H): predicts completion token 0
        width = completion_ids.shape[1]
        if width == 1:
            return first[completion_mask[:, 0].bool()]
        # 2. The prompt's keys and values for every row (`cache.batch_select_indices` indexes: see above).
        for layer in cache.layers:
            layer.keys, layer.values = layer.keys.index_select(0, repeat), layer.values.index_select(0, repeat)
        # 3. Completion pass.
        lengths = prompt_mask.sum(1, keepdim=True)  # (B, 1)
        model(
            input_ids=completion_ids[:, :-1],
            attention_mask=torch.cat([prompt_mask, completion_mask[:, :-1]], dim=1),
            position_ids=lengths + torch.arange(width - 1, device=device),
            **with_cache,
            use_cache=True,
            logits_to_keep=1,
        )
        predicting = torch.cat([first[:, None], captured[1]], dim=1)  # (B, T, H)
        return predicting[completion_mask.bool()]
    finally:
        hook.remove()
